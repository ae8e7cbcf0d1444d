"""Build a LlamaModel with weights: from a Hugging Face directory (safetensors,
single file or sharded) or random (a named shape or a config without weights)."""

from __future__ import annotations

import json
import pathlib

import torch
from safetensors import safe_open

from services.instance.engine.native.config import ModelConfig
from services.instance.engine.native.model import LlamaModel

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _empty_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> LlamaModel:
    with torch.device("meta"):
        model = LlamaModel(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.rotary.inv_freq = config.inv_freq().to(device)  # fp32, not the model dtype
    return model.eval().requires_grad_(False)


def weight_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    return sorted(model_dir.glob("*.safetensors"))


def _hf_tensors(files: list[pathlib.Path]):
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, st.get_tensor(name)


def load_model(model_dir: pathlib.Path, config: ModelConfig, device: torch.device,
               dtype: torch.dtype) -> LlamaModel:
    files = weight_files(model_dir)
    if not files:
        return random_model(config, device, dtype)
    model = _empty_model(config, device, dtype)
    params = dict(model.named_parameters())
    parts: dict[str, dict[str, torch.Tensor]] = {}  # fused name -> {part: tensor}
    fused = {"q_proj": ("qkv_proj", 3), "k_proj": ("qkv_proj", 3), "v_proj": ("qkv_proj", 3),
             "gate_proj": ("gate_up_proj", 2), "up_proj": ("gate_up_proj", 2)}
    loaded: set[str] = set()

    def put(name: str, t: torch.Tensor) -> None:
        if name not in params:
            raise ValueError(f"unexpected weight {name!r} in {model_dir}")
        if params[name].shape != t.shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} != {tuple(params[name].shape)}")
        params[name].copy_(t)
        loaded.add(name)

    for name, t in _hf_tensors(files):
        name = name.removeprefix("model.")
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if "rotary_emb" in name:
            continue
        prefix, _, leaf = name.rpartition(".")  # layers.0.self_attn.q_proj , weight
        mod_prefix, _, proj = prefix.rpartition(".")
        if proj in fused:
            target, n_parts = fused[proj]
            key = f"{mod_prefix}.{target}.{leaf}"
            parts.setdefault(key, {})[proj] = t
            if len(parts[key]) == n_parts:
                order = ("q_proj", "k_proj", "v_proj") if n_parts == 3 else ("gate_proj", "up_proj")
                got = parts.pop(key)
                put(key, torch.cat([got[p] for p in order], dim=0))
            continue
        put(name, t)
    missing = set(params) - loaded
    if missing or parts:
        raise ValueError(f"weights missing in {model_dir}: {sorted(missing)[:5]}")
    return model


def random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> LlamaModel:
    """Random weights (std 0.02, norms at 1) for performance work."""
    model = _empty_model(config, device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    return model
