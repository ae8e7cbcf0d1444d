"""The OpenAI API's features with the official openai client against a real
cluster of native instances (SmolLM2-135M, fp32, the deterministic mode):
logprobs against a transformers forward pass and across a migration, n,
batched prompts, echo with max_tokens 0 (loglikelihoods), structured outputs,
tools, penalties, /tokenize, each streamed and not."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from ferry.cluster import ClusterSpec, LocalCluster, free_port
from tests.helpers import instance_status, migrate

pytestmark = pytest.mark.model

ARGS = ["--num-blocks", "512", "--max-num-seqs", "16", "--dtype", "float32", "--deterministic"]
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(ClusterSpec(instances=2, engine="native", port=free_port(), instance_args=ARGS,
                                 log_dir=str(tmp_path_factory.mktemp("api"))))
    c.start(timeout_s=300)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from libs.common.models import ensure_model

    path = ensure_model("smollm2")
    return (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(path))


def reference_logprobs(hf, ids: list[int]):
    """log-softmax of transformers' logits: row i predicts token i + 1."""
    import torch

    with torch.no_grad():
        return hf[0](torch.tensor([ids])).logits[0].float().log_softmax(-1)



def test_logprobs_equal_a_transformers_forward_pass(client, hf):
    """Chat logprobs + top_logprobs and completions logprobs (vLLM's raw
    logprobs) against the same weights in transformers, within 1e-3 (fp32)."""
    prompt_ids = hf[1].apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    prompt_ids = list(prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids)
    r = client.completions.create(model="smollm2", prompt=prompt_ids, max_tokens=8, temperature=0, logprobs=5,
                                  extra_body={"return_token_ids": True})
    out = r.model_extra["ferry"]["token_ids"]
    ref = reference_logprobs(hf, prompt_ids + out)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(out) == 8
    for i, t in enumerate(out):
        want = ref[len(prompt_ids) + i - 1]
        assert abs(lp.token_logprobs[i] - float(want[t])) < 1e-3
        top = want.topk(5)
        got_top = lp.top_logprobs[i]
        assert len(got_top) == 5
        for tid, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(got_top[hf[1].decode([tid])] - v) < 1e-3
    c = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert [x.token for x in content] == [hf[1].decode([t]) for t in out]
    for i, entry in enumerate(content):
        assert abs(entry.logprob - float(ref[len(prompt_ids) + i - 1][out[i]])) < 1e-3
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.bytes == list(entry.token.encode())


def test_streamed_logprobs_are_the_whole_responses(client):
    kw = dict(model="smollm2", messages=QUESTION, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [e for ch in client.chat.completions.create(stream=True, **kw) if ch.choices
                for e in (ch.choices[0].logprobs.content if ch.choices[0].logprobs else [])]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole]


async def test_logprobs_are_bit_identical_across_a_migration(cluster):
    body = {"prompt": "A ferry crosses the river at dawn, and the", "max_tokens": 40, "ignore_eos": True,
            "temperature": 0.8, "seed": 7, "logprobs": 2, "stream": True}
    async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as http:
        async def run(migrate_at: int | None):
            lps, moved = [], []
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ch = json.loads(line[6:])
                    if ch.get("choices") and ch["choices"][0].get("logprobs"):
                        lps += list(zip(ch["choices"][0]["logprobs"]["tokens"],
                                        ch["choices"][0]["logprobs"]["token_logprobs"]))
                    if migrate_at is not None and len(lps) >= migrate_at and not moved:
                        moved.append(asyncio.create_task(migrate(cluster, ch["id"])))
                    if ch.get("ferry"):
                        final = ch["ferry"]
            if moved:
                await moved[0]
            return lps, final
        ref, f0 = await run(None)
        got, f1 = await run(12)
    assert f0["migrations"] == 0 and f1["migrations"] == 1
    assert got == ref and len(ref) == 40


