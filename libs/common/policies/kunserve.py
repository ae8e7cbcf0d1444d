"""KunServe's scheduling pieces (KunServe, §4.1 and §4.3), as pure functions
over snapshots: when to drop parameters (``predict_throttle``), which
instances drop which layers (``plan_buddy_groups``), and when a group may
restore (``fits_own_memory``). The simulator's controller (ferry/sim/kunserve.py)
and the scheduler's loop (services/scheduler/kunserve.py) both call them; the
engine side is services/instance/engine/native/kunserve.py (docs/kunserve.md)."""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from libs.common.types import InstanceStatus

# §4.3: drop when the KV requirement is about to exceed the memory within one
# second. Tight on purpose: a drop takes effect at once, so dropping earlier
# gains little, and a false positive costs pipeline overhead.
DEFAULT_HORIZON_S = 1.0


@dataclass(frozen=True)
class MemorySample:
    """One instance's memory at one time, in KV blocks. ``queued_blocks``: what
    its waiting requests need to be admitted."""

    time: float  # seconds
    used_blocks: int
    total_blocks: int
    queued_blocks: int = 0

    @property
    def requirement(self) -> int:
        return self.used_blocks + self.queued_blocks


def add_sample(window: deque, status: InstanceStatus, now: float, window_s: float) -> None:
    """Keep an instance's recent samples: a report not seen yet joins the
    window; samples older than ``window_s`` before ``now`` leave it."""
    if not window or status.timestamp > window[-1].time:
        window.append(sample_of(status))
    while window and window[0].time < now - window_s:
        window.popleft()


def fits_own_memory(instance_id: str, samples: Sequence[MemorySample], own_blocks: int, margin: float,
                    horizon: float = DEFAULT_HORIZON_S) -> bool:
    """May this group member give its lent memory back (§4.2, restore)? Its
    requirement (used + queued) fits ``1 - margin`` of its own memory (what it
    has without the dropped layers' blocks), and its forecast against that
    memory is not throttled within the horizon."""
    if not samples or samples[-1].requirement > (1 - margin) * own_blocks:
        return False
    return not forecast_instance(instance_id, [replace(s, total_blocks=own_blocks) for s in samples],
                                 horizon).throttled


def sample_of(status: InstanceStatus) -> MemorySample:
    """The sample in an instance's status report. The queue counts when
    memory is what holds it back (its head needs more blocks than are free),
    and then all of it: the memory freed must admit the whole queue. A queue
    held back by compute (the batch limit or the step's token budget, with
    memory to spare) counts as nothing: parameters dropped would not admit
    it, and a pipeline would serve it slower."""
    blocked = status.num_waiting > 0 and status.head_of_line_demand_blocks > status.free_blocks
    return MemorySample(status.timestamp, status.used_blocks, status.total_blocks,
                        status.waiting_demand_blocks if blocked else 0)


@dataclass(frozen=True)
class InstanceForecast:
    instance_id: str
    rate: float  # blocks/s: the least-squares slope of used + queued over the samples
    deficit_blocks: int  # the most by which the requirement exceeds capacity within the horizon
    time_to_throttle: float  # s after the last sample; 0: already over; inf: never at this rate

    @property
    def throttled(self) -> bool:
        return self.deficit_blocks > 0


@dataclass(frozen=True)
class ThrottleForecast:
    horizon: float
    instances: tuple[InstanceForecast, ...]

    @property
    def deficit_blocks(self) -> int:
        """What the throttled instances lack together. Other instances' free
        blocks do not count: reaching them means moving KV, which is what
        dropping parameters avoids (§2.3)."""
        return sum(f.deficit_blocks for f in self.instances)

    @property
    def throttled(self) -> bool:
        return any(f.throttled for f in self.instances)


def _slope(samples: Sequence[MemorySample]) -> float:
    if len(samples) < 2:
        return 0.0  # one sample shows no trend
    n = len(samples)
    mt = sum(s.time for s in samples) / n
    my = sum(s.requirement for s in samples) / n
    var = sum((s.time - mt) ** 2 for s in samples)
    return sum((s.time - mt) * (s.requirement - my) for s in samples) / var


def _check(instance_id: str, samples: Sequence[MemorySample]) -> None:
    if not samples:
        raise ValueError(f"instance {instance_id!r}: no memory samples")
    for s in samples:
        if min(s.used_blocks, s.total_blocks, s.queued_blocks) < 0 or not math.isfinite(s.time):
            raise ValueError(f"instance {instance_id!r}: invalid sample {s}")
    for a, b in itertools.pairwise(samples):
        if b.time <= a.time:
            raise ValueError(f"instance {instance_id!r}: sample times must increase, got {a.time} then {b.time}")


