"""The frontend's gRPC Generate API, fuzzed (hypothesis) against a
fake-engine cluster and a native one (real sampling): empty prompts,
negative or huge max_tokens, NaN, infinite and subnormal temperature and
top_p, unknown priorities, ids outside the vocabulary, long stop strings,
NUL, RTL and very long text, lone surrogates and bytes that are not UTF-8,
huge client request ids, bytes that are not a message at all, oversize
messages. Every call completes or ends INVALID_ARGUMENT (RESOURCE_EXHAUSTED
for size, PERMISSION_DENIED for a priority without a priority key), never
another status, never a stuck stream; afterwards the cluster answers, no
instance exited, nothing leaked."""

import math
import os

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferry.cluster import ClusterSpec, LocalCluster, free_port
from libs.pb import common_pb2 as cpb
from libs.pb import frontend_pb2 as fpb
from tests.conftest import start_fake_cluster
from tests.e2e.fuzz_values import EDGE_TEXT, FLOATS32, TEXT
from tests.helpers import expected_fake_text, wait_idle_and_check

EXAMPLES = {"fake": int(os.environ.get("FERRY_FUZZ_EXAMPLES", "200")),
            "native": int(os.environ.get("FERRY_FUZZ_EXAMPLES", "60"))}
OK_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED}
INT32 = st.integers(-(2**31), 2**31 - 1)
FLOATS = FLOATS32
PROTO_TEXT = TEXT.filter(lambda t: not any(0xD800 <= ord(ch) <= 0xDFFF for ch in t))  # what protobuf can carry
MAX_LEN = 64
FRONTEND_ARGS = ["--max-body-bytes", str(256 << 10)]


@pytest.fixture(scope="module", params=["fake", pytest.param("native", marks=pytest.mark.model)])
def grpc_cluster(request, tmp_path_factory):
    port = free_port()
    if request.param == "fake":
        c = start_fake_cluster(tmp_path_factory, "fuzz-grpc", instances=2, grpc_port=port,
                               instance_args=["--token-delay-ms", "0", "--max-model-len", str(MAX_LEN)],
                               frontend_args=FRONTEND_ARGS)
    else:
        c = LocalCluster(ClusterSpec(instances=2, engine="native", port=free_port(), grpc_port=port,
                                     instance_args=["--max-model-len", str(MAX_LEN), "--num-blocks", "256"],
                                     frontend_args=FRONTEND_ARGS,
                                     log_dir=str(tmp_path_factory.mktemp("fuzz-grpc-native"))))
        c.start(timeout_s=300)
    c.grpc_port = port
    c.engine = request.param
    c.seen = {}
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
        msgs = list(raw_generate(payload, timeout=120))
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


def _request(prompt, ids, t, p, k, mx, mn, seed, stops, stop_ids, prio, rid="", model="", eos=False):
    return fpb.TextGenerateRequest(
        prompt=prompt, prompt_token_ids=ids, priority=prio, stop=stops, request_id=rid, model=model,
        sampling=cpb.SamplingParams(
            temperature=t, top_p=p, top_k=k, max_tokens=mx, min_tokens=mn, has_seed=seed is not None,
            seed=seed or 0, stop_token_ids=stop_ids, ignore_eos=eos))


SEEDS = st.one_of(st.none(), st.integers(0, 2**64 - 1))
# Half of the cases are valid (they must complete), half anything the wire allows.
# Valid requests (they must complete) at the edges: subnormal and huge sampling values, unicode edge cases.
valid_requests = st.builds(
    _request, prompt=st.one_of(st.text(min_size=1, max_size=40),
                               st.sampled_from([t for t in EDGE_TEXT if t and len(t) < 100
                                                and not any(0xD800 <= ord(ch) <= 0xDFFF for ch in t)])),
    ids=st.just([]), t=st.one_of(st.floats(0, 2, width=32), st.sampled_from([1e-45, 1e-38, 9.99e-6, 1e-5, 2.0])),
    p=st.one_of(st.floats(0.0625, 1, width=32), st.sampled_from([1e-45, 1e-38, 1e-5])), k=st.integers(0, 50),
    mx=st.integers(1, 8), mn=st.just(0), seed=SEEDS,
    stops=st.lists(PROTO_TEXT.filter(lambda t: len(t) <= 256), max_size=4),
    stop_ids=st.lists(st.integers(97, 122), max_size=2), prio=st.just(0),
    rid=st.one_of(st.just(""), PROTO_TEXT.map(lambda t: t[:256])), model=PROTO_TEXT, eos=st.booleans())
wild_requests = st.builds(
    _request, prompt=PROTO_TEXT, ids=st.lists(st.one_of(INT32, st.integers(97, 122)), max_size=20),
    t=FLOATS, p=FLOATS, k=st.one_of(INT32, st.just(0)), mx=st.one_of(INT32, st.integers(1, 8)),
    mn=st.one_of(INT32, st.just(0)), seed=SEEDS, stops=st.lists(st.text(max_size=300), max_size=6),
    stop_ids=st.lists(INT32, max_size=3), prio=st.one_of(INT32, st.sampled_from([0, 1])),
    rid=st.one_of(st.just(""), st.text(max_size=300), st.just("r" * 100_000)), model=PROTO_TEXT,
    eos=st.booleans())
requests = st.one_of(valid_requests, wild_requests)

def test_generated_requests_complete_or_are_refused(grpc_cluster, raw_generate):
    SEEN = grpc_cluster.seen

    @settings(max_examples=EXAMPLES[grpc_cluster.engine], deadline=None, suppress_health_check=list(HealthCheck),
              database=None)
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
    print(f"grpc fuzz ({grpc_cluster.engine}): {sum(SEEN.values())} cases by status: {SEEN}")
    assert sum(SEEN.values()) == EXAMPLES[grpc_cluster.engine]
    assert SEEN.get("OK", 0) > 0 and SEEN.get("INVALID_ARGUMENT", 0) > 0


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
    msgs = list(raw_generate(req.SerializeToString(), timeout=60))
    assert msgs[-1].finish_reason in ("stop", "length")
    if grpc_cluster.engine == "fake":
        assert "".join(m.text for m in msgs) == expected_fake_text("fine", 4)
    for inst in grpc_cluster.instances():
        assert inst.alive()
        rep = wait_idle_and_check(inst.address, timeout_s=60)
        assert rep.ok and rep.free_blocks == rep.total_blocks, rep