def test_n_choices_share_the_prompt_and_each_has_its_seed(client, cluster):
    # The siblings go where the prompt was computed, an affinity the scheduler honours while that
    # instance can take them: one that a loaded machine made look hung for a step (services/instance/
    # hang.py: unschedulable) cannot, and they are then dispatched as usual. Up to three tries; without
    # the affinity, freeness dispatch sends them to the freer instance, not the one that ran the leader.
    prompt = "Once upon a time, in a city by the sea, there lived " * 6  # several full blocks of 32
    for _ in range(3):
        before = {i.name: instance_status(i.address).prefix_cache.hits for i in cluster.instances()}
        r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=1.0, seed=5, n=4)
        f = r.model_extra["ferry"]["choices"]
        if len({c["instances"][0] for c in f}) == 1:
            break
    assert len({c["instances"][0] for c in f}) == 1  # the siblings went where the prompt was computed
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # seeds 5, 6, 7, 8
    hits = {i.name: instance_status(i.address).prefix_cache.hits - before[i.name] for i in cluster.instances()}
    n_prompt = r.usage.prompt_tokens
    assert max(hits.values()) >= 3 * (n_prompt // 32) * 32  # 3 siblings from the cache: computed once
    assert r.usage.completion_tokens == 48
    # each choice is the single request with its own seed (vLLM's seed + index)
    for j in (0, 2):
        one = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=1.0, seed=5 + j)
        assert one.choices[0].text == texts[j]
    streamed = {}
    for ch in client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=1.0, seed=5, n=4,
                                        stream=True):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(4)] == texts


def test_batched_prompts_give_one_choice_each_times_n(client, hf):
    prompts = ["The capital of France is", "def add(a, b):"]
    r = client.completions.create(model="smollm2", prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by = {c.index: c.text for c in r.choices}
    assert by[0] == by[1] and by[2] == by[3] and by[0] != by[2]  # greedy: a prompt's n choices agree
    ids = [hf[1](p)["input_ids"] for p in prompts]
    t = client.completions.create(model="smollm2", prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in sorted(t.choices, key=lambda c: c.index)] == [by[0], by[2]]
    assert r.usage.prompt_tokens == sum(len(i) for i in ids)


def test_echo_with_no_tokens_gives_the_prompts_loglikelihood(client, hf):
    """What evaluation harnesses ask: echo, max_tokens 0, logprobs."""
    text = "The capital of France is Paris."
    r = client.completions.create(model="smollm2", prompt=text, max_tokens=0, echo=True, logprobs=1, temperature=0)
    c = r.choices[0]
    assert c.text == text and r.usage.completion_tokens == 0 and c.finish_reason == "length"
    ids = hf[1](text)["input_ids"]
    ref = reference_logprobs(hf, ids)
    assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.token_logprobs) == len(ids)
    for i in range(1, len(ids)):
        assert abs(c.logprobs.token_logprobs[i] - float(ref[i - 1][ids[i]])) < 1e-3
    # with tokens too: the prompt's, then the completion's
    g = client.completions.create(model="smollm2", prompt=text, max_tokens=3, echo=True, logprobs=0, temperature=0)
    assert g.choices[0].text.startswith(text) and len(g.choices[0].logprobs.tokens) == len(ids) + 3


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "pets"], "additionalProperties": False}


def test_json_schema_structured_output(client):
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    for seed in (1, 2, 3):
        r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=200, temperature=1.0,
                                           seed=seed, response_format=fmt)
        assert r.choices[0].finish_reason == "stop"  # the grammar ended it, not max_tokens
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    stream = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=200, temperature=1.0, seed=1,
                                            response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert json.loads(text) == json.loads(client.chat.completions.create(
        model="smollm2", messages=msgs, max_tokens=200, temperature=1.0, seed=1,
        response_format=fmt).choices[0].message.content)
    small = [{"role": "user", "content": "Give me a JSON object describing a cat with name and age."}]
    obj = client.chat.completions.create(model="smollm2", messages=small, max_tokens=100, temperature=0,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    choice = client.completions.create(model="smollm2", prompt="Is the sky blue? Answer:", max_tokens=5,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")


def test_tool_choice_required_and_named(client):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="smollm2", messages=msgs, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=80, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and c.message.tool_calls
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.function.name in ("get_weather", "get_time")
    params = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), params)
    n = client.chat.completions.create(model="smollm2", messages=msgs, tools=[WEATHER, TIME], max_tokens=60,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       temperature=0)
    named = n.choices[0].message.tool_calls[0]
    assert named.function.name == "get_weather" and n.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(named.function.arguments), WEATHER["function"]["parameters"])
    # streamed: the same calls, as OpenAI's deltas (index, id and name first, then the arguments)
    for choice, want in (("required", c.message.tool_calls), ({"type": "function", "function": {"name": "get_weather"}},
                                                               n.choices[0].message.tool_calls)):
        calls: dict[int, dict] = {}
        finish = None
        for ch in client.chat.completions.create(model="smollm2", messages=msgs, tools=[WEATHER, TIME],
                                                 tool_choice=choice, max_tokens=80, temperature=0, stream=True):
            if not ch.choices:
                continue
            for d in ch.choices[0].delta.tool_calls or ():
                entry = calls.setdefault(d.index, {"name": None, "arguments": ""})
                if d.function.name:
                    assert entry["name"] is None and d.id
                    entry["name"] = d.function.name
                entry["arguments"] += d.function.arguments or ""
            finish = ch.choices[0].finish_reason or finish
        assert [(v["name"], json.loads(v["arguments"])) for _, v in sorted(calls.items())] == \
            [(w.function.name, json.loads(w.function.arguments)) for w in want]
        assert finish == ("tool_calls" if choice == "required" else "stop")


