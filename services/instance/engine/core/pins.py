"""What an instance holds of a program's KV between its turns (issue 53):
when a turn of a program ends (EngineRequest.program_id, finished, not
aborted or moved), its cached blocks are held here for a while. Two modes,
one per engine (``program_hold``), both with the same life cycle: a hold
starts when a turn ends, is replaced when a newer turn of the program ends,
and ends at its expiry (the engine calls ``expire`` every step and at every
load; the simulator wakes an engine at ``next_expiry``).

- ``ProgramPins``: TTL pinning (Continuum's mechanism; the ``continuum``
  policy, ``--program-ttl-s``). The blocks hold a reference for ``ttl_s``,
  so LRU cannot evict them and they count as used, not free; the pin also
  ends when the program's next turn arrives here (at the step that admits
  it, which finds the blocks in the cache and then holds them itself).
  Strict: a pinned block is never taken for another request before its TTL,
  so requests that do not fit beside the pins wait.
- ``ProgramKeep``: keep by expected return (the ``llumnix-keep`` policy,
  ``--program-keep``). The blocks hold no reference: they stay evictable,
  but apart from the LRU queue (prefix_cache.py), and go only when no plain
  cached block is left, the program whose blocks are worth least first. A
  program's expected return is learned from its own gaps here (an EWMA of
  the time from a turn's end to its next turn's arrival, ``default_gap_s``
  before one is seen); the retention lasts ``RETAIN_GAPS`` expected gaps,
  after which its blocks are plain LRU cache. Worth: the recompute cost of
  a block (``block_cost``: its tokens, with attention to its earlier
  context) over the seconds until the program's expected return (at least
  ``MIN_LEFT_S``); a program's blocks go tail first. At most ``budget`` of
  the pool is kept: a new retention past it ends the retentions worth least
  (its own head kept if it alone is past it). Kept blocks that are free are
  withheld from the free count the engine reports (``withheld``): dispatch
  sees them as held, while this engine's admission may evict them.
  Clients cannot hint a program's return (no request field carries one):
  the expected return is only learned.
With neither (ttl 0, keep 0) nothing is held (every engine's default)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from services.instance.engine.core.block_pool import BlockPool


@dataclass
class Hold:
    blocks: list[int]
    since: float  # when the turn ended
    expires: float
    returns: float = 0.0  # expected arrival of the next turn (keep)


class ProgramHold:
    """The holds of one engine, program -> Hold; ``_start`` / ``_end`` are the mode's."""

    def __init__(self, pool: BlockPool, clock: Callable[[], float]):
        self.pool = pool
        self.clock = clock
        self._holds: dict[str, Hold] = {}
        self.pinned_total = 0  # blocks ever held (counters)
        self.expired_total = 0  # holds ended at their expiry

    active = False  # whether turns' ends hold anything

    def __len__(self) -> int:
        return len(self._holds)

    @property
    def watching(self) -> bool:
        """Whether ``expire`` has anything to do (holds, or programs whose return is awaited)."""
        return bool(self._holds)

    @property
    def num_blocks(self) -> int:
        return sum(len(h.blocks) for h in self._holds.values())

    def owned(self) -> list[list[int]]:
        """The blocks holds reference, for the pool's integrity check."""
        return []

    def withheld(self) -> int:
        """Free blocks that the engine's reported load counts as held."""
        return 0

    def next_expiry(self) -> float | None:
        return min((h.expires for h in self._holds.values()), default=None)

    def blocks_of(self, program_id: str) -> list[int]:
        h = self._holds.get(program_id)
        return list(h.blocks) if h else []

    def pin(self, program_id: str, cached_blocks: list[int]) -> None:
        """A turn of ``program_id`` ended holding these named blocks (called
        before the request's own references are dropped)."""
        if not self.active or not program_id or not self.pool.caching:
            return
        self.release(program_id)
        if not cached_blocks:
            return
        hold = self._start(program_id, list(cached_blocks))
        if hold is not None:
            self._holds[program_id] = hold
            self.pinned_total += len(hold.blocks)

    def release(self, program_id: str) -> None:
        hold = self._holds.pop(program_id, None)
        if hold is not None:
            self._end(program_id, hold)

    def expire(self, returned: Iterable[str] = ()) -> None:
        """End the holds past their expiry; ``returned``: the programs whose
        next turn is here."""
        if not self.watching:
            return
        now = self.clock()
        for p in [p for p, h in self._holds.items() if h.expires <= now]:
            self.release(p)
            self.expired_total += 1
        self._returned(returned, now)

    # --- moves of a program's kept blocks to another instance (keep only) --------------
    movable_holds = False  # whether a hold's blocks may leave for another instance (cache moves)

    def movable(self) -> list[tuple[str, int]]:
        """Programs whose held blocks could move now, the first to go first, with their blocks."""
        return []

    def chain(self, program_id: str) -> list[int]:
        """The blocks of ``program_id``'s hold a move would take, head first ([]: none)."""
        return []

    def handover(self, program_id: str) -> tuple[float, float]:
        """(seconds since its turn ended, its expected gap), for the instance it moves to."""
        raise NotImplementedError

    def adopt(self, program_id: str, blocks: list[int], age_s: float, gap_s: float) -> None:
        """Hold blocks that came from another instance as if the turn had ended here ``age_s`` ago."""
        raise NotImplementedError

    def _start(self, program_id: str, blocks: list[int]) -> Hold | None:
        raise NotImplementedError

    def _end(self, program_id: str, hold: Hold) -> None:
        raise NotImplementedError

    def _returned(self, programs: Iterable[str], now: float) -> None:
        raise NotImplementedError


