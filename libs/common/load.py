"""Virtual usage and freeness (docs/design.md §4, Llumnix Algorithm 1), as pure
functions. Instances compute these and report them with the raw numbers."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from libs.common.types import Priority, RequestLoad, RequestPhase

# The fake request of a terminating instance: +infinity, clamped so that it
# survives JSON and protobuf doubles and still dominates any real load.
TERMINATING_USAGE = 1e12


@dataclass(frozen=True)
class LoadSummary:
    requests: tuple[RequestLoad, ...]  # with virtual_usage filled in
    virtual_usage: float
    freeness: float
    normal_freeness: float  # counting only normal-priority load (auto-scaling)
    num_running: int


def virtual_usages(requests: tuple[RequestLoad, ...], head_of_line_demand: int,
                   headroom: dict[Priority, int]) -> tuple[RequestLoad, ...]:
    """Per-request virtual usage.

    - waiting: its block demand if it is the head of the waiting queue, else 0
      (the head's demand is ``head_of_line_demand``; the first waiting request
      in ``requests`` order is the head);
    - running: physical blocks + headroom(priority) / running requests of that priority.
    """
    running_per_prio = Counter(r.priority for r in requests if r.state != RequestPhase.WAITING)
    out = []
    head_seen = False
    for r in requests:
        if r.state == RequestPhase.WAITING:
            v = float(head_of_line_demand) if not head_seen else 0.0
            head_seen = True
        else:
            room = headroom.get(r.priority, 0)
            v = r.physical_blocks + (room / running_per_prio[r.priority] if room else 0.0)
        # The constructor, not dataclasses.replace: 2x cheaper, and this runs
        # for every request of every status report.
        out.append(RequestLoad(r.request_id, r.priority, r.state, r.physical_blocks, r.num_tokens, v))
    return tuple(out)


def freeness(total_blocks: int, usage: float, batch_size: int) -> float:
    """F = (M - ΣV) / B, B = running batch size (1 when empty). May be negative."""
    return (total_blocks - usage) / max(1, batch_size)


def summarize(total_blocks: int, requests: tuple[RequestLoad, ...], head_of_line_demand: int,
              headroom: dict[Priority, int], terminating: bool = False,
              reserved_blocks: int = 0, shared_blocks: int = 0) -> LoadSummary:
    """reserved_blocks: blocks held for incoming migrations. They are spoken
    for, so they count in the usage; otherwise a destination looks freer than
    it is and is filled past what it can hold (docs/design.md §4).

    Prefix caching: a request's physical blocks are those it holds alone;
    ``shared_blocks`` (in use by several requests) count once, here. Cached
    blocks no request uses are free (evictable) and count nowhere; the
    head-of-line demand is already net of its cached prefix."""
    reqs = virtual_usages(requests, head_of_line_demand, headroom)
    spoken = reserved_blocks + shared_blocks
    usage = sum(r.virtual_usage for r in reqs) + spoken
    normal_usage = sum(r.virtual_usage for r in reqs if r.priority == Priority.NORMAL) + spoken
    if terminating:
        usage += TERMINATING_USAGE
        normal_usage += TERMINATING_USAGE
    running = sum(1 for r in reqs if r.state != RequestPhase.WAITING)
    normal_running = sum(1 for r in reqs if r.state != RequestPhase.WAITING and r.priority == Priority.NORMAL)
    return LoadSummary(
        requests=reqs,
        virtual_usage=usage,
        freeness=freeness(total_blocks, usage, running),
        normal_freeness=freeness(total_blocks, normal_usage, normal_running),
        num_running=running,
    )


def is_finite(x: float) -> bool:
    return math.isfinite(x) and abs(x) < TERMINATING_USAGE / 10
