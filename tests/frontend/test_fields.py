"""Nothing is accepted and ignored: every field of the completion and chat
bodies is either honoured, with a test of its effect named in EFFECTS, or
refused with a 400 that names it (a sample of a non-default value in
REFUSED_SAMPLES); a field neither is a failure here. Then the effects that
the fake-engine cluster shows (the native ones are in tests/e2e/test_openai_native.py)."""

from __future__ import annotations

import importlib
import json

import httpx
import pydantic
import pytest

from services.frontend.responses import HONOURED_RESPONSES, ResponsesRequest
from services.frontend.schema import HONOURED, ChatCompletionRequest, CompletionRequest, refusals
from tests.helpers import expected_fake_text, expected_fake_tokens

MODELS = {"completion": (CompletionRequest, {"prompt": "x"}),
          "chat": (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}),
          "responses": (ResponsesRequest, {"input": "x"})}

NATIVE = "tests.e2e.test_openai_native"
HERE = "tests.frontend.test_fields"
FAKE = "tests.e2e.test_openai_fake"
# field -> the test that shows its effect
EFFECTS = {
    "model": f"{HERE}::test_another_model_is_a_404",
    "max_tokens": f"{FAKE}::test_completion_non_streaming",
    "max_completion_tokens": f"{HERE}::test_max_completion_tokens_and_truncation",
    "temperature": "tests.instance.engine.test_native::test_seeded_sampling_is_reproducible_and_seeds_differ",
    "seed": "tests.instance.engine.test_native::test_seeded_sampling_is_reproducible_and_seeds_differ",
    "top_p": "tests.instance.engine.test_sampler::test_top_k_and_top_p_keep_what_they_say",
    "top_k": "tests.instance.engine.test_sampler::test_top_k_and_top_p_keep_what_they_say",
    "min_p": "tests.instance.engine.test_sampler::test_min_p_keeps_what_it_says",
    "stop": f"{FAKE}::test_stop_string_ends_generation",
    "stop_token_ids": f"{HERE}::test_stop_token_ids_and_the_stop_string_kept",
    "include_stop_str_in_output": f"{HERE}::test_stop_token_ids_and_the_stop_string_kept",
    "n": f"{NATIVE}::test_n_choices_share_the_prompt_and_each_has_its_seed",
    "stream": f"{FAKE}::test_completion_streaming_exactly_once_in_order",
    "stream_options": f"{HERE}::test_usage_in_every_chunk_or_the_last",
    "priority": "tests.e2e.test_hostile_inputs::test_high_priority_needs_a_priority_key",
    "ignore_eos": f"{NATIVE}::test_logprobs_are_bit_identical_across_a_migration",
    "min_tokens": "tests.instance.engine.test_native::test_greedy_matches_transformers",
    "presence_penalty": f"{NATIVE}::test_penalties_and_biases_change_the_tokens",
    "frequency_penalty": f"{NATIVE}::test_penalties_and_biases_change_the_tokens",
    "repetition_penalty": f"{NATIVE}::test_penalties_and_biases_change_the_tokens",
    "logit_bias": f"{NATIVE}::test_penalties_and_biases_change_the_tokens",
    "allowed_token_ids": f"{NATIVE}::test_penalties_and_biases_change_the_tokens",
    "bad_words": "tests.instance.engine.test_sampler::test_bad_words_are_never_completed",
    "skip_special_tokens": f"{NATIVE}::test_special_tokens_kept_or_skipped",
    "prompt_logprobs": f"{NATIVE}::test_special_tokens_kept_or_skipped",
    "truncate_prompt_tokens": f"{HERE}::test_max_completion_tokens_and_truncation",
    "return_token_ids": f"{NATIVE}::test_logprobs_equal_a_transformers_forward_pass",
    "return_tokens_as_token_ids": f"{HERE}::test_fake_logprobs_and_tokens_as_ids",
    "logprobs": f"{NATIVE}::test_logprobs_equal_a_transformers_forward_pass",
    "top_logprobs": f"{NATIVE}::test_logprobs_equal_a_transformers_forward_pass",
    "user": f"{HERE}::test_end_user_ids_are_logged_with_the_request",
    "safety_identifier": f"{HERE}::test_end_user_ids_are_logged_with_the_request",
    "response_format": f"{NATIVE}::test_json_schema_structured_output",
    "structured_outputs": f"{NATIVE}::test_every_way_of_asking_for_a_grammar",
    "guided_json": f"{NATIVE}::test_every_way_of_asking_for_a_grammar",
    "guided_regex": f"{NATIVE}::test_every_way_of_asking_for_a_grammar",
    "guided_choice": f"{NATIVE}::test_json_schema_structured_output",
    "guided_grammar": f"{NATIVE}::test_every_way_of_asking_for_a_grammar",
    "guided_decoding_backend": f"{HERE}::test_one_tier_and_one_grammar_backend",
    "service_tier": f"{HERE}::test_one_tier_and_one_grammar_backend",
    "prompt": f"{NATIVE}::test_batched_prompts_give_one_choice_each_times_n",
    "echo": f"{NATIVE}::test_echo_with_no_tokens_gives_the_prompts_loglikelihood",
    "add_special_tokens": f"{HERE}::test_add_special_tokens_reaches_the_tokenizer",
    "messages": "tests.e2e.test_openai_fake::test_chat_streaming_and_not",
    "tools": f"{NATIVE}::test_tool_choice_required_and_named",
    "tool_choice": f"{NATIVE}::test_tool_choice_required_and_named",
    "parallel_tool_calls": f"{HERE}::test_parallel_tool_calls_bound_the_calls",
    "add_generation_prompt": f"{HERE}::test_chat_template_options_shape_the_prompt",
    "continue_final_message": f"{HERE}::test_chat_template_options_shape_the_prompt",
    "chat_template": f"{HERE}::test_chat_template_options_shape_the_prompt",
    "chat_template_kwargs": f"{HERE}::test_chat_template_options_shape_the_prompt",
    "documents": f"{HERE}::test_chat_template_options_shape_the_prompt",
    "modalities": f"{HERE}::test_one_tier_and_one_grammar_backend",
    "prompt_cache_key": "tests.e2e.test_programs::test_prompt_cache_key_and_the_session_header_reach_dispatch",
    # the Responses API's own
    "input": f"{NATIVE}::test_responses_text_instructions_and_formats",
    "instructions": f"{NATIVE}::test_responses_text_instructions_and_formats",
    "text": f"{NATIVE}::test_responses_text_instructions_and_formats",
    "max_output_tokens": f"{NATIVE}::test_responses_text_instructions_and_formats",
    "previous_response_id": f"{NATIVE}::test_responses_tools_and_a_continuation_on_another_replica",
    "store": f"{NATIVE}::test_responses_tools_and_a_continuation_on_another_replica",
    "metadata": f"{HERE}::test_a_stored_responses_metadata_and_truncation",
    "truncation": f"{HERE}::test_a_stored_responses_metadata_and_truncation",
}
# refused field -> a value other than its default (the 400 must name the field)
REFUSED_SAMPLES = {
    "best_of": 3, "use_beam_search": True, "length_penalty": 0.5, "cache_salt": "s", "request_id": "r",
    "metadata": {"k": "v"}, "prompt_cache_key": "k", "kv_transfer_params": {"a": 1}, "guided_whitespace_pattern": " ",
    "spaces_between_special_tokens": False, "suffix": "end", "echo": True, "store": True, "audio": {"voice": "x"},
    "prediction": {"type": "content", "content": "x"}, "web_search_options": {}, "reasoning_effort": "low",
    "verbosity": "low", "functions": [{"name": "f"}], "function_call": "auto",
    "reasoning": {"effort": "low"}, "include": ["reasoning.encrypted_content"], "background": True,
    "conversation": "conv_1", "prompt": {"id": "p"}, "max_tool_calls": 2,
}


