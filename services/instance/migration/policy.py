"""Which running request to migrate out first (pure): lower priority first
(when priorities count), then the shorter sequence — cheapest to move."""

from __future__ import annotations

from libs.common.types import RequestLoad


def migration_order(requests: tuple[RequestLoad, ...], use_priorities: bool,
                    exclude: frozenset[str] = frozenset()) -> list[str]:
    cands = [r for r in requests if r.state == "running" and r.request_id not in exclude]
    key = (lambda r: (int(r.priority), r.num_tokens)) if use_priorities else (lambda r: r.num_tokens)
    return [r.request_id for r in sorted(cands, key=key)]
