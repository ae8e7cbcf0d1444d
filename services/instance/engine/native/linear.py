"""Linear layers whose weights are prepacked for oneDNN on CPU.

``F.linear`` on a bf16 CPU tensor goes to oneDNN, which reorders the plain
``[out, in]`` weight into its blocked (AMX/AVX512-BF16) layout on every call;
for decode-sized inputs that reorder is most of the call. Packing once
(``torch.ops.mkldnn._reorder_linear_weight``, what inductor's freezing pass
does) measured 1.5-2.5x faster per projection on this project's CPU at 1-32
rows, and gave bit-identical outputs there.

With the ``vllm`` extra installed (and its kernels running on this CPU:
vllm_kernels.py), the packed weight is vLLM's oneDNN matmul handler instead
(``torch.ops._C.onednn_mm``): the same oneDNN kernel behind less per-call
dispatch, 13-15 us less per projection at 1-8 rows here (0.033 -> 0.018 ms
for SmolLM2's q|k|v at one row; ~1.6 ms of a 30 ms batch-1 step, 121
projections), and the same at prefill sizes. In bf16 it is used only where
its output equals ``F.linear``'s bit for bit on a check at first use.

fp32 (the default on CPUs without bf16 arithmetic, e.g. AVX2 only): steps of
more than one row go through vLLM's handler too, one row through F.linear
(``RowSplit``, with its measurements); oneDNN and MKL sum in other orders, so
the fp32 path's logits move in the last bits (its greedy tokens still equal
transformers': tests/instance/engine/test_native.py). Without vLLM, or with
``vllm_kernels=False`` (``--no-vllm-kernels``), fp32 runs plain ``F.linear``.
oneDNN has no bf16 matmul on AVX2 (it refuses to build the primitive), so
there bf16 runs torch's slow path (a step of 8 rows: 163 ms of projections
against 64 ms in fp32): ``dtype=auto`` picks fp32 on such CPUs.

The packed copy is kept beside the plain weight (which loading, weight
sharing and the tests use): +1 copy of the projections in memory.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from services.instance.engine import vllm_kernels
from services.instance.engine.vllm_kernels import LOCK
from services.instance.engine.native.batch_invariant import Slabs

log = logging.getLogger(__name__)

# The batch-size hint picks oneDNN's blocking; 1 measured best for decode
# steps of 1-32 rows and no worse than plain F.linear for prefill chunks.
_PACK_HINT = 1


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """bf16 on a CPU with oneDNN's bf16 kernels; fp32 on CPU where vLLM's matmul handler runs."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return _vllm_ok(torch.float32)
    if dtype != torch.bfloat16:
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class TorchPacked:
    """A weight reordered for oneDNN by torch."""

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_HINT)
        self.nbytes = self.packed.numel() * self.packed.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        out.copy_(self(x))


class VllmPacked:
    """A weight packed into vLLM's oneDNN matmul handler (it holds its own copy)."""

    def __init__(self, weight: torch.Tensor):
        self.n, self.k = weight.shape
        self._ops = torch.ops._C
        with LOCK:
            self.handler = torch.tensor(self._ops.create_onednn_mm_handler(weight.detach().t(), 32),
                                        dtype=torch.int64)
        self.nbytes = weight.numel() * weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(*x.shape[:-1], self.n, dtype=x.dtype, device=x.device)
        with LOCK:
            self._ops.onednn_mm(out, x.reshape(-1, self.k), None, self.handler)
        return out

    def into(self, out: torch.Tensor, x: torch.Tensor) -> None:
        with LOCK:
            self._ops.onednn_mm(out, x, None, self.handler)

    def __del__(self):
        try:
            with LOCK:
                self._ops.release_dnnl_matmul_handler(self.handler.item())
        except Exception:  # noqa: BLE001, S110  (interpreter shutdown: nothing to release into)
            pass