class ProgramPins(ProgramHold):
    """Continuum's strict TTL pins (the module's docstring)."""

    def __init__(self, pool: BlockPool, ttl_s: float, clock: Callable[[], float]):
        super().__init__(pool, clock)
        self.ttl_s = ttl_s
        self.active = ttl_s > 0

    def owned(self) -> list[list[int]]:
        return [h.blocks for h in self._holds.values()]  # each pin is one reference

    def _start(self, program_id: str, blocks: list[int]) -> Hold:
        self.pool.share(blocks)
        now = self.clock()
        return Hold(blocks, now, now + self.ttl_s)

    def _end(self, program_id: str, hold: Hold) -> None:
        self.pool.free(hold.blocks)

    def _returned(self, programs: Iterable[str], now: float) -> None:
        for p in programs:  # its blocks go back to the cache, where the turn's admission finds them
            self.release(p)


RETAIN_GAPS = 3.0  # a retention lasts this many expected gaps (an exponential gap passes 3 means 5% of the time)
GAP_WEIGHT = 0.5  # the EWMA's weight of the newest gap
MIN_LEFT_S = 1.0  # a program due (or overdue) counts as returning within this long
ATTN_TOKENS = 8192.0  # context length at which a token's attention costs as much as the rest of its compute
MAX_PROGRAMS = 4096  # programs whose gaps are remembered (least recently seen forgotten)


def block_cost(position: int, block_size: int) -> float:
    """Recomputing the block at ``position`` of a chain: its tokens, each
    attending to the context before it (relative to ATTN_TOKENS)."""
    return block_size * (1.0 + (position + 0.5) * block_size / ATTN_TOKENS)


