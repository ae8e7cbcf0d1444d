"""The request bodies of /v1/completions and /v1/chat/completions (pydantic):
OpenAI's fields and vLLM's extras. Nothing is accepted and ignored: every
field below is either honoured (``HONOURED``: its effect is tested in
tests/frontend/test_fields.py) or refused with a 400 naming it when set to
anything but its default (``refused``: the reason is the error's message);
a field the models do not name is refused too (``extra="forbid"``)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from libs.common.validation import MAX_LOGPROBS, stops_problem

INT32_MAX = 2**31 - 1  # what crosses to the instances travels as protobuf int32
# A program id (prompt_cache_key, the x-session-id header): at most this many characters.
PROGRAM_ID_MAX = 256


def _unicode(v: str) -> str:
    """JSON may escape a lone surrogate ("\\ud800"): valid JSON, no text. It
    cannot be tokenized (the tokenizer raised a TypeError: a 500), nor sent
    on as protobuf (strings are UTF-8): refused here, naming the field."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text is not valid Unicode ({e.reason} at position {e.start})") from None
    return v


Text = Annotated[str, AfterValidator(_unicode)]


def refused(why: str, default: Any = None, allowed: tuple = ()):
    """A field Ferry does not do: a value other than ``default`` (or one of
    ``allowed``, which mean the same) is a 400 naming the field, saying ``why``."""
    return Field(default=default, json_schema_extra={"ferry_refused": why, "ferry_allowed": list(allowed)})


def refusals(model: type[BaseModel]) -> dict[str, str]:
    """field -> why, for the model's refused fields."""
    return {name: f.json_schema_extra["ferry_refused"] for name, f in model.model_fields.items()
            if isinstance(f.json_schema_extra, dict) and "ferry_refused" in f.json_schema_extra}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="after")
    @classmethod
    def _refuse(cls, v, info: ValidationInfo):
        f = cls.model_fields.get(info.field_name)
        extra = f.json_schema_extra if f is not None else None
        if isinstance(extra, dict) and "ferry_refused" in extra and v != f.default and v not in extra["ferry_allowed"]:
            raise ValueError(f"not supported: {extra['ferry_refused']}")
        return v


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk


class JsonSchema(_Body):
    name: Text = "schema"
    description: Text | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(_Body):
    """vLLM's structured_outputs: exactly one of these."""

    json_: dict | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Text | None = refused("a custom whitespace pattern is not supported by Ferry's grammars")
    structural_tag: Text | None = refused("structural tags are not supported")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _Common(_Body):
    model: Text | None = None
    max_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=INT32_MAX)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: Literal["high", "normal"] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[Text] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = refused("this model's tokenizer (a fast one) has no such choice",
                                                  default=True)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    truncate_prompt_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    # vLLM's extension: the completion's token ids too (in Ferry's `ferry` object of the last chunk).
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    # Who asked (OpenAI's end-user ids): logged with the request.
    user: Text | None = None
    safety_identifier: Text | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    guided_decoding_backend: Literal["xgrammar", "auto"] | None = None
    guided_whitespace_pattern: Text | None = refused("a custom whitespace pattern is not supported")
    best_of: int | None = refused("best_of is not supported (vLLM's V1 refuses it too); use n", allowed=(1,))
    use_beam_search: bool = refused("beam search is not supported", default=False)
    length_penalty: float = refused("length_penalty applies to beam search, which is not supported", default=1.0)
    cache_salt: Text | None = refused("prefix-cache salts are not supported")
    request_id: Text | None = refused("the request id is the frontend's own (the response's id)")
    metadata: dict | None = refused("metadata is kept only with stored objects: use the Responses API (store)")
    service_tier: Literal["auto", "default"] | None = None  # the one tier Ferry has
    # OpenAI's cache routing key: here it names the program (an agent's
    # session) the request is a turn of, carried to dispatch and the instance
    # (completions.program_of; it wins over the x-session-id header).
    prompt_cache_key: Text | None = Field(default=None, min_length=1, max_length=PROGRAM_ID_MAX)
    kv_transfer_params: dict | None = refused("KV transfer parameters are Ferry's own business")

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        for k in v or {}:
            if not k.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {k!r}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        problem = stops_problem([v] if isinstance(v, str) else v or [])
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("guided_json", mode="before")
    @classmethod
    def _json_text(cls, v):
        if isinstance(v, str):
            try:
                json.loads(v)
            except ValueError as e:
                raise ValueError(f"not a JSON schema: {e}") from None
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Common):
    prompt: Text | list[int] | list[Text] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = Field(default=16, ge=0, le=INT32_MAX)
    add_special_tokens: bool = True
    suffix: Text | None = refused("suffix (fill-in-the-middle) is not supported by the served model")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if any(isinstance(p, (str, list)) and not p for p in v):
                raise ValueError("a prompt of the batch is empty")
        elif v == "":
            raise ValueError("prompt must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The batch: one prompt per element (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)


class ContentPart(_Body):
    """A part of a message's content: text. An image or an audio part is a
    400 saying the served model takes text only (not dropped)."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: Text | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type not in ("text", "input_text", "output_text"):
            raise ValueError(f"content parts of type {self.type!r} are not supported: the served model takes text "
                             f"only")
        if self.text is None:
            raise ValueError("a text part needs its text")
        extra = set(self.model_extra or ())
        if extra:
            raise ValueError(f"unknown fields in a text part: {sorted(extra)}")
        return self


class FunctionCall(_Body):
    name: Text
    arguments: Text


class ToolCall(_Body):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None
    refusal: Text | None = None  # an assistant message's refusal, as OpenAI returns it
    reasoning_content: Text | None = refused("the served model does not reason")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content)
        return self.content or ""


class FunctionDefinition(_Body):
    name: Text
    description: Text | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: Text


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: Text | None = None
    chat_template_kwargs: dict | None = None
    documents: list[dict[str, Text]] | None = None
    modalities: list[Literal["text"]] | None = None
    echo: bool = refused("echo of chat messages is not supported; use /v1/completions with echo", default=False)
    store: bool = refused("stored chat completions are not supported: use the Responses API (store)", default=False)
    audio: dict | None = refused("the served model takes and makes text only")
    prediction: dict | None = refused("predicted outputs are not supported")
    web_search_options: dict | None = refused("web search is not supported")
    reasoning_effort: Text | None = refused("the served model does not reason")
    verbosity: Text | None = refused("the served model has no verbosity setting")
    functions: list | None = refused("functions is deprecated: use tools")
    function_call: Text | dict | None = refused("function_call is deprecated: use tool_choice")

    @model_validator(mode="after")
    def _chat(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.continue_final_message and self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or ()]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, not among the tools")
        if self.tool_choice in ("required",) and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")
        return self


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: list[int]


# Every field a client may set and what it does here (tests/frontend/test_fields.py
# checks each against its effect, and that every other field is refused).
HONOURED = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "n",
    "stream", "stream_options", "priority", "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words", "include_stop_str_in_output",
    "skip_special_tokens", "prompt_logprobs", "truncate_prompt_tokens",
    "return_token_ids", "return_tokens_as_token_ids", "user", "safety_identifier", "response_format",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "service_tier", "prompt_cache_key",
    # completions
    "prompt", "echo", "logprobs", "add_special_tokens",
    # chat
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs", "documents",
    "modalities",
})
