"""The scheduler's side of the policies (docs/design.md §5): pairing migration
sources with destinations. Dispatch scoring and the policies themselves are
pure code in libs/common/policies (the frontend's bypass uses them too);
their names are re-exported here for the scheduler's modules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from libs.common.policies import POLICIES, POLICY_NAMES, Dispatcher, DispatchRequest, InstanceView, blocks_for
from libs.common.policies.freeness import base_freeness, llumnix_freeness, memory_load

__all__ = [
    "POLICIES",
    "POLICY_NAMES",
    "DispatchRequest",
    "Dispatcher",
    "InstanceView",
    "MigrationPair",
    "base_freeness",
    "blocks_for",
    "llumnix_freeness",
    "memory_load",
    "pair_migrations",
]


@dataclass(frozen=True)
class MigrationPair:
    source: str
    destination: str
    source_freeness: float
    destination_freeness: float


def pair_migrations(views: list[InstanceView], out_threshold: float, in_threshold: float,
                    freeness_of: Callable[[InstanceView], float] = llumnix_freeness,
                    busy: frozenset[str] = frozenset()) -> list[MigrationPair]:
    """Pair sources (F < out_threshold, or terminating) with destinations
    (F > in_threshold, not terminating, no queue of their own): repeatedly
    lowest-F source with highest-F destination. Called every round on fresh
    views, so a pair lasts one round. Instances in ``busy`` (an order is
    running there) and instances that cannot migrate are left out as sources
    and destinations; a destination's own refusal (below its in-threshold
    after the migration, a queue, its migrate-in limit) guards the rest."""
    def f(v: InstanceView) -> float:
        return float("-inf") if v.status.terminating else freeness_of(v)

    # NOTE: a hung engine (unschedulable) can neither send nor take a request
    live = [(f(v), v) for v in views
            if v.instance_id not in busy and v.migratable and not v.status.unschedulable]  # each F once
    sources = sorted(((fv, v) for fv, v in live if fv < out_threshold and
                      (v.status.num_running > 0 or v.status.terminating)), key=lambda p: p[0])
    # NOTE: an instance with a queue is never a destination: migrating in
    # would take the blocks its own head of line waits for. Nor is one that
    # does not decode (Splitwise prefill): a running request decodes.
    dests = sorted(((fv, v) for fv, v in live if not v.status.terminating and fv > in_threshold
                    and v.status.num_waiting == 0 and v.pending_requests == 0 and v.status.role.decodes),
                   key=lambda p: p[0], reverse=True)
    pairs = []
    for (fs, src), (fd, dst) in zip(sources, dests):
        if src.instance_id == dst.instance_id:
            break
        pairs.append(MigrationPair(src.instance_id, dst.instance_id, fs, fd))
    return pairs
