"""The native engine's deterministic mode (``--deterministic``): every row of a
step is computed bit for bit as it would be alone, so that a request's tokens
and logprobs do not depend on what else is in its batch, on prefix-cache hits,
on chunk boundaries, on preemption and recompute, on a handoff or a migration.

Why it is needed (measured on an AVX-512 BF16 EPYC, docs/determinism.md): the
matmul kernels pick their blocking by the number of rows. SmolLM2's down
projection (K=1,536) gives other bits from 32 rows on (one thread) or 7 (two
threads) than for one row alone, in bf16 and in fp32; MKL's fp32 GEMM differs
from its one-row GEMV at every size; on CPUs with AMX, oneDNN switches to AMX
tiles by size. A row computed in another batch (a cached prefix computed with
another prompt, a recomputed request, a chunk that starts elsewhere) is then
not the same row.

How each piece of a step is made row-invariant here:

- **projections and the LM head** (``Slabs``): every call of the matmul kernel
  gets exactly ``SLAB_ROWS`` rows, the last slab padded with zeros. One shape,
  so one kernel and one blocking, whatever the step; each row's sum is then
  independent of which slab and which slot it is in. The kernel is the
  default's (vLLM's oneDNN handler, else torch's prepacked oneDNN weight in
  bf16, else plain ``torch.mm`` in fp32); only fp32's one-row GEMV goes.
- **elementwise ops** (SiLU, products, sums): per element; the check below
  verifies the MLP row by row at several sizes (a vectorized op's scalar tail
  falls at a row's end only where a row's length is not a multiple of the
  vector width).
- **RoPE** reads cos/sin from a table computed once in blocks of fixed shape
  (``RopeTable``): a position's values do not depend on the step's other
  positions (torch's vectorized cos and its scalar tail differ in the last bit).
- **attention**: vLLM's CPU kernel over the paged cache (blocks of a multiple
  of 32) attends per query row over that row's context, in the same order
  whether the row is a decode, part of a prefill chunk, or in a batch of
  others (its KV split is off); required in this mode.
- **RMSNorm**: vLLM's kernel, one row at a time.
- **sampling**: softmax, sort and the per-request generator work per row.

``check()`` verifies each of these at engine start on this CPU, with this
process's thread count, and the engine refuses the mode (EngineError naming the
piece) where one fails: the mode never claims what it did not see hold here.
Invariance holds between engines with the same weights, dtype and thread count
on CPUs of one kind (a migration between unlike instances is exact for the KV
it copies; the steps after it run the destination's kernels).
"""

from __future__ import annotations

import torch

# 8: a decode batch of 8 costs nothing, one of 32 four calls (+10-30% on the
# projections), a prefill chunk 1.1-1.5x (docs/determinism.md). Fixed: a row must
# see the same shape in a decode of 1 and in a prefill of 2,048.
SLAB_ROWS = 8
ROPE_BLOCK = 128  # positions per RoPE table block (one fixed-shape computation each)
# The check's large batch: past the MLP's split (model.MLP_SPLIT_ABOVE) and torch's
# grain for splitting an elementwise op between threads (32,768 elements).
BIG_ROWS = 1100
# Most query rows of one sequence the attention kernel gets in one call: the deterministic
# mode's engine computes a prompt in chunks of at most this many tokens per step. vLLM's CPU
# kernel tiles longer query chunks: on an AVX2-only AMD EPYC, rows from 224 on of a 263-row
# chunk came out other than as decodes (at one thread), so a prompt of 242 tokens gave another
# first logprob in one step than in chunks (tests/instance/engine/test_native.py).
ATTENTION_CHUNK = 128


