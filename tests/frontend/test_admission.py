"""The frontend's admission pieces without a server: API keys and priority
keys, the in-flight bound and the drain, and a chat template that raises."""

from __future__ import annotations

import asyncio

import pytest

from libs.common.errors import InvalidArgument, PermissionDenied, ResourceExhausted, Unauthenticated, Unavailable
from libs.common.types import Priority
from services.frontend.admission import Admission
from services.frontend.auth import Keys, check_priority
from services.frontend.completions import prepare
from services.frontend.schema import ChatCompletionRequest
from services.frontend.tokenizer import ByteTokenizer


def test_keys_required_and_priority():
    open_ = Keys(priority=frozenset({"vip"}))
    assert open_.check(None) is False and open_.check("Bearer EMPTY") is False  # no key needed
    assert open_.check("Bearer vip") is True
    closed = Keys(required=frozenset({"a", "vip"}), priority=frozenset({"vip"}))
    for bad in (None, "", "Bearer", "Bearer b", "Basic a", "Bearer \u00e4", "Bearer \udcff"):
        with pytest.raises(Unauthenticated):
            closed.check(bad)
    assert closed.check("Bearer a") is False and closed.check("bearer  vip ") is True


def test_only_a_priority_key_raises_priority():
    check_priority(Priority.NORMAL, privileged=False)
    check_priority(Priority.HIGH, privileged=True)
    with pytest.raises(PermissionDenied):
        check_priority(Priority.HIGH, privileged=False)


def test_the_in_flight_bound_and_the_drain():
    a = Admission(max_in_flight=2)
    a.enter()
    with a.slot():
        with pytest.raises(ResourceExhausted):
            a.enter()
    assert a.in_flight == 1

    async def drain():
        task = asyncio.create_task(a.drain(grace_s=5, poll_s=0.01))
        await asyncio.sleep(0.05)
        assert not task.done()  # one still in flight
        with pytest.raises(Unavailable):  # draining: no new one
            a.enter()
        a.leave()
        return await task
    assert asyncio.run(drain()) == 0
    b = Admission(max_in_flight=0)
    for _ in range(10_000):
        b.enter()  # 0: no bound


class _RaisingTemplate(ByteTokenizer):
    def apply_chat_template(self, messages, **kw):
        raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")


def test_a_chat_template_that_raises_is_a_400():
    body = ChatCompletionRequest(messages=[{"role": "assistant", "content": "x"}], max_tokens=2)
    with pytest.raises(InvalidArgument, match="chat template.*roles must alternate") as e:
        prepare(body, _RaisingTemplate(), 128)
    assert e.value.param == "messages"
