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