@pytest.mark.parametrize("kind", list(MODELS))
def test_every_field_is_honoured_or_refused(kind):
    model, _ = MODELS[kind]
    refused = refusals(model)
    honoured = HONOURED_RESPONSES if kind == "responses" else HONOURED
    for name in model.model_fields:
        assert name in honoured or name in refused, f"{kind}: {name} must be honoured or refused"
        if name not in refused:
            assert name in EFFECTS, f"{name} is honoured: name the test of its effect in EFFECTS"
        else:
            assert name in REFUSED_SAMPLES, f"{name} is refused: give a sample value in REFUSED_SAMPLES"


def test_every_named_effect_test_exists():
    for name, where in EFFECTS.items():
        module, func = where.split("::")
        assert callable(getattr(importlib.import_module(module), func, None)), f"{name}: no test {where}"


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_refused_field_is_a_400_naming_it(kind):
    model, base = MODELS[kind]
    for name in refusals(model):
        with pytest.raises(pydantic.ValidationError) as e:
            model.model_validate({**base, name: REFUSED_SAMPLES[name]})
        assert any(err["loc"][:1] == (name,) for err in e.value.errors()), (name, e.value.errors())
        assert "not supported" in str(e.value)
        model.model_validate({**base, name: model.model_fields[name].default})  # its default is fine


