"""The native executor: owns the model and the KV cache, turns scheduled
chunks into one flat batch, runs the forward pass and samples."""

from __future__ import annotations

import numpy as np
import torch

from services.instance.engine.base import EngineError, KvLayout
from services.instance.engine.core.executor import Executor, TappedChunk, tapped_chunks
from services.instance.engine.core.request import Request
from services.instance.engine.core.scheduler import ScheduledChunk
from services.instance.engine.native.attention import AttentionMeta, build_dense, build_group
from services.instance.engine.native.decode_cache import DecodeCache
from services.instance.engine.native.model import LlamaModel
from services.instance.engine.native.pipeline import GuestChunk, LayerPeer, plan_segments
from services.instance.engine.native.sampler import (
    generator_state,
    new_generator,
    sample,
    set_generator_state,
)

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class ModelRunner(Executor):
    layer_taps = True

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, eos_token_ids: frozenset[int], seed: int = 0,
                 decode_cache_bytes: int | None = None):
        cfg = model.config
        self.model = model
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.vocab_size = cfg.vocab_size
        self._layout = KvLayout(_DTYPE_NAMES[dtype], block_size, cfg.num_hidden_layers,
                                cfg.num_key_value_heads, cfg.head_dim)
        # The fused transfer layout; see attention.py for why it is also fine for attention.
        self.kv_cache = torch.zeros(num_blocks, cfg.num_hidden_layers, 2, block_size,
                                    cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=device)
        # On CPU, KV transfer copies through a numpy view of the cache,
        # [block, layer, K|V ... bytes]: one memcpy per (block[, layer]) on the
        # calling thread. torch's index_select/index_copy_ on these shapes took
        # 10-40x longer here, waiting on its worker threads when the cores
        # are busy with the engine's own steps.
        self._np_cache = (self.kv_cache.view(torch.uint8).numpy().reshape(num_blocks, cfg.num_hidden_layers, -1)
                          if device.type == "cpu" else None)
        self._seeds = np.random.default_rng(seed)  # seeds for requests without one
        # Decodes read a dense copy of their context on CPU (see decode_cache.py);
        # by default it may take as much memory as the paged cache.
        if decode_cache_bytes is None:
            decode_cache_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        self.decode_cache = (DecodeCache(self.kv_cache, decode_cache_bytes)
                             if device.type == "cpu" and decode_cache_bytes > 0 else None)
        self._decode_cache_bytes = decode_cache_bytes
        # Pipelined execution (pipeline.py): which layers run here and which on a peer.
        self._segments: list[tuple[range, LayerPeer | None]] = [(range(cfg.num_hidden_layers), None)]
        self._remote: set[str] = set()  # requests with KV on a peer
        self._guest_cache: DecodeCache | None = None  # guests' decodes: their own slots

    @property
    def kv_layout(self) -> KvLayout:
        return self._layout

    # --- forward --------------------------------------------------------------
    @staticmethod
    def _order(chunks: list[ScheduledChunk], cache: DecodeCache | None) -> tuple[list[ScheduledChunk], bool]:
        """The step's chunks as attention wants them: decodes first (in the
        dense cache's slot order when it holds them: then True), then prefills."""
        decodes = [c for c in chunks if c.num_new == 1]
        order = (cache.prepare([c.request for c in decodes], [c.start for c in decodes])
                 if decodes and cache is not None else None)
        if order is not None:
            decodes = [decodes[i] for i in order]
        return decodes + [c for c in chunks if c.num_new != 1], order is not None

    def _metadata(self, chunks: list[ScheduledChunk], dense: bool, cache: DecodeCache | None = None,
                  with_ids: bool = True):
        """chunks are ordered decodes first (see attention.py); dense: the
        decodes are in ``cache``'s slot order (default: the decode cache) and
        read from it. ``with_ids``: the token ids (a guest's layers need none)."""
        bs, layers = self._layout.block_size, self._layout.num_layers
        ids, pos, slots = [], [], []
        for c in chunks:
            r = c.request
            if with_ids:
                ids += r.tokens(c.start, c.end)
            p = range(c.start, c.end)
            pos += p
            slots += [r.block_ids[i // bs] * (layers * 2 * bs) + i % bs for i in p]
        groups = []
        for decode in (True, False):
            sel = [c for c in chunks if (c.num_new == 1) == decode]
            if decode and dense:
                groups.append(None)
                continue
            groups.append(build_group([c.num_new for c in sel], [c.start for c in sel],
                                      [c.request.block_ids[: -(-c.end // bs)] for c in sel], bs, layers,
                                      self.device) if sel else None)
        dev = self.device
        meta = AttentionMeta(torch.tensor(slots, device=dev), groups[0], groups[1], layers, bs)
        if dense:
            starts = [c.start for c in chunks if c.num_new == 1]
            dc = cache or self.decode_cache
            meta.dense = build_dense(dc.buf, dc.slot_rows(starts), starts)
        last_rows, row = [], 0
        for c in chunks:
            row += c.num_new
            if c.samples:
                last_rows.append(row - 1)
        return (torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta,
                torch.tensor(last_rows, dtype=torch.long, device=dev))

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> list[int | None]:
        ordered, dense = self._order(chunks, self.decode_cache)
        input_ids, positions, meta, logits_index = self._metadata(ordered, dense)
        sampling = [c.request for c in ordered if c.samples]
        tapped = tapped_chunks(ordered, self._layout)
        after_layer = (lambda i: self._emit_layer(tapped, i)) if tapped else None
        if len(self._segments) == 1:
            logits = self.model(input_ids, positions, self.kv_cache, meta, logits_index, after_layer)
        else:
            if tapped:
                raise EngineError("a per-layer KV handoff of a request served by a pipeline is not supported")
            logits = self._pipelined(ordered, input_ids, positions, meta, logits_index)
        if dense:
            self.decode_cache.advance(sum(c.num_new == 1 for c in ordered))
        tokens = sample(logits, sampling, self.eos_token_ids) if sampling else []
        by_id = {r.request_id: t for r, t in zip(sampling, tokens)}
        return [by_id[c.request.request_id] if c.samples else None for c in chunks]

    # --- pipelined execution (pipeline.py) ----------------------------------------------
    def set_pipeline(self, own: range, peers: list[tuple[range, LayerPeer]]) -> None:
        """Run layers ``own`` here and each peer's range there, from the next
        step; ``own`` = every layer and no peers ends the pipeline. Refused
        while a request still has KV on a peer (it would lose it)."""
        segs = plan_segments(self._layout.num_layers, own, peers)
        if self._remote and [p for _, p in segs if p is not None] != [p for _, p in self._segments
                                                                      if p is not None]:
            raise EngineError(f"{len(self._remote)} requests have KV on the current peers")
        dropped = [i for i in self.model.dropped() if i in own]
        if dropped:
            raise EngineError(f"layers {dropped} are dropped here: they cannot run here")
        self._segments = segs

    def _pipelined(self, ordered: list[ScheduledChunk], input_ids, positions, meta, logits_index):
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary(positions, x.dtype)
        guest = [GuestChunk(c.request.request_id, c.start, c.num_new) for c in ordered]
        for layers, peer in self._segments:
            if peer is None:
                x = self.model.run_layers(x, cos, sin, self.kv_cache, meta, layers)
            else:
                self._remote.update(g.request_id for g in guest)
                x = peer.forward_layers(layers, guest, x)
        return self.model.head(x, logits_index)

    def release_requests(self, request_ids: list[str]) -> None:
        gone = [r for r in request_ids if r in self._remote]
        if not gone:
            return
        for _, peer in self._segments:
            if peer is not None:
                peer.release(gone)
        self._remote.difference_update(gone)

    @property
    def remote_requests(self) -> frozenset[str]:
        return frozenset(self._remote)

    def mark_remote(self, request_id: str) -> None:
        """This request's KV is now on the peers too (enter_pipeline)."""
        self._remote.add(request_id)

    def peer_segments(self) -> list[tuple[range, LayerPeer]]:
        return [(layers, p) for layers, p in self._segments if p is not None]

    def gather_kv_layers(self, block_ids: list[int], layers: range) -> memoryview:
        """These layers of the blocks, layer-major: ``[layers][n, 2, block_size, kv_heads, head_dim]``."""
        return memoryview(b"".join(bytes(self._gather_layer(block_ids, i)) for i in layers))

    def scatter_kv_layers(self, block_ids: list[int], layers: range, data: bytes | memoryview) -> None:
        """The inverse of ``gather_kv_layers``. NOTE: runs inside the owner's
        step when a peer hands a guest over (it touches only the guests'
        blocks then); the owner's dense cache is the caller's to forget."""
        per = len(block_ids) * self._layout.bytes_per_block // self._layout.num_layers
        if len(data) != per * len(layers):
            raise EngineError(f"{len(data)} bytes for {len(layers)} layers of {len(block_ids)} blocks")
        for j, i in enumerate(layers):
            self.scatter_kv_layer(block_ids, i, memoryview(data)[j * per:(j + 1) * per])

    def forget_dense_slots(self) -> None:
        """The decoding requests' dense copies are stale (their KV of some
        layers came back from a peer): reload them from the paged cache."""
        if self.decode_cache is not None:
            self.decode_cache.drop()

    @torch.inference_mode()
    def forward_guest(self, layers: range, chunks: list[ScheduledChunk], hidden: torch.Tensor) -> torch.Tensor:
        """Run ``layers`` (held here) for a peer's step: ``chunks`` over this
        engine's guests, ``hidden`` their rows in that order; returns the rows
        after the layers, in the same order."""
        missing = [i for i in self.model.dropped() if i in layers]
        if missing:
            raise EngineError(f"layers {missing} are not held here")
        if self._guest_cache is None and self.decode_cache is not None:
            self._guest_cache = DecodeCache(self.kv_cache, self._decode_cache_bytes)
        offsets, at = {}, 0
        for c in chunks:
            offsets[id(c)] = at
            at += c.num_new
        if at != hidden.shape[0]:
            raise EngineError(f"{hidden.shape[0]} hidden rows for {at} tokens")
        ordered, dense = self._order(chunks, self._guest_cache)
        _, positions, meta, _ = self._metadata(ordered, dense, self._guest_cache, with_ids=False)
        rows = torch.tensor([offsets[id(c)] + k for c in ordered for k in range(c.num_new)], device=self.device)
        x = hidden.to(self.device, self.kv_cache.dtype).index_select(0, rows)
        cos, sin = self.model.rotary(positions, x.dtype)
        y = self.model.run_layers(x, cos, sin, self.kv_cache, meta, layers)
        if dense:
            self._guest_cache.advance(sum(c.num_new == 1 for c in ordered))
        return torch.empty_like(y).index_copy_(0, rows, y)

    def grow_kv(self, num_blocks: int) -> None:
        """Make the cache hold block ids 0..num_blocks-1 (parameter memory
        lent to KV): a larger tensor, the blocks copied over."""
        have = self.kv_cache.shape[0]
        if num_blocks <= have:
            return
        bigger = torch.zeros((num_blocks,) + tuple(self.kv_cache.shape[1:]), dtype=self.kv_cache.dtype,
                             device=self.device)
        bigger[:have].copy_(self.kv_cache)
        self.kv_cache = bigger
        if self._np_cache is not None:
            self._np_cache = bigger.view(torch.uint8).numpy().reshape(num_blocks, self._layout.num_layers, -1)
        for dc in (self.decode_cache, self._guest_cache):
            if dc is not None:
                dc.kv_cache = bigger

    def _layer_rows(self, block_ids, layer: int) -> torch.Tensor:
        """Rows of (block, layer, K) and (block, layer, V) in the block-row
        view of the cache (see attention.py), [n, 2] flattened: whole
        contiguous rows that hold a layer's ``[n, 2, block_size, kv_heads, head_dim]``."""
        k = torch.tensor(block_ids, dtype=torch.long) * (self._layout.num_layers * 2) + 2 * layer
        return torch.stack((k, k + 1), dim=1).view(-1).to(self.device)

    def _block_rows(self) -> torch.Tensor:
        return self.kv_cache.view(self.kv_cache.shape[0] * self._layout.num_layers * 2, -1)

    def _emit_layer(self, tapped: list[TappedChunk], layer: int) -> None:
        """After ``layer`` ran: hand each tapped chunk's blocks of that layer
        to its tap, as a copy (the blocks may be reused once the request is
        gone; the copy is 1/layers of the blocks' KV)."""
        for t in tapped:
            data = None
            if t.copy:
                data = self._gather_layer(t.block_ids, layer)
            t.emit(layer, data)

    # --- KV transfer (any thread; full or reserved blocks only) ------------------
    @staticmethod
    def _bytes_in(data: bytes | memoryview, n: int, per_block: int) -> np.ndarray:
        raw = np.frombuffer(data, dtype=np.uint8)
        if raw.size != n * per_block:
            raise ValueError(f"{raw.size} bytes for {n} blocks of {per_block}")
        return raw.reshape(n, -1)

    def gather_kv(self, block_ids: list[int]) -> memoryview:
        if self._np_cache is not None:
            return memoryview(self._np_cache[list(block_ids)].reshape(-1))
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        buf = self.kv_cache.index_select(0, idx).cpu()
        return memoryview(buf.view(torch.uint8).numpy()).cast("B")

    def scatter_kv(self, block_ids: list[int], data: bytes | memoryview) -> None:
        n = len(block_ids)
        rows = self._bytes_in(data, n, self._layout.bytes_per_block)
        if self._np_cache is not None:
            self._np_cache[list(block_ids)] = rows.reshape(n, self._layout.num_layers, -1)
            return
        blocks = torch.from_numpy(rows.copy()).view(self.kv_cache.dtype).view((n,) + tuple(self.kv_cache.shape[1:]))
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self.kv_cache.index_copy_(0, idx, blocks.to(self.device))

    def _gather_layer(self, block_ids, layer: int) -> memoryview:
        if self._np_cache is not None:
            return memoryview(self._np_cache[list(block_ids), layer].reshape(-1))
        # NOTE: .cpu() waits for the layer on CUDA (a pinned buffer and an event would not)
        part = self._block_rows().index_select(0, self._layer_rows(block_ids, layer)).cpu()
        return memoryview(part.view(torch.uint8).numpy()).cast("B")

    def scatter_kv_layer(self, block_ids: list[int], layer: int, data: bytes | memoryview) -> None:
        n = len(block_ids)
        rows = self._bytes_in(data, n, self._layout.bytes_per_block // self._layout.num_layers)
        if self._np_cache is not None:
            self._np_cache[list(block_ids), layer] = rows
            return
        src = torch.from_numpy(rows.copy()).view(self.kv_cache.dtype).view(2 * n, -1)
        self._block_rows().index_copy_(0, self._layer_rows(block_ids, layer), src.to(self.device))

    def expect_context(self, num_tokens: int) -> None:
        if self.decode_cache is not None:
            self.decode_cache.prewarm(num_tokens)

    # --- sampler state ------------------------------------------------------------
    def init_request(self, req: Request) -> None:
        seed = req.sampling.seed
        if seed is None:
            seed = int(self._seeds.integers(0, 2**63 - 1))
        req.generator = new_generator(seed)

    def rng_state(self, req: Request) -> bytes:
        return generator_state(req.generator)

    def set_rng_state(self, req: Request, state: bytes) -> None:
        set_generator_state(req.generator, state)
