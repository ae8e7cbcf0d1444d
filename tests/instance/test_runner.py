"""The engine thread's bridge: when the thread dies, the step callback hears
it once and no command waits forever on the dead engine."""

from __future__ import annotations

import asyncio

import pytest

from libs.common import failpoints
from services.instance.engine import create_engine
from services.instance.engine.base import EngineBroken, EngineConfig
from services.instance.runner import EngineRunner
from tests.instance.engine.helpers import req


@pytest.fixture
def die_after_3_steps():
    failpoints.configure("engine.die_after_steps=3")
    yield
    failpoints.configure("")


async def test_a_dead_engine_thread_is_reported_and_fails_every_command(die_after_3_steps):
    engine = create_engine(EngineConfig(engine="fake", num_blocks=64, token_delay_ms=1.0))
    loop = asyncio.get_running_loop()
    deaths, outputs = [], []
    died = asyncio.Event()

    def on_step(outs, load):
        outputs.extend(outs)
        if load is None:
            deaths.append(1)
            died.set()

    runner = EngineRunner(engine, loop, on_step)
    runner.start()
    try:
        await runner.call(engine.add_request, req("r", [97, 98], max_tokens=50))
        await asyncio.wait_for(died.wait(), 5)
        assert runner.dead and isinstance(runner.error, EngineBroken)
        assert len(outputs) == 3  # three steps ran, then the thread died
        with pytest.raises(EngineBroken, match="died"):
            await asyncio.wait_for(runner.call(engine.has_work), 1)
        await asyncio.sleep(0.05)
        assert deaths == [1]
    finally:
        runner.stop()
