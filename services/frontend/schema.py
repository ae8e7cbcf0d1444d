"""The OpenAI request bodies Ferry accepts (pydantic), with Ferry's extras
(priority, top_k, ignore_eos, min_tokens) as vLLM accepts them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from libs.common.validation import stops_problem

INT32_MAX = 2**31 - 1  # what crosses to the instances travels as protobuf int32


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


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Text | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=INT32_MAX)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: Text | list[Text] | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | bool | None = None
    priority: Literal["high", "normal"] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    # vLLM's extension: the completion's token ids too (in Ferry's `ferry` object of the last chunk).
    return_token_ids: bool = False
    user: Text | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v):
        if v:  # token ids the engine would have to check and apply: refused, not ignored
            raise ValueError("logit_bias is not supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        problem = stops_problem([v] if isinstance(v, str) else v or [])
        if problem:
            raise ValueError(problem)
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Common):
    prompt: Text | list[int] | list[Text]
    echo: bool = False
    max_tokens: int | None = Field(default=16, ge=1, le=INT32_MAX)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], str):
                if len(v) != 1:
                    raise ValueError("batched prompts are not supported; send one prompt per request")
        elif v == "":
            raise ValueError("prompt must not be empty")
        return v


class ContentPart(BaseModel):
    """A part of a chat message's content: text parts only (an image or an
    audio part would be silently dropped otherwise)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
