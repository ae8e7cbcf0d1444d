"""Program identity (issue 53): the program a request is a turn of, named by
the client (OpenAI's ``prompt_cache_key``, else the ``x-session-id`` header),
reaches the scheduler's dispatch, which counts each program's turns and
prompt tokens (its metrics aggregate over programs); bad values are 400s
naming the field. The official openai client against the fake-engine cluster."""

from __future__ import annotations

import httpx
import openai
import pydantic
import pytest

from libs.common import convert
from libs.common.programs import ProgramLedger
from libs.common.types import GenerateOrder, SamplingParams
from services.frontend.completions import program_of
from services.frontend.schema import PROGRAM_ID_MAX, ChatCompletionRequest, CompletionRequest
from libs.common.errors import InvalidArgument
from tests.conftest import start_fake_cluster
from tests.helpers import metric

TURNS = "ferry_scheduler_program_turns_total"
TOKENS = "ferry_scheduler_program_prompt_tokens_total"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_fake_cluster(tmp_path_factory, "programs", metrics=True,
                           instance_args=["--token-delay-ms", "1", "--num-blocks", "4096"])
    yield c
    c.stop()


def _scheduler_metrics(cluster) -> str:
    addr = next(a for c, a in cluster.metrics_targets() if c.kind == "scheduler")
    return httpx.get(f"http://{addr}/metrics", timeout=10).text


def _count(text: str, name: str, **labels) -> float:
    return metric(text, name, missing_ok=True, **labels) or 0.0


def test_prompt_cache_key_and_the_session_header_reach_dispatch(cluster):
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)
    before = _scheduler_metrics(cluster)
    msgs = [{"role": "user", "content": "hello"}]
    usage = []
    # program p1: two turns by prompt_cache_key (chat and completions)
    r = client.chat.completions.create(model="fake", messages=msgs, max_tokens=3, prompt_cache_key="p1")
    usage.append(r.usage.prompt_tokens)
    r = client.completions.create(model="fake", prompt="hello again", max_tokens=2,
                                  extra_body={"prompt_cache_key": "p1"})
    usage.append(r.usage.prompt_tokens)
    # program s1 by the header; then the body's key wins over the header: a returning turn of p1
    r = client.completions.create(model="fake", prompt="x", max_tokens=2, extra_headers={"x-session-id": "s1"})
    usage.append(r.usage.prompt_tokens)
    r = client.completions.create(model="fake", prompt="y", max_tokens=2, extra_headers={"x-session-id": "s9"},
                                  extra_body={"prompt_cache_key": "p1"})
    usage.append(r.usage.prompt_tokens)
    # streamed, and a request naming no program (not counted)
    list(client.completions.create(model="fake", prompt="z", max_tokens=2, stream=True,
                                   extra_headers={"x-session-id": "s1"}))
    client.completions.create(model="fake", prompt="anonymous", max_tokens=2)
    after = _scheduler_metrics(cluster)

    def delta(name, **labels):
        return _count(after, name, **labels) - _count(before, name, **labels)

    assert delta(TURNS, turn="first") == 2  # p1, s1 (s9 was never a program: the key won)
    assert delta(TURNS, turn="returning") == 3  # p1 twice, s1 once
    first = delta(TOKENS, turn="first", source="cached") + delta(TOKENS, turn="first", source="computed")
    returning = delta(TOKENS, turn="returning", source="cached") + delta(TOKENS, turn="returning",
                                                                          source="computed")
    assert first == usage[0] + usage[2]
    assert returning > usage[1] + usage[3]  # + the streamed turn's
    log = "".join(p.read_text() for p in __import__("pathlib").Path(cluster.spec.log_dir).glob("frontend*.log"))
    assert "program_id=p1" in log or '"program_id": "p1"' in log


