"""Restart back-off (pure): at once, then doubling, reset after a stable run."""

from libs.common.backoff import RestartBackoff


def test_restarts_back_off_and_reset_after_a_stable_run():
    b = RestartBackoff(base_s=1, max_s=8, stable_s=60, started_at=0)
    delays = []
    now = 100.0
    for _ in range(6):
        d = b.died(now)
        delays.append(d)
        assert not b.due(now + d - 0.01) or d == 0
        assert b.due(now + d)
        now += d
        b.started(now)
        now += 1  # dies a second after each start
    assert delays == [0, 1, 2, 4, 8, 8]
    now += 60  # then it stayed up a minute
    assert b.died(now) == 0


async def test_a_reconnect_waits_double_each_failure_up_to_its_max_and_resets(monkeypatch):
    import asyncio

    from libs.common.backoff import Reconnect

    waited = []

    async def sleep(s):
        waited.append(s)
    monkeypatch.setattr(asyncio, "sleep", sleep)
    r = Reconnect(first_s=0.05, max_s=0.3)
    for _ in range(5):
        await r.wait()
    r.reset()
    await r.wait()
    assert waited == [0.05, 0.1, 0.2, 0.3, 0.3, 0.05]
