"""Native SmolLM2 engines for the in-process migration and handoff tests:
small pools, float32 (exact tokens), shared weights, one torch thread; and
the in-process cluster over a module's engines."""

from __future__ import annotations

import contextlib

import pytest

from services.instance.engine import create_engine
from services.instance.engine.base import EngineConfig
from services.instance.migration.messages import MigrationConfig
from tests.instance.migration.harness import CONFIG, Cluster


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


@contextlib.asynccontextmanager
async def cluster_of(engines, names: tuple[str, ...] = ("a", "b"), config: MigrationConfig = CONFIG):
    """A Cluster with one node per engine, stopped on exit; the engines
    outlive it (a module's tests share them)."""
    c = Cluster()
    for name, engine in zip(names, engines, strict=True):
        c.add(name, engine, config)
    try:
        yield c
    finally:
        await c.stop()