def test_an_unknown_field_is_refused_too():
    with pytest.raises(pydantic.ValidationError) as e:
        CompletionRequest.model_validate({"prompt": "x", "temprature": 0.5})
    assert e.value.errors()[0]["loc"] == ("temprature",)


# --- effects the fake-engine cluster shows -----------------------------------------------------
def _post(cluster, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{cluster.url}{path}", json=body, timeout=30)


def test_another_model_is_a_404(fake_cluster):
    r = _post(fake_cluster, "/v1/completions", {"model": "gpt-4", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert _post(fake_cluster, "/v1/completions", {"model": "fake", "prompt": "x", "max_tokens": 2}).status_code == 200


def test_stop_token_ids_and_the_stop_string_kept(fake_cluster):
    want = expected_fake_tokens(list(b"abc"), 12)
    r = _post(fake_cluster, "/v1/completions", {"prompt": "abc", "max_tokens": 12, "stop_token_ids": [want[4]]})
    assert r.json()["choices"][0]["text"] == bytes(want[: want.index(want[4]) + 1]).decode()
    text = expected_fake_text("abc", 12)
    stop = text[5:7]
    cut = text.index(stop)
    for keep, got in ((False, text[:cut]), (True, text[:cut + len(stop)])):
        r = _post(fake_cluster, "/v1/completions", {"prompt": "abc", "max_tokens": 12, "stop": [stop],
                                                    "include_stop_str_in_output": keep})
        assert r.json()["choices"][0]["text"] == got and r.json()["choices"][0]["finish_reason"] == "stop"


def test_max_completion_tokens_and_truncation(fake_cluster):
    r = _post(fake_cluster, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_completion_tokens": 5})
    assert r.json()["usage"]["completion_tokens"] == 5
    r = _post(fake_cluster, "/v1/completions", {"prompt": "0123456789", "max_tokens": 4, "truncate_prompt_tokens": 3})
    assert r.json()["usage"]["prompt_tokens"] == 3
    assert r.json()["choices"][0]["text"] == expected_fake_text("789", 4)


def test_usage_in_every_chunk_or_the_last(fake_cluster):
    for opts, every in (({"include_usage": True}, False), ({"continuous_usage_stats": True}, True)):
        chunks = []
        with httpx.stream("POST", f"{fake_cluster.url}/v1/completions", timeout=30,
                          json={"prompt": "x", "max_tokens": 6, "stream": True, "stream_options": opts}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        with_usage = [c for c in chunks if c.get("usage")]
        assert len(with_usage) == (len(chunks) if every else 1), opts  # every chunk / the last
        assert with_usage[-1]["usage"]["completion_tokens"] == 6


def test_fake_logprobs_and_tokens_as_ids(fake_cluster):
    r = _post(fake_cluster, "/v1/completions", {"prompt": "ab", "max_tokens": 3, "logprobs": 1,
                                               "return_tokens_as_token_ids": True}).json()
    want = expected_fake_tokens(list(b"ab"), 3)
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in want] and lp["token_logprobs"] == [0.0] * 3
    assert lp["top_logprobs"] == [{f"token_id:{t}": 0.0} for t in want]


def test_end_user_ids_are_logged_with_the_request(fake_cluster):
    r = _post(fake_cluster, "/v1/completions", {"prompt": "x", "max_tokens": 2, "user": "alice-42",
                                                "safety_identifier": "sid-7"})
    rid = r.json()["id"]
    import pathlib

    log = "".join(p.read_text() for p in pathlib.Path(fake_cluster.spec.log_dir).glob("frontend*.log"))
    line = next(ln for ln in log.splitlines() if rid in ln)
    assert "alice-42" in line and "sid-7" in line


def test_one_tier_and_one_grammar_backend(fake_cluster):
    for body, ok in (({"service_tier": "default"}, True), ({"service_tier": "flex"}, False),
                     ({"guided_decoding_backend": "xgrammar"}, True), ({"guided_decoding_backend": "outlines"}, False)):
        r = _post(fake_cluster, "/v1/completions", {"prompt": "x", "max_tokens": 2, **body})
        assert (r.status_code == 200) == ok, (body, r.text)
    for modalities, ok in ((["text"], True), (["text", "audio"], False)):
        r = _post(fake_cluster, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                         "max_tokens": 2, "modalities": modalities})
        assert (r.status_code == 200) == ok, r.text


def test_chat_template_options_shape_the_prompt(fake_cluster):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hel"}]

    def prompt_tokens(**kw) -> int:
        r = _post(fake_cluster, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, **kw})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    base = prompt_tokens()
    assert prompt_tokens(add_generation_prompt=False) == base - len("<assistant>")
    assert prompt_tokens(continue_final_message=True, add_generation_prompt=False) == base - len("<assistant>") - 1
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ extra }}"
    assert prompt_tokens(chat_template=template) == len("hihel")
    assert prompt_tokens(chat_template=template, chat_template_kwargs={"extra": "!!"}) == len("hihel!!")
    docs = "{% for d in documents %}{{ d['text'] }}{% endfor %}"
    assert prompt_tokens(chat_template=docs, documents=[{"title": "t", "text": "abc"}]) == 3


