"""A dense copy of the decoding requests' KV, so decode attention reads each
request's context in place instead of gathering it from the paged cache.

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
steps of ``_LEN_ROUND`` with 25% headroom and shrinks when it is more than
twice what the batch needs.

The buffer lives in one of two arenas, flat tensors that are reused, never
freed while the cache is in use: a resize writes the new layout into the
other arena and copies the slots over. Fresh memory costs a page fault per
4 KB page on first touch (here: 70 ms to zero 181 MB freshly allocated, 8 ms
to zero it again), and with a fresh buffer at every resize, the step that a
long request joined (a migration's first step at the destination) took
300 ms against a normal 36 ms. A reused arena holds stale KV or zeros, all
finite: the positions past a slot's length are masked to probability 0, and
0 x finite = 0. Loading a slot gathers the blocks into a reused staging
tensor and copies them into place with no temporary. The cost: up to two
buffers' worth of memory stays resident (each at most ``max_bytes``).
Memory for a larger buffer is made ready off the step path, on a helper
thread: after a resize (for the other arena, the next resize's target) and
on a hint that a long context is about to join (``prewarm``: an incoming
migration's reservation, a long prompt's admission).

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

_LEN_ROUND = 64


class DecodeCache:
    def __init__(self, kv_cache: torch.Tensor, max_bytes: int):
        # kv_cache: [n_blocks, layers, 2, block_size, kv_heads, head_dim]
        self.kv_cache = kv_cache
        _, self.layers, _, self.block_size, self.kv_heads, self.head_dim = kv_cache.shape
        self.elt = kv_cache.element_size()
        self.max_bytes = max_bytes
        self.buf: torch.Tensor | None = None  # [layers, 2, slots, kv_heads, cap_len, head_dim]
        self._arenas: list[torch.Tensor | None] = [None, None]  # buf is a view of _arenas[_cur]
        self._cur = 0
        self._staging: torch.Tensor | None = None  # flat, for _load's gathered blocks
        # Zeroed flat tensors made on a helper thread, for the next arena or staging that must grow.
        self._lock = threading.Lock()
        self._ready: dict[str, torch.Tensor] = {}
        self._warming: set[str] = set()
        self.owner: list[Request | None] = []
        self.lens: list[int] = []

    # --- sizing -----------------------------------------------------------------
    def _bytes(self, slots: int, cap_len: int) -> int:
        return self.layers * 2 * slots * self.kv_heads * cap_len * self.head_dim * self.elt

    def _ensure(self, slots: int, need_len: int) -> bool:
        cur_s, cur_l = (self.buf.shape[2], self.buf.shape[4]) if self.buf is not None else (0, 0)
        if slots <= cur_s and need_len <= cur_l < 2 * need_len + _LEN_ROUND:
            return True
        new_s = max(slots, cur_s)
        new_l = -(-int(need_len * 1.25) // _LEN_ROUND) * _LEN_ROUND
        if self._bytes(new_s, new_l) > self.max_bytes:
            new_l = need_len
            if self._bytes(new_s, new_l) > self.max_bytes:
                return False
        shape = (self.layers, 2, new_s, self.kv_heads, new_l, self.head_dim)
        nxt = 1 - self._cur
        numel = self._bytes(new_s, new_l) // self.elt
        self._arenas[nxt] = self._grown(self._arenas[nxt], "arena", numel)
        buf = self._arenas[nxt][:numel].view(shape)
        if self.buf is not None:
            for i, n in enumerate(self.lens):  # slots past new_l are stale and get reloaded
                if self.owner[i] is not None and n <= new_l:
                    buf[:, :, i, :, :n] = self.buf[:, :, i, :, :n]
                elif self.owner[i] is not None:
                    self.owner[i] = None
        self.buf, self._cur = buf, nxt
        if self._arenas[1 - nxt] is None or self._arenas[1 - nxt].numel() < numel:
            self._make_ready("arena", numel)  # the next resize writes into the other arena
        self.owner += [None] * (new_s - cur_s)
        self.lens += [0] * (new_s - cur_s)
        return True

    # --- memory ----------------------------------------------------------------
    def _zeros(self, numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=self.kv_cache.dtype, device=self.kv_cache.device)

    def _grown(self, t: torch.Tensor | None, kind: str, numel: int) -> torch.Tensor:
        """``t`` if it holds ``numel`` elements, else the ready tensor of this
        kind if that does, else a fresh one (zeroed: faulted in here)."""
        if t is not None and t.numel() >= numel:
            return t
        with self._lock:
            ready = self._ready.get(kind)
            if ready is not None and ready.numel() >= numel:
                return self._ready.pop(kind)
        return self._zeros(numel)

    def _make_ready(self, kind: str, numel: int) -> None:
        """Zero a tensor of ``numel`` elements on a helper thread for the next
        ``_grown`` of this kind (one at a time per kind; any thread)."""
        if self.kv_cache.device.type != "cpu" or numel * self.elt > self.max_bytes:
            return
        with self._lock:
            ready = self._ready.get(kind)
            if kind in self._warming or (ready is not None and ready.numel() >= numel):
                return
            self._warming.add(kind)

        def fill():
            try:
                t = self._zeros(numel)
                with self._lock:
                    old = self._ready.get(kind)
                    if old is None or old.numel() < numel:
                        self._ready[kind] = t
            finally:
                with self._lock:
                    self._warming.discard(kind)

        threading.Thread(target=fill, name=f"decode-cache-{kind}", daemon=True).start()

    def prewarm(self, context_len: int) -> None:
        """A hint from any thread: a request with ``context_len`` tokens may
        start decoding soon. Make the memory its joining would need ready."""
        buf = self.buf
        slots, cap = (buf.shape[2], buf.shape[4]) if buf is not None else (0, 0)
        need = max(cap, context_len + 1)
        new_l = -(-int(need * 1.25) // _LEN_ROUND) * _LEN_ROUND
        if buf is None or need > cap or all(o is not None for o in list(self.owner)):
            self._make_ready("arena", self._bytes(slots + 1, new_l) // self.elt)
        nb = -(-context_len // self.block_size)
        staged = nb * self.kv_cache[0].numel()
        if self._staging is None or self._staging.numel() < staged:
            self._make_ready("staging", staged)

    def drop(self) -> None:
        """Forget every slot and free the memory (the runner gathers instead)."""
        self.buf, self.owner, self.lens = None, [], []
        self._arenas, self._staging = [None, None], None
        with self._lock:
            self._ready = {}

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
                self.buf[:, :, j, :, :n] = self.buf[:, :, i, :, :n]
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
            self._staging = self._grown(self._staging, "staging", numel)
            staged = self._staging[:numel].view(nb, *self.kv_cache.shape[1:])
            torch.index_select(self.kv_cache, 0, idx, out=staged)  # [nb, layers, 2, bs, kvh, d]
            src = staged.permute(1, 2, 4, 0, 3, 5)  # [layers, 2, kvh, nb, bs, d], no copy
            dst = self.buf[:, :, slot]  # [layers, 2, kvh, cap, d]
            full, rest = divmod(n, bs)
            if full:
                dst[:, :, :, :full * bs].unflatten(3, (full, bs)).copy_(src[:, :, :, :full])
            if rest:
                dst[:, :, :, full * bs:n].copy_(src[:, :, :, full, :rest])
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
