"""Attention over the paged KV cache.

KV cache layout: ONE contiguous tensor ``[num_blocks, layers, 2, block_size,
kv_heads, head_dim]`` — the fused migration buffer's layout, so gather_kv is a
single ``index_select`` along dim 0 and scatter_kv a single ``index_copy_``.
For attention it costs nothing: what a layer touches is one (layer, K|V) slice
of a block, a contiguous ``block_size*kv_heads*head_dim`` run (12 KiB for
SmolLM2 fp32) here just as in a per-layer layout. Viewing the cache as rows of
one such run, gathering a request's context is an ``index_select`` of whole
rows, and writing new K/V an ``index_copy_`` of token rows — both fast
contiguous copies (advanced-index assignment on a strided view was 10x slower).

Method: the runner orders a step's tokens as [decodes..., prefill chunks...].
- decodes (one new token each): gathered context + batched matmuls with the
  query heads grouped per KV head (GQA without repeating K/V), softmax in fp32,
  a length mask; on CPU this beat SDPA's flash kernel ~7x in bf16 for q_len 1.
- prefill chunks: padded to the longest chunk, torch SDPA with a boolean mask
  (causal inside the chunk, everything before it, length padding).
The metadata (row indices, masks) is built once per step and shared by all layers.

On CPU the decodes read their context from a dense per-request copy instead
of gathering it (decode_cache.py: the gather was ~40% of a batch-32 step);
``AttentionMeta.dense`` is set then, and the gather path stays the fallback.

With vLLM's CPU kernels and blocks of a multiple of 32 positions, none of
the above: the cache is kept in the kernel's layout (``KvLayout.k_transposed``)
and ``AttentionMeta.paged`` is set: the kernel writes the step's new K/V into
their blocks and attends over each request's own blocks through its block
table, decodes and prefill chunks in one call (cpu_kernels.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.instance.engine.native.cpu_kernels import CpuKernels, StepMeta, paged_views


@dataclass
class GroupMeta:
    """A padded batch of requests for one attention call."""

    block_base: torch.Tensor  # [B*max_blocks] row of (block, layer 0, K) in the block-row view
    mask: torch.Tensor  # decode: [B, 1, 1, Lk]; prefill: [B, 1, Q, Lk] bool
    batch: int
    q_len: int  # 1 for decode
    num_tokens: int  # real tokens in the group
    token_index: torch.Tensor | None = None  # prefill: [B*Q] rows of the group's tokens (pads -> 0)
    out_index: torch.Tensor | None = None  # prefill: [num_tokens] valid rows of the padded output
    kernel_step: StepMeta | None = None  # prefill with vLLM's kernel (cpu_kernels.py) instead of SDPA


@dataclass
class DenseMeta:
    """The decodes' slots in DecodeCache.buf ([layers, 2, slots, kvh, cap, D])."""

    buf: torch.Tensor
    rows: torch.Tensor | None  # [layers, 2*B*kvh]: the new K rows (slot, head), then V, in buf's [-1, D] view
    masked: torch.Tensor | None  # [B, 1, 1, Lk] bool: True past each slot's length
    batch: int
    kv_len: int  # Lk: the slots' capacity (attention reads it all, masked)
    kernels: CpuKernels | None = None  # vLLM's kernels write and attend (K transposed in buf); rows/masked unused
    step: StepMeta | None = None


@dataclass
class AttentionMeta:
    slot_rows: torch.Tensor | None  # [layers, 2T] rows of the new tokens' K, then V, in the token-row view
    decode: GroupMeta | None
    prefill: GroupMeta | None
    num_layers: int
    block_size: int
    dense: DenseMeta | None = None  # decodes read from DecodeCache (then ``decode`` is None)
    kernels: CpuKernels | None = None  # vLLM's CPU kernels (cpu_kernels.py): attention, RMSNorm's fp32 part
    paged: StepMeta | None = None  # every chunk by the kernels over the k_transposed paged cache (then only this)


def _per_layer(base: torch.Tensor, layer_stride: int, v_offset: int, num_layers: int) -> torch.Tensor:
    """[layers, 2N] = base (N rows at layer 0, K) + layer * layer_stride, then
    the same + v_offset (V): built once a step so that a layer writes its K and
    V with one index_copy_ and no index arithmetic."""
    layer = torch.arange(num_layers, device=base.device).view(-1, 1, 1) * layer_stride
    kv = torch.tensor([0, v_offset], device=base.device).view(1, 2, 1)
    return (base.view(1, 1, -1) + layer + kv).view(num_layers, -1)


def slot_rows(slot_base: torch.Tensor, num_layers: int, block_size: int) -> torch.Tensor:
    """slot_base: [T] row of each new token's K at layer 0 in the token-row
    view ([blocks*layers*2*block_size, kvh*D]) -> AttentionMeta.slot_rows."""
    return _per_layer(slot_base, 2 * block_size, block_size, num_layers)


