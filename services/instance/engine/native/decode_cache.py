"""A dense copy of the decoding requests' KV, so decode attention reads each
request's context in place instead of gathering it from the paged cache.

Not used where vLLM's CPU kernel attends over the paged cache itself (bf16,
blocks of a multiple of 32: cpu_kernels.py); there the copy, its padding to
the longest context and its cost when a long request joins are gone.

Why: decode attention is memory-bound on CPU. Gathering a request's blocks
into a padded batch writes the whole context once more and reads it back
(3x the traffic of reading it once); at batch 32, context ~200 that gather
took ~40% of the step. Here each request that decodes owns a slot: a row of
``buf[layer, k|v, slot, :len]``. A request's KV is copied from the paged
cache once when it starts decoding; afterwards every step appends its one new
token to both the paged cache (the source of truth: migration, preemption and
prefill use it) and its slot. Slots are heads-major, ``buf[layer, k|v, slot,
kv_head, pos, head_dim]``: a KV head's context is one contiguous
``[cap, head_dim]`` matrix, which batched matmuls read without a copy. The slots of a
step's decodes are kept at 0..B-1 (compacted when requests leave), so a
layer's K for the batch is ``buf[layer, 0, :B]``, contiguous, and attention
runs on it without a copy. It reads every slot's full capacity (the
positions past a request's length are masked; the buffer starts zeroed so
they are finite): a strided ``[..., :Lk, :]`` view would be copied by the
kernels. So the capacity follows the longest context closely: it grows in
steps of ``_LEN_ROUND`` with 25% headroom (as much as ``max_bytes`` holds,
when that is less) and shrinks when it is more than twice what the batch needs.

The buffer is a view of a flat arena tensor. Arenas are reused, not freed
while the cache is in use: a resize writes the new layout into a spare
arena (the smallest that holds it) and copies the slots over; the old arena
becomes a spare (at most ``_SPARES`` kept, the largest). Fresh memory costs a page fault per
4 KB page on first touch (here: 70 ms to zero 181 MB freshly allocated, 8 ms
to zero it again), and with a fresh buffer at every resize, the step that a
long request joined (a migration's first step at the destination) took
300 ms against a normal 36 ms. A reused arena holds stale KV or zeros, all
finite: the positions past a slot's length are masked to probability 0, and
0 x finite = 0. Loading a slot gathers the blocks into a reused staging
tensor and copies them into place with no temporary. The cost: up to three
buffers' worth of memory stays resident (each at most ``max_bytes``).
Memory for a larger buffer is zeroed off the step path, on a helper thread,
into a spare: after a resize (so that the next one finds a spare as large)
and on a hint that a long context is about to join (``prewarm``: an incoming
migration's reservation, a long prompt's admission). A resize that needs
a spare still being zeroed waits for it (sooner than zeroing its own).

With ``k_transposed`` (the layout vLLM's CPU attention kernel reads,
cpu_kernels.py) a slot's K per KV head is stored transposed, ``[head_dim,
cap]``, and V as above; ``views`` gives both as ``[layers, slots, kv_heads,
cap, head_dim]`` (K as a strided view), and every copy here goes through them.

A slot is trusted only while its length equals the chunk's start (the
request's KV count before the step); anything else (preempted, recomputed,
migrated) is reloaded from the paged cache. When the slots would exceed
``max_bytes`` (long contexts x many requests) ``prepare`` returns None and
the runner falls back to gathering; the buffer is dropped then.
"""

from __future__ import annotations

import threading

import torch

from services.instance.engine.core.request import Request
from services.instance.engine.native.cpu_kernels import BLOCK_ALIGN

_LEN_ROUND = 64
_SPARES = 2  # spare arenas kept


