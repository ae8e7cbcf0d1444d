"""The native executor: owns the model and the KV cache, turns scheduled
chunks into one flat batch, runs the forward pass and samples."""

from __future__ import annotations

import numpy as np
import torch

from services.instance.engine.base import KvLayout
from services.instance.engine.core.executor import Executor
from services.instance.engine.core.request import Request
from services.instance.engine.core.scheduler import ScheduledChunk
from services.instance.engine.native.attention import AttentionMeta, build_dense, build_group
from services.instance.engine.native.decode_cache import DecodeCache
from services.instance.engine.native.model import LlamaModel
from services.instance.engine.native.sampler import (
    generator_state,
    new_generator,
    sample,
    set_generator_state,
)

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class ModelRunner(Executor):
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
        self._seeds = np.random.default_rng(seed)  # seeds for requests without one
        # Decodes read a dense copy of their context on CPU (see decode_cache.py);
        # by default it may take as much memory as the paged cache.
        if decode_cache_bytes is None:
            decode_cache_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        self.decode_cache = (DecodeCache(self.kv_cache, decode_cache_bytes)
                             if device.type == "cpu" and decode_cache_bytes > 0 else None)

    @property
    def kv_layout(self) -> KvLayout:
        return self._layout

    # --- forward --------------------------------------------------------------
    def _metadata(self, chunks: list[ScheduledChunk], dense: bool):
        """chunks are ordered decodes first (see attention.py); dense: the
        decodes are in DecodeCache slot order and read from it."""
        bs, layers = self._layout.block_size, self._layout.num_layers
        ids, pos, slots = [], [], []
        for c in chunks:
            r = c.request
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
            dc = self.decode_cache
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
        decodes = [c for c in chunks if c.num_new == 1]
        order = (self.decode_cache.prepare([c.request for c in decodes], [c.start for c in decodes])
                 if decodes and self.decode_cache is not None else None)
        if order is not None:
            decodes = [decodes[i] for i in order]
        ordered = decodes + [c for c in chunks if c.num_new != 1]
        input_ids, positions, meta, logits_index = self._metadata(ordered, order is not None)
        sampling = [c.request for c in ordered if c.samples]
        logits = self.model(input_ids, positions, self.kv_cache, meta, logits_index)
        if order is not None:
            self.decode_cache.advance(len(decodes))
        tokens = sample(logits, sampling, self.eos_token_ids) if sampling else []
        by_id = {r.request_id: t for r, t in zip(sampling, tokens)}
        return [by_id[c.request.request_id] if c.samples else None for c in chunks]

    # --- KV transfer (any thread; full or reserved blocks only) ------------------
    def gather_kv(self, block_ids: list[int]) -> memoryview:
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        buf = self.kv_cache.index_select(0, idx).cpu()
        return memoryview(buf.view(torch.uint8).numpy()).cast("B")

    def scatter_kv(self, block_ids: list[int], data: bytes | memoryview) -> None:
        n = len(block_ids)
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if raw.numel() != n * self._layout.bytes_per_block:
            raise ValueError(f"{raw.numel()} bytes for {n} blocks of {self._layout.bytes_per_block}")
        blocks = raw.view(self.kv_cache.dtype).view((n,) + tuple(self.kv_cache.shape[1:]))
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self.kv_cache.index_copy_(0, idx, blocks.to(self.device))

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
