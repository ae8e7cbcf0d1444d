"""The official openai client against a real fake-engine cluster."""

import asyncio

import httpx
import openai
import pytest

from tests.helpers import expected_fake_text, wait_idle_and_check


@pytest.fixture(scope="module")
def client(fake_cluster):
    return openai.OpenAI(base_url=f"{fake_cluster.url}/v1", api_key="unused")


def test_completion_non_streaming(client):
    r = client.completions.create(model="fake", prompt="Hello, Ferry", max_tokens=12)
    assert r.choices[0].text == expected_fake_text("Hello, Ferry", 12)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (12, 12)


def test_completion_streaming_exactly_once_in_order(client):
    stream = client.completions.create(model="fake", prompt="stream me", max_tokens=20, stream=True,
                                       stream_options={"include_usage": True})
    texts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            texts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert "".join(texts) == expected_fake_text("stream me", 20)
    assert finish == "length" and usage.completion_tokens == 20


def test_chat_streaming_and_not(client):
    msgs = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="fake", messages=msgs, max_tokens=8, temperature=0)
    text = r.choices[0].message.content
    assert len(text) == 8 and r.choices[0].message.role == "assistant"
    chunks = client.chat.completions.create(model="fake", messages=msgs, max_tokens=8, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_stop_string_ends_generation(client):
    full = expected_fake_text("stop test", 30)
    stop = full[10:12]
    r = client.completions.create(model="fake", prompt="stop test", max_tokens=30, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_models_and_health(fake_cluster):
    models = httpx.get(f"{fake_cluster.url}/v1/models").json()
    assert models["data"][0]["id"] == "fake"
    h = httpx.get(f"{fake_cluster.url}/health").json()
    assert h["status"] == "ok" and h["instances"] == 2


@pytest.mark.parametrize("body,status,param", [
    ("{not json", 400, None),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": 123}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "x", "best_of": 2}, 400, "best_of"),
    ({"prompt": "x", "no_such_field": 1}, 400, "no_such_field"),
    ({"prompt": "x", "priority": "urgent"}, 400, "priority"),
    ({"prompt": "x" * 3000, "max_tokens": 4}, 400, "prompt"),
    ({"prompt": "x" * 100, "max_tokens": 2000}, 400, "max_tokens"),
    ({"prompt": ""}, 400, "prompt"),
])
def test_bad_input_gets_openai_error(fake_cluster, body, status, param):
    url = f"{fake_cluster.url}/v1/completions"
    if isinstance(body, str):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(url, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param:
        assert err["param"] == param


def test_context_limit_message_says_the_limits(fake_cluster):
    r = httpx.post(f"{fake_cluster.url}/v1/completions", json={"prompt": "x" * 100, "max_tokens": 2000})
    msg = r.json()["error"]["message"]
    assert "2048" in msg and "2100" in msg and "100 in the prompt" in msg


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="fake", prompt="x", max_tokens=5, best_of=3)


async def test_200_concurrent_streams_get_exactly_their_tokens(fake_cluster):
    async def one(i: int, http: httpx.AsyncClient):
        prompt = f"request number {i}"
        n = 8 + i % 13
        text = ""
        async with http.stream("POST", "/v1/completions",
                               json={"prompt": prompt, "max_tokens": n, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    import json

                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    text += chunk["choices"][0]["text"]
        return text == expected_fake_text(prompt, n)

    limits = httpx.Limits(max_connections=250)
    async with httpx.AsyncClient(base_url=fake_cluster.url, timeout=60, limits=limits) as http:
        results = await asyncio.gather(*(one(i, http) for i in range(200)))
    assert sum(results) == 200
    for inst in fake_cluster.instances():
        r = wait_idle_and_check(inst.address)
        assert r.ok, r.error
        assert r.free_blocks == r.total_blocks


async def test_client_disconnect_aborts_and_frees_blocks(fake_cluster):
    async with httpx.AsyncClient(base_url=fake_cluster.url, timeout=30) as http:
        async with http.stream("POST", "/v1/completions",
                               json={"prompt": "long one " * 20, "max_tokens": 1800, "stream": True}) as r:
            got = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    got += 1
                if got >= 5:
                    break  # leave mid-stream
    # Finishing would take 1800 steps x 5 ms = 9 s: idle sooner means it was aborted.
    for inst in fake_cluster.instances():
        rep = wait_idle_and_check(inst.address, timeout_s=3)
        assert rep.ok, rep.error
        assert rep.num_requests == 0 and rep.free_blocks == rep.total_blocks


def test_usage_says_how_many_prompt_tokens_a_prefix_cache_served(client):
    """usage.prompt_tokens_details.cached_tokens (completions, chat, and the
    streamed usage) and the Responses API's input_tokens_details: 0 for a
    prompt no cache has seen, its full blocks but the last token's once the
    instance it lands on has computed it (tried until one has: the module's
    cluster may have grown)."""
    prompt = "a prompt the prefix cache will see again " * 8
    first = client.completions.create(model="fake", prompt=prompt, max_tokens=4)
    n = first.usage.prompt_tokens
    full = (n - 1) // 16 * 16
    assert first.usage.prompt_tokens_details.cached_tokens == 0 and full >= 16 * 20
    def until_hit(ask) -> list[int]:
        """The cached counts of up to 8 tries, until one lands where the
        prompt was computed (load decides between the instances)."""
        hits = []
        while len(hits) < 8 and full not in hits:
            hits.append(ask().prompt_tokens_details.cached_tokens)
        return hits

    hits = until_hit(lambda: client.completions.create(model="fake", prompt=prompt, max_tokens=4).usage)
    assert set(hits) <= {0, full} and hits[-1] == full, hits

    def streamed():
        stream = client.completions.create(model="fake", prompt=prompt, max_tokens=4, stream=True,
                                           stream_options={"include_usage": True})
        return [c.usage for c in stream if c.usage is not None][-1]

    hits = until_hit(streamed)
    assert set(hits) <= {0, full} and hits[-1] == full, hits
    chat = [{"role": "user", "content": prompt}]
    for _ in range(8):
        r = client.chat.completions.create(model="fake", messages=chat, max_tokens=4)
        if r.usage.prompt_tokens_details.cached_tokens:
            break
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached == (r.usage.prompt_tokens - 1) // 16 * 16 > 0
    for _ in range(8):
        resp = client.responses.create(model="fake", input=prompt + " (responses)", max_output_tokens=4)
        if resp.usage.input_tokens_details.cached_tokens:
            break
    got = resp.usage.input_tokens_details.cached_tokens
    assert 0 < got <= (resp.usage.input_tokens - 1) // 16 * 16 and got % 16 == 0
