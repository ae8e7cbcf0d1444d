"""Linear layers whose bf16 weights are prepacked for oneDNN on CPU.

``F.linear`` on a bf16 CPU tensor goes to oneDNN, which reorders the plain
``[out, in]`` weight into its blocked (AMX/AVX512-BF16) layout on every call;
for decode-sized inputs that reorder is most of the call. Packing once
(``torch.ops.mkldnn._reorder_linear_weight``, what inductor's freezing pass
does) measured 1.5-2.5x faster per projection on this project's CPU at 1-32
rows, and gave bit-identical outputs there. Elsewhere (fp32, CUDA, a CPU or
build without oneDNN bf16) the plain ``F.linear`` runs: the fp32 path is the
one checked token for token against transformers, and oneDNN's fp32 kernel
neither was faster nor rounded like MKL's.

With the ``vllm`` extra installed, the packed weight is vLLM's oneDNN matmul
handler instead (``torch.ops._C.onednn_mm``): the same oneDNN kernel behind
less per-call dispatch, 13-15 us less per projection at 1-8 rows here (0.033
-> 0.018 ms for SmolLM2's q|k|v at one row; ~1.6 ms of a 30 ms batch-1 step,
121 projections), and the same at prefill sizes. It is used only where its
output equals ``F.linear``'s bit for bit on a check at first use.

The packed copy is kept beside the plain weight (which loading, weight
sharing and the tests use): +1 copy of the projections in memory.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from services.instance.engine import vllm_kernels

log = logging.getLogger(__name__)

# The batch-size hint picks oneDNN's blocking; 1 measured best for decode
# steps of 1-32 rows and no worse than plain F.linear for prefill chunks.
_PACK_HINT = 1
_VLLM_OK: bool | None = None  # vLLM's onednn_mm present and exact here (checked once)


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
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


class VllmPacked:
    """A weight packed into vLLM's oneDNN matmul handler (it holds its own copy)."""

    def __init__(self, weight: torch.Tensor):
        self.n, self.k = weight.shape
        self._ops = torch.ops._C
        self.handler = torch.tensor(self._ops.create_onednn_mm_handler(weight.detach().t(), 32), dtype=torch.int64)
        self.nbytes = weight.numel() * weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(*x.shape[:-1], self.n, dtype=x.dtype, device=x.device)
        self._ops.onednn_mm(out, x.reshape(-1, self.k), None, self.handler)
        return out

    def __del__(self):
        try:
            self._ops.release_dnnl_matmul_handler(self.handler.item())
        except Exception:  # noqa: BLE001, S110  (interpreter shutdown: nothing to release into)
            pass


def vllm_matmul_exact() -> bool:
    """Whether vLLM's onednn_mm (already registered) gives F.linear's bits on a small case."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 64, generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    return torch.equal(VllmPacked(w)(x), F.linear(x, w))


def _vllm_ok() -> bool:
    global _VLLM_OK
    if _VLLM_OK is None:
        if vllm_kernels.ops() is None:
            _VLLM_OK = False
            return False
        try:
            _VLLM_OK = vllm_matmul_exact()
            if not _VLLM_OK:
                log.warning("vLLM's onednn_mm differs from F.linear here: torch's packing is used")
        except Exception as e:  # noqa: BLE001  (another version of vLLM: the op is missing or fails)
            log.info("vLLM's onednn_mm not used: %s", e)
            _VLLM_OK = False
    return _VLLM_OK


def pack_weight(weight: torch.Tensor, vllm: bool = True) -> TorchPacked | VllmPacked:
    """``vllm``: vLLM's handler where it is installed and exact; else (or False) torch's reorder."""
    return VllmPacked(weight) if vllm and _vllm_ok() else TorchPacked(weight)


class Linear(nn.Linear):
    """nn.Linear without bias that uses a packed weight once ``pack()`` ran."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.packed: TorchPacked | VllmPacked | None = None

    def pack(self, vllm: bool = True) -> None:
        self.packed = pack_weight(self.weight, vllm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        return F.linear(x, self.weight)
