"""From a validated OpenAI body to text: tokenization, limits, sampling
parameters, and the text stream (detokenization + stop strings)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from libs.common.errors import InvalidArgument
from libs.common.validation import out_of_vocab_message
from libs.common.types import Priority, SamplingParams
from services.frontend import metrics
from services.frontend.generation import Generation, run_generation
from services.frontend.router import Router
from services.frontend.schema import ChatCompletionRequest, CompletionRequest
from services.frontend.stops import StopMatcher
from services.frontend.tokenizer import Tokenizer


@dataclass
class Prepared:
    gen: Generation
    stops: list[str]
    created: int
    kind: str  # "completion" | "chat"


def parse_priority(body_value: str | None, header_value: str | None) -> Priority:
    value = body_value or header_value
    try:
        return Priority.parse(value)
    except ValueError as e:
        raise InvalidArgument(str(e), param="priority") from e


def check_token_ids(ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    """A 400 naming the first id outside the model's vocabulary: such an id
    must never reach an engine."""
    message = out_of_vocab_message(param, ids, vocab_size)
    if message:
        raise InvalidArgument(message, param=param)


def prepare(body: CompletionRequest | ChatCompletionRequest, tokenizer: Tokenizer, max_model_len: int,
            priority_header: str | None = None, vocab_size: int | None = None) -> Prepared:
    """``vocab_size``: the served model's (default: the tokenizer's)."""
    if body.n != 1:
        raise InvalidArgument("n > 1 is not supported; send one request per completion", param="n")
    if body.logprobs:
        raise InvalidArgument("logprobs are not supported", param="logprobs")
    if isinstance(body, ChatCompletionRequest):
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt_ids = tokenizer.apply_chat_template(messages)
        except Exception as e:  # noqa: BLE001 - the template is a program over the client's messages
            # (SmolLM2's raises on some role orders): its refusal is the request's problem
            raise InvalidArgument(f"the model's chat template cannot format these messages: {e}",
                                  param="messages") from e
        max_tokens = body.max_completion_tokens or body.max_tokens
        kind = "chat"
    else:
        if body.echo:
            raise InvalidArgument("echo is not supported", param="echo")
        p = body.prompt
        if isinstance(p, list) and isinstance(p[0], int):
            prompt_ids = list(p)
            check_token_ids(prompt_ids, vocab_size or tokenizer.vocab_size)
        else:
            prompt_ids = tokenizer.encode(p[0] if isinstance(p, list) else p)
        max_tokens = body.max_tokens
        kind = "completion"
    n_prompt = len(prompt_ids)
    if n_prompt >= max_model_len:
        raise InvalidArgument(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{n_prompt} tokens. Shorten the prompt.", param="prompt" if kind == "completion" else "messages")
    if max_tokens is None:
        max_tokens = max_model_len - n_prompt
    if n_prompt + max_tokens > max_model_len:
        raise InvalidArgument(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the completion). "
            f"Reduce the prompt or max_tokens.", param="max_tokens")
    if body.min_tokens > max_tokens:
        raise InvalidArgument("min_tokens must not exceed max_tokens", param="min_tokens")
    sampling = SamplingParams(
        temperature=body.temperature, top_p=body.top_p, top_k=max(0, body.top_k), seed=body.seed,
        max_tokens=max_tokens, ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
    )
    priority = parse_priority(body.priority, priority_header)
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    gen = Generation(f"{prefix}-{uuid.uuid4().hex}", prompt_ids, sampling, priority)
    return Prepared(gen, body.stop_list(), int(time.time()), kind)


async def text_stream(router: Router, tokenizer: Tokenizer, prep: Prepared,
                      max_resumes: int = 3) -> AsyncIterator[str]:
    """Text deltas of the completion; sets prep.gen.finish_reason at the end.
    The first token always yields, even when it makes no text yet (an
    incomplete character, a held-back stop prefix): a stream starts with its
    first token. Stops early (finish_reason "stop") on a stop string, which
    cancels the instance call and so aborts the request there."""
    gen = prep.gen
    detok = tokenizer.detokenizer(gen.prompt_ids)
    stops = StopMatcher(prep.stops)
    metrics.IN_FLIGHT.inc()
    try:
        first = True
        async for token_id in run_generation(router, gen, max_resumes):
            metrics.TOKENS.inc()
            text = stops.feed(detok.add(token_id))
            if text or first:
                yield text
            first = False
            if stops.stopped:
                gen.finish_reason = "stop"
                return
        tail = stops.feed(detok.flush())
        if stops.stopped:
            gen.finish_reason = "stop"
        tail += stops.flush()
        if tail:
            yield tail
    finally:
        metrics.IN_FLIGHT.dec()
        metrics.E2E.observe(time.perf_counter() - gen.arrival)


def usage(gen: Generation) -> dict:
    n_prompt = len(gen.prompt_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": len(gen.delivered),
            "total_tokens": n_prompt + len(gen.delivered)}
