"""An instance asks for a status report when a step changes what dispatch and
migration read (blocks, queue, request states), not on every token."""

from libs.common.types import Priority, SamplingParams
from services.instance.engine.base import EngineRequest
from services.instance.config import InstanceConfig
from services.instance.service import InstanceService


class CountingReporter:
    def __init__(self):
        self.pokes = 0

    def poke(self):
        self.pokes += 1


def _step(svc: InstanceService) -> int:
    """One engine step, handed to the agent as the engine thread would."""
    before = svc.reporter.pokes
    svc._on_step(svc.engine.step(), svc.engine.load())
    return svc.reporter.pokes - before


def test_report_asked_on_block_and_state_changes_only():
    svc = InstanceService(InstanceConfig(engine="fake", num_blocks=64, block_size=16, token_delay_ms=0))
    svc.reporter = CountingReporter()
    prompt = tuple(range(1, 5))  # 4 tokens: block 1 fills at token 16
    svc.engine.add_request(EngineRequest("a", prompt, SamplingParams(max_tokens=40, ignore_eos=True)))
    svc._on_step([], svc.engine.load())  # the request joined the queue
    assert svc.reporter.pokes == 1

    asked = [_step(svc) for _ in range(40)]
    # Step 0 writes the prompt's KV (positions 0-3); step k >= 1 writes the
    # KV of the token before it, at position 3 + k. A report is asked when
    # the request starts running (blocks allocated), when a position opens a
    # new block, and when it finishes (blocks freed).
    new_block = [k for k in range(1, 40) if (len(prompt) - 1 + k) % 16 == 0]
    expected = {0, *new_block, 39}
    assert {k for k, a in enumerate(asked) if a} == expected
    assert sum(asked) == len(expected) < 10  # not one per token
    assert not svc.engine.has_work()


def test_token_only_change_keeps_the_key_and_a_new_request_changes_it():
    svc = InstanceService(InstanceConfig(engine="fake", num_blocks=64, block_size=16, token_delay_ms=0))
    svc.reporter = CountingReporter()
    svc.engine.add_request(EngineRequest("a", (1, 2, 3), SamplingParams(max_tokens=100, ignore_eos=True)))
    _step(svc)
    _step(svc)
    assert _step(svc) == 0  # token 5 of block 1
    svc.engine.add_request(EngineRequest("b", (1, 2, 3), SamplingParams(max_tokens=5), Priority.HIGH))
    assert _step(svc) == 1  # b is running now


class _Clock:
    """A virtual clock with a queue of timed calls (what ReportTimer runs on)."""

    def __init__(self):
        self.now, self.queue = 0.0, []

    def call_at(self, when, fn, *args):
        self.queue.append((when, len(self.queue), fn, args))

    def run_until(self, t):
        while True:
            due = sorted(q for q in self.queue if q[0] <= t)
            if not due:
                break
            self.queue.remove(due[0])
            self.now = max(self.now, due[0][0])
            due[0][2](*due[0][3])
        self.now = t


def test_report_timer_rate_limits_pokes_heartbeats_and_sends_late_reports_when_readable():
    from services.instance.reporter import ReportTimer

    clock, sent, readable = _Clock(), [], [True]
    timer = ReportTimer(lambda: ("status", clock.now) if readable[0] else None, lambda s: sent.append(s[1]),
                        min_interval_s=0.05, heartbeat_s=0.5, clock=lambda: clock.now, call_at=clock.call_at)
    timer.poke()
    clock.run_until(0.0)
    assert sent == [0.0]
    for t in (0.01, 0.02, 0.03):  # pokes within the interval: one report at its end
        clock.run_until(t)
        timer.poke()
    clock.run_until(0.2)
    assert sent == [0.0, 0.05]
    clock.run_until(0.56)  # no poke: the heartbeat
    assert sent == [0.0, 0.05, 0.55]
    readable[0] = False
    timer.poke()
    clock.run_until(0.7)
    assert sent == [0.0, 0.05, 0.55] and timer.late_reports == 1
    readable[0] = True
    clock.now = 0.71
    timer.readable()  # the late report goes now
    assert sent[-1] == 0.71 and timer.reports == 4
    timer.stop()
    timer.poke()
    clock.run_until(5.0)
    assert sent[-1] == 0.71
