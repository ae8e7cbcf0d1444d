"""What a migrate-out order chooses from: the instance's status as if the
requests already leaving were gone (pure). NOTE: several orders or slots run
at once; choosing from the plain status would pick a leaving request again,
or keep migrating for load that is already on its way out (over-migration)."""

from __future__ import annotations

import dataclasses
import time

from libs.common.types import InstanceStatus, Priority
from services.instance.engine.base import EngineLoad
from services.instance.status import instance_status


def load_without(load: EngineLoad, leaving: frozenset[str]) -> EngineLoad:
    """The load with the leaving requests gone and their blocks free."""
    if not leaving:
        return load
    gone = [r for r in load.requests if r.request_id in leaving]
    if not gone:
        return load
    return dataclasses.replace(
        load, requests=tuple(r for r in load.requests if r.request_id not in leaving),
        free_blocks=load.free_blocks + sum(r.physical_blocks for r in gone))


def status_without(instance_id: str, load: EngineLoad, headroom: dict[Priority, int], terminating: bool,
                   leaving: frozenset[str]) -> InstanceStatus:
    return instance_status(instance_id, 0, time.time(), load_without(load, leaving), headroom, terminating)