def build_dense(buf: torch.Tensor, rows: torch.Tensor, starts: list[int]) -> DenseMeta:
    """rows: [B*kvh] row of each slot's new K per head at layer 0 in buf's
    [-1, D] view; starts: each slot's context length before its new token, slot order."""
    layers, _, slots, kvh, kv_len, _ = buf.shape
    masked = torch.arange(kv_len).unsqueeze(0) > torch.tensor(starts).unsqueeze(1)
    rows = _per_layer(rows, 2 * slots * kvh * kv_len, slots * kvh * kv_len, layers)
    return DenseMeta(buf, rows, masked.view(len(starts), 1, 1, kv_len).to(buf.device), len(starts), kv_len)


def build_dense_kernels(buf: torch.Tensor, starts: list[int], kernels: CpuKernels, num_heads: int) -> DenseMeta:
    """build_dense for vLLM's CPU kernels (cpu_kernels.py): slot i is their block i."""
    _, _, _, kvh, kv_len, d = buf.shape
    step = kernels.step_meta(starts, kv_len, num_heads, kvh, d, buf.dtype)
    return DenseMeta(buf, None, None, len(starts), kv_len, kernels, step)


def build_group(q_lens: list[int], ctx_starts: list[int], block_tables: list[list[int]], block_size: int,
                num_layers: int, device: torch.device) -> GroupMeta:
    """q_lens: new tokens per request (their rows are consecutive in the
    group); ctx_starts: position of each request's first new token."""
    batch, q = len(q_lens), max(q_lens)
    max_blocks = max(len(bt) for bt in block_tables)
    kv_len = max_blocks * block_size
    table = torch.zeros(batch, max_blocks, dtype=torch.long)
    for b, bt in enumerate(block_tables):
        table[b, : len(bt)] = torch.tensor(bt, dtype=torch.long)
    qlen = torch.tensor(q_lens).unsqueeze(1)
    valid = torch.arange(q).unsqueeze(0) < qlen  # [B, Q]
    # query i of request b sits at position ctx_starts[b] + i and sees keys <= it;
    # padding rows see key 0 only (no all-masked rows, so no NaN).
    qpos = torch.where(valid, torch.tensor(ctx_starts).unsqueeze(1) + torch.arange(q).unsqueeze(0), 0)
    mask = (torch.arange(kv_len).view(1, 1, kv_len) <= qpos.unsqueeze(2)).unsqueeze(1)  # [B, 1, Q, Lk]
    meta = GroupMeta(block_base=(table.reshape(-1) * (num_layers * 2)).to(device), mask=mask.to(device),
                     batch=batch, q_len=q, num_tokens=sum(q_lens))
    if q > 1:
        starts = torch.tensor([0] + q_lens[:-1]).cumsum(0).unsqueeze(1)
        meta.token_index = torch.where(valid, starts + torch.arange(q).unsqueeze(0), 0).reshape(-1).to(device)
        meta.out_index = valid.reshape(-1).nonzero().squeeze(1).to(device)
    return meta


def _gather(cache_rows: torch.Tensor, g: GroupMeta, layer: int, kvh: int, d: int):
    k_idx = g.block_base + 2 * layer
    k = cache_rows.index_select(0, k_idx).view(g.batch, -1, kvh, d)
    v = cache_rows.index_select(0, k_idx + 1).view(g.batch, -1, kvh, d)
    return k, v


