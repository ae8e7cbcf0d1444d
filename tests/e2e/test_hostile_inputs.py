"""Every input that is not a clean 2xx is a clean 4xx (issue 39), at the
real frontend over a fake-engine cluster: lone surrogates, non-string chat
parts, a non-ASCII API key, a priority raised without a priority key, an
unbounded client request id on the gRPC API (kept as metadata, never the
cluster's id), a key checked before the body is read."""

import json
import socket
import time

import grpc
import httpx
import pytest

from ferry.cluster import free_port
from libs.pb import common_pb2 as cpb
from libs.pb import frontend_pb2 as fpb
from libs.pb import frontend_pb2_grpc as fpb_grpc
from tests.conftest import start_fake_cluster
from tests.helpers import expected_fake_text, wait_idle_and_check

KEY = {"Authorization": "Bearer plain"}
VIP = {"Authorization": "Bearer vip"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    grpc_port = free_port()
    c = start_fake_cluster(tmp_path_factory, "hostile", instances=1, grpc_port=grpc_port,
                           frontend_args=["--api-key", "plain", "--priority-api-key", "vip",
                                          "--client-timeout-s", "1"],
                           instance_args=["--token-delay-ms", "1"])
    c.grpc_port = grpc_port
    yield c
    c.stop()


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


@pytest.mark.parametrize("body,param", [
    (b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    (b'{"prompt": ["ok \\udfff"], "max_tokens": 2}', "prompt"),
    (b'{"prompt": "x", "stop": "\\ud83d", "max_tokens": 2}', "stop"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(cluster, body, param):
    r = httpx.post(f"{cluster.url}/v1/completions", content=body,
                   headers={**KEY, "content-type": "application/json"})
    err = error_of(r, 400)
    assert err["param"] == param and "not valid Unicode" in err["message"], err


@pytest.mark.parametrize("content", [
    [{"type": "text", "text": 5}], [{"type": "text", "text": None}], [{"type": "text"}],
    [{"type": "image_url", "image_url": {"url": "http://x"}}], '[{"type": "text", "text": "\\ud800"}]',
])
def test_chat_parts_that_are_not_text_are_a_400(cluster, content):
    body = {"messages": [{"role": "user", "content": "@"}], "max_tokens": 2}
    raw = json.dumps(body).replace('"@"', content if isinstance(content, str) else json.dumps(content))
    r = httpx.post(f"{cluster.url}/v1/chat/completions", content=raw.encode(),
                   headers={**KEY, "content-type": "application/json"})
    assert error_of(r, 400)["param"] == "messages"


def test_text_parts_are_joined(cluster):
    r = httpx.post(f"{cluster.url}/v1/chat/completions", headers=KEY,
                   json={"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                   {"type": "text", "text": "b"}]}],
                         "max_tokens": 3})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("key", ["Bearer pl\u00e4in", "Bearer \u00ff\u00fe", "Bearer \u00e9" * 50])
def test_a_non_ascii_api_key_is_a_401(cluster, key):
    r = httpx.post(f"{cluster.url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                   headers={"Authorization": key.encode("latin-1")})
    assert error_of(r, 401)["type"] == "authentication_error"


def test_high_priority_needs_a_priority_key(cluster):
    url = f"{cluster.url}/v1/completions"
    body = {"prompt": "x", "max_tokens": 2}
    for headers, extra in (({**KEY, "X-Priority": "high"}, {}), (KEY, {"priority": "high"})):
        err = error_of(httpx.post(url, json={**body, **extra}, headers=headers), 403)
        assert err["type"] == "permission_error" and err["param"] == "priority"
    assert httpx.post(url, json={**body, "priority": "high"}, headers=VIP).status_code == 200
    assert httpx.post(url, json={**body, "priority": "normal"}, headers=KEY).status_code == 200
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as ch:
        stub = fpb_grpc.FrontendStub(ch)
        req = fpb.TextGenerateRequest(prompt="x", priority=1, sampling=cpb.SamplingParams(max_tokens=2))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=10, metadata=[("authorization", "Bearer plain")]))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert list(stub.Generate(req, timeout=10, metadata=[("authorization", "Bearer vip")]))[-1].finish_reason


def test_the_key_is_checked_before_the_body_is_read(cluster):
    """A client without a key gets its 401 at once, not after sending (up to
    8 MiB of) a body: here the body never comes."""
    with socket.create_connection(("127.0.0.1", int(cluster.url.rsplit(":", 1)[1])), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 8000000\r\n\r\n{")
        t0 = time.monotonic()
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 401") and time.monotonic() - t0 < 0.9  # well before the 1 s body timeout


def test_a_body_that_does_not_come_is_a_408(cluster):
    with socket.create_connection(("127.0.0.1", int(cluster.url.rsplit(":", 1)[1])), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer plain\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        head = b""
        while chunk := s.recv(4096):  # the frontend closes the connection after its answer
            head += chunk
    assert head.startswith(b"HTTP/1.1 408") and b"client_timeout" in head


def test_headers_that_do_not_come_close_the_connection(cluster):
    """A slowloris: a connection that never completes its headers is closed
    after --client-timeout-s (1 s here)."""
    with socket.create_connection(("127.0.0.1", int(cluster.url.rsplit(":", 1)[1])), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        assert s.recv(4096) == b""  # closed by the frontend
    assert 0.5 < time.monotonic() - t0 < 5


def test_grpc_request_ids_are_the_frontends_and_the_clients_is_bounded(cluster):
    key = [("authorization", "Bearer plain")]
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as ch:
        stub = fpb_grpc.FrontendStub(ch)
        same = fpb.TextGenerateRequest(prompt="twins", request_id="mine",
                                       sampling=cpb.SamplingParams(max_tokens=30))
        a, b = stub.Generate(same, timeout=30, metadata=key), stub.Generate(same, timeout=30, metadata=key)
        msgs_a, msgs_b = list(a), list(b)  # the same client id twice at once: no collision
        for msgs in (msgs_a, msgs_b):
            assert "".join(m.text for m in msgs) == expected_fake_text("twins", 30)
            assert msgs[-1].client_request_id == "mine" and msgs[-1].request_id.startswith("grpc-")
        assert msgs_a[-1].request_id != msgs_b[-1].request_id
        huge = fpb.TextGenerateRequest(prompt="x", request_id="r" * 100_000, sampling=cpb.SamplingParams(max_tokens=2))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(huge, timeout=10, metadata=key))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.value.details()
    rep = wait_idle_and_check(cluster.instances()[0].address)
    assert rep.ok and rep.free_blocks == rep.total_blocks
