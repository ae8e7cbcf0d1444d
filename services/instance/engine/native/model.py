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
from services.instance.engine.native.batch_invariant import RopeTable, Slabs
from services.instance.engine.native.config import ModelConfig
from services.instance.engine.native.cpu_kernels import CpuKernels
from services.instance.engine.native.linear import (
    HEAD_TILE,
    Linear,
    RowSplit,
    TorchPacked,
    VllmPacked,
    pack_weight,
    packing_supported,
    slab_weight,
)

# Remote attention (KunServe's live KV exchange, kunserve.py): (n, attend) says
# that the step's rows from the n-th on have their KV elsewhere;
# attend(layer, q, k, v) runs their attention there, writing their new K/V
# there too, and returns its output [rows, heads*head_dim]. Rows before n attend
# over this cache as usual.
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
RemoteRows = tuple[int, Attend]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, kernels: CpuKernels | None = None) -> torch.Tensor:
        # Same arithmetic as transformers' LlamaRMSNorm (variance in fp32, the
        # normalized x rounded to the model's dtype before the weight).
        # ``kernels``: vLLM's CPU RMSNorm does the fp32 part in one op
        # (cpu_kernels.py: the same bits up to the variance's summation order).
        if kernels is not None:
            return self.weight * kernels.normalize(x.float(), self.eps).to(x.dtype)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """cos and a signed sin per position, computed once a step for the step's
    positions (see apply_rope)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.register_buffer("inv_freq", config.inv_freq(), persistent=False)
        self.table: RopeTable | None = None  # the deterministic mode's (batch_invariant.py)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.table is not None and self.table.dtype == dtype:
            return self.table(positions, dtype)
        return self.compute(positions, dtype)

    def compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        sin[:, : sin.shape[1] // 2].neg_()
        return emb.cos().to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)  # [T, 1, D]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` with rotate_half(x) =
    (-x2, x1): here (x2, x1) times a sin whose first half is negated, the
    same products bit for bit, in three ops instead of five."""
    half = x.shape[-1] // 2
    r = torch.cat((x[..., half:], x[..., :half]), dim=-1).mul_(sin_signed)
    return r.add_(x * cos)


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

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMeta | None, remote: RemoteRows | None = None):
        qkv = self.qkv_proj(x)
        # q and k heads are adjacent in qkv: rotate them in one go.
        qk = apply_rope(qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads,
                                                                  self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(-1, self.num_kv_heads, self.head_dim)
        if remote is None:
            return self.o_proj(paged_attention(q, k, v, kv_cache, self.layer, meta, self.scale))
        n, attend = remote
        outs = [paged_attention(q[:n], k[:n], v[:n], kv_cache, self.layer, meta, self.scale)] if n else []
        outs.append(attend(self.layer, q[n:], k[n:], v[n:]).to(q.dtype))
        return self.o_proj(outs[0] if len(outs) == 1 else torch.cat(outs))


# A step of more rows than MLP_SPLIT_ABOVE runs its MLP MLP_ROWS rows at a time when
# the projections are prepacked (bf16 on CPU): gate|up's output for 2,048 rows of
# SmolLM2 is 12 MiB, which SiLU, the multiply and down_proj would each read back
# from memory; 256 rows of it stay in cache. Each row's arithmetic is unchanged
# (bit-identical outputs). Measured on this project's 2-core CPU, one thread, one
# MLP: 61.7 -> 55.5 ms at 2,048 rows, 122.8 -> 109.4 ms at 4,096, no change at 512
# or 1,024 rows. fp32 and CUDA keep one call (not measured; GPUs want large GEMMs).
MLP_ROWS = 256
MLP_SPLIT_ABOVE = 1024


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.inter = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.inter)
        self.down_proj = Linear(self.inter, config.hidden_size)

    def forward(self, x):
        n = x.shape[0]
        if n <= MLP_SPLIT_ABOVE or self.down_proj.packed is None:
            return self._rows(x)
        out = torch.empty(n, self.down_proj.out_features, dtype=x.dtype, device=x.device)
        for i in range(0, n, MLP_ROWS):
            out[i:i + MLP_ROWS] = self._rows(x[i:i + MLP_ROWS])
        return out

    def _rows(self, x):
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, kv_cache, meta, remote=None):
        kernels = meta.kernels if meta is not None else None
        x = x + self.self_attn(self.input_layernorm(x, kernels), cos, sin, kv_cache, meta, remote)
        return x + self.mlp(self.post_attention_layernorm(x, kernels))


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
        self.lm_head_packed: TorchPacked | VllmPacked | RowSplit | Slabs | None = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_weights(self, vllm: bool = True) -> bool:
        """Prepack every projection and the LM head for oneDNN where that is
        supported (see linear.py); returns whether it was. Idempotent."""
        w = self.embed_tokens.weight
        if not packing_supported(w.device, w.dtype):
            return False
        if self.lm_head_packed is None:
            for m in self.modules():
                if isinstance(m, Linear):
                    m.pack(vllm)
            self.lm_head_packed = pack_weight(self.lm_head_weight, vllm)
        return True

    def make_deterministic(self, max_positions: int, vllm: bool = True) -> None:
        """The deterministic mode's pieces (batch_invariant.py): slab
        projections, LM head and MLPs, RoPE from a table. On a model that
        pack_weights did not pack (the engine builds it for this mode)."""
        w = self.embed_tokens.weight
        for m in self.modules():
            if isinstance(m, Linear):
                m.pack(vllm, slabs=True)
        self.lm_head_packed = slab_weight(self.lm_head_weight, vllm, tile=HEAD_TILE)
        self.rotary.table = RopeTable(self.rotary, max_positions, w.dtype)

    @property
    def deterministic(self) -> bool:
        return isinstance(self.lm_head_packed, Slabs)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMeta, logits_index: torch.Tensor,
                after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids/positions: [T] flat over the step's requests; returns fp32
        logits [len(logits_index), vocab] for the rows that sample.
        ``after_layer(i)``: called once layer i wrote its K/V into kv_cache."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        x = self.run_layers(x, cos, sin, kv_cache, meta, range(len(self.layers)), after_layer)
        return self.head(x, logits_index, meta.kernels)

    # --- the pieces of forward, for pipelined execution (KunServe) ------------------
    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                   meta: AttentionMeta, layers: range,
                   after_layer: Callable[[int], None] | None = None,
                   remote: RemoteRows | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] through layers ``layers`` (a contiguous range).
        ``remote``: the rows from the n-th on attend elsewhere (RemoteRows)."""
        for i in layers:
            x = self.layers[i](x, cos, sin, kv_cache, meta, remote)
            if after_layer is not None:
                after_layer(i)
        return x

    def head(self, x: torch.Tensor, logits_index: torch.Tensor, kernels: CpuKernels | None = None) -> torch.Tensor:
        """The final norm and the LM head over the rows that sample -> fp32 logits."""
        x = self.norm(x.index_select(0, logits_index), kernels)
        if self.lm_head_packed is not None:
            return self.lm_head_packed(x).float()
        return F.linear(x, self.lm_head_weight).float()

    def layer_bytes(self, layers: range) -> int:
        """Parameter bytes of these layers, prepacked copies included (what dropping them frees)."""
        total = 0
        for i in layers:
            total += sum(p.numel() * p.element_size() for p in self.layers[i].parameters())
            total += sum(m.packed.nbytes for m in self.layers[i].modules()
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
        self.install_layers(self.build_layers(states))

    def build_layers(self, states: dict[int, dict[str, torch.Tensor]]) -> dict[int, DecoderLayer]:
        """Layers made from their parameters, not yet in the model (any
        thread: loading and prepacking them is most of a restore's cost)."""
        w = self.embed_tokens.weight
        built = {}
        for i, state in states.items():
            layer = DecoderLayer(self.config, i).to(device=w.device, dtype=w.dtype).eval().requires_grad_(False)
            layer.load_state_dict(state)
            if self.lm_head_packed is not None:  # this model runs prepacked projections: pack them alike
                packed = self.lm_head_packed
                vllm = isinstance(packed, (VllmPacked, RowSplit)) or getattr(packed, "kernel", "").startswith("vLLM")
                for m in layer.modules():
                    if isinstance(m, Linear):
                        m.pack(vllm, slabs=self.deterministic)
            built[i] = layer
        return built

    def install_layers(self, built: dict[int, DecoderLayer]) -> None:
        for i, layer in built.items():
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
