"""The OpenAI HTTP API, fuzzed against a fake-engine cluster and a native
one (real sampling: the fake engine never samples, which is why subnormal
temperatures were not found), two ways:

- from the OpenAPI schema the frontend serves (schemathesis: valid and
  invalid bodies, headers, methods the schema names);
- hostile bodies built here (tests/e2e/fuzz_values.py): every optional
  field, extreme floats, integers past int64, lone surrogates, NUL, RTL,
  very long tokens, NaN/Infinity literals, wrong types, odd headers.

Pass: no response >= 500, every error is OpenAI error JSON with the 4xx its
type says, every 200 is a finished completion, and afterwards the cluster
answers a normal request with no instance gone and no block leaked. A
bounded number of examples here; `make fuzz` runs thousands
(FERRY_FUZZ_EXAMPLES, per strategy and engine)."""

import json
import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from ferry.cluster import ClusterSpec, LocalCluster, free_port
from tests.conftest import start_fake_cluster
from tests.e2e.fuzz_values import ANY_JSON, EDGE_FLOATS, FLOATS, INTS, TEXT
from tests.helpers import expected_fake_text, wait_idle_and_check

EXAMPLES = {"fake": int(os.environ.get("FERRY_FUZZ_EXAMPLES", "150")),
            "native": int(os.environ.get("FERRY_FUZZ_EXAMPLES", "40"))}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
               413: "invalid_request_error", 429: "rate_limit_error"}
SCHEMATHESIS_MAX_EVENTS = 20  # schemathesis.core.transport.DEFAULT_MAX_STREAM_EVENTS
MAX_LEN = 64  # short contexts: generated requests that ask for the most tokens finish fast


@pytest.fixture(scope="module", params=["fake", pytest.param("native", marks=pytest.mark.model)])
def fuzz_cluster(request, tmp_path_factory):
    if request.param == "fake":
        c = start_fake_cluster(tmp_path_factory, "fuzz", instances=2,
                               instance_args=["--token-delay-ms", "0", "--max-model-len", str(MAX_LEN)])
    else:
        c = LocalCluster(ClusterSpec(instances=2, engine="native", port=free_port(),
                                     instance_args=["--max-model-len", str(MAX_LEN), "--num-blocks", "256"],
                                     log_dir=str(tmp_path_factory.mktemp("fuzz-native"))))
        c.start(timeout_s=300)
    c.engine = request.param
    c.seen = {"cases": 0, "by_status": {}}
    yield c
    c.stop()


def check(c, r, what: str) -> None:
    """``r``: an httpx response or schemathesis' (its headers: lists of values)."""
    c.seen["cases"] += 1
    ctype = r.headers.get("content-type", "")
    ctype = ctype[0] if isinstance(ctype, list) and ctype else str(ctype)
    c.seen["by_status"][r.status_code] = c.seen["by_status"].get(r.status_code, 0) + 1
    assert r.status_code < 500, f"{what} -> {r.status_code} {r.text[:300]}"
    if r.status_code >= 400:
        try:
            err = r.json()["error"]
        except ValueError:
            raise AssertionError(f"{what} -> {r.status_code}, not JSON: {r.text[:300]!r}") from None
        assert set(err) == {"message", "type", "param", "code"}, r.text
        assert ERROR_TYPES.get(r.status_code) == err["type"], (r.status_code, err)
    elif r.status_code == 200 and ctype.startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        if not isinstance(r, httpx.Response) and len(events) >= SCHEMATHESIS_MAX_EVENTS:
            return  # schemathesis reads at most 20 events of a stream, then closes it itself
        assert events[-1] == "[DONE]", r.text[-300:]
        finals = [json.loads(e) for e in events[:-1] if '"finish_reason"' in e]
        assert any(ch.get("finish_reason") in ("stop", "length") for f in finals for ch in f.get("choices", []))
    elif r.status_code == 200 and "completions" in what.split(" {")[0]:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text[:300]