class RowSplit:
    """fp32: one row (a batch-1 decode, a matrix-vector product) through
    F.linear, more through vLLM's oneDNN handler. Measured per SmolLM2 step
    (30 layers' projections and the LM head, one thread, best of 40; this
    project's AVX-512 CPU, then capped at AVX2 by ATEN_CPU_CAPABILITY,
    ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS and vLLM's _C_AVX2 build):
    1 row 21.9 vs 23.1 ms (AVX2: 21.5 vs 26.1), 4 rows 33.4 vs 19.9 (47.2 vs
    35.0), 8 rows 52.8 vs 30.8 (63.8 vs 46.2), 32 rows 86.9 vs 67.6 (144.9 vs
    119.8): F.linear (MKL) vs onednn_mm. torch's own oneDNN packing was no
    faster than F.linear in fp32 (87.1 at 32 rows)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.many = VllmPacked(weight)
        self.nbytes = self.many.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.shape[-1]:
            return F.linear(x, self.weight)
        return self.many(x)


def vllm_matmul_exact(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether vLLM's onednn_mm (already registered) gives F.linear's bits on a
    small case in bf16 (the same oneDNN kernel), or its values within fp32
    rounding in fp32 (oneDNN and MKL sum in different orders)."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 64, generator=g) * 0.1).to(dtype)
    x = torch.randn(5, 64, generator=g).to(dtype)
    got, want = VllmPacked(w)(x), F.linear(x, w)
    if dtype == torch.bfloat16:
        return torch.equal(got, want)
    return torch.allclose(got, want, rtol=1e-5, atol=1e-6)


_VLLM_OK: dict[torch.dtype, bool] = {}  # vLLM's onednn_mm present and right here, by dtype (checked once)


def _vllm_ok(dtype: torch.dtype = torch.bfloat16) -> bool:
    if dtype not in _VLLM_OK:
        ok = False
        if vllm_kernels.ops() is not None:
            try:
                ok = vllm_matmul_exact(dtype)
                if not ok:
                    log.warning("vLLM's onednn_mm differs from F.linear here (%s): not used", dtype)
            except Exception as e:  # noqa: BLE001  (another version of vLLM, or no oneDNN kernel for this ISA)
                log.info("vLLM's onednn_mm not used (%s): %s", dtype, e)
        _VLLM_OK[dtype] = ok
    return _VLLM_OK[dtype]


def pack_weight(weight: torch.Tensor, vllm: bool = True) -> TorchPacked | VllmPacked | RowSplit | None:
    """bf16: vLLM's handler where installed and exact (``vllm``), else torch's
    reorder. fp32: RowSplit with ``vllm`` and vLLM's handler, else None (F.linear)."""
    if weight.dtype == torch.float32:
        return RowSplit(weight) if vllm and _vllm_ok(torch.float32) else None
    return VllmPacked(weight) if vllm and _vllm_ok() else TorchPacked(weight)


# The LM head's weight in blocks of this many output columns (vocabulary
# entries) for the deterministic mode's slabs: 4.7 MiB of SmolLM2's stays in
# cache while a step's slabs pass; at 32 rows 7.4 ms against 10.5 for slabs over
# the whole 57 MiB weight (2 threads; the plain 32-row call: 5.5 ms).
HEAD_TILE = 4096


def slab_weight(weight: torch.Tensor, vllm: bool = True, tile: int = 0) -> Slabs:
    """The deterministic mode's projection (batch_invariant.py): a oneDNN
    kernel on slabs of SLAB_ROWS rows, vLLM's handler where it runs and is
    right here (``_vllm_ok``), else torch's prepacked weight; in fp32 too (no
    RowSplit, whose one-row F.linear is MKL's, which sums in other orders and,
    without MKL_CBWR, by the data's alignment). ``tile``: output columns per
    block (the LM head)."""
    n, k = weight.shape
    blocks = [weight[i:i + tile].contiguous() for i in range(0, n, tile)] if tile and tile < n else [weight]
    use_vllm = vllm and _vllm_ok(torch.float32 if weight.dtype == torch.float32 else torch.bfloat16)
    kernels = [VllmPacked(b) if use_vllm else TorchPacked(b) for b in blocks]
    return Slabs([(kn.into, b.shape[0]) for kn, b in zip(kernels, blocks)], k, sum(kn.nbytes for kn in kernels),
                 kernel="vLLM onednn_mm" if use_vllm else "torch prepacked (oneDNN)")


class Linear(nn.Linear):
    """nn.Linear without bias that uses a packed weight once ``pack()`` ran."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.packed: TorchPacked | VllmPacked | RowSplit | Slabs | None = None

    def pack(self, vllm: bool = True, slabs: bool = False) -> None:
        """``slabs``: the deterministic mode's (slab_weight)."""
        self.packed = slab_weight(self.weight, vllm) if slabs else pack_weight(self.weight, vllm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        return F.linear(x, self.weight)
