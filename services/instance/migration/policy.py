"""Which running request to migrate out first (pure): lower priority first
(when priorities count), then the shorter sequence — cheapest to move; and
when a migrate-out order stops."""

from __future__ import annotations

from libs.common.types import InstanceStatus, RequestLoad


def migration_order(requests: tuple[RequestLoad, ...], use_priorities: bool,
                    exclude: frozenset[str] = frozenset()) -> list[str]:
    cands = [r for r in requests if r.state == "running" and r.request_id not in exclude]
    key = (lambda r: (int(r.priority), r.num_tokens)) if use_priorities else (lambda r: r.num_tokens)
    return [r.request_id for r in sorted(cands, key=key)]


def next_to_migrate(status: InstanceStatus, started: int, stop_when_freeness_above: float,
                    use_priorities: bool, tried: frozenset[str] = frozenset()) -> str | None:
    """The next request a migrate-out order moves, given the source's status
    now and how many migrations the order started; None when the order is
    done: after the first, once the source is no longer a source (freeness
    above the threshold and not terminating), or when no request is left."""
    if started and not status.terminating and status.freeness > stop_when_freeness_above:
        return None
    order = migration_order(status.requests, use_priorities, tried)
    return order[0] if order else None
