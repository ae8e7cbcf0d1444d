"""Whose fault a failed step is. When every request of a step failed, the
engine runs a canary (a two-token greedy prompt of its own, in a block of its
own) through the executor: if the canary runs, the requests were the poison
and fail alone while the engine goes on; if it fails too, the engine is
broken. Without it, four requests that each fail on their own (a sampling
value that overflowed) looked like a broken engine and took the instance
down, then the next one they were resumed on."""

from __future__ import annotations

from libs.common.types import SamplingParams
from services.instance.engine.core.request import Request
from services.instance.engine.core.scheduler import ScheduledChunk

CANARY_ID = "\x00ferry-canary"  # NUL first: no request id a client can send (ids are checked at the edges)


def executor_works(executor, pool) -> bool | None:
    """True if the executor runs a known-good chunk, False if it fails, None
    when there is no free block to try it in (the caller decides alone)."""
    blocks = 1 if executor.kv_layout.block_size >= 2 else 2
    if not pool.can_allocate(blocks):
        return None
    vocab = max(1, executor.vocab_size)
    canary = Request(CANARY_ID, [1 % vocab, 2 % vocab], SamplingParams(max_tokens=1), arrival_time=1.0)
    canary.block_ids = pool.allocate(blocks)
    try:
        executor.init_request(canary)
        executor.execute([ScheduledChunk(canary, 0, 2)])
        return True
    except Exception:  # noqa: BLE001 - any failure of a known-good chunk is the engine's
        return False
    finally:
        executor.release_requests([CANARY_ID])
        pool.free(canary.block_ids)