class Slabs:
    """A projection whose kernel always runs on exactly ``rows`` rows.
    ``tiles``: per block of output columns, ``(into, width)``, where
    ``into(out, x)`` computes one slab's ``x @ W_block.T`` into ``out``; the
    LM head has several (each block's weights stay in cache while every slab
    passes), a projection one."""

    def __init__(self, tiles: list, in_features: int, nbytes: int, rows: int = SLAB_ROWS, kernel: str = ""):
        self.tiles = tiles
        self.in_features = in_features
        self.out_features = sum(w for _, w in tiles)
        self.nbytes = nbytes
        self.rows = rows
        self.kernel = kernel  # which matmul runs the slabs, in words

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        m, r = x.shape[0], self.rows
        full = m - m % r
        if full < m:  # the last slab, padded with zero rows (they do not touch the real rows' sums)
            x = torch.cat((x, x.new_zeros(full + r - m, x.shape[1])))
        slabs = x.split(r)
        outs = []
        for into, width in self.tiles:
            out = torch.empty(x.shape[0], width, dtype=x.dtype, device=x.device)
            for o, xs in zip(out.split(r), slabs):
                into(o, xs)
            outs.append(out)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return (out if full == m else out[:m]).view(*lead, self.out_features)


class RopeTable:
    """cos and signed sin (model.Rotary's) for positions 0 .. n-1, computed
    ``ROPE_BLOCK`` positions at a time: every block is the same computation
    on the same shape, so a position's values do not depend on n either."""

    def __init__(self, rotary, n: int, dtype: torch.dtype):
        n = -(-n // ROPE_BLOCK) * ROPE_BLOCK
        dev = rotary.inv_freq.device
        cos, sin = [], []
        for s in range(0, n, ROPE_BLOCK):
            c, si = rotary.compute(torch.arange(s, s + ROPE_BLOCK, device=dev), dtype)
            cos.append(c)
            sin.append(si)
        self.cos, self.sin = torch.cat(cos), torch.cat(sin)  # [n, 1, D]
        self.dtype = dtype

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.numel() and int(positions.max()) >= self.cos.shape[0]:
            raise ValueError(f"position {int(positions.max())} past the RoPE table ({self.cos.shape[0]})")
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


class NotInvariant(Exception):
    """A piece of the deterministic mode gave a row other bits in another batch on this CPU."""


def _rows_alone_equal(fn, x: torch.Tensor, what: str, big: int = 0) -> None:
    """fn(x) row by row == fn(x) on all rows at once, on the rows in another
    order, and (``big``) on the rows at the start and the end of ``big`` rows."""
    g = torch.Generator().manual_seed(1)
    n = x.shape[0]
    alone = torch.cat([fn(x[i:i + 1]) for i in range(n)])
    perm = torch.randperm(n, generator=g)
    ways = {"all at once": fn(x), "in another order": fn(x[perm])[torch.argsort(perm)]}
    if big > 2 * n:
        filler = torch.randn(big - 2 * n, x.shape[1], generator=g).to(x)
        out = fn(torch.cat((x, filler, x)))
        ways[f"first of {big} rows"], ways[f"last of {big} rows"] = out[:n], out[-n:]
    for name, got in ways.items():
        if not torch.equal(got, alone):
            bad = (got != alone).any(dim=-1).nonzero().flatten().tolist()
            raise NotInvariant(f"{what}: rows {bad[:6]} of {n} computed {name} differ from the same rows "
                               f"computed alone")


def check_projections(model, rows: int) -> list[str]:
    """Each distinct projection shape of the model (and the LM head) on 2 * rows + 3 random rows."""
    layer = next(m for m in model.layers if hasattr(m, "mlp"))
    mods = [("lm_head", model.lm_head_packed)] + [(name, m.packed) for name, m in layer.named_modules()
                                                    if getattr(m, "packed", None) is not None]
    g = torch.Generator().manual_seed(0)
    w = model.embed_tokens.weight
    seen, checked = set(), []
    for name, packed in mods:
        shape = (packed.in_features, packed.out_features)
        if shape in seen:
            continue
        seen.add(shape)
        x = torch.randn(2 * rows + 3, shape[0], generator=g).to(device=w.device, dtype=w.dtype)
        _rows_alone_equal(packed, x, f"projection {name} [{shape[0]} -> {shape[1]}]", big=BIG_ROWS)
        checked.append(f"{name} {shape[0]}x{shape[1]}")
    return checked


def check_mlp_and_norm(model, kernels, rows: int) -> None:
    layer = next(m for m in model.layers if hasattr(m, "mlp"))
    w = model.embed_tokens.weight
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2 * rows + 3, model.config.hidden_size, generator=g).to(device=w.device, dtype=w.dtype)
    _rows_alone_equal(layer.mlp, x, "the MLP", big=BIG_ROWS)
    _rows_alone_equal(lambda t: layer.input_layernorm(t, kernels), x * 3, "RMSNorm", big=BIG_ROWS)


