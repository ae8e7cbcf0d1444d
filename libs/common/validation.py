"""Checks of what a request asks for, shared by the frontend (HTTP 400, gRPC
INVALID_ARGUMENT) and the engines (INVALID_ARGUMENT): an id outside the
vocabulary must never reach a model (an embedding lookup out of range killed
an engine thread), nor a NaN temperature a sampler."""

from __future__ import annotations

import math
from typing import Sequence

from libs.common.types import SamplingParams


def out_of_vocab(ids: Sequence[int], vocab_size: int) -> tuple[int, int] | None:
    """(position, id) of the first id outside 0 .. vocab_size-1, or None."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return None
    return next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)


def out_of_vocab_message(what: str, ids: Sequence[int], vocab_size: int) -> str | None:
    """An error message naming the first bad id of ``what``, or None."""
    bad = out_of_vocab(ids, vocab_size)
    if bad is None:
        return None
    return (f"{what} has token id {bad[1]} at position {bad[0]}, outside the model's vocabulary "
            f"(0..{vocab_size - 1})")


MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound; vLLM's default max_logprobs
MAX_LOGIT_BIAS = 300  # OpenAI's bound on logit_bias entries
MAX_BAD_WORDS = 100


def sampling_problem(sp: SamplingParams, vocab_size: int | None = None) -> str | None:
    """What is wrong with sampling parameters (NaN and infinities included),
    or None. The one rule set for the gRPC APIs and the engines; token ids
    are checked against ``vocab_size`` where it is known."""
    if not math.isfinite(sp.temperature) or sp.temperature < 0:
        return f"temperature must be a finite number >= 0, got {sp.temperature}"
    if not math.isfinite(sp.top_p) or not 0 < sp.top_p <= 1:
        return f"top_p must be in (0, 1], got {sp.top_p}"
    if sp.top_k < 0:
        return f"top_k must be >= 0 (0 = off), got {sp.top_k}"
    if sp.max_tokens < 0 or (sp.max_tokens == 0 and sp.prompt_logprobs is None):
        return f"max_tokens must be >= 1 (0 only with prompt logprobs), got {sp.max_tokens}"
    if not 0 <= sp.min_tokens <= max(sp.max_tokens, 0):
        return f"min_tokens must be in [0, max_tokens], got {sp.min_tokens}"
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(sp, name)
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            return f"{name} must be in [0, {MAX_LOGPROBS}], got {k}"
    for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                         ("min_p", 0.0, 1.0)):
        v = getattr(sp, name)
        if not math.isfinite(v) or not lo <= v <= hi:
            return f"{name} must be in [{lo:g}, {hi:g}], got {v}"
    if not math.isfinite(sp.repetition_penalty) or not 0 < sp.repetition_penalty <= 2:
        return f"repetition_penalty must be in (0, 2], got {sp.repetition_penalty}"
    if len(sp.logit_bias) > MAX_LOGIT_BIAS:
        return f"logit_bias has at most {MAX_LOGIT_BIAS} entries, got {len(sp.logit_bias)}"
    if any(not math.isfinite(b) or not -100 <= b <= 100 for _, b in sp.logit_bias):
        return "logit_bias values must be in [-100, 100]"
    if len(sp.bad_words) > MAX_BAD_WORDS or any(not w for w in sp.bad_words):
        return f"bad_words: at most {MAX_BAD_WORDS} non-empty token sequences"
    if vocab_size:
        for what, ids in (("logit_bias", [t for t, _ in sp.logit_bias]), ("allowed_token_ids", sp.allowed_token_ids),
                          ("bad_words", [t for w in sp.bad_words for t in w]), ("stop_token_ids", sp.stop_token_ids)):
            message = out_of_vocab_message(what, ids, vocab_size)
            if message:
                return message
    return None


# A request id is copied into every status report of its instance and every
# event of its stream: bounded (ids made inside the cluster are ~40 characters).
MAX_REQUEST_ID = 128
MAX_CLIENT_REQUEST_ID = 256  # a client's own id, kept beside the frontend's


def request_id_problem(request_id: str) -> str | None:
    """What is wrong with a request id inside the cluster, or None."""
    if not request_id:
        return "request_id is empty"
    if len(request_id) > MAX_REQUEST_ID:
        return f"request_id has at most {MAX_REQUEST_ID} characters, got {len(request_id)}"
    if request_id[0] == "\x00":
        return "request_id must not start with NUL (reserved for the engine's own)"
    return None


MAX_STOPS = 4
MAX_STOP_CHARS = 256  # a stop string is matched against held-back text on every token


def stops_problem(stops: Sequence[str]) -> str | None:
    """What is wrong with a list of stop strings, or None."""
    if len(stops) > MAX_STOPS:
        return f"at most {MAX_STOPS} stop sequences, got {len(stops)}"
    long = next((s for s in stops if len(s) > MAX_STOP_CHARS), None)
    if long is not None:
        return f"a stop sequence has at most {MAX_STOP_CHARS} characters, got {len(long)}"
    return None