def test_schema_cases_no_server_error_and_every_error_is_openai_json(fuzz_cluster):
    schema = schemathesis.openapi.from_url(f"{fuzz_cluster.url}/openapi.json")
    cases = st.one_of([schema.as_strategy(mode) for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)])

    # NOTE: hypothesis driven directly: schemathesis' pytest plugin does not
    # run under this pytest (9), its strategies do.
    @settings(max_examples=EXAMPLES[fuzz_cluster.engine], deadline=None, suppress_health_check=list(HealthCheck),
              database=None)
    @given(case=cases)
    def one(case):
        r = case.call(base_url=fuzz_cluster.url, timeout=120)
        check(fuzz_cluster, r, f"{case.method} {case.path} {case.body!r}")

    one()


def _small(strategy):
    """Mostly small (a native engine decodes each token), sometimes anything."""
    return st.one_of(st.integers(1, 6), st.integers(1, 6), strategy)


COMMON = {
    "model": st.one_of(st.just("smollm2"), TEXT, ANY_JSON), "max_tokens": _small(st.one_of(INTS, FLOATS, ANY_JSON)),
    "temperature": FLOATS, "top_p": FLOATS, "top_k": INTS, "seed": INTS, "n": st.one_of(st.just(1), INTS),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=5), ANY_JSON), "stream": st.one_of(st.booleans(), ANY_JSON),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), ANY_JSON),
    "logprobs": st.one_of(st.booleans(), INTS, st.none()), "priority": st.one_of(
        st.sampled_from(["high", "normal", "HIGH", "low", ""]), TEXT, INTS), "ignore_eos": st.booleans(),
    "min_tokens": _small(INTS), "user": st.one_of(TEXT, ANY_JSON), "presence_penalty": FLOATS,
    "frequency_penalty": FLOATS, "logit_bias": st.one_of(st.just({}), st.dictionaries(TEXT, FLOATS, max_size=2)),
    "stream_extra": ANY_JSON,
}
COMPLETION = st.fixed_dictionaries(
    {"prompt": st.one_of(TEXT, st.lists(st.one_of(st.integers(0, 49151), INTS), min_size=1, max_size=12),
                         st.lists(TEXT, min_size=1, max_size=2), ANY_JSON)},
    optional={**COMMON, "echo": st.booleans()})
PART = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(TEXT, ANY_JSON)}),
                 st.fixed_dictionaries({"type": st.one_of(st.just("image_url"), TEXT)}, optional={"text": ANY_JSON}))
MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), TEXT),
     "content": st.one_of(TEXT, st.lists(PART, max_size=3), st.none(), ANY_JSON)},
    optional={"name": TEXT, "tool_calls": ANY_JSON})
CHAT = st.fixed_dictionaries({"messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=4), ANY_JSON)},
                             optional={**COMMON, "max_completion_tokens": _small(INTS)})
# Well-formed requests at the edges of what is accepted: these must sample (and finish) on the native engine.
ACCEPTED_T = st.one_of(st.sampled_from([v for v in EDGE_FLOATS if 0 <= v <= 2]), st.floats(0, 2))
ACCEPTED_P = st.one_of(st.sampled_from([v for v in EDGE_FLOATS if 0 < v <= 1]), st.floats(0, 1, exclude_min=True))
VALID_TEXT = TEXT.filter(lambda t: t and not any(0xD800 <= ord(ch) <= 0xDFFF for ch in t))
EDGY = {"temperature": ACCEPTED_T, "top_p": ACCEPTED_P, "top_k": st.sampled_from([-1, 0, 1, 2, 50, 2**31 - 1]),
        "seed": st.one_of(st.none(), st.integers(0, 2**63 - 1)), "max_tokens": st.integers(1, 6),
        "min_tokens": st.integers(0, 1), "stop": st.lists(VALID_TEXT.filter(lambda t: len(t) <= 256), max_size=4),
        "stream": st.booleans(), "ignore_eos": st.booleans(), "presence_penalty": FLOATS,
        "user": VALID_TEXT, "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})}
EDGY_COMPLETION = st.fixed_dictionaries({"prompt": st.one_of(
    VALID_TEXT.map(lambda t: t[:60]), st.lists(st.integers(0, 49151), min_size=1, max_size=12))}, optional=EDGY)
EDGY_CHAT = st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant"]), "content": VALID_TEXT.map(lambda t: t[:60])}),
    min_size=1, max_size=3)}, optional=EDGY)
