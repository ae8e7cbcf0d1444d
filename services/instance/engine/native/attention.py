"""Attention over the paged KV cache.

KV cache layout: ONE tensor ``[num_blocks, layers, 2, block_size, kv_heads,
head_dim]`` — the fused migration buffer's layout, so gather_kv is a single
``index_select`` along dim 0 and scatter_kv a single ``index_copy_``. For
attention speed the layout costs nothing: what attention touches is one
(layer, K|V) slice of a block, which is a contiguous ``block_size*kv_heads*
head_dim`` run (12 KiB for SmolLM2 in fp32) in this layout just as in a
per-layer one, so gathering a request's context copies whole contiguous runs.

Method: per step the requests split into a decode group (1 new token each)
and a prefill group (chunks of several tokens). For each group, per layer, the
new K/V are written into their slots, the group's context is gathered through
its padded block table with one index_select, and torch SDPA runs once over the
padded batch with a boolean mask (causal within the chunk, length padding).
No Python loop over requests in the hot path; the metadata (slots, block
tables, masks) is built once per step and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class GroupMeta:
    """A padded batch of requests for one SDPA call."""

    token_index: torch.Tensor  # [B*Q] rows of the flat token batch, in padded order (pads point at 0)
    valid: torch.Tensor  # [B*Q] bool, False for padding rows
    block_table: torch.Tensor  # [B*max_blocks] flat, padded with block 0
    mask: torch.Tensor  # [B, 1, Q, max_blocks*block_size] bool
    batch: int
    q_len: int
    out_index: torch.Tensor  # [n_valid] positions in the padded rows of the real tokens


@dataclass
class AttentionMeta:
    slot_blocks: torch.Tensor  # [T] block of each new token's KV
    slot_offsets: torch.Tensor  # [T] offset inside the block
    groups: list[GroupMeta]
    num_tokens: int


def build_group(token_starts: list[int], q_lens: list[int], ctx_starts: list[int], block_tables: list[list[int]],
                block_size: int, device: torch.device) -> GroupMeta:
    """token_starts: row of each request's first new token in the flat batch;
    ctx_starts: its first new token's position; q_lens: new tokens."""
    batch, q = len(q_lens), max(q_lens)
    max_blocks = max(len(bt) for bt in block_tables)
    kv_len = max_blocks * block_size
    rows = torch.tensor(token_starts).unsqueeze(1) + torch.arange(q).unsqueeze(0)  # [B, Q]
    qlen = torch.tensor(q_lens).unsqueeze(1)
    valid = torch.arange(q).unsqueeze(0) < qlen
    token_index = torch.where(valid, rows, 0).reshape(-1)
    # query i of request b sits at position ctx_starts[b] + i and sees keys <= that.
    qpos = torch.tensor(ctx_starts).unsqueeze(1) + torch.arange(q).unsqueeze(0)  # [B, Q]
    qpos = torch.where(valid, qpos, 0)  # padding rows see key 0 only (no all-masked rows -> no NaN)
    mask = torch.arange(kv_len).view(1, 1, kv_len) <= qpos.unsqueeze(2)  # [B, Q, K]
    table = torch.zeros(batch, max_blocks, dtype=torch.long)
    for b, bt in enumerate(block_tables):
        table[b, : len(bt)] = torch.tensor(bt, dtype=torch.long)
    return GroupMeta(
        token_index=token_index.to(device),
        valid=valid.reshape(-1).to(device),
        block_table=table.reshape(-1).to(device),
        mask=mask.unsqueeze(1).to(device),
        batch=batch,
        q_len=q,
        out_index=valid.reshape(-1).nonzero().squeeze(1).to(device),
    )


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                    meta: AttentionMeta, scale: float) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, KVH, D] for the step's new tokens; returns [T, H*D]."""
    k_cache = kv_cache[:, layer, 0]  # [N, bs, KVH, D] views into the one cache tensor
    v_cache = kv_cache[:, layer, 1]
    k_cache[meta.slot_blocks, meta.slot_offsets] = k.to(kv_cache.dtype)
    v_cache[meta.slot_blocks, meta.slot_offsets] = v.to(kv_cache.dtype)
    T, H, D = q.shape
    kvh = k.shape[1]
    out = q.new_empty(T, H * D)
    for g in meta.groups:
        qg = q.index_select(0, g.token_index).view(g.batch, g.q_len, H, D).transpose(1, 2)
        kg = k_cache.index_select(0, g.block_table).view(g.batch, -1, kvh, D).transpose(1, 2)
        vg = v_cache.index_select(0, g.block_table).view(g.batch, -1, kvh, D).transpose(1, 2)
        if kg.dtype != qg.dtype:
            kg, vg = kg.to(qg.dtype), vg.to(qg.dtype)
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale, enable_gqa=kvh != H)
        og = og.transpose(1, 2).reshape(g.batch * g.q_len, H * D)
        out[g.token_index[g.out_index]] = og.index_select(0, g.out_index)
    return out
