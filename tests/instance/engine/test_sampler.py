"""The sampler is numerically safe for every value the APIs accept: a
temperature too small to divide by samples greedily, a top_p that rounds to
0 in float32 keeps the best token, and a row that still cannot be drawn from
fails that request alone, before any generator moved."""

from __future__ import annotations

import pytest
import torch

from libs.common.types import FinishReason, SamplingParams
from services.instance.engine.base import RequestFailed
from services.instance.engine.core.request import Request
from services.instance.engine.native.sampler import new_generator, sample
from tests.instance.engine.helpers import req
from tests.instance.engine.test_failures import drain


def _reqs(*params: dict) -> list[Request]:
    out = []
    for i, p in enumerate(params):
        r = Request(f"r{i}", [1, 2], SamplingParams(max_tokens=4, **p))
        r.generator = new_generator(i)
        out.append(r)
    return out


@pytest.mark.parametrize("params", [
    dict(temperature=1e-45), dict(temperature=1.4e-45, top_p=1e-300), dict(temperature=1e-30, top_k=1),
    dict(temperature=9.9e-6), dict(temperature=0.7, top_p=1e-45), dict(temperature=2.0, top_k=2**31 - 1),
    dict(temperature=1e-5, top_p=float.fromhex("0x1p-149")),
])
def test_every_accepted_value_draws_a_token(params):
    torch.manual_seed(0)
    logits = torch.randn(3, 500) * 30
    reqs = _reqs(params, params, params)
    got = sample(logits.clone(), reqs, frozenset())
    assert all(0 <= t < 500 for t in got)
    if SamplingParams(**params).greedy or params.get("top_k") == 1 or params.get("top_p", 1) < 1e-30:
        assert got == logits.argmax(dim=-1).tolist()  # the best token, as greedy


def test_a_temperature_below_the_threshold_is_greedy():
    assert SamplingParams(temperature=1e-45).greedy and SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-5).greedy


def test_a_row_that_cannot_be_drawn_from_fails_alone_before_any_draw():
    logits = torch.randn(2, 64)
    logits[1, 3] = 3e38  # finite, but over a temperature of 1e-5 it overflows
    reqs = _reqs(dict(temperature=0.8, seed=1), dict(temperature=1e-5))
    before = reqs[0].generator.get_state().clone()
    with pytest.raises(RequestFailed) as e:
        sample(logits, reqs, frozenset())
    assert e.value.request_ids == ["r1"]
    assert torch.equal(reqs[0].generator.get_state(), before), "a generator moved in a failed step"


def test_native_four_requests_with_a_subnormal_temperature_finish_like_greedy(make_engine):
    """The reproduction of issue 39: four concurrent requests with temperature
    1e-45 killed the engine (NaN probabilities, torch.multinomial raised for
    every row, the step was declared broken)."""
    e = make_engine("native", num_blocks=64)
    prompt = [1, 504, 3101, 314, 260, 1345]  # any prompt of the real model's vocabulary
    for i in range(4):
        e.add_request(req(f"tiny{i}", prompt, max_tokens=6, temperature=1e-45))
    e.add_request(req("greedy", prompt, max_tokens=6))
    tokens, finals = drain(e)
    assert all(f.finish_reason is FinishReason.LENGTH for f in finals.values()), finals
    for i in range(4):
        assert tokens[f"tiny{i}"] == tokens["greedy"]
