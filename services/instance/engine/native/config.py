"""Model shape and RoPE parameters, from a Hugging Face config.json or a named
shape (random weights for performance work)."""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass, field

import torch

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# Named shapes (public configs of these models) for random-weight runs.
SHAPES: dict[str, dict] = {
    "tiny-llama": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       tie_word_embeddings=True),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                         max_position_embeddings=131072, tie_word_embeddings=True, rope_scaling=_LLAMA3_ROPE,
                         eos_token_id=[128001, 128008, 128009]),
    "llama-3.2-3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, rope_theta=500000.0,
                         max_position_embeddings=131072, tie_word_embeddings=True, rope_scaling=_LLAMA3_ROPE,
                         eos_token_id=[128001, 128008, 128009]),
    "llama-2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, rope_theta=10000.0,
                       max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-5),
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                       max_position_embeddings=8192, tie_word_embeddings=False, eos_token_id=[128001, 128009]),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                         max_position_embeddings=131072, tie_word_embeddings=False,
                         rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}, eos_token_id=[128001, 128008, 128009]),
}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        if cfg.get("model_type", "llama") not in ("llama", "mistral", "smollm"):
            raise ValueError(f"model_type {cfg.get('model_type')!r} is not a Llama-family decoder")
        # transformers 5 writes rope_parameters; older configs rope_theta + rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = dict(cfg.get("rope_scaling") or rope)
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_theta=theta,
            rope_scaling=scaling,
            eos_token_ids=eos,
        )

    @classmethod
    def from_dir(cls, path: str | pathlib.Path) -> ModelConfig:
        return cls.from_dict(json.loads((pathlib.Path(path) / "config.json").read_text()))

    @classmethod
    def from_shape(cls, name: str) -> ModelConfig:
        return cls.from_dict(dict(SHAPES[name]))

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies with the model's scaling (default, linear, llama3)."""
        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        # NOTE: float32 math like transformers, so RoPE angles match it bit for bit.
        kind = self.rope_scaling.get("rope_type", "default")
        if kind == "linear":
            inv = inv / float(self.rope_scaling["factor"])
        elif kind == "llama3":
            s = self.rope_scaling
            factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
            old = float(s["original_max_position_embeddings"])
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > old / lo, inv / factor, inv)
            smooth = (old / wavelen - lo) / (hi - lo)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= old / hi) & (wavelen <= old / lo)
            inv = torch.where(medium, smoothed, scaled)
        elif kind not in ("default", "dynamic"):  # dynamic NTK only differs past max_position_embeddings
            raise ValueError(f"unsupported rope_type {kind!r}")
        return inv.float()
