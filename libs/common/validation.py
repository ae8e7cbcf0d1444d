"""Checks of what a request asks for, shared by the frontend (HTTP 400, gRPC
INVALID_ARGUMENT) and the engines (INVALID_ARGUMENT): an id outside the
vocabulary must never reach a model (an embedding lookup out of range killed
an engine thread), nor a NaN temperature a sampler."""

from __future__ import annotations

import math
from typing import Sequence


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


def sampling_problem(temperature: float, top_p: float, top_k: int, max_tokens: int, min_tokens: int) -> str | None:
    """What is wrong with sampling parameters (NaN and infinities included),
    or None. The one rule set for the gRPC APIs and the engines."""
    if not math.isfinite(temperature) or temperature < 0:
        return f"temperature must be a finite number >= 0, got {temperature}"
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        return f"top_p must be in (0, 1], got {top_p}"
    if top_k < 0:
        return f"top_k must be >= 0 (0 = off), got {top_k}"
    if max_tokens < 1:
        return f"max_tokens must be >= 1, got {max_tokens}"
    if not 0 <= min_tokens <= max_tokens:
        return f"min_tokens must be in [0, max_tokens], got {min_tokens}"
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
