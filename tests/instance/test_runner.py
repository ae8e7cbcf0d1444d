"""The engine thread's bridge: when the thread dies, the step callback hears
it once and no command waits forever on the dead engine."""

from __future__ import annotations

import asyncio
import time

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


async def test_a_hold_keeps_the_step_boundary_open_until_released_or_expired():
    """``hold``: no step starts while it lasts, commands still run (a
    migration's install joins the very next step); ``release`` ends it at
    once; a hold nobody releases ends by itself."""
    engine = create_engine(EngineConfig(engine="fake", num_blocks=64, token_delay_ms=1.0))
    runner = EngineRunner(engine, asyncio.get_running_loop(), lambda outs, load: None)
    runner.start()
    try:
        await runner.call(engine.add_request, req("r", [97, 98], max_tokens=100_000))
        await asyncio.sleep(0.05)
        runner.hold("m", 30.0)
        await runner.call(lambda: None)  # the boundary after the hold began
        held_at = runner.steps
        await asyncio.sleep(0.2)
        assert runner.steps == held_at  # ~200 steps of 1 ms would have run
        assert await asyncio.wait_for(runner.call(engine.has_work), 1)  # commands run meanwhile
        runner.release("m")
        await asyncio.sleep(0.2)
        assert runner.steps > held_at + 10
        runner.hold("n", 0.3)  # never released
        await runner.call(lambda: None)
        held_at = runner.steps
        await asyncio.sleep(0.1)
        assert runner.steps == held_at
        await asyncio.sleep(0.6)
        assert runner.steps > held_at + 10
        runner.release("unknown")  # nothing to release: nothing happens
        await runner.call(engine.abort_request, "r")
    finally:
        runner.stop()


async def test_an_expected_join_holds_only_the_boundary_within_half_a_step_of_it():
    """``expect(key, at, seconds)``: steps go on while a step begun now would
    end well before ``at``; from half a step before ``at`` no step starts
    (until ``seconds`` past it, or a release). Steps of 100 ms, recorded."""
    engine = create_engine(EngineConfig(engine="fake", num_blocks=64, token_delay_ms=100.0))
    starts = []
    step = engine.step

    def recording_step():
        starts.append(time.monotonic())
        return step()

    engine.step = recording_step
    runner = EngineRunner(engine, asyncio.get_running_loop(), lambda outs, load: None)
    runner.start()
    try:
        await runner.call(engine.add_request, req("r", [97, 98], max_tokens=100_000))
        await asyncio.sleep(0.25)
        half = runner.last_step_s / 2
        assert half > 0.04
        at = time.monotonic() + 0.45
        runner.expect("m", at, 0.3)
        await asyncio.sleep(at + 0.5 - time.monotonic())
        # (0.6 of the half step measured before: room for steps a loaded machine stretches or shrinks)
        before = [s for s in starts if at - 0.45 <= s < at]
        assert len(before) >= 2 and all(s < at - 0.6 * half for s in before), (before, at, half)
        assert not [s for s in starts if at - 0.6 * half <= s < at + 0.28]  # held from then to its end
        assert [s for s in starts if s >= at + 0.28]  # and it ended by itself

        n = len(starts)
        at = time.monotonic() + 0.05  # within half a step: held from the next boundary
        runner.expect("n", at, 30.0)
        await runner.call(lambda: None)
        held = len(starts)
        await asyncio.sleep(0.4)
        assert len(starts) == held <= n + 1
        runner.release("n")
        await asyncio.sleep(0.3)
        assert len(starts) > held + 1
        await runner.call(engine.abort_request, "r")
    finally:
        runner.stop()
