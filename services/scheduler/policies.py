"""The scheduler's side of the policies (docs/design.md §5): pairing migration
sources with destinations. Dispatch scoring and the policies themselves are
pure code in libs/common/policies (the frontend's bypass uses them too);
their names are re-exported here for the scheduler's modules."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from libs.common.policies import POLICIES, POLICY_NAMES, Dispatcher, DispatchRequest, InstanceView, Policy, blocks_for
from libs.common.policies.freeness import base_freeness, llumnix_freeness, memory_load
from libs.common.policies.migration import next_to_migrate
from libs.common.types import RequestPhase

__all__ = [
    "POLICIES",
    "POLICY_NAMES",
    "DispatchRequest",
    "Dispatcher",
    "HeldPrefix",
    "InstanceView",
    "MigrationPair",
    "MoveCost",
    "MoveCosts",
    "PromptHashes",
    "base_freeness",
    "blocks_for",
    "llumnix_freeness",
    "memory_load",
    "pair_migrations",
]

# (source, destination) -> the blocks a migration between them would send.
MoveCost = Callable[[InstanceView, InstanceView], float]
# block hashes -> per instance, how many of the first hashes its cache holds (the prefix index's match).
HeldPrefix = Callable[[tuple], dict[str, int]]


class PromptHashes:
    """The prompt block hashes of recent dispatches (DispatchRequest's), by
    request id, for counting what a migration of the request would send
    (``MoveCosts``). Bounded: the oldest go first."""

    def __init__(self, capacity: int = 65536):
        self.capacity = capacity
        self._by_id: OrderedDict[str, tuple] = OrderedDict()

    def put(self, request_id: str, hashes) -> None:
        self._by_id[request_id] = tuple(hashes)
        self._by_id.move_to_end(request_id)
        while len(self._by_id) > self.capacity:
            self._by_id.popitem(last=False)

    def get(self, request_id: str) -> tuple:
        return self._by_id.get(request_id, ())

    def __len__(self) -> int:
        return len(self._by_id)


class MoveCosts:
    """What moving a source's requests to a destination would send, for one
    pairing round (Policy.pairs_by_move_cost): each running request's
    prompt is looked up in the prefix index once (``held``: every instance's
    held prefix of it at once), then ``linkable`` and the cost of a pair are
    lookups."""

    def __init__(self, hashes: PromptHashes, held: HeldPrefix, out_threshold: float, use_priorities: bool):
        self.hashes, self.held = hashes, held
        self.out_threshold, self.use_priorities = out_threshold, use_priorities
        self._holders: dict[str, dict[str, int]] = {}  # request id -> instance id -> blocks held

    def _held_by(self, request_id: str) -> dict[str, int]:
        if request_id not in self._holders:
            h = self.hashes.get(request_id)
            self._holders[request_id] = self.held(h) if h else {}
        return self._holders[request_id]

    def linkable(self, src: InstanceView, dst_id: str) -> dict[str, int]:
        """Of the source's running requests, those whose prompt's first
        blocks the destination holds: request id -> how many
        (MigrateOutOrder.linkable: the order moves the cheapest to send first)."""
        out = {}
        for r in src.status.requests:
            if r.state == RequestPhase.RUNNING:
                n = self._held_by(r.request_id).get(dst_id, 0)
                if n:
                    out[r.request_id] = n
        return out

    def __call__(self, src: InstanceView, dst: InstanceView) -> float:
        """The cost of the source's first move to the destination: the blocks
        the request its migrate-out order would choose first there
        (libs/common/policies/migration.next_to_migrate on the scheduler's
        view, with ``linkable``) would send: its blocks less the prefix the
        destination holds (linked there, not sent)."""
        link = self.linkable(src, dst.instance_id)
        rid = next_to_migrate(src.status, 0, self.out_threshold, self.use_priorities, linkable=link)
        blocks = next((r.physical_blocks for r in src.status.requests if r.request_id == rid), 0)
        return max(0, blocks - link.get(rid, 0))


@dataclass(frozen=True)
class MigrationPair:
    source: str
    destination: str
    source_freeness: float
    destination_freeness: float


def pair_migrations(views: list[InstanceView], out_threshold: float, in_threshold: float,
                    freeness_of: Callable[[InstanceView], float] = llumnix_freeness,
                    busy: frozenset[str] = frozenset(), cost: MoveCost | None = None,
                    policy: Policy | None = None) -> list[MigrationPair]:
    """Pair sources (F < out_threshold, or terminating) with destinations
    (F > in_threshold, not terminating, no queue of their own): repeatedly
    lowest-F source with highest-F destination. Called every round on fresh
    views, so a pair lasts one round. Instances in ``busy`` (an order is
    running there) and instances that cannot migrate are left out as sources
    and destinations; a destination's own refusal (below its in-threshold
    after the migration, a queue, its migrate-in limit) guards the rest.
    With ``cost`` (Policy.pairs_by_move_cost), each source in turn (lowest F
    first) takes the destination left where its move is cheapest, of equal
    costs the highest F: with no prefix held anywhere, the same pairs.
    The ``policy``'s further rules (Policy.preempted_sources: an instance
    with a preempted request waiting is a source and no destination;
    Policy.strict_destinations False: a destination's queue and pending
    dispatches do not rule it out), as Llumnix's first release pairs
    (libs/common/policies/llumnix_v0.py)."""
    preempted = policy is not None and policy.preempted_sources
    strict = policy is None or policy.strict_destinations

    def f(v: InstanceView) -> float:
        return float("-inf") if v.status.terminating else freeness_of(v)

    # NOTE: a hung engine (unschedulable) can neither send nor take a request
    live = [(f(v), v) for v in views
            if v.instance_id not in busy and v.migratable and not v.status.unschedulable]  # each F once
    sources = sorted(((fv, v) for fv, v in live
                      if (fv < out_threshold or (preempted and v.status.preempted_waiting > 0))
                      and (v.status.num_running > 0 or v.status.terminating)), key=lambda p: p[0])
    # NOTE: an instance with a queue is never a destination: migrating in
    # would take the blocks its own head of line waits for. Nor is one that
    # does not decode (Splitwise prefill): a running request decodes.
    dests = sorted(((fv, v) for fv, v in live if not v.status.terminating and fv > in_threshold
                    and (not strict or (v.status.num_waiting == 0 and v.pending_requests == 0))
                    and not (preempted and v.status.preempted_waiting > 0) and v.status.role.decodes),
                   key=lambda p: p[0], reverse=True)
    pairs = []
    if cost is not None:
        for fs, src in sources:
            left = [(cost(src, dst), -fd, i) for i, (fd, dst) in enumerate(dests)
                    if dst.instance_id != src.instance_id]
            if not left:
                break
            _, _, i = min(left)
            fd, dst = dests.pop(i)
            pairs.append(MigrationPair(src.instance_id, dst.instance_id, fs, fd))
        return pairs
    for (fs, src), (fd, dst) in zip(sources, dests):
        if src.instance_id == dst.instance_id:
            break
        pairs.append(MigrationPair(src.instance_id, dst.instance_id, fs, fd))
    return pairs
