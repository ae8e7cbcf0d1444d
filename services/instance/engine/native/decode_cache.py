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

A slot is trusted only while its length equals the chunk's start (the
request's KV count before the step); anything else (preempted, recomputed,
migrated) is reloaded from the paged cache. When the slots would exceed
``max_bytes`` (long contexts x many requests) ``prepare`` returns None and
the runner falls back to gathering; the buffer is dropped then.
"""

from __future__ import annotations

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
        buf = torch.zeros(self.layers, 2, new_s, self.kv_heads, new_l, self.head_dim, dtype=self.kv_cache.dtype,
                          device=self.kv_cache.device)
        if self.buf is not None:
            for i, n in enumerate(self.lens):  # slots past new_l are stale and get reloaded
                if self.owner[i] is not None and n <= new_l:
                    buf[:, :, i, :, :n] = self.buf[:, :, i, :, :n]
                elif self.owner[i] is not None:
                    self.owner[i] = None
        self.buf = buf
        self.owner += [None] * (new_s - cur_s)
        self.lens += [0] * (new_s - cur_s)
        return True

    def drop(self) -> None:
        self.buf, self.owner, self.lens = None, [], []

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
            nb = -(-n // self.block_size)
            idx = torch.tensor(req.block_ids[:nb], dtype=torch.long, device=self.kv_cache.device)
            blocks = self.kv_cache.index_select(0, idx)  # [nb, layers, 2, bs, kvh, d]
            dense = blocks.permute(1, 2, 4, 0, 3, 5).reshape(self.layers, 2, self.kv_heads, nb * self.block_size,
                                                             self.head_dim)
            self.buf[:, :, slot, :, :n] = dense[:, :, :, :n]
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