def test_a_conversation_with_a_tool_result(client):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model="smollm2", messages=msgs, tools=[WEATHER], tool_choice="required",
                                           max_tokens=60, temperature=0).choices[0].message
    msgs += [first.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": '{"temperature": 21, "sky": "clear"}'}]
    second = client.chat.completions.create(model="smollm2", messages=msgs, tools=[WEATHER], tool_choice="none",
                                            max_tokens=30, temperature=0)
    assert second.choices[0].message.content and second.choices[0].finish_reason in ("stop", "length")


def test_auto_tool_choice_needs_a_parser(client):
    with pytest.raises(openai.BadRequestError, match="tool-call-parser"):
        client.chat.completions.create(model="smollm2", messages=QUESTION, tools=[WEATHER], max_tokens=8)


def test_penalties_and_biases_change_the_tokens(client, hf):
    kw = dict(model="smollm2", prompt="List the days of the week: Monday, Tuesday,", max_tokens=16, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"extra_body": {"repetition_penalty": 1.8}}):
        assert client.completions.create(**kw, **extra).choices[0].text != plain, extra
    first = hf[1](plain)["input_ids"][0]
    banned = client.completions.create(**kw, logit_bias={str(first): -100}).choices[0].text
    assert hf[1](banned)["input_ids"][0] != first
    only = client.completions.create(**kw, extra_body={"allowed_token_ids": [first]}).choices[0].text
    assert set(hf[1](only)["input_ids"]) == {first}


