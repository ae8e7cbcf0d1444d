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
from services.instance.engine.native.sampler import new_generator, sample, skip_draws
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


def test_skipped_draws_leave_the_generator_where_real_draws_did():
    """skip_draws (a resumed seeded request) relies on one draw taking the same
    part of the generator's stream whatever the row's probabilities."""
    torch.manual_seed(3)
    real, skipped = new_generator(11), new_generator(11)
    for _ in range(6):
        logits = torch.randn(1, 500) * 4
        logits[0, torch.rand(500) < 0.8] = float("-inf")  # most of the vocabulary filtered out
        r = Request("r", [1], SamplingParams(max_tokens=9, temperature=0.8, top_k=40))
        r.generator = real
        sample(logits, [r], frozenset())
    skip_draws(skipped, 6, 500)
    assert torch.equal(real.get_state(), skipped.get_state())
    assert not torch.equal(new_generator(11).get_state(), skipped.get_state())


def test_logprobs_are_the_raw_log_softmax_of_the_chosen_and_the_top_tokens():
    """vLLM's definition: before temperature, top-k/p and min_tokens' masks."""
    torch.manual_seed(4)
    logits = torch.randn(2, 300) * 3
    want = logits.log_softmax(-1)
    reqs = [Request("a", [1], SamplingParams(max_tokens=4, logprobs=5, temperature=0.7, top_k=3, seed=1)),
            Request("b", [1], SamplingParams(max_tokens=4, min_tokens=2, logprobs=0))]
    for i, r in enumerate(reqs):
        r.generator = new_generator(i)
    eos = int(logits[1].argmax())  # banned for b by min_tokens: not its logprob's business
    got = sample(logits.clone(), reqs, frozenset({eos}))
    a, b = got
    assert a.logprobs.logprob == pytest.approx(float(want[0, a.token]), abs=0)
    top = want[0].topk(5)
    assert [t for t, _ in a.logprobs.top] == top.indices.tolist()
    assert [v for _, v in a.logprobs.top] == top.values.tolist()
    assert b.token != eos and b.logprobs.top == ()
    assert b.logprobs.logprob == float(want[1, b.token])


def _draws(params: dict, logits: torch.Tensor, n: int = 200) -> set[int]:
    r = Request("r", [1], SamplingParams(max_tokens=4, temperature=1.0, **params))
    r.generator = new_generator(0)
    return {sample(logits.clone(), [r], frozenset())[0] for _ in range(n)}


def test_top_k_and_top_p_keep_what_they_say():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.05, 0.05]]))
    assert _draws({}, logits) == {0, 1, 2, 3, 4}
    assert _draws({"top_k": 2}, logits) == {0, 1}
    assert _draws({"top_p": 0.65}, logits) == {0, 1}  # 0.4 + 0.3 reaches it


def test_min_p_keeps_what_it_says():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.05, 0.05]]))
    assert _draws({"min_p": 0.45}, logits) == {0, 1, 2}  # at least 0.45 x 0.4
    assert _draws({"min_p": 0.9}, logits) == {0}


def test_bad_words_are_never_completed():
    """A one-token bad word never comes; a longer one's last token is banned
    only right after the rest of it (vLLM's rule)."""
    logits = torch.zeros(1, 10)
    logits[0, 7] = 5.0  # greedy would always pick 7
    r = Request("r", [1], SamplingParams(max_tokens=4, bad_words=((7,),)))
    r.generator = new_generator(0)
    assert sample(logits.clone(), [r], frozenset())[0] != 7
    r = Request("r", [1], SamplingParams(max_tokens=4, bad_words=((3, 7),)), output_token_ids=[2])
    assert sample(logits.clone(), [r], frozenset())[0] == 7  # not after 3
    r.output_token_ids.append(3)
    assert sample(logits.clone(), [r], frozenset())[0] != 7
