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

The packed copy is kept beside the plain weight (which loading, weight
sharing and the tests use): +1 copy of the projections in memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The batch-size hint picks oneDNN's blocking; 1 measured best for decode
# steps of 1-32 rows and no worse than plain F.linear for prefill chunks.
_PACK_HINT = 1


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear without bias that uses a packed weight once ``pack()`` ran."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.packed: torch.Tensor | None = None

    def pack(self) -> None:
        self.packed = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed)
        return F.linear(x, self.weight)