def test_add_special_tokens_reaches_the_tokenizer():
    from services.frontend.completions import prepare
    from services.frontend.tokenizer import ByteTokenizer

    seen = []

    class Recording(ByteTokenizer):
        def encode(self, text, add_special_tokens=False):
            seen.append(add_special_tokens)
            return [1] + super().encode(text) if add_special_tokens else super().encode(text)

    a = prepare(CompletionRequest(prompt="hi"), Recording(), 64)
    b = prepare(CompletionRequest(prompt="hi", add_special_tokens=False), Recording(), 64)
    assert seen == [True, False] and a.prompts[0] == [1, *b"hi"] and b.prompts[0] == list(b"hi")


def test_parallel_tool_calls_bound_the_calls():
    from services.frontend.tools import plan

    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})
    for parallel, bound in ((True, None), (False, 1)):
        _, grammar = plan(body.tools, body.tool_choice, parallel)
        assert json.loads(grammar.spec).get("maxItems") == bound


def test_a_stored_responses_metadata_and_truncation(fake_cluster):
    """metadata is kept with the stored response; truncation takes only "disabled" (what Ferry does)."""
    r = _post(fake_cluster, "/v1/responses", {"input": "x", "max_output_tokens": 2, "metadata": {"run": "7"}})
    assert r.status_code == 200, r.text
    got = httpx.get(f"{fake_cluster.url}/v1/responses/{r.json()['id']}", timeout=10).json()
    assert got["metadata"] == {"run": "7"}
    assert _post(fake_cluster, "/v1/responses", {"input": "x", "max_output_tokens": 2,
                                                 "truncation": "disabled"}).status_code == 200
    bad = _post(fake_cluster, "/v1/responses", {"input": "x", "truncation": "auto"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncation"
