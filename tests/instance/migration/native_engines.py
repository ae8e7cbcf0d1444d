"""Native SmolLM2 engines for the in-process migration and handoff tests:
small pools, float32 (exact tokens), shared weights, one torch thread."""

from __future__ import annotations

import pytest

from services.instance.engine import create_engine
from services.instance.engine.base import EngineConfig


@pytest.fixture(scope="module")
def one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def native(num_blocks: int = 64, **config):
    return create_engine(EngineConfig(engine="native", model="smollm2", num_blocks=num_blocks, block_size=16,
                                      max_model_len=512, dtype="float32",
                                      extra={"share_weights": True, "warmup": False}, **config))
