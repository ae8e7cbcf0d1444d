"""An instance's status report as a pure function of the engine's published
load and the agent's own marks (docs/design.md §4): what the live agent reports to
the meta store and what the discrete-event simulator reports for it."""

from __future__ import annotations

from libs.common.load import summarize
from libs.common.policies.headroom import profile_headroom
from libs.common.types import InstanceStatus, Priority, RequestPhase, Role
from services.instance.engine.base import EngineLoad


def instance_status(instance_id: str, seq: int, timestamp: float, load: EngineLoad,
                    headroom: dict[Priority, int], terminating: bool = False, migrating_in: int = 0,
                    migrating_out: int = 0, engine_steps: int = 0, role: Role = Role.MIXED,
                    unschedulable: bool = False) -> InstanceStatus:
    summary = summarize(load.total_blocks, load.requests, load.head_of_line_demand_blocks, headroom, terminating,
                        reserved_blocks=load.reserved_blocks, shared_blocks=load.shared_blocks)
    waiting = sum(1 for r in load.requests if r.state == RequestPhase.WAITING)
    return InstanceStatus(
        instance_id=instance_id, seq=seq, timestamp=timestamp,
        total_blocks=load.total_blocks, free_blocks=load.free_blocks, block_size=load.block_size,
        num_running=summary.num_running, num_waiting=waiting,
        head_of_line_demand_blocks=load.head_of_line_demand_blocks,
        virtual_usage=summary.virtual_usage, freeness=summary.freeness,
        normal_freeness=summary.normal_freeness,
        terminating=terminating,
        num_preemptions=load.num_preemptions, migrating_in=migrating_in,
        migrating_out=migrating_out, requests=summary.requests,
        used_blocks=load.total_blocks - load.free_blocks - load.reserved_blocks,
        waiting_demand_blocks=load.waiting_demand_blocks, running_prefill_tokens=load.running_prefill_tokens,
        engine_steps=engine_steps, role=role,
        unschedulable=unschedulable,
        prefix_cache=load.prefix_cache, shared_blocks=load.shared_blocks,
        preempted_waiting=load.preempted_waiting, kept_blocks=load.kept_blocks,
    )


def high_priority_headroom(override: int | None, profile, total_blocks: int | None = None) -> dict[Priority, int]:
    """Headroom per priority (Algorithm 1): for high priority the flag when
    given, else the memory that keeps a high-priority request decoding at its
    ideal speed, derived from the engine's step-time profile
    (libs/common/policies/headroom.py; 0 for engines without one)."""
    high = override if override is not None else profile_headroom(profile, total_blocks)
    return {Priority.HIGH: high}


def material(load: EngineLoad) -> tuple:
    """What a status report carries, but for token counts: the inputs of
    dispatch and migration (blocks, queue, states, priorities). A step that
    changes only token counts does not call for a report; the heartbeat
    carries the counts (``running_prefill_tokens`` too: a prompt computed in
    chunks holds all its blocks from the first chunk on, so its progress is a
    count; a report it is in may be a heartbeat old, and over-states what is
    left)."""
    return (load.free_blocks, load.head_of_line_demand_blocks, load.waiting_demand_blocks,
            load.num_preemptions, load.reserved_blocks,
            tuple((r.request_id, r.state, r.priority, r.physical_blocks) for r in load.requests), load.shared_blocks,
            load.preempted_waiting)  # kept_blocks: free_blocks moves with it
