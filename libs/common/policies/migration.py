"""Which running request a migrate-out order moves next, when the order
stops, and whether a destination takes a migration (pure).

De-fragmentation serves the blocked request: when the head of the source's
queue cannot be admitted (its demand exceeds the free blocks), the order
moves requests whose blocks cover the shortfall: the smallest single
request that covers it (with ``linkable``: the one that sends the fewest
tokens), else the largest first. Otherwise (load balancing,
draining) it moves the cheapest: lower priority first when priorities
count, then the shorter sequence, or, when the order knows which prefixes
the destination holds (``linkable``: request id -> its first blocks held
there, which the destination links instead of receiving), the fewest tokens
to send. An order may name another ``pick`` (PICKS): "last_running", the
request admitted last (Llumnix's first release, LCFS: llumnix_v0.py)."""

from __future__ import annotations

from collections.abc import Mapping

from libs.common.types import InstanceStatus, RequestLoad, RequestPhase

Linkable = Mapping[str, int]  # request id -> its first blocks the destination holds
LAST_RUNNING = "last_running"
PICKS = ("", LAST_RUNNING)  # MigrateOutOrder.pick: "" = the rules above


def head_of_line_shortfall(status: InstanceStatus) -> int:
    """Blocks the head of the waiting queue lacks to be admitted now (0: no
    queue, or the head fits)."""
    if not status.num_waiting and not any(r.state == RequestPhase.WAITING for r in status.requests):
        return 0
    return max(0, status.head_of_line_demand_blocks - status.free_blocks)


def _running(requests: tuple[RequestLoad, ...], use_priorities: bool,
             exclude: frozenset[str]) -> list[RequestLoad]:
    cands = [r for r in requests if r.state == RequestPhase.RUNNING and r.request_id not in exclude]
    if use_priorities:  # high-priority requests move only when nothing else is left
        low = min((int(r.priority) for r in cands), default=0)
        cands = [r for r in cands if int(r.priority) == low]
    return cands


def migration_order(requests: tuple[RequestLoad, ...], use_priorities: bool,
                    exclude: frozenset[str] = frozenset(), linkable: Linkable | None = None,
                    block_size: int = 16) -> list[str]:
    """The load-balancing order: lower priority first, then the shorter
    sequence (net of its ``linkable`` blocks: the tokens a move sends)."""
    cands = [r for r in requests if r.state == RequestPhase.RUNNING and r.request_id not in exclude]
    link = linkable or {}

    def tokens(r: RequestLoad) -> int:
        return r.num_tokens - link.get(r.request_id, 0) * block_size

    key = (lambda r: (int(r.priority), tokens(r))) if use_priorities else tokens
    return [r.request_id for r in sorted(cands, key=key)]


def cover_shortfall(requests: tuple[RequestLoad, ...], shortfall: int, use_priorities: bool,
                    exclude: frozenset[str] = frozenset(), linkable: Linkable | None = None,
                    block_size: int = 16) -> str | None:
    """The request to move for a head of line ``shortfall`` blocks short: the
    smallest that covers it alone, else the largest (ties: the shorter
    sequence, then the id). When the order knows what the destination holds
    (``linkable``), a move costs the tokens it sends: of the requests that
    cover the shortfall, the cheapest to move goes first (it frees as much
    as is needed either way)."""
    cands = _running(requests, use_priorities, exclude)
    if not cands:
        return None
    link = linkable or {}

    def to_send(r: RequestLoad) -> int:
        return r.num_tokens - link.get(r.request_id, 0) * block_size if link else 0

    covering = [r for r in cands if r.physical_blocks >= shortfall]
    if covering:
        return min(covering, key=lambda r: (to_send(r), r.physical_blocks, r.num_tokens, r.request_id)).request_id
    return min(cands, key=lambda r: (-r.physical_blocks, to_send(r), r.num_tokens, r.request_id)).request_id


def last_running(requests: tuple[RequestLoad, ...], exclude: frozenset[str] = frozenset()) -> str | None:
    """The running request admitted last (the last RUNNING one in the
    status's order: an engine lists its running queue in admission order,
    services/instance/engine/core/engine.py ``load``), not in ``exclude``."""
    for r in reversed(requests):
        if r.state == RequestPhase.RUNNING and r.request_id not in exclude:
            return r.request_id
    return None


def next_to_migrate(status: InstanceStatus, started: int, stop_when_freeness_above: float,
                    use_priorities: bool, tried: frozenset[str] = frozenset(),
                    linkable: Linkable | None = None, pick: str = "") -> str | None:
    """The next request a migrate-out order moves, given the source's status
    now and how many migrations the order started; None when the order is
    done. The first always starts. After it, a terminating source drains;
    otherwise the order stops once freeness is above the threshold, or once
    no head of line is blocked and the source is not overloaded (freeness
    >= 0): the scheduler pairs again next round if it is still a source.
    ``pick`` "last_running": the request admitted last, whatever the
    shortfall or the sizes (the order's stop rule unchanged)."""
    if pick not in PICKS:
        raise ValueError(f"unknown migration pick {pick!r}; supported: {PICKS}")
    shortfall = head_of_line_shortfall(status)
    if started and not status.terminating:
        if status.freeness > stop_when_freeness_above:
            return None
        if shortfall == 0 and status.freeness >= 0:
            return None
    if pick == LAST_RUNNING:
        return last_running(status.requests, tried)
    if shortfall > 0 and not status.terminating:
        return cover_shortfall(status.requests, shortfall, use_priorities, tried, linkable, max(1, status.block_size))
    order = migration_order(status.requests, use_priorities, tried, linkable, max(1, status.block_size))
    return order[0] if order else None


def accepts_migration(status: InstanceStatus, blocks: int, keep_freeness_above: float | None = None,
                      handoff: bool = False) -> tuple[bool, str]:
    """Whether a destination takes a request of ``blocks`` blocks: never while
    terminating; not with a queue of its own (the blocks are its head of
    line's), and, when ``keep_freeness_above`` is given, not when its
    freeness with the request added (virtual usage, reserved blocks included,
    one more in the batch) would fall below it. A Splitwise ``handoff`` is
    the decode instance's own work (its decode step was placed there at
    dispatch), so neither the queue nor the floor refuses it.

    NOTE: the simulator measures the threshold refusal as harmful at the
    paper's load (docs/results/sim/policies.md): with the in-threshold (20) it
    refused 590 of 676 migrations of seed 0 and P99 TTFT of llumnix_base got
    worse on the busy seeds; the simulated destination applies the queue rule
    only (MigrationModel.dest_keep_freeness_above = None)."""
    if status.terminating:
        return False, "destination is terminating"
    if handoff:
        return True, ""
    if status.num_waiting > 0:
        return False, f"destination has a queue ({status.num_waiting} waiting)"
    after = (status.total_blocks - status.virtual_usage - blocks) / (status.num_running + 1)
    if keep_freeness_above is not None and after < keep_freeness_above:
        return False, f"freeness would drop to {after:.1f} (< {keep_freeness_above:g})"
    return True, ""


__all__ = ["LAST_RUNNING", "PICKS", "accepts_migration", "cover_shortfall", "head_of_line_shortfall",
           "last_running", "migration_order", "next_to_migrate"]
