"""Engines behind one interface (base.Engine), chosen by name."""

from __future__ import annotations

import importlib

from services.instance.engine.base import Engine, EngineConfig

# name -> "module:class"; each class takes an EngineConfig.
ENGINES = {
    "fake": "services.instance.engine.fake:FakeEngine",
    "native": "services.instance.engine.native.engine:NativeEngine",
    "sim": "services.instance.engine.sim:SimEngine",
    "vllm": "services.instance.engine.vllm.engine:VllmEngine",  # optional extra: .[vllm]
}


def create_engine(config: EngineConfig) -> Engine:
    try:
        target = ENGINES[config.engine]
    except KeyError:
        raise ValueError(
            f"unknown engine {config.engine!r}; supported: {', '.join(sorted(ENGINES))}"
        ) from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(config)
