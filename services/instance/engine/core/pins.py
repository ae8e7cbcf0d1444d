"""TTL pinning of programs' KV (Continuum's mechanism; issue 53's baseline,
the ``continuum`` policy): when a turn of a program ends (EngineRequest.
program_id, finished, not aborted or moved), its cached blocks stay pinned
here for ``ttl_s``: they hold a reference, so LRU cannot evict them and they
count as used, not free. A pin is released when its TTL passes, when the
program's next turn arrives here (at the step that admits it, which finds
the blocks in the cache and then holds them itself), or when a newer turn of
the program ends (its pin replaces it). Strict: a pinned block is never
taken for another request before its TTL, so requests that do not fit
beside the pins wait (the engine calls ``expire`` every step; the simulator
wakes an engine at ``next_expiry``).
With ``ttl_s`` 0 nothing is pinned (every engine's default)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from services.instance.engine.core.block_pool import BlockPool


class ProgramPins:
    def __init__(self, pool: BlockPool, ttl_s: float, clock: Callable[[], float]):
        self.pool = pool
        self.ttl_s = ttl_s
        self.clock = clock
        self._pins: dict[str, tuple[float, list[int]]] = {}  # program -> (expiry, pinned blocks)
        self.pinned_total = 0  # blocks ever pinned (counters)
        self.expired_total = 0  # pins released at their TTL

    def __len__(self) -> int:
        return len(self._pins)

    @property
    def num_blocks(self) -> int:
        return sum(len(b) for _, b in self._pins.values())

    def owned(self) -> list[list[int]]:
        """The pinned blocks, for the pool's integrity check (each pin is one reference)."""
        return [b for _, b in self._pins.values()]

    def next_expiry(self) -> float | None:
        return min((t for t, _ in self._pins.values()), default=None)

    def blocks_of(self, program_id: str) -> list[int]:
        pin = self._pins.get(program_id)
        return list(pin[1]) if pin else []

    def pin(self, program_id: str, cached_blocks: list[int]) -> None:
        """A turn of ``program_id`` ended holding these named blocks (called
        before the request's own references are dropped)."""
        if self.ttl_s <= 0 or not program_id or not self.pool.caching:
            return
        self.release(program_id)
        if not cached_blocks:
            return
        self.pool.share(cached_blocks)
        self._pins[program_id] = (self.clock() + self.ttl_s, list(cached_blocks))
        self.pinned_total += len(cached_blocks)

    def release(self, program_id: str) -> None:
        pin = self._pins.pop(program_id, None)
        if pin is not None:
            self.pool.free(pin[1])

    def expire(self, returned: Iterable[str] = ()) -> None:
        """Release the pins whose TTL passed and those of ``returned``
        programs (their next turn is here)."""
        if not self._pins:
            return
        now = self.clock()
        for p in [p for p, (t, _) in self._pins.items() if t <= now]:
            self.release(p)
            self.expired_total += 1
        for p in returned:
            self.release(p)
