"""Scheduling policies: pure functions over snapshots, chosen by name
(DESIGN §5). No I/O, no threads; unit tested on hand-made snapshots."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterable

from libs.common.types import InstanceStatus, Priority


@dataclass(frozen=True)
class InstanceView:
    """What a policy sees of one instance: its last status plus what the
    scheduler dispatched there since (not yet visible in a report)."""

    instance_id: str
    status: InstanceStatus
    pending_blocks: int = 0  # demand of requests dispatched but not yet reported
    pending_requests: int = 0
    migratable: bool = True  # False: the instance said it cannot live-migrate (InstanceInfo.no_migration)

    @property
    def schedulable(self) -> bool:
        return not self.status.terminating


@dataclass(frozen=True)
class DispatchRequest:
    request_id: str
    num_prompt_tokens: int
    priority: Priority = Priority.NORMAL
    exclude: frozenset[str] = field(default_factory=frozenset)


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // max(1, block_size))


def llumnix_freeness(v: InstanceView) -> float:
    """Reported freeness (Algorithm 1: physical usage, priority headroom, the
    head-of-line demand) less pending dispatches. The rescheduling loop's view."""
    s = v.status
    usage = s.total_blocks - s.freeness * max(1, s.num_running) + v.pending_blocks
    return (s.total_blocks - usage) / max(1, s.num_running + v.pending_requests)


def base_freeness(v: InstanceView) -> float:
    """Freeness without priority headroom (llumnix_base): used blocks plus the
    head-of-line demand, as Algorithm 1 counts them."""
    s = v.status
    if s.terminating:
        return float("-inf")
    usage = s.used_blocks + s.head_of_line_demand_blocks + v.pending_blocks
    return (s.total_blocks - usage) / max(1, s.num_running + v.pending_requests)


def llumnix_dispatch_freeness(v: InstanceView, demand_blocks: int) -> float:
    """Freeness for placing a new request of ``demand_blocks``: every queued
    request counts (its demand in the usage, itself in the batch), not only
    the head of line, and so does the new request. Migration needs only the
    head of line (what blocks admission now); dispatch must also see how long
    a queue the new request would join, or it keeps sending requests to an
    instance whose queue is blocked behind one small head."""
    s = v.status
    usage = (s.total_blocks - s.freeness * max(1, s.num_running) - s.head_of_line_demand_blocks
             + s.waiting_demand_blocks + v.pending_blocks + demand_blocks)
    return (s.total_blocks - usage) / (s.num_running + s.num_waiting + v.pending_requests + 1)


def base_dispatch_freeness(v: InstanceView, demand_blocks: int) -> float:
    """llumnix_dispatch_freeness without priority headroom (llumnix_base)."""
    s = v.status
    if s.terminating:
        return float("-inf")
    usage = s.used_blocks + s.waiting_demand_blocks + v.pending_blocks + demand_blocks
    return (s.total_blocks - usage) / (s.num_running + s.num_waiting + v.pending_requests + 1)


def memory_load(v: InstanceView) -> float:
    """INFaaS++ load: memory in use including queued demand, as a fraction."""
    s = v.status
    return (s.used_blocks + s.waiting_demand_blocks + v.pending_blocks) / max(1, s.total_blocks)


def _candidates(views: Iterable[InstanceView], req: DispatchRequest) -> list[InstanceView]:
    c = [v for v in views if v.schedulable and v.instance_id not in req.exclude]
    if not c:  # every instance terminating or excluded: better anywhere than nowhere
        c = [v for v in views if v.instance_id not in req.exclude]
    return c


class Dispatcher:
    """A named dispatch policy. Round robin keeps a cursor; the others are
    stateless."""

    def __init__(self, name: str):
        if name not in DISPATCH_POLICIES:
            raise ValueError(f"unknown dispatch policy {name!r}; supported: {', '.join(DISPATCH_POLICIES)}")
        self.name = name
        self._rr = itertools.count()

    @property
    def migrates(self) -> bool:
        return self.name in ("llumnix", "llumnix_base")

    @property
    def uses_priorities(self) -> bool:
        return self.name == "llumnix"

    def choose(self, views: list[InstanceView], req: DispatchRequest) -> str | None:
        cands = sorted(_candidates(views, req), key=lambda v: v.instance_id)
        if not cands:
            return None
        if self.name == "round_robin":
            return cands[next(self._rr) % len(cands)].instance_id
        score: Callable[[InstanceView, int], float] = DISPATCH_POLICIES[self.name]
        # Highest score wins; ties go to the lowest id for determinism. (The
        # position comes from enumerate: list.index compared whole views, O(N^2).)
        return max(enumerate(cands), key=lambda iv: (score(iv[1], blocks_for(req.num_prompt_tokens,
                                                                                iv[1].status.block_size)),
                                                     -iv[0]))[1].instance_id


# Dispatch scores (instance, the new request's prompt blocks there). The
# freeness policies score each instance as it would be with the request
# placed (see llumnix_dispatch_freeness).
DISPATCH_POLICIES: dict[str, Callable[[InstanceView, int], float] | None] = {
    "llumnix": llumnix_dispatch_freeness,
    "llumnix_base": base_dispatch_freeness,
    "infaas++": lambda v, blocks: -memory_load(v),  # the same demand everywhere: ranking unchanged
    "round_robin": None,
}
# Freeness for the rescheduling loop (instances as they are, nothing added).
MIGRATION_FREENESS: dict[str, Callable[[InstanceView], float]] = {
    "llumnix": llumnix_freeness,
    "llumnix_base": base_freeness,
}


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
    (F > in_threshold, not terminating): repeatedly lowest-F source with
    highest-F destination. Instances in ``busy`` (already migrating) and
    instances that cannot migrate are left out."""
    def f(v: InstanceView) -> float:
        return float("-inf") if v.status.terminating else freeness_of(v)

    live = [v for v in views if v.instance_id not in busy and v.migratable]
    sources = sorted((v for v in live if f(v) < out_threshold and
                      (v.status.num_running > 0 or v.status.terminating)), key=f)
    dests = sorted((v for v in live if not v.status.terminating and f(v) > in_threshold),
                   key=f, reverse=True)
    pairs = []
    for src, dst in zip(sources, dests):
        if src.instance_id == dst.instance_id:
            break
        pairs.append(MigrationPair(src.instance_id, dst.instance_id, f(src), f(dst)))
    return pairs
