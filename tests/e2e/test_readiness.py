"""Ready means ready: the frontend's /health is 503 until a request can be
placed, a request that cannot be placed gets a 503 with OpenAI error JSON and
Retry-After (never a 200 followed by an error event), and a stream's first
chunk carries the first generated token (with the role, for chat)."""

import json
import time

import httpx
import openai
import pytest

from ferry.cluster import ClusterSpec, LocalCluster, free_port
from tests.helpers import expected_fake_text


def sse_data(text: str) -> list:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


@pytest.fixture
def empty_cluster(tmp_path):
    """Meta store, scheduler and frontend; no instance yet."""
    c = LocalCluster(ClusterSpec(instances=0, engine="fake", port=free_port(), log_dir=str(tmp_path),
                                 instance_args=["--token-delay-ms", "5"]))
    c.start(timeout_s=60)
    yield c
    c.stop()


def test_not_ready_until_an_instance_serves_then_ready(empty_cluster):
    c = empty_cluster
    with httpx.Client(base_url=c.url, timeout=30) as http:
        assert http.get("/live").status_code == 200
        h = http.get("/health")
        assert h.status_code == 503 and h.json()["serving"] == 0 and h.headers["retry-after"] == "1"
        for body in ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True},
                     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}):
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1"
            err = r.json()["error"]
            assert err["type"] == "service_unavailable_error" and "instance" in err["message"]
        with pytest.raises(openai.APIStatusError) as e:
            openai.OpenAI(base_url=f"{c.url}/v1", api_key="x", max_retries=0).completions.create(
                model="fake", prompt="hi", max_tokens=2, stream=True)
        assert e.value.status_code == 503
        c.add_instance()
        deadline = time.monotonic() + 20
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline, http.get("/health").json()
            time.sleep(0.05)
        assert http.get("/health").json()["serving"] == 1
        r = http.post("/v1/completions", json={"prompt": "now", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected_fake_text("now", 4)


def test_the_first_chunk_carries_the_first_token(fake_cluster):
    with httpx.Client(base_url=fake_cluster.url, timeout=30) as http:
        chat = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "first"}], "max_tokens": 6, "stream": True})
        events = sse_data(chat.text)
        first = events[0]["choices"][0]["delta"]
        assert first["role"] == "assistant" and first["content"] != ""
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        assert text.startswith(first["content"]) and len(text) == 6
        assert all("role" not in e["choices"][0]["delta"] for e in events[1:] if e["choices"])
        comp = http.post("/v1/completions", json={"prompt": "first", "max_tokens": 6, "stream": True})
        events = sse_data(comp.text)
        assert events[0]["choices"][0]["text"] == expected_fake_text("first", 6)[0]
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == expected_fake_text("first", 6)
