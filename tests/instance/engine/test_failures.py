"""One request's failure fails that request only: ids outside the vocabulary
are refused at the door; an exception in a step (named by the executor, or
found by running each request alone) ends the failing request with an error
and the engine goes on for the others with their exact tokens; an engine
that fails for everyone is declared broken."""

from __future__ import annotations

import pytest

from libs.common import failpoints
from libs.common.types import FinishReason
from services.instance.engine.base import EngineBroken, EngineError
from services.instance.engine.fake import fake_generate
from tests.instance.engine.helpers import req

POISON = 7  # a token id the failpoint makes the engine choke on


@pytest.fixture
def poison():
    failpoints.configure(f"engine.poison_token={POISON}")
    yield
    failpoints.configure("")


def drain(engine, start: dict | None = None, max_steps: int = 10_000) -> tuple[dict, dict]:
    """Step until idle: ({rid: tokens}, {rid: final output}); ``start``: the
    output index each request is at (0 if not given)."""
    tokens, finals = {}, {}
    start = start or {}
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for o in engine.step():
            got = tokens.setdefault(o.request_id, [])
            assert o.index == start.get(o.request_id, 0) + len(got)
            if o.token_id is not None:
                got.append(o.token_id)
            if o.finish_reason is not None:
                finals[o.request_id] = o
        engine.check_integrity()
    return tokens, finals


@pytest.mark.parametrize("prompt,resume,stop,bad", [
    ([97, 99_999_999], (), (), "the prompt has token id 99999999 at position 1"),
    ([-1_378_239_111_136], (), (), "the prompt has token id -1378239111136 at position 0"),
    ([97], (98, -1), (), "resume_token_ids has token id -1 at position 1"),
    ([97], (), (1 << 24,), "stop_token_ids has token id 16777216 at position 0"),
])
def test_ids_outside_the_vocabulary_are_refused_naming_the_id(make_engine, prompt, resume, stop, bad):
    e = make_engine(num_blocks=16)
    with pytest.raises(EngineError, match=bad):
        e.add_request(req("bad", prompt, max_tokens=4, resume=resume, stop_token_ids=stop))
    assert not e.has_work()


def test_native_vocabulary_is_the_models(make_engine):
    e = make_engine("native", model="tiny-llama", num_blocks=16)  # random weights, vocab 512
    assert e.vocab_size == 512
    with pytest.raises(EngineError, match="token id 512 at position 2"):
        e.add_request(req("bad", [1, 2, 512], max_tokens=2))
    e.add_request(req("ok", [1, 2, 511], max_tokens=2))
    tokens, finals = drain(e)
    assert len(tokens["ok"]) == 2 and finals["ok"].finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("kind", ["fake", "sim"])
def test_an_exception_naming_nobody_fails_only_the_request_that_causes_it(make_engine, poison, kind):
    e = make_engine(kind, num_blocks=64) if kind == "fake" else make_engine(kind, profile="llama-7b-a10",
                                                                             num_blocks=64)
    prompts = {f"r{i}": [97 + (i * 5 + j) % 26 for j in range(9 + i)] for i in range(5)}
    prompts["r2"][4] = POISON  # r2 makes a batched step fail without saying so
    for rid, p in prompts.items():
        e.add_request(req(rid, p, max_tokens=12))
    tokens, finals = drain(e)
    assert finals["r2"].finish_reason is FinishReason.ERROR
    assert finals["r2"].error[0] == "internal" and "poison_token" in finals["r2"].error[1]
    assert tokens["r2"] == []
    for rid, p in prompts.items():
        if rid != "r2":
            assert tokens[rid] == fake_generate(p, 12), rid
            assert finals[rid].finish_reason is FinishReason.LENGTH
    # and it keeps serving
    e.add_request(req("after", [97, 98], max_tokens=3))
    assert drain(e)[0]["after"] == fake_generate([97, 98], 3)


def test_a_request_that_fails_while_others_decode_fails_alone(make_engine, poison):
    e = make_engine(num_blocks=64)
    e.add_request(req("a", [97, 98, 99], max_tokens=20))
    e.add_request(req("b", [100, 101], max_tokens=20))
    early = {"a": [], "b": []}
    for _ in range(5):
        for o in e.step():
            early[o.request_id].append(o.token_id)
    e.add_request(req("late", [97, POISON], max_tokens=5))  # joins a decoding batch and breaks its step
    tokens, finals = drain(e, start={rid: len(t) for rid, t in early.items()})
    assert finals["late"].finish_reason is FinishReason.ERROR
    assert early["a"] + tokens["a"] == fake_generate([97, 98, 99], 20)
    assert early["b"] + tokens["b"] == fake_generate([100, 101], 20)