def check_sampling(vocab: int) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(13, vocab, generator=g) * 4
    _rows_alone_equal(lambda t: t.log_softmax(-1), x, "log-softmax")
    _rows_alone_equal(lambda t: t.softmax(-1), x, "softmax")
    _rows_alone_equal(lambda t: t.sort(dim=-1, descending=True).values.softmax(-1).cumsum(-1), x, "top-p's cumsum")


def check_attention(kernels, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    """Every query row of one sequence attended as a decode alone, as one
    prefill chunk, in chunks that start elsewhere, and as decodes in a batch
    of other sequences: the same bits (vLLM's kernel over a paged cache)."""
    from services.instance.engine.native.cpu_kernels import BLOCK_ALIGN

    bs, n = BLOCK_ALIGN, ATTENTION_CHUNK + 2 * BLOCK_ALIGN + 7
    g = torch.Generator().manual_seed(4)
    nblocks = -(-n // bs)
    kc = torch.zeros(nblocks + 1, kv_heads, bs, head_dim, dtype=dtype)
    vc = torch.zeros_like(kc)
    table = list(range(nblocks))
    keys = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
    vals = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(n, heads, head_dim, generator=g).to(dtype)
    kernels.write(keys, vals, kc, vc, torch.tensor([table[p // bs] * bs + p % bs for p in range(n)]))
    scale = head_dim ** -0.5

    def attend(chunks: list[tuple[int, int]], others: tuple[int, ...] = ()) -> dict[int, torch.Tensor]:
        out = {}
        for s, m in chunks:
            meta = kernels.step_meta([s, *others], bs, heads, kv_heads, head_dim, dtype, q_lens=[m] + [1] * len(others),
                                     block_tables=[table] * (1 + len(others)))
            rows = torch.cat([q[s:s + m]] + [q[o:o + 1] for o in others]).contiguous()
            o = kernels.attend(rows, kc, vc, meta, scale)
            out.update({s + i: o[i] for i in range(m)})
        return out

    alone = attend([(p, 1) for p in range(n)])
    ways = {"chunks of the longest": [(s, min(ATTENTION_CHUNK, n - s)) for s in range(0, n, ATTENTION_CHUNK)],
            "chunks of 50": [(s, min(50, n - s)) for s in range(0, n, 50)],
            "chunks of 7, 33 and the rest": [(0, 7), (7, 33), (40, n - 40)]}
    for name, chunks in ways.items():
        got = attend(chunks)
        bad = [p for p in range(n) if not torch.equal(got[p], alone[p])]
        if bad:
            raise NotInvariant(f"attention: rows {bad[:6]} in {name} differ from the same rows as decodes alone")
    got = attend([(p, 1) for p in range(0, n, 11)], others=(5, 40, n - 2))
    bad = [p for p in got if not torch.equal(got[p], alone[p])]
    if bad:
        raise NotInvariant(f"attention: decodes {bad[:6]} in a batch of others differ from the same decodes alone")


def check(model, kernels, dtype: torch.dtype, rows: int = SLAB_ROWS) -> str:
    """Verify every piece (module docstring) here; returns what was checked, in words."""
    cfg = model.config
    checked = check_projections(model, rows)
    check_mlp_and_norm(model, kernels, rows)
    check_attention(kernels, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, dtype)
    check_sampling(cfg.vocab_size)
    return (f"slabs of {rows} rows ({', '.join(checked)}), MLP, RMSNorm, attention, sampling: row-invariant "
            f"with {torch.get_num_threads()} threads")

