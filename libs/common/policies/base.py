"""What a dispatch policy is and what it sees (docs/design.md §5): pure code over
snapshots, shared by the scheduler, the frontend's bypass and the simulator.
No I/O, no threads, no imports from services/."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

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
        return not self.status.terminating and not self.status.unschedulable


@dataclass(frozen=True)
class DispatchRequest:
    request_id: str
    num_prompt_tokens: int
    priority: Priority = Priority.NORMAL
    exclude: frozenset[str] = field(default_factory=frozenset)
    # Prefix caching (docs/design.md §9.3), the input of the prefix-aware
    # policies (Policy.uses_prefix): how many full blocks of the prompt were
    # hashed (libs/common/prefix_hash) and, per instance, how many of the
    # first of them it holds (its longest cached prefix; absent: none). The
    # scheduler fills ``hits`` from its prefix index, the simulator from its
    # engines' caches; prefix-blind policies ignore both.
    prefix_blocks: int = 0
    hits: Mapping[str, int] = field(default_factory=dict)
    # An instance this request should go to if it can take it (n > 1: where the
    # first choice computed the prompt the others share; "" = none).
    affinity: str = ""
    # The program (an agent's session) this request is a turn of, as the
    # client named it (prompt_cache_key or the x-session-id header; "" = none):
    # what program-aware policies group turns by (issue 53).
    program_id: str = ""
    # Turns of that program dispatched before this one, as the scheduler's
    # program ledger counts them (libs/common/programs.py; 0: its first turn
    # seen; -1: not counted, as by the frontend's bypass): llumnix-keep places
    # a program's first turn apart from its returning ones.
    program_turn: int = -1


def affine(views: list[InstanceView], req: DispatchRequest) -> str | None:
    """``req.affinity`` when that instance can take the request now
    (schedulable, not excluded, it runs prompts, enough free blocks for the
    request's own demand beside what is pending there); None: dispatch as
    usual. Every placement asks this first (phases.place, the scheduler's)."""
    if not req.affinity or req.affinity in req.exclude:
        return None
    v = next((v for v in views if v.instance_id == req.affinity), None)
    if v is None or not v.schedulable or not v.status.role.prefills:
        return None
    need = demand_blocks(req.num_prompt_tokens, v.status.block_size, req.hits.get(v.instance_id, 0))
    return v.instance_id if v.status.free_blocks - v.pending_blocks >= need else None


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // max(1, block_size))


def demand_blocks(tokens: int, block_size: int, hit: int = 0) -> int:
    """The blocks a dispatched prompt of ``tokens`` will take where ``hit``
    of its blocks are cached (at least one: a dispatch is counted pending
    until the instance reports it)."""
    return max(1, blocks_for(tokens, block_size) - hit)


def hit_blocks(v: InstanceView, req: DispatchRequest) -> int:
    """The blocks of ``req``'s prompt that ``v`` would not compute: its
    longest held prefix, at most ``(prompt tokens - 1) // block size`` (an
    engine computes at least one token of a prompt:
    services/instance/engine/core/scheduler.py ``prefix_hit``)."""
    h = req.hits.get(v.instance_id, 0)
    if h <= 0:
        return 0
    return min(h, req.prefix_blocks, max(0, (req.num_prompt_tokens - 1) // max(1, v.status.block_size)))


def fit_key(total_blocks: float, usage: float, batch: int) -> tuple[int, float]:
    """Dispatch order once ``usage`` counts the new request (docs/design.md §5):
    where it fits now (usage <= total), the highest freeness; where it fits
    nowhere, the smallest shortfall in blocks. The shortfall is never divided
    by a load: a negative count divided by a larger batch moves towards zero
    and would reward the busiest instance. A larger key is better."""
    room = total_blocks - usage
    if room >= 0:
        return 1, room / max(1, batch)
    return 0, room


@dataclass(frozen=True)
class FitTerms:
    """A fit_key score's parts that do not depend on the new request: the
    key is fit_key(total, usage + demand, batch), or (-1, 0.0) where the
    instance is terminating. The scheduler's dispatch index keeps these per
    instance and scores every instance at once (policies/index.py)."""

    terminating: bool
    total: float
    usage: float
    batch: int


def fit_terms_key(t: FitTerms, demand_blocks: int) -> tuple:
    if t.terminating:
        return (-1, 0.0)
    return fit_key(t.total, t.usage + demand_blocks, t.batch)


# A dispatch score: (instance, the new request's prompt blocks there) -> a
# sortable key, larger is better.
Score = Callable[[InstanceView, int], tuple]
# The rescheduling loop's freeness: an instance as it is, nothing added.
Freeness = Callable[[InstanceView], float]
# A whole-cluster choice (policies that compare instances with each other,
# not each alone): (candidates, request) -> the chosen candidate.
Select = Callable[[list[InstanceView], DispatchRequest], InstanceView]


@dataclass(frozen=True)
class Policy:
    """One scheduling policy, everything the services and tools need to know
    about it. ``score`` None: round robin (the Dispatcher's cursor)."""

    name: str
    summary: str
    score: Score | None
    migrates: bool = False
    uses_priorities: bool = False  # dispatch by priority and run requests at their own priority
    migration_freeness: Freeness | None = None  # the rescheduling loop's (when it migrates)
    # Set where ``score`` is fit_terms_key over these terms: the scheduler
    # may then dispatch through its index (policies/index.py), same choice.
    dispatch_terms: Callable[[InstanceView], FitTerms] | None = None
    migrate_out_threshold: float = 10.0  # freeness below: a migration source
    migrate_in_threshold: float = 20.0  # freeness above: a destination
    # Set: the policy picks among the candidates itself (``score`` unused).
    select: Select | None = None
    # The policy reads DispatchRequest.prefix_blocks and .hits: the scheduler
    # (and the simulator) look the prompt's hashes up for it, and only then.
    uses_prefix: bool = False
    # Migration pairing counts a move's cost as the blocks it would send (the
    # request's blocks net of the prefix the destination holds, which it links):
    # each source goes to the destination where its next request is cheapest
    # (services/scheduler/policies.py pair_migrations).
    pairs_by_move_cost: bool = False
    # Migration pairing's further rules (services/scheduler/policies.py
    # pair_migrations). ``preempted_sources``: an instance with a preempted
    # request waiting (InstanceStatus.preempted_waiting) is a source whatever
    # its freeness, and never a destination. ``strict_destinations``: a
    # destination has no queue and no dispatch pending (False: its freeness
    # alone decides, as in Llumnix's first release).
    preempted_sources: bool = False
    strict_destinations: bool = True
    # The migrate-out order the rescheduler sends (MigrateOutOrder):
    # ``order_max_requests`` migrations at most (0: the instance's default),
    # the first chosen by ``order_pick`` (libs/common/policies/migration.PICKS).
    order_max_requests: int = 0
    order_pick: str = ""
    # Above 0: the instances pin a program's cached blocks this long after each
    # of its turns (Continuum's TTL: services/instance/engine/core/pins.py,
    # InstanceConfig.program_ttl_s); the simulator sets it on its engines,
    # a live cluster's instances take --program-ttl-s.
    program_ttl_s: float = 0.0
    # Above 0: the instances keep programs' cached blocks between turns by
    # expected return, at most this fraction of their pool (services/
    # instance/engine/core/pins.py ProgramKeep, InstanceConfig.program_keep).
    program_keep: float = 0.0
    # The rescheduler moves kept blocks of programs (with program_keep) from
    # instances short of room to instances with room, before admission evicts
    # them (libs/common/policies/cache_moves.py; cache moves, no request).
    moves_kept: bool = False


def best_of(cands: list[InstanceView], key: Callable[[InstanceView], tuple]) -> InstanceView:
    """The candidate with the highest key; of equals, the lowest id."""
    best, best_key = None, None
    for v in cands:
        k = key(v)
        if best_key is None or k > best_key or (k == best_key and v.instance_id < best.instance_id):
            best, best_key = v, k
    return best


def candidates(views: list[InstanceView], req: DispatchRequest) -> list[InstanceView]:
    c = [v for v in views if v.schedulable and v.instance_id not in req.exclude]
    if not c:  # every instance terminating or excluded: better anywhere than nowhere
        c = [v for v in views if v.instance_id not in req.exclude]
    return c


class Dispatcher:
    """A policy's dispatch: highest score, ties to the lowest id. Round robin
    keeps a cursor; the others are stateless."""

    def __init__(self, policy: Policy | str):
        if isinstance(policy, str):
            from libs.common.policies import get

            policy = get(policy)
        self.policy = policy
        self._rr = itertools.count()

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def migrates(self) -> bool:
        return self.policy.migrates

    @property
    def uses_priorities(self) -> bool:
        return self.policy.uses_priorities

    def next_round_robin(self, n: int) -> int:
        return next(self._rr) % n

    def choose(self, views: list[InstanceView], req: DispatchRequest) -> str | None:
        cands = candidates(views, req)
        if not cands:
            return None
        if self.policy.select is not None:
            return self.policy.select(cands, req).instance_id
        score = self.policy.score
        if score is None:
            cands.sort(key=lambda v: v.instance_id)
            return cands[self.next_round_robin(len(cands))].instance_id
        # Highest key; of equals, the lowest id (no sort per dispatch: that
        # was O(N log N) of every placement, ferry bench control-plane).
        best, best_key = None, None
        for v in cands:
            key = score(v, blocks_for(req.num_prompt_tokens, v.status.block_size))
            if best_key is None or key > best_key or (key == best_key and v.instance_id < best.instance_id):
                best, best_key = v, key
        return best.instance_id
