"""API keys on the HTTP API, and the frontend's gRPC Generate API."""

import grpc
import httpx
import openai
import pytest

from ferry.cluster import free_port
from libs.pb import common_pb2 as cpb
from libs.pb import frontend_pb2 as fpb
from libs.pb import frontend_pb2_grpc as fpb_grpc
from tests.conftest import start_fake_cluster
from tests.helpers import expected_fake_text


@pytest.fixture(scope="module")
def keyed_cluster(tmp_path_factory):
    grpc_port = free_port()
    c = start_fake_cluster(tmp_path_factory, "keyed", instances=1, grpc_port=grpc_port,
                           frontend_args=["--api-key", "s3cret,other"],
                           instance_args=["--token-delay-ms", "2"])
    c.grpc_port = grpc_port
    yield c
    c.stop()


def test_missing_or_wrong_key_is_401(keyed_cluster):
    url = f"{keyed_cluster.url}/v1/completions"
    body = {"prompt": "x", "max_tokens": 2}
    assert httpx.post(url, json=body).status_code == 401
    r = httpx.post(url, json=body, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer other"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_cluster.url}/v1", api_key="bad").completions.create(
            model="fake", prompt="x", max_tokens=2)
    ok = openai.OpenAI(base_url=f"{keyed_cluster.url}/v1", api_key="s3cret").completions.create(
        model="fake", prompt="x", max_tokens=3)
    assert ok.choices[0].text == expected_fake_text("x", 3)
    assert httpx.get(f"{keyed_cluster.url}/health").status_code == 200  # health needs no key


def test_grpc_generate_streams_the_same_tokens(keyed_cluster):
    key = [("authorization", "Bearer s3cret")]
    with grpc.insecure_channel(f"127.0.0.1:{keyed_cluster.grpc_port}") as ch:
        stub = fpb_grpc.FrontendStub(ch)
        req = fpb.TextGenerateRequest(prompt="grpc hello", sampling=cpb.SamplingParams(max_tokens=10))
        for metadata in (None, [("authorization", "Bearer nope")]):  # the API keys hold here too
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, timeout=30, metadata=metadata))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        msgs = list(stub.Generate(req, timeout=30, metadata=key))
        assert "".join(m.text for m in msgs) == expected_fake_text("grpc hello", 10)
        assert msgs[-1].finish_reason == "length" and msgs[-1].completion_tokens == 10
        ids = [t for m in msgs for t in m.token_ids]
        assert bytes(ids).decode() == expected_fake_text("grpc hello", 10)
        bad = fpb.TextGenerateRequest(prompt="x", sampling=cpb.SamplingParams(max_tokens=5000))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(bad, timeout=10, metadata=key))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "maximum context length" in e.value.details()
