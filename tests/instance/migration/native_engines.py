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


def native(num_blocks: int = 64, block_size: int = 16, dtype: str = "float32", extra: dict | None = None,
           **config):
    return create_engine(EngineConfig(engine="native", model="smollm2", num_blocks=num_blocks, block_size=block_size,
                                      max_model_len=512, dtype=dtype,
                                      extra={"share_weights": True, "warmup": False, **(extra or {})}, **config))


def kernel_native(num_blocks: int = 32, **config):
    """bf16 with blocks of 32: vLLM's CPU kernel attends over the paged
    cache in place (KvLayout.k_transposed); skips where it is not installed."""
    from services.instance.engine import vllm_kernels

    if vllm_kernels.ops() is None:
        pytest.skip("vLLM's CPU kernels are not installed or cannot run on this CPU")
    e = native(num_blocks, block_size=32, dtype="bfloat16", **config)
    if not e.kv_layout.k_transposed:
        pytest.skip("vLLM's CPU kernels are not usable here")
    return e


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