def test_tokenize_and_detokenize(cluster, hf):
    t = httpx.post(f"{cluster.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert t["tokens"] == hf[1]("Hello world")["input_ids"] and t["count"] == len(t["tokens"])
    chat = httpx.post(f"{cluster.url}/tokenize", json={"messages": QUESTION}).json()
    assert chat["tokens"][-3:] == hf[1].apply_chat_template(QUESTION, add_generation_prompt=True,
                                                             tokenize=True)["input_ids"][-3:]
    d = httpx.post(f"{cluster.url}/detokenize", json={"tokens": t["tokens"]}).json()
    assert d["prompt"] == "Hello world"
    bad = httpx.post(f"{cluster.url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    # no messages: a 400 naming them (the HTTP fuzzer found a 500 here)
    r = httpx.post(f"{cluster.url}/tokenize", json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"] + str(r.json()["error"]["param"]), r.text


def test_image_parts_are_refused_saying_why(client):
    with pytest.raises(openai.BadRequestError, match="text only"):
        client.chat.completions.create(model="smollm2", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])


def test_special_tokens_kept_or_skipped(client, hf):
    """skip_special_tokens: false keeps the end-of-turn token's text; vLLM's
    prompt_logprobs come per prompt token (None for the first)."""
    kw = dict(model="smollm2", messages=QUESTION, max_tokens=12, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0]
    kept = client.chat.completions.create(**kw, extra_body={"skip_special_tokens": False}).choices[0]
    assert plain.finish_reason == kept.finish_reason == "stop"
    assert kept.message.content == plain.message.content + "<|im_end|>"
    r = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    ids = hf[1]("The capital of France is")["input_ids"]
    ref = reference_logprobs(hf, ids)
    assert plp[0] is None and len(plp) == len(ids)
    for i in range(1, len(ids)):
        assert abs(plp[i][str(ids[i])]["logprob"] - float(ref[i - 1][ids[i]])) < 1e-3
        assert sum(1 for v in plp[i].values() if "rank" in v) == 2


def test_every_way_of_asking_for_a_grammar(client):
    """vLLM's structured_outputs and its older guided_* fields."""
    msgs = [{"role": "user", "content": "Pick a number."}]
    for extra, check in (
            ({"structured_outputs": {"regex": "[0-9]{3}"}}, lambda t: len(t) == 3 and t.isdigit()),
            ({"guided_regex": "(red|green|blue)"}, lambda t: t in ("red", "green", "blue")),
            ({"structured_outputs": {"json": {"type": "object", "properties": {"n": {"type": "integer"}},
                                              "required": ["n"], "additionalProperties": False}}},
             lambda t: isinstance(json.loads(t)["n"], int)),
            ({"guided_json": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
             lambda t: all(isinstance(x, int) for x in json.loads(t))),
            ({"guided_grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no"))):
        r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=40, temperature=0,
                                           extra_body=extra)
        text = r.choices[0].message.content
        assert check(text), (extra, text)
    with pytest.raises(openai.BadRequestError, match="guided_regex"):
        client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=4,
                                       extra_body={"guided_regex": "(", "guided_choice": ["a"]})
    with pytest.raises(openai.BadRequestError, match="invalid regex"):
        client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=4, extra_body={"guided_regex": "("})


# --- the Responses API ---------------------------------------------------------------------
def test_responses_text_instructions_and_formats(client):
    r = client.responses.create(model="smollm2", input="What is the capital of France?", temperature=0,
                                instructions="Answer in one word.", max_output_tokens=16)
    assert r.status == "completed" and "Paris" in r.output_text
    assert r.usage.output_tokens > 0 and r.output[0].type == "message"
    j = client.responses.create(model="smollm2", input="Describe a person as JSON.", temperature=1.0,
                                extra_body={"seed": 2},
                                max_output_tokens=200, text={"format": {"type": "json_schema", "name": "person",
                                                                        "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(j.output_text), SCHEMA)


def test_responses_stream_in_openais_order(client):
    kinds = [e.type for e in client.responses.create(model="smollm2", input="Say hi.", temperature=0,
                                                     max_output_tokens=24, stream=True)]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    with client.responses.stream(model="smollm2", input="Say hi.", temperature=0, max_output_tokens=24) as s:
        streamed = s.get_final_response().output_text
    assert streamed == client.responses.create(model="smollm2", input="Say hi.", temperature=0,
                                               max_output_tokens=24).output_text


def test_responses_tools_and_a_continuation_on_another_replica(client, cluster):
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city now",
            "parameters": WEATHER["function"]["parameters"]}
    first = client.responses.create(model="smollm2", input="What is the weather in Paris?", tools=[tool],
                                    tool_choice="required", temperature=0, max_output_tokens=60)
    call = next(o for o in first.output if o.type == "function_call")
    jsonschema.validate(json.loads(call.arguments), tool["parameters"])
    other = cluster.add_frontend()
    replica = openai.OpenAI(base_url=f"http://127.0.0.1:{other.port}/v1", api_key="unused", max_retries=0)
    assert replica.responses.retrieve(first.id).output[0].call_id == call.call_id  # stored where both read
    second = replica.responses.create(model="smollm2", previous_response_id=first.id, tools=[tool],
                                      tool_choice="none", temperature=0, max_output_tokens=30,
                                      input=[{"type": "function_call_output", "call_id": call.call_id,
                                              "output": '{"temperature": 21, "sky": "clear"}'}])
    assert second.status in ("completed", "incomplete") and second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    unstored = client.responses.create(model="smollm2", input="Hi", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        replica.responses.retrieve(unstored.id)
    replica.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="smollm2", previous_response_id=first.id, input="and now?",
                                max_output_tokens=4)
