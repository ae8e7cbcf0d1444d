"""The OpenAI HTTP API, fuzzed from the OpenAPI schema the frontend serves
(schemathesis: valid and invalid bodies, headers, methods the schema names)
against a fake-engine cluster. Pass: no response >= 500, every error is
OpenAI error JSON with the 4xx its type says, and afterwards the cluster
answers a normal request with no block leaked. A bounded number of examples
here; `make fuzz` runs many more (FERRY_FUZZ_EXAMPLES)."""

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.conftest import start_fake_cluster
from tests.helpers import expected_fake_text, wait_idle_and_check

EXAMPLES = int(os.environ.get("FERRY_FUZZ_EXAMPLES", "150"))
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


@pytest.fixture(scope="module")
def fuzz_cluster(tmp_path_factory):
    # No token delay and a short context: generated requests that ask for the
    # default max_tokens finish fast.
    c = start_fake_cluster(tmp_path_factory, "fuzz", instances=2,
                           instance_args=["--token-delay-ms", "0", "--max-model-len", "96"])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def http_strategy(fuzz_cluster):
    """Cases for every operation of the served schema, valid and invalid."""
    schema = schemathesis.openapi.from_url(f"{fuzz_cluster.url}/openapi.json")
    return st.one_of([schema.as_strategy(mode) for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)])


SEEN = {"cases": 0, "by_status": {}}


def test_no_server_error_and_every_error_is_openai_json(fuzz_cluster, http_strategy):
    # NOTE: hypothesis driven directly: schemathesis' pytest plugin does not
    # run under this pytest (9), its strategies do.
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=http_strategy)
    def one(case):
        r = case.call(base_url=fuzz_cluster.url, timeout=30)
        SEEN["cases"] += 1
        SEEN["by_status"][r.status_code] = SEEN["by_status"].get(r.status_code, 0) + 1
        assert r.status_code < 500, f"{case.method} {case.path} {case.body!r} -> {r.status_code} {r.text[:300]}"
        if r.status_code >= 400:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, r.text
            assert ERROR_TYPES.get(r.status_code) == err["type"], (r.status_code, err)

    one()


def test_after_fuzzing_the_cluster_answers_and_leaks_nothing(fuzz_cluster):
    assert SEEN["cases"] > 0, "the fuzz test ran no case"
    print(f"fuzz cases: {SEEN['cases']}, by status: {SEEN['by_status']}")
    r = httpx.post(f"{fuzz_cluster.url}/v1/completions", json={"prompt": "still here", "max_tokens": 5}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected_fake_text("still here", 5)
    for inst in fuzz_cluster.instances():
        assert inst.alive()
        rep = wait_idle_and_check(inst.address)
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
