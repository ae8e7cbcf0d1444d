"""vLLM's CPU kernels in the native engine (cpu_kernels.py): decode attention
over the dense cache's K-transposed slots gives the torch path's output within
bf16 rounding, and so does prefill attention against SDPA; in a running bf16
engine every slot holds exactly its request's KV from the paged cache after
each step (the kernel wrote the new token where the cache's copies read it),
through churn and preemption; RMSNorm with the kernel's fp32 part gives the
torch ops' bits. Skipped where vLLM's CPU build is not installed."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from services.instance.engine.native import cpu_kernels
from services.instance.engine.native.attention import (
    AttentionMeta,
    build_dense,
    build_dense_kernels,
    build_group,
    paged_attention,
    slot_rows,
)
from services.instance.engine.native.decode_cache import DecodeCache
from tests.instance.engine.helpers import LOGPROB_NOISE, assert_bounded_divergence, collect, req

H, KVH, D, LAYERS, BS = 9, 3, 64, 2, 16

KERNELS = cpu_kernels.load(H, KVH, D)
pytestmark = pytest.mark.skipif(KERNELS is None, reason="vLLM's CPU kernels are not installed or not usable here")


class Req:
    def __init__(self, blocks: list[int]):
        self.block_ids = blocks


def test_decode_attention_matches_the_torch_path():
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(40, LAYERS, 2, BS, KVH, D, generator=g).to(torch.bfloat16)
    reqs = [Req(list(range(12))), Req(list(range(12, 20))), Req(list(range(20, 40)))]
    starts = [150, 97, 300]  # context before the new token
    plain, fast = DecodeCache(kv, 2**26), DecodeCache(kv.clone(), 2**26, k_transposed=True)
    order = plain.prepare(reqs, starts)
    assert fast.prepare(reqs, starts) == order
    reqs, starts = [reqs[i] for i in order], [starts[i] for i in order]  # rows in slot order, as the runner puts them
    q = torch.randn(3, H, D, generator=g).to(torch.bfloat16)
    k = torch.randn(3, KVH, D, generator=g).to(torch.bfloat16)
    v = torch.randn(3, KVH, D, generator=g).to(torch.bfloat16)
    slots = torch.tensor([r.block_ids[s // BS] * (LAYERS * 2 * BS) + s % BS for r, s in zip(reqs, starts)])
    outs = []
    for dc, kernels in ((plain, None), (fast, KERNELS)):
        meta = AttentionMeta(slot_rows(slots, LAYERS, BS), None, None, LAYERS, BS, kernels=kernels)
        meta.dense = (build_dense_kernels(dc.buf, starts, kernels, H) if kernels
                      else build_dense(dc.buf, dc.slot_rows(starts), starts))
        outs.append(paged_attention(q, k, v, dc.kv_cache, 1, meta, D ** -0.5).float())
        dc.advance(3)
    assert outs[1].abs().max() > 0.1  # not a zero output
    assert (outs[0] - outs[1]).abs().max() < 0.02
    # both wrote the new token where their slots read it, and into the paged cache
    for i, s in enumerate(starts):
        assert torch.equal(fast.slot_kv(i, s + 1), plain.slot_kv(i, s + 1))
        assert torch.equal(fast.slot_kv(i, s + 1)[1, 0, :, s], k[i])
    assert torch.equal(fast.kv_cache, plain.kv_cache)


def test_prefill_attention_matches_sdpa():
    """Chunks with and without context before them, of different lengths
    (the kernel reads each request's gathered context as one block)."""
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(60, LAYERS, 2, BS, KVH, D, generator=g).to(torch.bfloat16)
    q_lens, ctx = [40, 7, 100], [0, 33, 150]  # 150 + 100 = 250 positions: 16 blocks of 16
    tables = [list(range(3)), list(range(3, 6)), list(range(6, 22))]
    t = sum(q_lens)
    q = torch.randn(t, H, D, generator=g).to(torch.bfloat16)
    k = torch.randn(t, KVH, D, generator=g).to(torch.bfloat16)
    v = torch.randn(t, KVH, D, generator=g).to(torch.bfloat16)
    slots = torch.tensor([tb[p // BS] * (LAYERS * 2 * BS) + p % BS
                          for tb, s, n in zip(tables, ctx, q_lens) for p in range(s, s + n)])
    outs = []
    for kernels in (None, KERNELS):
        group = build_group(q_lens, ctx, tables, BS, LAYERS, torch.device("cpu"))
        if kernels is not None:
            lk = group.mask.shape[-1]
            group.kernel_step = kernels.step_meta(ctx, -(-lk // cpu_kernels.BLOCK_ALIGN) * cpu_kernels.BLOCK_ALIGN, H, KVH, D, torch.bfloat16, q_lens=q_lens)
        meta = AttentionMeta(slot_rows(slots, LAYERS, BS), None, group, LAYERS, BS, kernels=kernels)
        outs.append(paged_attention(q, k, v, kv.clone(), 0, meta, D ** -0.5).float())
    assert outs[1].abs().max() > 0.1
    assert (outs[0] - outs[1]).abs().max() < 0.03


def test_rms_norm_fp32_part_gives_the_torch_ops_bits():
    """What RMSNorm takes from the kernel (model.py): the same bits as
    transformers' arithmetic once rounded to bf16 and times the weight."""
    from services.instance.engine.native.model import RMSNorm

    g = torch.Generator().manual_seed(2)
    norm = RMSNorm(576, 1e-5).to(torch.bfloat16)
    norm.weight.data = (torch.rand(576, generator=g) + 0.5).to(torch.bfloat16)
    with torch.no_grad():
        for rows in (1, 8, 32):
            x = (torch.randn(rows, 576, generator=g) * 3).to(torch.bfloat16)
            assert torch.equal(norm(x, KERNELS), norm(x))


@pytest.mark.model
def test_a_bf16_engine_keeps_every_slot_equal_to_the_paged_cache(make_engine):
    prompts = [list(range(100 + 7 * i, 100 + 7 * i + n)) for i, n in enumerate([5, 40, 17, 90, 33, 64])]
    # 12 blocks for ~330 tokens of KV: the scheduler preempts and recomputes; requests leave at different steps
    e = make_engine("native", dtype="bfloat16", num_blocks=12, watermark=0.0,
                    extra={"share_weights": True, "warmup": False})
    r = e.executor
    assert r.kernels is not None and r.decode_cache.k_transposed
    for i, (p, n) in enumerate(zip(prompts, (24, 8, 30, 12, 20, 16))):
        e.add_request(req(str(i), p, max_tokens=n, min_tokens=n))
    out, dense_steps = {}, 0
    while e.has_work():
        for o in e.step():
            out.setdefault(o.request_id, []).append(o.token_id)
        e.check_integrity()
        dc = r.decode_cache
        for slot, (owner, n) in enumerate(zip(dc.owner, dc.lens)):
            if owner is None or n == 0 or not owner.block_ids or owner.num_computed_tokens != n:
                continue  # stale (the request finished, left or was preempted): reloaded if it decodes again
            dense_steps += 1
            blocks = r.kv_cache[torch.tensor(owner.block_ids)]  # [nb, layers, 2, bs, kvh, d]
            want = blocks.permute(1, 2, 4, 0, 3, 5).flatten(3, 4)[:, :, :, :n]
            assert torch.equal(dc.slot_kv(slot, n), want), f"slot {slot} ({owner.request_id}, {n} tokens)"
    assert e.load().num_preemptions > 0
    assert dense_steps > 20
    assert {k: len(v) for k, v in out.items()} == {str(i): n for i, n in enumerate((24, 8, 30, 12, 20, 16))}


def test_paged_attention_in_place_matches_the_torch_path():
    """Blocks of 32 in the kernel's layout (KvLayout.k_transposed): one call
    writes the step's new K/V into each request's own blocks and attends
    through its block table, decodes and prefill chunks together; the same
    as the torch path over the plain layout (gathered decodes, SDPA for the
    chunks), and the new K/V land where the layout says."""
    from services.instance.engine.native.cpu_kernels import paged_views

    bs, nb = 32, 40
    g = torch.Generator().manual_seed(4)
    ctx, q_lens = [150, 61, 0, 33], [1, 1, 40, 70]  # two decodes, then prefill chunks with and without context
    tables = [[7, 3, 30, 12, 5], [21, 8], [0, 39], [17, 25, 9, 2]]  # scattered, not in order
    plain = torch.zeros(nb, LAYERS, 2, bs, KVH, D, dtype=torch.bfloat16)
    for t, n in zip(tables, ctx):  # the contexts' KV, random, in both layouts
        for p in range(n):
            plain[t[p // bs], :, :, p % bs] = torch.randn(LAYERS, 2, KVH, D, generator=g).to(torch.bfloat16)
    transposed = torch.empty_like(plain)
    tv = transposed.view(nb, LAYERS, 2, KVH, bs, D)
    tv[:, :, 0].view(nb, LAYERS, KVH, D, bs).copy_(plain[:, :, 0].permute(0, 1, 3, 4, 2))
    tv[:, :, 1].copy_(plain[:, :, 1].permute(0, 1, 3, 2, 4))
    t = sum(q_lens)
    q = torch.randn(t, H, D, generator=g).to(torch.bfloat16)
    k = torch.randn(t, KVH, D, generator=g).to(torch.bfloat16)
    v = torch.randn(t, KVH, D, generator=g).to(torch.bfloat16)
    layer = 1
    slots = torch.tensor([tb[p // bs] * (LAYERS * 2 * bs) + p % bs
                          for tb, s, n in zip(tables, ctx, q_lens) for p in range(s, s + n)])
    dev = torch.device("cpu")
    used = [tb[: -(-(s + n) // bs)] for tb, s, n in zip(tables, ctx, q_lens)]
    meta = AttentionMeta(slot_rows(slots, LAYERS, bs), build_group(q_lens[:2], ctx[:2], used[:2], bs, LAYERS, dev),
                         build_group(q_lens[2:], ctx[2:], used[2:], bs, LAYERS, dev), LAYERS, bs)
    want = paged_attention(q, k, v, plain, layer, meta, D ** -0.5).float()
    step = KERNELS.step_meta(ctx, bs, H, KVH, D, torch.bfloat16, q_lens=q_lens, block_tables=used)
    meta = AttentionMeta(None, None, None, LAYERS, bs, kernels=KERNELS, paged=step)
    got = paged_attention(q, k, v, transposed, layer, meta, D ** -0.5).float()
    assert got.abs().max() > 0.1
    assert (got - want).abs().max() < 0.03
    kc, vc = paged_views(transposed, layer)
    row = 0
    for tb, s, n in zip(tables, ctx, q_lens):
        for p in range(s, s + n):
            blk, off = tb[p // bs], p % bs
            assert torch.equal(kc[blk].reshape(KVH, D, bs)[:, :, off], k[row])
            assert torch.equal(vc[blk, :, off], v[row])
            row += 1
    others = [i for i in range(LAYERS) if i != layer]  # the kernel wrote this layer's part of the blocks only
    assert torch.equal(transposed[:, others], tv.view_as(plain)[:, others])


@pytest.mark.model
def test_a_bf16_engine_attending_in_place_gives_the_dense_paths_tokens(make_engine):
    """SmolLM2 in bf16, greedy: blocks of 32 (the kernel over the paged
    cache, preempted and recomputed in a small pool) against blocks of 16
    (the dense decode cache, a pool that holds everything). Two paths whose
    rows are computed in other step shapes: the same tokens up to a bounded
    divergence (helpers.assert_bounded_divergence)."""
    prompts = [list(range(100 + 7 * i, 100 + 7 * i + n)) for i, n in enumerate([5, 40, 17, 90, 33, 64])]
    lens = (24, 8, 30, 12, 20, 16)
    out = {}
    for bs, blocks in ((16, 64), (32, 7)):
        e = make_engine("native", dtype="bfloat16", block_size=bs, num_blocks=blocks, watermark=0.0,
                        extra={"share_weights": True, "warmup": False})
        assert e.kv_layout.k_transposed == (bs == 32)
        assert (e.executor.decode_cache is None) == (bs == 32)
        for i, (p, n) in enumerate(zip(prompts, lens)):
            e.add_request(req(str(i), p, max_tokens=n, min_tokens=n, logprobs=5))
        out[bs] = (collect(e), e.load().num_preemptions)
    assert out[32][1] > 0 and out[16][1] == 0
    assert out[32][0].keys() == out[16][0].keys()
    for rid, want in out[16][0].items():
        assert_bounded_divergence(want, out[32][0][rid], LOGPROB_NOISE["bfloat16"])