def _decode_dense(q: torch.Tensor, new_kv: torch.Tensor, dm: DenseMeta, layer: int, scale: float):
    """Append the decodes' new K/V to their slots, then attend over the slots
    in place (contiguous [B, KVH, cap, D] views, masked past each length).
    q: [B, H, D], new_kv: [2*B*KVH, D] (K rows, then V rows) -> [B, H*D]."""
    d = dm.buf.shape[-1]
    b, h = dm.batch, q.shape[1]
    kvh = dm.buf.shape[3]
    dm.buf.view(-1, d).index_copy_(0, dm.rows[layer], new_kv)
    # Two batched matmuls with the query heads grouped per KV head (no K/V
    # repeat), softmax in fp32 as transformers' eager attention does. Not
    # SDPA: its CPU flash kernel at q_len 1 measured 3-12x slower than this
    # on an AVX512-BF16 EPYC (batch 1-32, context 256-8192, bf16).
    qg = q.view(b, kvh, h // kvh, d)
    s = torch.matmul(qg, dm.buf[layer, 0, :b].transpose(-1, -2)).float().mul_(scale)  # [B, KVH, G, cap]
    s.masked_fill_(dm.masked, float("-inf"))
    p = s.softmax(dim=-1).to(q.dtype)
    return torch.matmul(p, dm.buf[layer, 1, :b]).view(b, h * d)


def _decode_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """Decode attention without transposing the gathered K/V (on CPU those
    strided copies cost more than the whole attention): multiply every query
    head with every KV head in two plain bmm's over the gathered rows, then
    keep the matching (KV head, query group) pairs with a diagonal view. The
    extra flops (x kv_heads) are small at q_len 1; measured 2.7x faster in bf16.
    q: [B, H, D]; k/v: [B, Lk, KVH, D]; mask [B, 1, 1, Lk] -> [B, H*D]."""
    B, H, D = q.shape
    Lk, kvh = k.shape[1], k.shape[2]
    G = H // kvh
    s = torch.bmm(k.reshape(B, Lk * kvh, D), q.transpose(1, 2))  # [B, Lk*KVH, H]
    s = s.view(B, Lk, kvh, kvh, G).diagonal(dim1=2, dim2=3)  # [B, Lk, G, KVH]
    s = s.permute(0, 3, 2, 1).reshape(B, H, Lk).mul_(scale)  # head h = kvh*G + g
    s.masked_fill_(~mask.view(B, 1, Lk), float("-inf"))
    p = s.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    o = torch.bmm(p, v.reshape(B, Lk, kvh * D))  # [B, H, KVH*D]
    o = o.view(B, kvh, G, kvh, D).diagonal(dim1=1, dim2=3)  # [B, G, D, KVH]
    return o.permute(0, 3, 1, 2).reshape(B, H * D)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                    meta: AttentionMeta, scale: float) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, KVH, D] for the step's new tokens (decodes
    first); returns [T, H*D]."""
    T, H, D = q.shape
    if meta.paged is not None:
        kc, vc = paged_views(kv_cache, layer)
        meta.kernels.write(k, v, kc, vc, meta.paged.slot_mapping)
        return meta.kernels.attend(q.contiguous(), kc, vc, meta.paged, scale).view(T, H * D)
    kvh = k.shape[1]
    bs = meta.block_size
    n_blocks = kv_cache.shape[0]
    new_kv = torch.cat((k.reshape(T, kvh * D), v.reshape(T, kvh * D))).to(kv_cache.dtype)  # [2T, kvh*D]
    kv_cache.view(-1, kvh * D).index_copy_(0, meta.slot_rows[layer], new_kv)
    block_rows = kv_cache.view(n_blocks * meta.num_layers * 2, bs * kvh * D)
    outs = []
    dm = meta.dense
    if dm is not None and dm.kernels is not None:
        b = dm.batch
        kc, vc = dm.buf[layer, 0], dm.buf[layer, 1]  # [slots, kvh, cap, D] each: one block per slot
        dm.kernels.write(k[:b], v[:b], kc, vc, dm.step.slot_mapping)
        outs.append(dm.kernels.attend(q[:b].contiguous(), kc, vc, dm.step, scale).view(b, H * D))
    elif dm is not None:
        b = dm.batch
        dense_kv = new_kv if b == T else torch.cat((new_kv[:b], new_kv[T: T + b]))
        outs.append(_decode_dense(q[:b], dense_kv.view(-1, D), dm, layer, scale))
    g = meta.decode
    if g is not None:
        kg, vg = _gather(block_rows, g, layer, kvh, D)  # [B, Lk, KVH, D]
        if q.device.type == "cpu":
            outs.append(_decode_cpu(q[: g.batch], kg, vg, g.mask, scale))
        else:
            qg = q[: g.batch].view(g.batch, kvh, H // kvh, D)
            scores = torch.matmul(qg, kg.permute(0, 2, 3, 1)).mul_(scale)  # [B, KVH, G, Lk]
            scores.masked_fill_(~g.mask, float("-inf"))
            probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)  # fp32 accumulation
            outs.append(torch.matmul(probs, vg.transpose(1, 2)).reshape(g.batch, H * D))  # [B, KVH, G, D]
    g = meta.prefill
    if g is not None:
        kg, vg = _gather(block_rows, g, layer, kvh, D)
        rows = q[T - g.num_tokens:]
        if g.kernel_step is not None:
            outs.append(meta.kernels.attend_gathered(rows, kg, vg, g.kernel_step, scale).view(-1, H * D))
        else:
            qg = rows.index_select(0, g.token_index).view(g.batch, g.q_len, H, D).transpose(1, 2)
            og = F.scaled_dot_product_attention(qg, kg.transpose(1, 2).to(q.dtype), vg.transpose(1, 2).to(q.dtype),
                                                attn_mask=g.mask, scale=scale, enable_gqa=kvh != H)
            outs.append(og.transpose(1, 2).reshape(g.batch * g.q_len, H * D).index_select(0, g.out_index))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
