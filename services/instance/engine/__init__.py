"""Engines behind one interface (base.Engine), chosen by name from a
registry whose entries carry what the rest of Ferry needs to know about an
engine: adding an engine is one module and one entry here."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from services.instance.engine.base import Engine, EngineConfig


@dataclass(frozen=True)
class EngineSpec:
    """An engine and its facts.

    ``target``: "module:class" (the class takes an EngineConfig);
    ``real_model``: it runs a real model (a model to prepare, a real
    tokenizer at the frontend), else token ids are the fake byte vocabulary;
    ``torch_threads``: it computes on this process's torch threads (``ferry
    up`` shares the cores out between instances);
    ``block_size``: "module:function(device, dtype)" of its default KV block
    size, or None for 16;
    ``native_code``: it loads vLLM's compiled code (``ferry up`` checks this
    CPU first, services/instance/engine/vllm_kernels.py): "kernels" (optional,
    with a fallback) or "required";
    ``prepares_any_model``: it loads hub names itself (the model cache only
    prepares the models it knows)."""

    name: str
    target: str
    real_model: bool = False
    torch_threads: bool = False
    block_size: str | None = None
    native_code: str | None = None
    prepares_any_model: bool = False

    def default_block_size(self, device: str = "cpu", dtype: str = "auto") -> int:
        if self.block_size is None:
            return 16
        module, fn = self.block_size.split(":")
        return getattr(importlib.import_module(module), fn)(device, dtype)


REGISTRY: dict[str, EngineSpec] = {s.name: s for s in (
    EngineSpec("fake", "services.instance.engine.fake:FakeEngine"),
    EngineSpec("native", "services.instance.engine.native.engine:NativeEngine", real_model=True, torch_threads=True,
               block_size="services.instance.engine.native.engine:default_block_size", native_code="kernels"),
    EngineSpec("sim", "services.instance.engine.sim:SimEngine"),
    # optional extra: .[vllm]
    EngineSpec("vllm", "services.instance.engine.vllm.engine:VllmEngine", real_model=True,
               block_size="services.instance.engine.vllm.args:default_block_size", native_code="required",
               prepares_any_model=True),
)}
ENGINES = {name: s.target for name, s in REGISTRY.items()}  # name -> "module:class"


def spec(name: str) -> EngineSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; supported: {', '.join(sorted(REGISTRY))}") from None


def create_engine(config: EngineConfig) -> Engine:
    module, cls = spec(config.engine).target.split(":")
    return getattr(importlib.import_module(module), cls)(config)
