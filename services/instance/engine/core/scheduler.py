"""Continuous batching without phases (vLLM v1): every request has
``num_computed_tokens`` and ``num_tokens`` and a step closes part of the gap
under a token budget. Prompts longer than the budget are prefilled in chunks.

Policy:
- running requests first, in admission order; a running request that needs a
  block when none is free preempts (by recompute) the running request with the
  lowest priority and the latest arrival — possibly itself;
- then the waiting queue, ordered by priority (HIGH first) then arrival; the
  head is admitted when all its blocks fit above the watermark, else it waits
  (no skipping ahead: FCFS within a priority);
- nothing new is admitted in a step that preempted.

Prefix caching: a request admitted with no KV starts at its longest cached
prefix (whole blocks, and never its last token: the step must compute at
least one token to sample); its demand is the blocks it still needs plus
the evictable ones its hit takes off the free count.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.instance.engine.core.block_pool import BlockPool
from services.instance.engine.core.request import Request, RequestStatus


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # num_computed_tokens before the step
    num_new: int  # tokens whose KV this step computes

    @property
    def end(self) -> int:
        return self.start + self.num_new

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the last known token: the step samples."""
        return self.end == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new for c in self.chunks)


class Scheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 clock: Callable[[], float] = time.time, prefill_first: bool = False):
        """``prefill_first``: vLLM 0.4's scheduling (``_schedule_prefills``
        before ``_schedule_running`` in its Scheduler._schedule_default): a
        step admits waiting requests with their whole prompts and runs no
        decode; only a step that admits nobody decodes. Otherwise (vLLM's
        chunked prefill) the running requests go first and prompts fill the
        rest of the budget in chunks."""
        self.pool = pool
        self.prefill_first = prefill_first
        # Most prompt tokens of one request in one step (0: the budget alone). The native engine's
        # deterministic mode sets it: its attention kernel is row-invariant only up to a chunk length.
        self.max_chunk_tokens = 0
        self.clock = clock
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []  # admission order
        self.num_preemptions = 0
        self.num_admitted = 0  # requests that joined the running batch, since start
        # Whether a cached prefix may be reused now (the engine turns it off
        # while layers run on a pipeline peer, which lacks the cached KV).
        self.prefix_reuse = True

    # --- queues -------------------------------------------------------------
    def add_waiting(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        keys = [r.sort_key for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, req.sort_key), req)

    def add_running(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.num_admitted += 1

    def remove(self, req: Request) -> None:
        """Take a request out of whichever queue holds it (blocks untouched)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def blocks_needed(self, req: Request, num_tokens: int) -> int:
        return max(0, cdiv(num_tokens, self.block_size) - len(req.block_ids))

    def prefix_hit(self, req: Request) -> list[int]:
        """The cached blocks a request with no KV would start from."""
        if (req.block_ids or req.num_computed_tokens or not self.prefix_reuse or not self.pool.caching
                or req.sampling.prompt_logprobs is not None):  # NOTE: its prompt is computed whole (vLLM)
            return []
        return self.pool.lookup(req.full_block_hashes(self.block_size, (req.num_tokens - 1) // self.block_size))

    def demand_blocks(self, req: Request, hit: list[int] | None = None) -> int:
        """Free blocks a waiting request takes when admitted: its whole
        context less its cached prefix, plus the hit blocks that are free
        (evictable) now."""
        if hit is None:
            hit = self.prefix_hit(req)
        return self.blocks_needed(req, req.num_tokens) - len(hit) + self.pool.num_evictable_of(hit)

    def _start_from_cache(self, req: Request, hit: list[int]) -> None:
        """Admission of a request with no KV: count the query, take the hit."""
        if req.block_ids or req.num_computed_tokens:
            return
        if self.pool.caching:
            stats = self.pool.cache.stats
            if req.num_preemptions:
                stats.preempted_queries += req.num_tokens
                stats.preempted_hits += len(hit) * self.block_size
            else:
                stats.requests += 1
                stats.queries += req.num_tokens
                stats.hits += len(hit) * self.block_size
        req.prefix_hit_tokens = len(hit) * self.block_size
        if req.cached_prompt_tokens < 0 or not req.output_token_ids:  # until its first token: this admission's
            req.cached_prompt_tokens = min(req.prefix_hit_tokens, len(req.prompt_token_ids))
        if hit:
            self.pool.touch(hit)
            req.block_ids = list(hit)
            req.num_computed_tokens = req.prefix_hit_tokens
            req.num_cached_blocks = len(hit)

    # --- policy ---------------------------------------------------------------
    def pick_victim(self) -> Request:
        """Lowest priority first, then the latest arrival."""
        return min(self.running, key=lambda r: (int(r.priority), -r.arrival_time, -r.seq))

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.on_preempted(self.clock())
        self.num_preemptions += 1
        self.add_waiting(req)

    def schedule(self) -> SchedulerOutput:
        chunk_prompts = not self.prefill_first
        if self.prefill_first:
            out, too_long = self._schedule_prompts()
            if out.chunks:
                return out
            chunk_prompts = too_long
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: dict[str, ScheduledChunk] = {}

        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING or budget <= 0:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, self._chunk_limit(budget))
            if n <= 0:
                continue
            need = self.blocks_needed(req, req.num_computed_tokens + n)
            while need and not self.pool.can_allocate(need):  # most decode steps need no block
                victim = self.pick_victim()
                self.preempt(victim)
                out.preempted.append(victim)
                dropped = scheduled.pop(victim.request_id, None)
                if dropped is not None:
                    budget += dropped.num_new
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            if need:
                req.block_ids += self.pool.allocate(need)
            scheduled[req.request_id] = ScheduledChunk(req, req.num_computed_tokens, n)
            budget -= n

        if not out.preempted and chunk_prompts:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                hit = self.prefix_hit(req)
                if not self.pool.can_allocate(self.demand_blocks(req, hit), keep_watermark=True):
                    break
                self._admit(req, hit)
                n = min(req.num_tokens - req.num_computed_tokens, self._chunk_limit(budget))
                scheduled[req.request_id] = ScheduledChunk(req, req.num_computed_tokens, n)
                budget -= n

        out.chunks = list(scheduled.values())
        return out

    def _chunk_limit(self, budget: int) -> int:
        """Most prompt tokens one request computes in a step with ``budget`` left."""
        return min(budget, self.max_chunk_tokens or budget)

    def _admit(self, req: Request, hit: list[int]) -> None:
        """The head of the queue joins the running batch: its cached prefix taken, its blocks allocated."""
        self.waiting.pop(0)
        self._start_from_cache(req, hit)
        req.block_ids += self.pool.allocate(self.blocks_needed(req, req.num_tokens))
        self.add_running(req)

    def _schedule_prompts(self) -> tuple[SchedulerOutput, bool]:
        """A prefill-only step (``prefill_first``): the head of the queue and
        those after it while their whole prompts (net of a cached prefix) fit
        the token budget, the blocks (with the watermark) and the batch.
        Returns it, and whether the head's prompt alone is longer than the
        budget: that one is computed in chunks beside the decodes, as without
        the mode (vLLM 0.4 refused it; its budget was at least the context
        length)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hit = self.prefix_hit(req)
            n = req.num_tokens - max(req.num_computed_tokens, len(hit) * self.block_size)
            if n > self._chunk_limit(budget):
                return out, not out.chunks
            if not self.pool.can_allocate(self.demand_blocks(req, hit), keep_watermark=True):
                break
            self._admit(req, hit)
            n = req.num_tokens - req.num_computed_tokens
            out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
        return out, False
