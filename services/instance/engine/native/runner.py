"""The native executor: owns the model and the KV cache, turns scheduled
chunks into one flat batch, runs the forward pass and samples."""

from __future__ import annotations

import math

import numpy as np
import torch

from services.instance.engine import shared_kv
from services.instance.engine.base import EngineError, KvLayout
from services.instance.engine.core.executor import Executor, Sampled, TappedChunk, tapped_chunks
from services.instance.engine.core.request import Request
from services.instance.engine.core.scheduler import ScheduledChunk
from libs.common import cpu_features
from services.instance.engine.native import batch_invariant, cpu_kernels
from services.instance.engine.native.attention import (
    AttentionMeta,
    build_dense,
    build_dense_kernels,
    build_group,
    paged_attention,
    slot_rows,
)
from services.instance.engine.native.decode_cache import DecodeCache
from services.instance.engine.native.grammar import Grammars
from services.instance.engine.native.kv_staging import CudaKvStaging
from services.instance.engine.native.model import Attend, LlamaModel
from services.instance.engine.native.kunserve import GuestChunk, LayerPeer, plan_segments
from services.instance.engine.native.sampler import (
    generator_state,
    keep_prompt_logprobs,
    new_generator,
    prompt_logprob_positions,
    sample,
    samples,
    set_generator_state,
    skip_draws,
)

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class ModelRunner(Executor):
    layer_taps = True

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, eos_token_ids: frozenset[int], seed: int = 0,
                 decode_cache_bytes: int | None = None, vllm_kernels: bool = True, share_kv: bool = True,
                 kv_staging: bool = True, deterministic: bool = False, tokenizer_dir=None):
        cfg = model.config
        self.model = model
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.vocab_size = cfg.vocab_size
        self.grammars = Grammars(tokenizer_dir, cfg.vocab_size, eos_token_ids)  # structured outputs (grammar.py)
        # On CPU (bf16 or fp32): vLLM's attention kernel and RMSNorm's fp32 part where they run (cpu_kernels.py).
        self.kernels = (cpu_kernels.load(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, dtype)
                        if vllm_kernels and device.type == "cpu" and dtype in cpu_kernels.DTYPES else None)
        # With blocks the kernel can read, it attends over the paged cache in place (K transposed
        # within each block): no dense decode copy, no gathered context (attention.py).
        self.paged_kernels = self.kernels is not None and block_size % cpu_kernels.BLOCK_ALIGN == 0
        # The deterministic mode (batch_invariant.py): what its check verified here, in words.
        self.invariance = self._check_invariance(dtype) if deterministic else ""
        self._layout = KvLayout(_DTYPE_NAMES[dtype], block_size, cfg.num_hidden_layers,
                                cfg.num_key_value_heads, cfg.head_dim, k_transposed=self.paged_kernels)
        # The fused transfer layout; see attention.py for why it is also fine for attention.
        # On CPU in shared memory a destination on this host can copy from (shared_kv.py).
        self._share_kv = share_kv and device.type == "cpu"
        self._region: shared_kv.SharedRegion | None = None
        self._regions: dict[int, shared_kv.SharedRegion] = {}  # new_kv's tensors, by data_ptr
        self.kv_cache = self._alloc_kv((num_blocks, cfg.num_hidden_layers, 2, block_size,
                                        cfg.num_key_value_heads, cfg.head_dim), dtype)
        self._adopt_region(self.kv_cache)
        # On CPU, KV transfer copies through a numpy view of the cache,
        # [block, layer, K|V ... bytes]: one memcpy per (block[, layer]) on the
        # calling thread. torch's index_select/index_copy_ on these shapes took
        # 10-40x longer here, waiting on its worker threads when the cores
        # are busy with the engine's own steps.
        self._np_cache = (self.kv_cache.view(torch.uint8).numpy().reshape(num_blocks, cfg.num_hidden_layers, -1)
                          if device.type == "cpu" else None)
        # On CUDA, KV transfer on a side stream through pinned host buffers (kv_staging.py);
        # kv_staging=False keeps the plain path (the default stream, pageable memory) for comparison.
        self._staging = CudaKvStaging(device) if device.type == "cuda" and kv_staging else None
        self._seeds = np.random.default_rng(seed)  # seeds for requests without one
        # Decodes read a dense copy of their context on CPU (see decode_cache.py);
        # by default it may take as much memory as the paged cache.
        if decode_cache_bytes is None:
            decode_cache_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        dense = device.type == "cpu" and decode_cache_bytes > 0 and not self.paged_kernels
        if not dense and not self.paged_kernels:
            self.kernels = None  # without a dense cache the decodes gather their context and torch attends
        self.decode_cache = (DecodeCache(self.kv_cache, decode_cache_bytes, k_transposed=self.kernels is not None)
                             if dense else None)
        self._decode_cache_bytes = decode_cache_bytes
        # Pipelined execution (kunserve.py): which layers run here and which on a peer.
        self._segments: list[tuple[range, LayerPeer | None]] = [(range(cfg.num_hidden_layers), None)]
        self._remote: set[str] = set()  # requests with KV on a peer
        self._pending: set[str] = set()  # ... whose KV of the peers' layers is still here (live exchange)
        self._returning = False  # leaving the pipeline: only the requests in _remote still use the peers
        self._guest_cache: DecodeCache | None = None  # guests' decodes: their own slots

    @property
    def kv_layout(self) -> KvLayout:
        return self._layout

    def _check_invariance(self, dtype: torch.dtype) -> str:
        if not self.paged_kernels:
            raise EngineError("the deterministic mode needs vLLM's CPU attention kernel over the paged cache: "
                              "the vllm extra installed and runnable here (vllm_kernels.py), blocks of a multiple "
                              f"of {cpu_kernels.BLOCK_ALIGN}")
        if not self.model.deterministic:
            raise EngineError("the deterministic mode needs a model built for it (LlamaModel.make_deterministic)")
        try:
            return batch_invariant.check(self.model, self.kernels, dtype)
        except batch_invariant.NotInvariant as e:
            raise EngineError(f"the deterministic mode does not hold on this CPU ({cpu_features.level()}, "
                              f"{torch.get_num_threads()} threads): {e}") from None

    def set_kv_staging(self, on: bool) -> None:
        """On CUDA: KV transfer through kv_staging.py (on) or the plain path
        (off), from the next copy on; A/B runs in one process (``ferry bench
        migration-local``). Call between migrations."""
        if self.device.type == "cuda":
            self._staging = CudaKvStaging(self.device) if on else None

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
        ids, pos = [], []
        for c in chunks:
            if with_ids:
                ids += c.request.tokens(c.start, c.end)
            pos += range(c.start, c.end)
        if self.paged_kernels:
            return self._inputs(chunks, ids, pos, self._paged_meta(chunks))
        slots = [c.request.block_ids[i // bs] * (layers * 2 * bs) + i % bs for c in chunks
                 for i in range(c.start, c.end)]
        groups, cfg = [], self.model.config
        for decode in (True, False):
            sel = [c for c in chunks if (c.num_new == 1) == decode]
            if not sel or (decode and dense):
                groups.append(None)
                continue
            g = build_group([c.num_new for c in sel], [c.start for c in sel],
                            [c.request.block_ids[: -(-c.end // bs)] for c in sel], bs, layers, self.device)
            if not decode and self.kernels is not None:  # prefill by vLLM's kernel, not SDPA
                align = cpu_kernels.BLOCK_ALIGN
                g.kernel_step = self.kernels.step_meta(
                    [c.start for c in sel], -(-g.mask.shape[-1] // align) * align, cfg.num_attention_heads,
                    cfg.num_key_value_heads, cfg.head_dim, self.kv_cache.dtype, q_lens=[c.num_new for c in sel])
            groups.append(g)
        dev = self.device
        meta = AttentionMeta(slot_rows(torch.tensor(slots, device=dev), layers, bs), groups[0], groups[1], layers, bs,
                             kernels=self.kernels)
        if dense:
            starts = [c.start for c in chunks if c.num_new == 1]
            dc = cache or self.decode_cache
            meta.dense = (build_dense_kernels(dc.buf, starts, self.kernels, cfg.num_attention_heads)
                          if self.kernels is not None else build_dense(dc.buf, dc.slot_rows(starts), starts))
        return self._inputs(chunks, ids, pos, meta)

    def _paged_meta(self, chunks: list[ScheduledChunk]) -> AttentionMeta:
        """_metadata's attention part when the kernels attend over the paged
        cache: one call for every chunk, each through its own block table."""
        bs, cfg = self._layout.block_size, self.model.config
        step = self.kernels.step_meta(
            [c.start for c in chunks], bs, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            self.kv_cache.dtype, q_lens=[c.num_new for c in chunks],
            block_tables=[c.request.block_ids[: -(-c.end // bs)] for c in chunks])
        return AttentionMeta(None, None, None, self._layout.num_layers, bs, kernels=self.kernels, paged=step)

    def _inputs(self, chunks: list[ScheduledChunk], ids: list[int], pos: list[int], meta: AttentionMeta):
        """(token ids, positions, meta, the rows whose logits are needed) as
        tensors: first the rows that sample (``samples``), then those whose
        next token is a prompt token its request wants the logprob of
        (``prompt_rows``)."""
        last_rows, prompt_rows, row = [], [], 0
        for c in chunks:
            if samples(c):
                last_rows.append(row + c.num_new - 1)
            prompt_rows += [row + j - c.start for j in prompt_logprob_positions(c)]
            row += c.num_new
        dev = self.device
        return (torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta,
                torch.tensor(last_rows + prompt_rows, dtype=torch.long, device=dev))

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> list[int | Sampled | None]:
        ordered, dense = self._order(chunks, self.decode_cache)
        input_ids, positions, meta, logits_index = self._metadata(ordered, dense)
        sampling = [c.request for c in ordered if samples(c)]
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
        if self._staging is not None:
            self._staging.step_done()
        if logits.shape[0] > len(sampling):
            keep_prompt_logprobs(ordered, logits[len(sampling):])
        tokens = sample(logits[:len(sampling)], sampling, self.eos_token_ids) if sampling else []
        by_id = {r.request_id: t for r, t in zip(sampling, tokens)}
        return [by_id.get(c.request.request_id) if c.samples else None for c in chunks]

    # --- pipelined execution (kunserve.py) ----------------------------------------------
    def set_pipeline(self, own: range, peers: list[tuple[range, LayerPeer]]) -> None:
        """Run layers ``own`` here and each peer's range there, from the next
        step; ``own`` = every layer and no peers ends the pipeline. Refused
        while a request still has KV on a peer (it would lose it)."""
        segs = self._plan(own, peers)
        if self._remote and [p for _, p in segs if p is not None] != [p for _, p in self._segments
                                                                      if p is not None]:
            raise EngineError(f"{len(self._remote)} requests have KV on the current peers")
        self._segments = segs
        self._returning = False

    def _plan(self, own: range, peers: list[tuple[range, LayerPeer]]) -> list:
        """``plan_segments`` (ValueError), refused (EngineError) where a layer to run here is dropped."""
        segs = plan_segments(self._layout.num_layers, own, peers)
        dropped = [i for i in self.model.dropped() if i in own]
        if dropped:
            raise EngineError(f"layers {dropped} are dropped here: they cannot run here")
        return segs

    def holders(self, own: range | None = None, peers: list[tuple[range, LayerPeer]] | None = None) -> list:
        """Who runs each layer (None: here, else the peer): now, or in the
        pipeline ``own`` and ``peers`` would set (``_plan``'s errors if it cannot be)."""
        segs = self._segments if own is None else self._plan(own, peers or [])
        return [p for layers, p in segs for _ in layers]

    def regroup(self, own: range, peers: list[tuple[range, LayerPeer]], moved: list[str]) -> None:
        """A pipeline re-formed (KunServe's merge): ``moved``, the requests
        with KV, have it where ``own`` and ``peers`` say now (the engine moved
        it, ``NativeEngine.enter_pipeline``); from the next step they run so.
        Their guests on a peer that is no longer one are released there, and
        the other remote requests' everywhere (they have no KV left)."""
        segs = self._plan(own, peers)
        self.release_requests(sorted(self._remote - set(moved)))
        kept = {id(p) for _, p in segs if p is not None}
        gone = {id(p): p for _, p in self.peer_segments() if id(p) not in kept}
        for peer in gone.values():
            if moved:
                peer.release(list(moved))
        self._segments = segs
        self._remote = set(moved)
        self.forget_dense_slots()  # the copies of layers that came here, or left, are stale

    def _pipelined(self, ordered: list[ScheduledChunk], input_ids, positions, meta, logits_index):
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary(positions, x.dtype)
        guest = [GuestChunk(c.request.request_id, c.start, c.num_new, c.request.request_id in self._pending)
                 for c in ordered]
        here = [c for c in ordered if c.request.request_id in self._pending]
        attend = self._attend_here(here) if here else None
        split = self._return_split(ordered, cos, sin) if self._returning else None
        for layers, peer in self._segments:
            if peer is None:
                x = self.model.run_layers(x, cos, sin, self.kv_cache, meta, layers)
            elif split is None:
                self._remote.update(g.request_id for g in guest)
                x = peer.forward_layers(layers, guest, x, attend)
            else:
                x = self._run_split(split, guest, x, layers, peer)
        return self.model.head(x, logits_index, meta.kernels)

    def _return_split(self, ordered: list[ScheduledChunk], cos, sin):
        """Leaving the pipeline live (``start_return``): the rows of the
        requests whose KV is back (home: they run the peers' layers here,
        attending over the paged cache) and of those still on the peers."""
        home_rows, far_rows, home, far, at = [], [], [], [], 0
        for i, c in enumerate(ordered):
            rows = range(at, at + c.num_new)
            at += c.num_new
            if c.request.request_id in self._remote:
                far.append(i)
                far_rows += rows
            else:
                home.append(c)
                home_rows += rows
        dev = self.device
        hr = torch.tensor(home_rows, dtype=torch.long, device=dev)
        meta = self._metadata(home, dense=False, with_ids=False)[2] if home else None
        return (hr, torch.tensor(far_rows, dtype=torch.long, device=dev), far, meta,
                cos.index_select(0, hr), sin.index_select(0, hr))

    def _run_split(self, split, guest: list[GuestChunk], x: torch.Tensor, layers: range, peer) -> torch.Tensor:
        hr, fr, far, meta, cos, sin = split
        y = torch.empty_like(x)
        if hr.numel():
            y.index_copy_(0, hr, self.model.run_layers(x.index_select(0, hr), cos, sin, self.kv_cache, meta, layers))
        if far:
            y.index_copy_(0, fr, peer.forward_layers(layers, [guest[i] for i in far], x.index_select(0, fr)).to(
                x.dtype))
        return y

    def _attend_here(self, chunks: list[ScheduledChunk]) -> Attend:
        """Remote attention for a peer (kunserve.py): ``chunks`` (in step
        order: decodes first) have their KV of the peer's layers here; the
        peer sends their rows' q, k, v in that order, layer by layer."""
        _, _, meta, _ = self._metadata(chunks, dense=False, with_ids=False)
        rows = sum(c.num_new for c in chunks)
        scale = self.model.config.head_dim ** -0.5
        dtype = self.kv_cache.dtype

        @torch.inference_mode()
        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if q.shape[0] != rows or k.shape[0] != rows or v.shape[0] != rows:
                raise EngineError(f"remote attention: {q.shape[0]} rows for {rows} tokens with KV here")
            dev = self.device
            return paged_attention(q.to(dev, dtype), k.to(dev, dtype), v.to(dev, dtype), self.kv_cache, layer,
                                   meta, scale)
        return attend

    def release_requests(self, request_ids: list[str]) -> None:
        self._pending.difference_update(request_ids)
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

    @property
    def returning(self) -> bool:
        return self._returning

    @property
    def pipelined(self) -> bool:
        return len(self._segments) > 1 and not self._returning

    def kv_all_here(self, request_id: str) -> bool:
        # NOTE: a request that stepped while layers ran on a peer is in
        # _remote until its KV of those layers is back here.
        return request_id not in self._remote and not self.pipelined

    def start_return(self) -> None:
        """Leave the pipeline live: from the next step, a request not in
        ``remote_requests`` runs every layer here (its KV is back), the others
        still run the peers' layers there. Needs every layer here."""
        dropped = self.model.dropped()
        if dropped:
            raise EngineError(f"layers {dropped} are dropped here: restore them first")
        if self._pending:
            raise EngineError(f"{len(self._pending)} requests' KV is pending: release them first")
        self._returning = True

    def mark_remote(self, request_id: str, kv_here: bool = False) -> None:
        """This request's KV is now on the peers too (enter_pipeline);
        ``kv_here``: not yet, it attends here until ``exchanged``."""
        self._remote.add(request_id)
        if kv_here:
            self._pending.add(request_id)

    @property
    def pending_exchange(self) -> list[str]:
        """Requests whose KV of the peers' layers is still here, in order."""
        return sorted(self._pending)

    def exchanged(self, request_id: str) -> None:
        """Its KV of the peers' layers is there now: it attends there from the next step."""
        self._pending.discard(request_id)

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
    def forward_guest(self, layers: range, chunks: list[ScheduledChunk], hidden: torch.Tensor,
                      attend: Attend | None = None, at_owner: list[bool] | None = None) -> torch.Tensor:
        """Run ``layers`` (held here) for a peer's step: ``chunks`` over this
        engine's guests, ``hidden`` their rows in that order; returns the rows
        after the layers, in the same order. ``at_owner[i]``: chunk i's KV of
        these layers is at its owner; ``attend`` runs its attention there."""
        missing = [i for i in self.model.dropped() if i in layers]
        if missing:
            raise EngineError(f"layers {missing} are not held here")
        if self._guest_cache is None and self.decode_cache is not None:
            self._guest_cache = DecodeCache(self.kv_cache, self._decode_cache_bytes,
                                            k_transposed=self.kernels is not None)
        offsets, at = {}, 0
        for c in chunks:
            offsets[id(c)] = at
            at += c.num_new
        if at != hidden.shape[0]:
            raise EngineError(f"{hidden.shape[0]} hidden rows for {at} tokens")
        far_ids = {id(c) for c, f in zip(chunks, at_owner or ()) if f}
        far = [c for c in chunks if id(c) in far_ids]
        if far and attend is None:
            raise EngineError(f"{len(far)} chunks have their KV at the owner and no remote attention")
        local = [c for c in chunks if id(c) not in far_ids]
        ordered, dense, meta = [], False, None
        if local:
            ordered, dense = self._order(local, self._guest_cache)
            _, _, meta, _ = self._metadata(ordered, dense, self._guest_cache, with_ids=False)
        seq = ordered + far  # attention here for the first rows, at the owner for the rest
        rows = torch.tensor([offsets[id(c)] + k for c in seq for k in range(c.num_new)], device=self.device)
        positions = torch.tensor([p for c in seq for p in range(c.start, c.end)], device=self.device)
        x = hidden.to(self.device, self.kv_cache.dtype).index_select(0, rows)
        cos, sin = self.model.rotary(positions, x.dtype)
        remote = (sum(c.num_new for c in ordered), attend) if far else None
        y = self.model.run_layers(x, cos, sin, self.kv_cache, meta, layers, remote=remote)
        if dense:
            self._guest_cache.advance(sum(c.num_new == 1 for c in ordered))
        return torch.empty_like(y).index_copy_(0, rows, y)

    def new_kv(self, num_blocks: int) -> torch.Tensor:
        """A zeroed cache tensor of ``num_blocks`` blocks, for ``grow_kv``
        (any thread). On CPU it is memory from the kernel (a memfd when the
        cache is shared, shared_kv.zeroed), which reads as zeros and is
        committed page by page as blocks are first written: zeroing 212 MB
        up front (a page fault a page) took 0.3-3.9 s of CPU on four
        instances sharing two cores, and stalled the other instances' steps
        too. Elsewhere, a zeroed tensor (a device memset)."""
        return self._alloc_kv((num_blocks,) + tuple(self.kv_cache.shape[1:]), self.kv_cache.dtype)

    def _alloc_kv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=self.device)
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        buf, region = shared_kv.zeroed(size, "native", self._share_kv)  # the tensor keeps buf mapped
        t = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
        if region is not None:
            self._regions[t.data_ptr()] = region
        return t

    def _adopt_region(self, cache: torch.Tensor) -> None:
        """``cache`` (from _alloc_kv) is the cache now: its region is the one
        peers map; the previous one closes (its mapping stays valid here)."""
        region = self._regions.pop(cache.data_ptr(), None)
        if self._region is not None:
            self._region.close()
        self._region = region

    def kv_share(self) -> shared_kv.KvShare | None:
        return self._region.share if self._region is not None else None

    def grow_kv(self, num_blocks: int, fresh: torch.Tensor | None = None, holding: list[int] | None = None) -> None:
        """Make the cache hold block ids 0..num_blocks-1 (parameter memory
        lent to KV): a larger tensor (``fresh``, from ``new_kv``, when it is
        that size), the blocks copied over: ``holding`` (in order) only, when
        given, the others being free (``BlockPool.holding``). Copying all 352
        blocks of a SmolLM2 pool in fp32 (517 MB, into pages not committed
        yet) held each of four instances on two cores for 5.4 s in a merge."""
        have = self.kv_cache.shape[0]
        if num_blocks <= have:
            return
        bigger = fresh if fresh is not None and fresh.shape[0] == num_blocks else self.new_kv(num_blocks)
        if fresh is not None and fresh is not bigger:
            self._regions.pop(fresh.data_ptr(), None)
        if holding is None:
            bigger[:have].copy_(self.kv_cache)
        else:
            for _, first, n in shared_kv.runs([i for i in holding if i < have]):
                bigger[first:first + n].copy_(self.kv_cache[first:first + n])
        self.kv_cache = bigger
        self._adopt_region(bigger)
        if self._np_cache is not None:
            self._np_cache = bigger.view(torch.uint8).numpy().reshape(num_blocks, self._layout.num_layers, -1)
        for dc in (self.decode_cache, self._guest_cache):
            if dc is not None:
                dc.kv_cache = bigger

    def _layer_rows(self, block_ids, layer: int, on_host: bool = False) -> torch.Tensor:
        """Rows of (block, layer, K) and (block, layer, V) in the block-row
        view of the cache (see attention.py), [n, 2] flattened: whole
        contiguous rows that hold a layer's ``[n, 2, block_size, kv_heads, head_dim]``.
        On the cache's device, or on the host (``on_host``: for kv_staging)."""
        k = torch.tensor(block_ids, dtype=torch.long) * (self._layout.num_layers * 2) + 2 * layer
        rows = torch.stack((k, k + 1), dim=1).view(-1)
        return rows if on_host else rows.to(self.device)

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
        return raw.reshape(n, per_block)  # (no blocks: an empty [0, per_block])

    def gather_kv(self, block_ids: list[int]) -> memoryview:
        if self._np_cache is not None:
            return memoryview(self._np_cache[list(block_ids)].reshape(-1))
        if self._staging is not None:
            return self._staging.gather(self.kv_cache, block_ids)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        buf = self.kv_cache.index_select(0, idx).cpu()
        return memoryview(buf.view(torch.uint8).numpy()).cast("B")

    def scatter_kv(self, block_ids: list[int], data: bytes | memoryview) -> None:
        n = len(block_ids)
        rows = self._bytes_in(data, n, self._layout.bytes_per_block)
        if not n:
            return
        if self._np_cache is not None:
            self._np_cache[list(block_ids)] = rows.reshape(n, self._layout.num_layers, -1)
            return
        if self._staging is not None:
            self._staging.scatter(self.kv_cache, block_ids, data)
            return
        blocks = torch.from_numpy(rows.copy()).view(self.kv_cache.dtype).view((n,) + tuple(self.kv_cache.shape[1:]))
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self.kv_cache.index_copy_(0, idx, blocks.to(self.device))

    def _gather_layer(self, block_ids, layer: int) -> memoryview:
        if self._np_cache is not None:
            return memoryview(self._np_cache[list(block_ids), layer].reshape(-1))
        if self._staging is not None:  # on the engine thread, mid-step: after the layer just queued
            return self._staging.gather(self._block_rows(), self._layer_rows(block_ids, layer, True), now=True)
        # NOTE: .cpu() waits for the layer on CUDA (a pinned buffer and an event would not)
        part = self._block_rows().index_select(0, self._layer_rows(block_ids, layer)).cpu()
        return memoryview(part.view(torch.uint8).numpy()).cast("B")

    def scatter_kv_layer(self, block_ids: list[int], layer: int, data: bytes | memoryview) -> None:
        n = len(block_ids)
        rows = self._bytes_in(data, n, self._layout.bytes_per_block // self._layout.num_layers)
        if self._np_cache is not None:
            self._np_cache[list(block_ids), layer] = rows
            return
        if self._staging is not None:
            self._staging.scatter(self._block_rows(), self._layer_rows(block_ids, layer, True), data)
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
        if req.sampling.grammar is not None:  # fed the output so far: a migrated or resumed request's state
            req.grammar_matcher = self.grammars.matcher(req.sampling.grammar, req.output_token_ids)
            req.grammar_done = req.grammar_matcher.is_terminated()

    def resume_sampler(self, req: Request, num_tokens: int) -> None:
        if not req.sampling.greedy:
            skip_draws(req.generator, num_tokens, self.vocab_size)

    def rng_state(self, req: Request) -> bytes:
        return generator_state(req.generator)

    def set_rng_state(self, req: Request, state: bytes) -> None:
        set_generator_state(req.generator, state)
