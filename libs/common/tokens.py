"""Token-id checks shared by the frontend (HTTP 400) and the engines (gRPC
INVALID_ARGUMENT): an id outside the vocabulary must never reach a model
(an embedding lookup out of range kills the engine thread)."""

from __future__ import annotations

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
