"""The frontend's gRPC Generate API, fuzzed (hypothesis): empty prompts,
negative or huge max_tokens, NaN and infinite temperature and top_p,
unknown priorities, ids outside the vocabulary, long stop strings, lone
surrogates and bytes that are not UTF-8, bytes that are not a message at
all, oversize messages. Every call completes or ends INVALID_ARGUMENT (or
RESOURCE_EXHAUSTED for size), never another status, never a stuck stream;
afterwards the cluster answers and leaks nothing."""

import math
import os

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferry.cluster import free_port
from ferry.pb import common_pb2 as cpb
from ferry.pb import frontend_pb2 as fpb
from tests.conftest import start_fake_cluster
from tests.helpers import expected_fake_text, wait_idle_and_check

EXAMPLES = int(os.environ.get("FERRY_FUZZ_EXAMPLES", "200"))
OK_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
INT32 = st.integers(-(2**31), 2**31 - 1)
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 0.7, 1.0]))


@pytest.fixture(scope="module")
def grpc_cluster(tmp_path_factory):
    port = free_port()
    c = start_fake_cluster(tmp_path_factory, "fuzz-grpc", instances=2, grpc_port=port,
                           instance_args=["--token-delay-ms", "0", "--max-model-len", "96"],
                           frontend_args=["--max-body-bytes", str(256 << 10)])
    c.grpc_port = port
    yield c
    c.stop()


@pytest.fixture(scope="module")
def raw_generate(grpc_cluster):
    """Generate taking raw request bytes, so that anything can be sent."""
    ch = grpc.insecure_channel(f"127.0.0.1:{grpc_cluster.grpc_port}")
    yield ch.unary_stream("/ferry.v1.Frontend/Generate", request_serializer=lambda b: b,
                          response_deserializer=fpb.TextGenerateResponse.FromString)
    ch.close()


def call(raw_generate, payload: bytes) -> grpc.StatusCode:
    try:
        msgs = list(raw_generate(payload, timeout=30))
    except grpc.RpcError as e:
        assert e.code() in OK_CODES, (e.code(), e.details(), payload[:200])
        return e.code()
    assert msgs and msgs[-1].finish_reason in ("stop", "length"), msgs[-1:]
    return grpc.StatusCode.OK


def _string_field(number: int, raw: bytes) -> bytes:
    """A length-delimited protobuf field holding ``raw`` as is."""
    n, varint = len(raw), b""
    while True:
        b, n = n & 0x7F, n >> 7
        varint += bytes([b | (0x80 if n else 0)])
        if not n:
            return bytes([number << 3 | 2]) + varint + raw


def _request(prompt, ids, t, p, k, mx, mn, seed, stops, stop_ids, prio) -> fpb.TextGenerateRequest:
    return fpb.TextGenerateRequest(
        prompt=prompt, prompt_token_ids=ids, priority=prio, stop=stops, sampling=cpb.SamplingParams(
            temperature=t, top_p=p, top_k=k, max_tokens=mx, min_tokens=mn, has_seed=seed is not None,
            seed=seed or 0, stop_token_ids=stop_ids))


SEEDS = st.one_of(st.none(), st.integers(0, 2**64 - 1))
# Half of the cases are valid (they must complete), half anything the wire allows.
valid_requests = st.builds(
    _request, prompt=st.text(min_size=1, max_size=40), ids=st.just([]),
    t=st.floats(0, 2, width=32), p=st.floats(0.0625, 1, width=32), k=st.integers(0, 50), mx=st.integers(1, 20),
    mn=st.just(0), seed=SEEDS, stops=st.lists(st.text(max_size=20), max_size=4),
    stop_ids=st.lists(st.integers(97, 122), max_size=2), prio=st.sampled_from([0, 1]))
wild_requests = st.builds(
    _request, prompt=st.text(max_size=40), ids=st.lists(st.one_of(INT32, st.integers(97, 122)), max_size=20),
    t=FLOATS, p=FLOATS, k=st.one_of(INT32, st.just(0)), mx=st.one_of(INT32, st.integers(1, 20)),
    mn=st.one_of(INT32, st.just(0)), seed=SEEDS, stops=st.lists(st.text(max_size=300), max_size=6),
    stop_ids=st.lists(INT32, max_size=3), prio=st.one_of(INT32, st.sampled_from([0, 1])))
requests = st.one_of(valid_requests, wild_requests)

SEEN: dict = {}


def test_generated_requests_complete_or_are_refused(raw_generate):
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(req=requests, corrupt=st.one_of(st.none(), st.none(), st.binary(min_size=1, max_size=8)))
    def one(req, corrupt):
        payload = req.SerializeToString()
        if corrupt is not None:  # a prompt whose bytes may not be UTF-8 (lone surrogates as CESU too)
            payload = _string_field(1, b"ok" + corrupt + b"\xed\xa0\x80"[: len(corrupt) % 4]) + payload
        code = call(raw_generate, payload)
        SEEN[code.name] = SEEN.get(code.name, 0) + 1
        sp = req.sampling
        if code is grpc.StatusCode.OK:  # what completed must have been valid
            assert math.isfinite(sp.temperature) and sp.temperature >= 0 and 0 <= sp.top_p <= 1
            assert 0 <= req.priority <= 1 and sp.max_tokens >= 1

    one()
    print(f"grpc fuzz cases by status: {SEEN}")
    assert sum(SEEN.values()) == EXAMPLES and SEEN.get("OK", 0) > 0 and SEEN.get("INVALID_ARGUMENT", 0) > 0


@pytest.mark.parametrize("payload,code", [
    (b"\xff\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT),  # not a message at all
    (_string_field(1, b"\xed\xa0\x80 lone surrogate"), grpc.StatusCode.INVALID_ARGUMENT),
    (_string_field(1, b"x" * (300 << 10)), grpc.StatusCode.RESOURCE_EXHAUSTED),  # over --max-body-bytes
    (fpb.TextGenerateRequest(prompt="").SerializeToString(), grpc.StatusCode.INVALID_ARGUMENT),
    (fpb.TextGenerateRequest(prompt="x", priority=7, sampling=cpb.SamplingParams(max_tokens=2)).SerializeToString(),
     grpc.StatusCode.INVALID_ARGUMENT),
    (fpb.TextGenerateRequest(prompt="x", sampling=cpb.SamplingParams(max_tokens=2, temperature=math.nan))
     .SerializeToString(), grpc.StatusCode.INVALID_ARGUMENT),
    (fpb.TextGenerateRequest(prompt="x", sampling=cpb.SamplingParams(max_tokens=-5)).SerializeToString(),
     grpc.StatusCode.INVALID_ARGUMENT),
])
def test_known_bad_requests(raw_generate, payload, code):
    assert call(raw_generate, payload) == code


def test_after_fuzzing_the_cluster_answers_and_leaks_nothing(grpc_cluster, raw_generate):
    req = fpb.TextGenerateRequest(prompt="fine", sampling=cpb.SamplingParams(max_tokens=4))
    msgs = list(raw_generate(req.SerializeToString(), timeout=30))
    assert "".join(m.text for m in msgs) == expected_fake_text("fine", 4)
    for inst in grpc_cluster.instances():
        assert inst.alive()
        rep = wait_idle_and_check(inst.address)
        assert rep.ok and rep.free_blocks == rep.total_blocks, rep