def _capacity(need_len: int) -> int:
    """The slots' capacity for a longest context of ``need_len``: 25% headroom, in steps of _LEN_ROUND."""
    return -(-int(need_len * 1.25) // _LEN_ROUND) * _LEN_ROUND


class DecodeCache:
    def __init__(self, kv_cache: torch.Tensor, max_bytes: int, k_transposed: bool = False):
        # kv_cache: [n_blocks, layers, 2, block_size, kv_heads, head_dim]
        self.kv_cache = kv_cache
        self.k_transposed = k_transposed
        _, self.layers, _, self.block_size, self.kv_heads, self.head_dim = kv_cache.shape
        self.elt = kv_cache.element_size()
        self.max_bytes = max_bytes
        self.buf: torch.Tensor | None = None  # [layers, 2, slots, kv_heads, cap_len, head_dim]
        self._arena: torch.Tensor | None = None  # flat; buf is a view of it
        self._staging: torch.Tensor | None = None  # flat, for _load's gathered blocks
        # Flat zeroed tensors for the next arena or staging that must grow, by
        # kind; the helper thread adds to them. Fills in flight: kind -> (numel, done).
        self._lock = threading.Lock()
        self._spares: dict[str, list[torch.Tensor]] = {"arena": [], "staging": []}
        self._fills: dict[str, tuple[int, threading.Event]] = {}
        self._asked: dict[str, int] = {}  # kind -> the largest size asked for while a fill ran
        self._gen = 0  # drop() moves it on: a fill started before gives nothing after
        self.owner: list[Request | None] = []
        self.lens: list[int] = []

    def views(self, buf: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``buf`` (default: the buffer) as [layers, slots, kv_heads, cap, head_dim]."""
        buf = self.buf if buf is None else buf
        k, v = buf[:, 0], buf[:, 1]
        if self.k_transposed:
            k = k.flatten(-2).unflatten(-1, (buf.shape[-1], buf.shape[-2])).transpose(-1, -2)
        return k, v

    def slot_kv(self, slot: int, n: int) -> torch.Tensor:
        """[layers, 2, kv_heads, n, head_dim]: what slot ``slot`` holds of its first n positions."""
        k, v = self.views()
        return torch.stack((k[:, slot, :, :n], v[:, slot, :, :n]), dim=1)

    def _copy_slot(self, dst_buf: torch.Tensor, dst: int, src: int, n: int) -> None:
        """The first n positions of slot ``src`` of the buffer into slot ``dst`` of ``dst_buf``."""
        for d, s in zip(self.views(dst_buf), self.views()):
            d[:, dst, :, :n] = s[:, src, :, :n]

    # --- sizing -----------------------------------------------------------------
    def _bytes(self, slots: int, cap_len: int) -> int:
        return self.layers * 2 * slots * self.kv_heads * cap_len * self.head_dim * self.elt

    def _ensure(self, slots: int, need_len: int) -> bool:
        cur_s, cur_l = (self.buf.shape[2], self.buf.shape[4]) if self.buf is not None else (0, 0)
        if slots <= cur_s and need_len <= cur_l < 2 * need_len + _LEN_ROUND:
            return True
        new_s = max(slots, cur_s)
        new_l = _capacity(need_len)
        if self._bytes(new_s, new_l) > self.max_bytes:
            # As much headroom as the budget holds: with none (the capacity
            # exactly the need), every step of a growing batch resized and
            # copied all the slots (a batch-8 step 38 -> 65 ms when the budget,
            # the paged cache's size, was nearly all in use).
            new_l = self.max_bytes // self._bytes(new_s, 1)
            if self.k_transposed:  # vLLM's kernel takes blocks (slots) of a multiple of BLOCK_ALIGN positions
                new_l -= new_l % BLOCK_ALIGN
            if new_l < need_len:
                return False
        shape = (self.layers, 2, new_s, self.kv_heads, new_l, self.head_dim)
        numel = self._bytes(new_s, new_l) // self.elt
        arena = self._take("arena", numel)
        buf = arena[:numel].view(shape)
        if self.buf is not None:
            for i, n in enumerate(self.lens):  # slots past new_l are stale and get reloaded
                if self.owner[i] is not None and n <= new_l:
                    self._copy_slot(buf, i, i, n)
                elif self.owner[i] is not None:
                    self.owner[i] = None
        if self._arena is not None:
            self._give("arena", self._arena)
        self.buf, self._arena = buf, arena
        self._make_ready("arena", numel)  # the next resize finds a spare as large
        self.owner += [None] * (new_s - cur_s)
        self.lens += [0] * (new_s - cur_s)
        return True

    # --- memory ----------------------------------------------------------------
    def _zeros(self, numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=self.kv_cache.dtype, device=self.kv_cache.device)

    def _take(self, kind: str, numel: int) -> torch.Tensor:
        """The smallest spare of this kind that holds ``numel`` elements
        (waiting for one being zeroed that will), else a fresh one (zeroed:
        faulted in here, on the step)."""
        with self._lock:
            fill = self._fills.get(kind)
        if fill is not None and fill[0] >= numel:
            fill[1].wait()
        with self._lock:
            fits = [t for t in self._spares[kind] if t.numel() >= numel]
            if fits:
                t = min(fits, key=lambda t: t.numel())
                self._spares[kind] = [s for s in self._spares[kind] if s is not t]
                return t
        return self._zeros(numel)

    def _give(self, kind: str, t: torch.Tensor, gen: int | None = None) -> bool:
        """Keep ``t`` as a spare (only the largest few are kept); not if the
        cache was dropped since ``gen``."""
        with self._lock:
            if gen is not None and gen != self._gen:
                return False
            keep = sorted([*self._spares[kind], t], key=lambda s: s.numel(), reverse=True)
            self._spares[kind] = keep[:_SPARES if kind == "arena" else 1]
            return True

    def _make_ready(self, kind: str, numel: int) -> None:
        """Unless a spare of this kind holds ``numel`` elements already, zero
        one on a helper thread (any thread). One fill per kind at a time: a
        fill under way goes on with the largest size asked for meanwhile."""
        if self.kv_cache.device.type != "cpu" or numel * self.elt > self.max_bytes:
            return
        with self._lock:
            if any(t.numel() >= numel for t in self._spares[kind]):
                return
            if kind in self._fills:
                self._asked[kind] = max(self._asked.get(kind, 0), numel)
                return
            done = threading.Event()
            self._fills[kind] = (numel, done)

        gen = self._gen

        def fill():
            n = numel
            try:
                while True:
                    if not self._give(kind, self._zeros(n), gen):  # dropped meanwhile
                        break
                    with self._lock:
                        n = self._asked.pop(kind, 0)
                        if not n or any(t.numel() >= n for t in self._spares[kind]):
                            break
                        self._fills[kind] = (n, done)
            finally:
                with self._lock:
                    self._fills.pop(kind, None)
                done.set()

        threading.Thread(target=fill, name=f"decode-cache-{kind}", daemon=True).start()

    def prewarm(self, context_len: int) -> None:
        """A hint from any thread: a request with ``context_len`` tokens may
        start decoding soon. Make the memory its joining would need ready."""
        buf = self.buf
        slots, cap = (buf.shape[2], buf.shape[4]) if buf is not None else (0, 0)
        need = max(cap, context_len + 1)
        if buf is None or need > cap or all(o is not None for o in list(self.owner)):
            self._make_ready("arena", self._bytes(slots + 1, _capacity(need)) // self.elt)
        nb = -(-context_len // self.block_size)
        staged = nb * self.kv_cache[0].numel()
        if self._staging is None or self._staging.numel() < staged:
            self._make_ready("staging", staged)

    def drop(self) -> None:
        """Forget every slot and free the memory (the runner gathers instead)."""
        self.buf, self.owner, self.lens = None, [], []
        self._arena, self._staging = None, None
        with self._lock:
            self._spares = {"arena": [], "staging": []}
            self._gen += 1

    # --- per step -----------------------------------------------------------------
    def prepare(self, reqs: list[Request], starts: list[int]) -> list[int] | None:
        """Give each of this step's single-token chunks a slot in 0..B-1 that
        holds its first ``start`` tokens; returns the order of ``reqs`` by
        slot (the runner puts the decode rows in that order), or None when
        the slots do not fit ``max_bytes``."""
        b = len(reqs)
        if not self._ensure(b, max(starts) + 1):
            self.drop()
            return None
        want = {id(r): s for r, s in zip(reqs, starts)}
        for i, r in enumerate(self.owner):  # evict the requests not decoding now, and stale slots
            if r is not None and want.get(id(r)) != self.lens[i]:
                self.owner[i] = None
        # compact: owned slots >= b move into free slots < b
        free = [i for i in range(b) if self.owner[i] is None]
        for i in range(b, len(self.owner)):
            if self.owner[i] is not None:
                j = free.pop()
                n = self.lens[i]
                self._copy_slot(self.buf, j, i, n)
                self.owner[j], self.lens[j], self.owner[i] = self.owner[i], n, None
        placed = {id(r): i for i, r in enumerate(self.owner[:b]) if r is not None}
        for r, s in zip(reqs, starts):
            if id(r) not in placed:
                j = free.pop()
                self._load(j, r, s)
                placed[id(r)] = j
        order = sorted(range(b), key=lambda k: placed[id(reqs[k])])
        return order

    def _load(self, slot: int, req: Request, n: int) -> None:
        """Copy the first n tokens of req's KV from the paged cache."""
        if n:
            bs = self.block_size
            nb = -(-n // bs)
            idx = torch.tensor(req.block_ids[:nb], dtype=torch.long, device=self.kv_cache.device)
            numel = nb * self.kv_cache[0].numel()
            if self._staging is None or self._staging.numel() < numel:
                self._staging = None  # free the smaller one first
                self._staging = self._take("staging", numel)
            staged = self._staging[:numel].view(nb, *self.kv_cache.shape[1:])
            torch.index_select(self.kv_cache, 0, idx, out=staged)  # [nb, layers, 2, bs, kvh, d]
            full, rest = divmod(n, bs)
            for kv, view in enumerate(self.views()):
                src = staged[:, :, kv].permute(1, 3, 0, 2, 4)  # [layers, kvh, nb, bs, d], no copy
                dst = view[:, slot]  # [layers, kvh, cap, d]
                if full:
                    dst[:, :, :full * bs].unflatten(2, (full, bs)).copy_(src[:, :, :full])
                if rest:
                    dst[:, :, full * bs:n].copy_(src[:, :, full, :rest])
        self.owner[slot], self.lens[slot] = req, n

    def advance(self, batch: int) -> None:
        """After the step: each of slots 0..batch-1 gained its new token."""
        for i in range(batch):
            self.lens[i] += 1

    def slot_rows(self, starts_by_slot: list[int]) -> torch.Tensor:
        """[B*kv_heads] row, in the ``[-1, head_dim]`` view of buf, of each
        slot's new K per KV head at layer 0 (slot-major, then head); V is
        +slots*kv_heads*cap, layer l +l*2*slots*kv_heads*cap."""
        cap, kvh = self.buf.shape[4], self.kv_heads
        start = torch.tensor(starts_by_slot, dtype=torch.long)
        slot_head = torch.arange(len(starts_by_slot) * kvh, dtype=torch.long).view(-1, kvh)
        return (slot_head * cap + start.unsqueeze(1)).reshape(-1).to(self.kv_cache.device)