@pytest.mark.parametrize("body, param", [
    ({"prompt_cache_key": "k" * (PROGRAM_ID_MAX + 1)}, "prompt_cache_key"),
    ({"prompt_cache_key": 7}, "prompt_cache_key"),
    ({"prompt_cache_key": ""}, "prompt_cache_key"),
    ({"prompt_cache_key": ["a"]}, "prompt_cache_key"),
])
def test_a_bad_prompt_cache_key_is_a_400_naming_it(cluster, body, param):
    r = httpx.post(f"{cluster.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert param in r.text


@pytest.mark.parametrize("header", ["s" * (PROGRAM_ID_MAX + 1), "", "caf\u00e9".encode().decode("latin-1")])
def test_a_bad_session_header_is_a_400_naming_it(cluster, header):
    r = httpx.post(f"{cluster.url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                   headers={"x-session-id": header.encode("latin-1")}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "x-session-id"


def test_the_schema_takes_a_key_and_refuses_bad_ones():
    for model, base in ((CompletionRequest, {"prompt": "x"}),
                        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})):
        assert model.model_validate({**base, "prompt_cache_key": "agent-7"}).prompt_cache_key == "agent-7"
        assert model.model_validate(base).prompt_cache_key is None
        for bad in ("k" * (PROGRAM_ID_MAX + 1), "", 12, None.__class__):
            if bad is None.__class__:
                continue
            with pytest.raises(pydantic.ValidationError) as e:
                model.model_validate({**base, "prompt_cache_key": bad})
            assert e.value.errors()[0]["loc"][0] == "prompt_cache_key"


def test_the_key_wins_over_the_header():
    assert program_of("p", "s") == "p"
    assert program_of(None, " s ") == "s"
    assert program_of(None, None) == ""
    with pytest.raises(InvalidArgument):
        program_of(None, "x" * (PROGRAM_ID_MAX + 1))
    with pytest.raises(InvalidArgument):
        program_of(None, "tab\there")


def test_the_program_travels_to_the_instance_in_the_order():
    o = GenerateOrder("r", (1, 2), SamplingParams(max_tokens=2), program_id="p1")
    assert convert.order_from_pb(convert.order_to_pb(o)).program_id == "p1"
    assert convert.order_from_pb(convert.order_to_pb(GenerateOrder("r", (1,), SamplingParams()))).program_id == ""


def test_the_ledger_counts_turns_and_attained_service_and_forgets_the_oldest():
    led = ProgramLedger(max_programs=2)
    s = led.record("a", 100, 0, 1.0)
    assert (s.turns, s.prompt_tokens, s.computed_tokens) == (1, 100, 100)
    s = led.record("a", 250, 100, 2.0)
    assert (s.turns, s.prompt_tokens, s.cached_tokens, s.computed_tokens, s.first_seen, s.last_seen) == \
        (2, 350, 100, 250, 1.0, 2.0)
    led.record("b", 10, 0, 3.0)
    led.record("a", 10, 20, 4.0)  # cached never exceeds the prompt
    assert led.get("a").cached_tokens == 110
    led.record("c", 10, 0, 5.0)  # b is the least recently seen
    assert led.get("b") is None and len(led) == 2


def test_the_instance_keeps_the_program_with_the_request_and_a_migration_carries_it():
    """The engine's request holds its program (its stats say it), its exported
    state carries it over the wire, and the destination's request has it."""
    from services.instance.engine.base import EngineConfig, EngineRequest
    from services.instance.engine.fake import FakeEngine

    src, dst = (FakeEngine(EngineConfig(num_blocks=64)) for _ in range(2))
    src.add_request(EngineRequest("r", tuple(range(3, 40)), SamplingParams(max_tokens=8), program_id="p1"))
    src.step()
    assert src.request_stats("r")["program_id"] == "p1"
    assert src.suspend_request("r")
    state = convert.state_from_pb(convert.state_to_pb(src.export_state("r")))
    assert state.program_id == "p1"
    blocks = dst.reserve_blocks(-(-state.num_computed_tokens // dst.block_size))
    dst.install_request(state, blocks)
    assert dst.request_stats("r")["program_id"] == "p1"