def test_nan_logits_fail_that_request_and_the_others_keep_their_exact_tokens(make_engine, monkeypatch):
    import services.instance.engine.native.runner as runner_mod

    def run_all(nan_for: str | None):
        e = make_engine("native", model="tiny-llama", num_blocks=64, dtype="float32")
        prompts = {f"r{i}": [(i * 37 + j * 11) % 500 + 1 for j in range(5 + 3 * i)] for i in range(4)}
        for rid, p in prompts.items():
            e.add_request(req(rid, p, max_tokens=10, min_tokens=10))
        return drain(e)

    clean, _ = run_all(None)
    real_sample = runner_mod.sample

    def sample_with_nan(logits, reqs, eos):  # r1's logits go bad on its 4th token
        for i, r in enumerate(reqs):
            if r.request_id == "r1" and len(r.output_token_ids) == 3:
                logits[i, 5] = float("nan")
        return real_sample(logits, reqs, eos)

    monkeypatch.setattr(runner_mod, "sample", sample_with_nan)
    tokens, finals = run_all("r1")
    assert finals["r1"].finish_reason is FinishReason.ERROR
    assert "non-finite logits" in finals["r1"].error[1]
    assert tokens["r1"] == clean["r1"][:3]
    for rid in ("r0", "r2", "r3"):
        assert tokens[rid] == clean[rid], rid


def test_an_engine_that_fails_for_everyone_is_broken(make_engine, monkeypatch):
    e = make_engine(num_blocks=64)

    def broken(chunks):
        raise RuntimeError("device lost")

    monkeypatch.setattr(e.executor, "execute", broken)
    for i in range(3):
        e.add_request(req(f"r{i}", [97 + i, 98], max_tokens=4))
    with pytest.raises(EngineBroken, match="fails alone.*canary request fails too"):
        e.step()
    assert e.num_free_blocks == e.num_total_blocks  # the failed requests' and the canary's blocks came back


def test_a_request_failing_alone_step_after_step_never_breaks_a_working_engine(make_engine, poison):
    """Whose fault it is, the canary says: poison requests alone in their
    steps, one after the other, fail alone (the engine ran a canary fine)."""
    e = make_engine(num_blocks=64)
    for i in range(2 * 3 + 1):  # more than MAX_FAILED_STEPS in a row
        e.add_request(req(f"p{i}", [97, POISON, 98 + i], max_tokens=4))
        _, finals = drain(e)
        assert finals[f"p{i}"].finish_reason is FinishReason.ERROR
    for i in range(4):  # and a step of nothing but poison
        e.add_request(req(f"q{i}", [POISON, 99 + i], max_tokens=4))
    _, finals = drain(e)
    assert {f.finish_reason for f in finals.values()} == {FinishReason.ERROR} and len(finals) == 4
    e.add_request(req("after", [97, 98], max_tokens=3))
    assert drain(e)[0]["after"] == fake_generate([97, 98], 3)


def test_one_request_failing_where_the_canary_fails_too_means_the_engine_is_broken(make_engine, monkeypatch):
    e = make_engine(num_blocks=64)
    monkeypatch.setattr(e.executor, "execute", lambda chunks: (_ for _ in ()).throw(RuntimeError("boom")))
    e.add_request(req("r0", [97, 98], max_tokens=4))
    with pytest.raises(EngineBroken, match="canary request fails too"):
        e.step()


def test_without_a_block_for_the_canary_three_failed_steps_in_a_row_break_the_engine(make_engine, monkeypatch):
    import services.instance.engine.core.engine as core

    e = make_engine(num_blocks=64)
    monkeypatch.setattr(e.executor, "execute", lambda chunks: (_ for _ in ()).throw(RuntimeError("boom")))
    monkeypatch.setattr(core, "executor_works", lambda executor, pool: None)  # no free block to try one in
    for i in range(2):  # alone in its step, each one fails: could be the request's fault
        e.add_request(req(f"r{i}", [97, 98 + i], max_tokens=4))
        _, finals = drain(e)
        assert finals[f"r{i}"].finish_reason is FinishReason.ERROR
    e.add_request(req("r2", [97, 100], max_tokens=4))
    with pytest.raises(EngineBroken, match="3 steps in a row"):
        e.step()
