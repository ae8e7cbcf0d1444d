"""Engine test fixtures: every engine a test builds is checked afterwards —
check_integrity() passes and every block is back on the free list."""

from __future__ import annotations

import pytest

from services.instance.engine import create_engine
from services.instance.engine.base import EngineConfig


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread: on a shared 2-core box, two spinning OpenMP threads
    per process made every op wait for a descheduled sibling (measured 6x
    slower steps under load); on a quiet box one thread costs < 2x."""
    try:
        import torch
    except ImportError:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def make_engine():
    built = []

    def make(engine: str = "fake", **kw):
        kw.setdefault("token_delay_ms", 0.0)
        if engine == "native":
            kw.setdefault("extra", {"share_weights": True, "warmup": False})
            kw.setdefault("model", "smollm2")
        e = create_engine(EngineConfig(engine=engine, **kw))
        e.check_integrity()
        built.append((e, e.num_free_blocks))
        return e

    yield make
    for e, free_at_start in built:
        e.check_integrity()
        assert not e.has_work(), "a test left requests in the engine"
        assert e.num_free_blocks == free_at_start == e.num_total_blocks