class ProgramKeep(ProgramHold):
    """Keep by expected return (the module's docstring)."""

    def __init__(self, pool: BlockPool, budget: float, default_gap_s: float, block_size: int,
                 clock: Callable[[], float]):
        super().__init__(pool, clock)
        self.budget = budget
        self.default_gap_s = default_gap_s
        self.block_size = block_size
        self.active = budget > 0
        self._gaps: OrderedDict[str, float] = OrderedDict()  # program -> EWMA of its gaps here
        self._ended: OrderedDict[str, float] = OrderedDict()  # program -> its last turn's end, until it returns
        if self.active:
            pool.cache.choose = self._victims

    @property
    def watching(self) -> bool:
        return bool(self._holds or self._ended)

    def withheld(self) -> int:
        return self.pool.cache.num_kept_evictable

    def expected_gap(self, program_id: str) -> float:
        return self._gaps.get(program_id, self.default_gap_s)

    def worth(self, program_id: str, now: float | None = None) -> float:
        """A kept block's recompute cost per second until the program's
        expected return (mean over its blocks; lowest goes first). Past its
        expected return, the seconds it is late count instead: a program
        later than expected has likely ended, or gone on elsewhere."""
        h = self._holds[program_id]
        now = self.clock() if now is None else now
        n = len(h.blocks)
        cost = sum(block_cost(i, self.block_size) for i in range(n)) / max(1, n)
        return cost / max(abs(h.returns - now), MIN_LEFT_S)

    def _start(self, program_id: str, blocks: list[int]) -> Hold:
        cap = int(self.budget * self.pool.capacity)
        blocks = blocks[:cap]
        now = self.clock()
        gap = self.expected_gap(program_id)
        hold = Hold(blocks, now, now + RETAIN_GAPS * gap, returns=now + gap)
        self._remember(self._ended, program_id, now)
        self.pool.keep(program_id, blocks)
        # past the budget: the retentions worth least end (this one counts from the next call on)
        others = sorted(self._holds, key=lambda p: self.worth(p, now))
        while others and self.pool.cache.num_kept > cap:
            self.release(others.pop(0))
        return hold

    def _end(self, program_id: str, hold: Hold) -> None:
        self.pool.unkeep(program_id, hold.blocks)

    movable_holds = True

    def chain(self, program_id: str) -> list[int]:
        """The head of the hold's blocks still cached and kept by it, when
        every one of them is free (no turn of the program uses them here)."""
        h = self._holds.get(program_id)
        if h is None:
            return []
        cache = self.pool.cache
        out = []
        for b in h.blocks:
            if program_id not in cache.keepers_of(b):  # evicted (and maybe reused) from here on
                break
            if not cache.is_kept_evictable(b):
                return []
            out.append(b)
        return out

    def movable(self) -> list[tuple[str, int]]:
        """The programs whose kept blocks are all free, worth least first
        (those the keeper would evict first: ``_victims``)."""
        now = self.clock()
        got = [(self.worth(p, now), p, len(c)) for p in self._holds if (c := self.chain(p))]
        return [(p, n) for _, p, n in sorted(got)]

    def handover(self, program_id: str) -> tuple[float, float]:
        h = self._holds[program_id]
        return self.clock() - h.since, self.expected_gap(program_id)

    def adopt(self, program_id: str, blocks: list[int], age_s: float, gap_s: float) -> None:
        """Its gap as learned where it came from; its retention counts from
        its turn's end there (``age_s`` ago). The blocks are in use (the
        caller frees them after)."""
        self._remember(self._gaps, program_id, gap_s)
        self.release(program_id)
        cap = int(self.budget * self.pool.capacity)
        blocks = blocks[:cap]
        if not blocks:
            return
        ended = self.clock() - max(0.0, age_s)
        self._remember(self._ended, program_id, ended)
        self.pool.keep(program_id, blocks)
        self._holds[program_id] = Hold(blocks, ended, ended + RETAIN_GAPS * gap_s, returns=ended + gap_s)
        self.pinned_total += len(blocks)
        others = sorted((p for p in self._holds if p != program_id), key=lambda p: self.worth(p))
        while others and self.pool.cache.num_kept > cap:
            self.release(others.pop(0))

    def _returned(self, programs: Iterable[str], now: float) -> None:
        """A program's next turn arrived here: its gap is learned, once,
        whether or not the retention had ended; the retention goes on (its
        blocks are in use once the turn is admitted) until that turn's end
        replaces it, or for one more expected gap."""
        for p in programs:
            end = self._ended.pop(p, None)
            if end is None:
                continue
            old = self._gaps.pop(p, None)
            gap = now - end
            self._remember(self._gaps, p, gap if old is None else GAP_WEIGHT * gap + (1.0 - GAP_WEIGHT) * old)
            h = self._holds.get(p)
            if h is not None:  # due now; if the turn leaves (moved, aborted), the hold ends within a gap
                h.returns = now
                h.expires = min(h.expires, now + self.expected_gap(p))

    @staticmethod
    def _remember(d: OrderedDict, program_id: str, value: float) -> None:
        d.pop(program_id, None)
        d[program_id] = value
        if len(d) > MAX_PROGRAMS:
            d.popitem(last=False)

    def _victims(self) -> list[int]:
        """The pool's next kept blocks to evict: the evictable blocks that
        only the program worth least keeps (popped last first: tail first)."""
        cache = self.pool.cache
        now = self.clock()
        best, best_worth = [], None
        for p, h in self._holds.items():
            mine = [b for b in h.blocks if cache.is_kept_evictable(b) and cache.keepers_of(b) == {p}]
            if not mine:
                continue
            w = self.worth(p, now)
            if best_worth is None or w < best_worth:
                best, best_worth = mine, w
        return best


def program_hold(pool: BlockPool, ttl_s: float, keep: float, default_gap_s: float, block_size: int,
                 clock: Callable[[], float]) -> ProgramHold:
    """The engine's holds: Continuum's pins (``ttl_s`` > 0) or keep (``keep`` > 0); neither: nothing held."""
    if ttl_s > 0 and keep > 0:
        raise ValueError("program_ttl_s and program_keep are two modes: set one")
    if keep > 0:
        return ProgramKeep(pool, keep, default_gap_s, block_size, clock)
    return ProgramPins(pool, ttl_s, clock)