def forecast_instance(instance_id: str, samples: Sequence[MemorySample],
                      horizon: float = DEFAULT_HORIZON_S) -> InstanceForecast:
    """Extrapolate the KV requirement (used + queued) linearly from its
    least-squares slope and compare it with the capacity of the last sample.

    The requirement is fitted as a whole, so a request admitted from the queue
    (queued falls, used rises) is no growth. The capacity is not extrapolated:
    it changes in steps, when parameters are dropped or restored, and a step
    is no trend. (The paper also watches the change rate of the available
    memory; here that is the requirement's rate against a fixed capacity.)
    Being linear, the excess is largest at one end of the horizon, so an
    instance already over capacity stays throttled whatever its slope."""
    _check(instance_id, samples)
    if horizon <= 0:
        raise ValueError(f"horizon must be positive, got {horizon}")
    rate = _slope(samples)
    last = samples[-1]
    excess_now = last.requirement - last.total_blocks
    excess = max(0.0, excess_now, excess_now + rate * horizon)
    if excess_now > 0:
        when = 0.0
    elif rate > 0:
        when = (last.total_blocks - last.requirement) / rate
    else:
        when = math.inf
    return InstanceForecast(instance_id, rate, math.ceil(excess - 1e-9), when)


def predict_throttle(samples: Mapping[str, Sequence[MemorySample]],
                     horizon: float = DEFAULT_HORIZON_S) -> ThrottleForecast:
    """Per instance, its recent samples oldest first (the caller picks the
    window). The cluster is throttled when any instance is."""
    return ThrottleForecast(horizon, tuple(forecast_instance(iid, s, horizon) for iid, s in samples.items()))


@dataclass(frozen=True)
class Candidate:
    """An instance the planner may group. ``deficit_blocks``: what it lacks
    (its forecast); ``free_blocks``: what it could lend a group;
    ``eligible``: False for one already in a group, draining or terminating."""

    instance_id: str
    free_blocks: int
    deficit_blocks: int = 0
    eligible: bool = True

    @property
    def need(self) -> int:
        """Positive: throttled by that much; negative: that much to spare. A
        throttled instance's free blocks go to its own queue: its deficit
        already counts them."""
        return self.deficit_blocks if self.deficit_blocks > 0 else -self.free_blocks


@dataclass(frozen=True)
class Member:
    instance_id: str
    start: int  # the layers it keeps: [start, end)
    end: int
    freed_blocks: int  # the parameter memory of the layers it drops


@dataclass(frozen=True)
class BuddyGroup:
    """Instances that together keep exactly one copy of the model, in pipeline
    stage order (requests enter at the first)."""

    members: tuple[Member, ...]

    @property
    def freed_blocks(self) -> int:
        return sum(m.freed_blocks for m in self.members)


@dataclass(frozen=True)
class BuddyPlan:
    needed_blocks: int
    groups: tuple[BuddyGroup, ...]  # only groups of two or more; every other instance stays whole

    @property
    def freed_blocks(self) -> int:
        return sum(g.freed_blocks for g in self.groups)

    @property
    def covered(self) -> bool:
        """False: even the largest groups allowed free too little; the paper
        scales out for the rest (§4.1, §4.3)."""
        return self.freed_blocks >= self.needed_blocks

    @property
    def disturbed(self) -> int:
        """Instances that drop layers (and so run pipelined)."""
        return sum(len(g.members) for g in self.groups)


def group_sizes(n: int, merges: int) -> list[int]:
    """``n`` instances in ``n - merges`` groups as even as possible, largest first."""
    groups = n - merges
    q, r = divmod(n, groups)
    return [q + 1] * r + [q] * (groups - r)


def layer_ranges(num_layers: int, k: int) -> list[tuple[int, int]]:
    """[0, num_layers) cut into k contiguous ranges that differ by at most one layer."""
    q, r = divmod(num_layers, k)
    bounds = [0]
    for i in range(k):
        bounds.append(bounds[-1] + q + (1 if i < r else 0))
    return list(itertools.pairwise(bounds))


def buddy_group(instance_ids: Sequence[str], num_layers: int, layer_blocks: int) -> BuddyGroup:
    """The instances, in stage order, keeping contiguous layer ranges; each
    frees the parameter memory of the layers it does not keep."""
    return BuddyGroup(tuple(Member(iid, s, e, (num_layers - (e - s)) * layer_blocks)
                            for iid, (s, e) in zip(instance_ids, layer_ranges(num_layers, len(instance_ids)))))


