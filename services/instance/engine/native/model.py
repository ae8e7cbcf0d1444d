"""A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU,
tied or untied embeddings) in plain PyTorch, as a list of layer modules so
later phases can split layers across instances.

Projections are fused (q|k|v and gate|up) into one matmul each: fewer, larger
GEMMs are what a 2-core CPU and a GPU both like. The loader fuses HF weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.instance.engine.native.attention import AttentionMeta, paged_attention
from services.instance.engine.native.config import ModelConfig
from services.instance.engine.native.linear import Linear, pack_weight, packed_linear, packing_supported


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as transformers' LlamaRMSNorm (variance in fp32).
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """cos/sin per position, computed on demand for the step's positions."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.register_buffer("inv_freq", config.inv_freq(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)  # [T, 1, D]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size)
        self.o_proj = Linear(self.q_size, config.hidden_size)
        self.scale = self.head_dim ** -0.5

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMeta):
        qkv = self.qkv_proj(x)
        # q and k heads are adjacent in qkv: rotate them in one go.
        qk = apply_rope(qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads,
                                                                  self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(-1, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, self.layer, meta, self.scale)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.inter = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.inter)
        self.down_proj = Linear(self.inter, config.hidden_size)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = Rotary(config)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)
        self.lm_head_packed: torch.Tensor | None = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_weights(self) -> bool:
        """Prepack every projection and the LM head for oneDNN where that is
        supported (see linear.py); returns whether it was. Idempotent."""
        w = self.embed_tokens.weight
        if not packing_supported(w.device, w.dtype):
            return False
        if self.lm_head_packed is None:
            for m in self.modules():
                if isinstance(m, Linear):
                    m.pack()
            self.lm_head_packed = pack_weight(self.lm_head_weight)
        return True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMeta, logits_index: torch.Tensor,
                after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids/positions: [T] flat over the step's requests; returns fp32
        logits [len(logits_index), vocab] for the rows that sample.
        ``after_layer(i)``: called once layer i wrote its K/V into kv_cache."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        x = self.run_layers(x, cos, sin, kv_cache, meta, range(len(self.layers)), after_layer)
        return self.head(x, logits_index)

    # --- the pieces of forward, for pipelined execution (KunServe) ------------------
    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                   meta: AttentionMeta, layers: range,
                   after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] through layers ``layers`` (a contiguous range)."""
        for i in layers:
            x = self.layers[i](x, cos, sin, kv_cache, meta)
            if after_layer is not None:
                after_layer(i)
        return x

    def head(self, x: torch.Tensor, logits_index: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head over the rows that sample -> fp32 logits."""
        x = self.norm(x.index_select(0, logits_index))
        if self.lm_head_packed is not None:
            return packed_linear(x, self.lm_head_packed).float()
        return F.linear(x, self.lm_head_weight).float()

    def layer_bytes(self, layers: range) -> int:
        """Parameter bytes of these layers, prepacked copies included (what dropping them frees)."""
        total = 0
        for i in layers:
            total += sum(p.numel() * p.element_size() for p in self.layers[i].parameters())
            total += sum(m.packed.numel() * m.packed.element_size() for m in self.layers[i].modules()
                         if isinstance(m, Linear) and m.packed is not None)
        return total

    def drop_layers(self, layers: range) -> dict[int, int]:
        """Forget these layers' parameters; returns {layer: bytes it held}
        for those not dropped before. A dropped layer raises if run. The
        embedding, the final norm and the LM head stay: a request's owner
        embeds and samples."""
        freed = {}
        for i in layers:
            if isinstance(self.layers[i], DroppedLayer):
                continue
            freed[i] = self.layer_bytes(range(i, i + 1))
            self.layers[i] = DroppedLayer(i)
        return freed

    def layer_states(self, layers: range) -> dict[int, dict[str, torch.Tensor]]:
        """The parameters of these layers (what a peer restores from)."""
        gone = [i for i in self.dropped() if i in layers]
        if gone:
            raise ValueError(f"layers {gone} are dropped here too")
        return {i: self.layers[i].state_dict() for i in layers}

    def restore_layers(self, states: dict[int, dict[str, torch.Tensor]]) -> None:
        """Take layers back from their parameters (a copy in host memory, or a
        peer's, ``layer_states``), as this model's own copies on its device
        and dtype."""
        w = self.embed_tokens.weight
        for i, state in states.items():
            layer = DecoderLayer(self.config, i).to(device=w.device, dtype=w.dtype).eval().requires_grad_(False)
            layer.load_state_dict(state)
            if self.lm_head_packed is not None:  # this model runs prepacked projections
                for m in layer.modules():
                    if isinstance(m, Linear):
                        m.pack()
            self.layers[i] = layer

    def dropped(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, DroppedLayer)]


class DroppedLayer(nn.Module):
    """Stands where a dropped layer was: running it is a bug, never a silent identity."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, *args):
        raise RuntimeError(f"layer {self.index} was dropped on this instance; its pipeline peer runs it")