HEADERS = st.fixed_dictionaries({}, optional={
    # control characters included (the HTTP parser refuses them: still OpenAI JSON), not CR/LF/NUL (no client sends)
    "x-priority": st.one_of(st.sampled_from(["high", "normal", "x"]), st.text(st.characters(
        max_codepoint=255, exclude_characters="\r\n\x00"), max_size=20)),
    "authorization": st.text(st.characters(max_codepoint=255, exclude_characters="\r\n\x00"), max_size=40),
    "content-type": st.sampled_from(["application/json", "text/plain", "application/json; charset=latin-1"])})


def test_hostile_bodies_no_server_error_and_every_error_is_openai_json(fuzz_cluster):
    @settings(max_examples=EXAMPLES[fuzz_cluster.engine], deadline=None, suppress_health_check=list(HealthCheck),
              database=None)
    @given(path_body=st.one_of(st.tuples(st.just("/v1/completions"), EDGY_COMPLETION),
                               st.tuples(st.just("/v1/chat/completions"), EDGY_CHAT),
                               st.tuples(st.just("/v1/completions"), COMPLETION),
                               st.tuples(st.just("/v1/chat/completions"), CHAT)),
           headers=HEADERS, nan_literals=st.booleans())
    def one(path_body, headers, nan_literals):
        path, body = path_body
        # NaN/Infinity literals (not JSON, but what json.dumps writes) or a string with surrogates escaped
        raw = json.dumps(body, allow_nan=True) if nan_literals else json.dumps(body, default=str)
        hdrs = {"content-type": "application/json",
                **{k: v.strip(" \t").encode("latin-1") for k, v in headers.items()}}
        try:
            r = httpx.post(f"{fuzz_cluster.url}{path}", content=raw.encode(), headers=hdrs, timeout=120)
        except httpx.LocalProtocolError:
            reject()  # a header the client itself refuses to send
        check(fuzz_cluster, r, f"POST {path} {raw[:300]} {headers}")

    one()


def test_after_fuzzing_the_cluster_answers_and_leaks_nothing(fuzz_cluster):
    c = fuzz_cluster
    assert c.seen["cases"] >= 2 * EXAMPLES[c.engine] * 0.9, c.seen
    assert c.seen["by_status"].get(200, 0) > 0 and c.seen["by_status"].get(400, 0) > 0, c.seen
    print(f"http fuzz ({c.engine}): {c.seen['cases']} cases, by status: {dict(sorted(c.seen['by_status'].items()))}")
    r = httpx.post(f"{c.url}/v1/completions", json={"prompt": "still here", "max_tokens": 5}, timeout=60)
    assert r.status_code == 200
    if c.engine == "fake":
        assert r.json()["choices"][0]["text"] == expected_fake_text("still here", 5)
    for inst in c.instances():
        assert inst.alive()
        rep = wait_idle_and_check(inst.address, timeout_s=60)
        assert rep.ok and rep.free_blocks == rep.total_blocks, rep


def test_a_body_over_the_limit_is_a_413(fuzz_cluster):
    url = f"{fuzz_cluster.url}/v1/completions"
    big = b'{"prompt": "' + b"x" * (9 << 20) + b'"}'
    r = httpx.post(url, content=big, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(9):
            yield b"x" * (1 << 20)
        yield b'"}'
    r = httpx.post(url, content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413
    assert httpx.post(url, json={"prompt": "small", "max_tokens": 2}, timeout=30).status_code == 200