def plan_buddy_groups(candidates: Sequence[Candidate], needed_blocks: int, num_layers: int, layer_blocks: int,
                      max_group_size: int | None = None) -> BuddyPlan:
    """KunServe's throughput-greedy buddy groups (§4.1, Algorithm 1).

    Every instance holds a full replica of ``num_layers`` layers whose
    parameters take ``layer_blocks`` KV blocks each (P = num_layers *
    layer_blocks for the model). A group of k keeps one copy, so joining two
    groups frees exactly P whichever they are: the paper's Algorithm 1 merges
    groups until the freed memory covers ``needed_blocks`` (R), which takes
    ceil(R / P) merges, and stops there because every further stage costs
    throughput (more pipeline stages, more bubbles). With fewer than that
    possible (too few eligible instances, or ``max_group_size``, or a stage
    per layer at most) it merges all it can and the plan is not covered.

    Where this differs from the paper:
    - Algorithm 1 merges the two smallest groups each time. With 6 instances
      and 4 merges that ends at groups of 4 and 2 where 3 and 3 free the
      same; under a size cap of 3 it stops at three pairs, short of R. The
      same number of merges is spread evenly here instead: the largest group
      is as small as any plan that covers R allows, and for a concave group
      throughput (the paper's Thpt_g) no covering plan has a higher total.
      The price is instances disturbed: up to 2 * merges, where one big group
      would disturb merges + 1.
    - The paper does not say which instances join which (its dispatcher
      rebalances the overflow afterwards, §4.3). Here the most throttled
      instances lead the groups and the instances with the most to spare
      join them, so a group's pooled memory covers its own members where it
      can; the middle of the order stays whole.
    - A group's layers are split in contiguous ranges, the first member
      keeping the first layers; parameter memory is uniform per layer."""
    if num_layers < 1 or layer_blocks < 1:
        raise ValueError(f"need at least one layer of at least one block, got {num_layers} x {layer_blocks}")
    if max_group_size is not None and max_group_size < 1:
        raise ValueError(f"max_group_size must be at least 1, got {max_group_size}")
    if needed_blocks <= 0:
        return BuddyPlan(needed_blocks, ())
    ids = [c.instance_id for c in candidates]
    if len(set(ids)) != len(ids):
        raise ValueError(f"instance ids repeat: {ids}")
    pool = sorted((c for c in candidates if c.eligible), key=lambda c: (-c.need, c.instance_id))
    n = len(pool)
    cap = min(n, num_layers, max_group_size or n)
    if cap < 2:
        return BuddyPlan(needed_blocks, ())
    param_blocks = num_layers * layer_blocks
    merges = min(-(-needed_blocks // param_blocks), n - -(-n // cap))
    sizes = [k for k in group_sizes(n, merges) if k > 1]
    heads = pool[:len(sizes)]  # the most throttled lead
    spare = pool[::-1]  # the most to spare first
    groups = []
    for head, k in zip(heads, sizes):
        chosen = [head] + spare[:k - 1]
        del spare[:k - 1]
        groups.append(buddy_group([c.instance_id for c in chosen], num_layers, layer_blocks))
    return BuddyPlan(needed_blocks, tuple(groups))


def merge_groups(first: BuddyGroup, second: BuddyGroup, num_layers: int, layer_blocks: int) -> BuddyGroup | None:
    """Two formed groups as one (Algorithm 1's merge, §4.1), each member
    keeping a part of the layers it keeps now, so that a merge only drops
    layers, never fetches any back: the members in the order of their ranges
    (``first``'s before ``second``'s on equal ranges), each cut as close to an
    even split of ``num_layers`` as its range and its neighbours' allow.
    Two pairs of [0, 24) and [24, 48) become [0, 12), [12, 24), [24, 36),
    [36, 48), the first pair's members keeping the lower halves. None when no
    such cut gives every member a layer (a range of one layer shared by two
    members)."""
    for g in (first, second):
        if not holders_cover(g, num_layers):
            raise ValueError(f"group {[m.instance_id for m in g.members]} does not keep each layer exactly once")
    members = sorted(first.members + second.members, key=lambda m: (m.start, m.end))  # stable: first's first
    if len({m.instance_id for m in members}) != len(members):
        raise ValueError(f"the groups share members: {[m.instance_id for m in members]}")
    n = len(members)
    if n > num_layers:
        return None
    cuts = [0]
    for i in range(n - 1):
        m, nxt = members[i], members[i + 1]
        lo, hi = max(cuts[-1] + 1, m.start, nxt.start), min(m.end, nxt.end - 1)
        if lo > hi:
            return None
        cuts.append(min(hi, max(lo, round((i + 1) * num_layers / n))))
    if members[-1].end != num_layers or cuts[-1] >= num_layers or cuts[-1] < members[-1].start:
        return None
    cuts.append(num_layers)
    return BuddyGroup(tuple(Member(m.instance_id, s, e, (num_layers - (e - s)) * layer_blocks)
                            for m, (s, e) in zip(members, itertools.pairwise(cuts))))


def holders_cover(group: BuddyGroup, num_layers: int) -> bool:
    """Whether the group's members keep each of ``num_layers`` layers exactly once."""
    at = 0
    for m in sorted(group.members, key=lambda m: m.start):
        if m.start != at or m.end <= m.start:
            return False
        at = m.end
    return at == num_layers
