"""A request inside an engine: its tokens, how many have KV (vLLM v1 style
``num_computed_tokens`` vs ``num_tokens``), its blocks and its counters."""

from __future__ import annotations

import enum
import time

from libs.common.prefix_hash import ROOT, BlockHash, extend_hashes
from libs.common.types import FinishReason, Priority, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SUSPENDED = "suspended"
    FINISHED = "finished"


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        priority: Priority = Priority.NORMAL,
        arrival_time: float = 0.0,
        output_token_ids: list[int] | None = None,
        seq: int = 0,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        # Tokens resumed from a dead instance or migrated count as output:
        # they extend the context and count against max_tokens.
        self.output_token_ids: list[int] = list(output_token_ids or ())
        self.sampling = sampling
        self.priority = Priority(priority)
        self.arrival_time = arrival_time or time.time()
        self.seq = seq  # engine-local arrival order (ties in arrival_time)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        # Prefix caching: the hashes of its full blocks (prefix_hash.py), made
        # as they are needed; how many of its first blocks are known to the
        # cache (hit at admission, or named once computed); its last hit.
        self.block_hashes: list[BlockHash] = []
        self.num_cached_blocks = 0
        self.prefix_hit_tokens = 0
        # of the prompt, served from cache at the admission that gave its first token (-1: none yet)
        self.cached_prompt_tokens = -1
        self.program_id = ""  # the program (agent session) it is a turn of (EngineRequest.program_id)
        # The parent of its first block: prefix_hash.chain_root(salt) of
        # whatever else changes the KV (none today: one root for all).
        self.hash_root: BlockHash = ROOT
        self.generator = None  # per-request RNG (native sampler), exportable
        # The structured output's matcher (native: grammar.py), built from the
        # grammar and the output so far wherever the request runs; ``done``:
        # the grammar is complete, the request stops (Engine._stop_reason).
        self.grammar_matcher = None
        self.grammar_done = False
        # SamplingParams.prompt_logprobs: by prompt position (1 ..), as the
        # chunks compute them; sent once, with the first output.
        self.prompt_logprobs: dict[int, object] = {}
        self.prompt_logprobs_sent = False
        # counters
        self.first_token_time = 0.0
        self.num_preemptions = 0
        self.preemption_loss_ms = 0.0
        self.num_migrations = 0
        self.extra: dict = {}
        self.hold_after_prefill = False  # Splitwise: suspend after the first new token (EngineRequest)
        # (tap, copy) while a per-layer KV transfer watches it (Engine.tap_layers)
        self.layer_tap = None
        self._preempted_at = 0.0
        self._recompute_target = 0
        self.finish_reason: FinishReason | None = None

    # --- sizes ----------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    def tokens(self, start: int, end: int) -> list[int]:
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def full_block_hashes(self, block_size: int, n: int | None = None) -> list[BlockHash]:
        """The hashes of its first ``n`` full blocks (default: every full block)."""
        n_full = self.num_tokens // block_size if n is None else n
        if len(self.block_hashes) < n_full:
            extend_hashes(self.block_hashes, self.all_token_ids[: n_full * block_size], block_size, self.hash_root)
        return self.block_hashes[:n_full]

    @property
    def sort_key(self) -> tuple:
        """Waiting-queue order: higher priority first, then arrival."""
        return (-int(self.priority), self.arrival_time, self.seq)

    # --- preemption accounting --------------------------------------------------
    def on_preempted(self, now: float) -> None:
        self.num_preemptions += 1
        if not self._preempted_at:  # preempted again before recovering: one span
            self._preempted_at = now
            self._recompute_target = max(self._recompute_target, self.num_computed_tokens)
        self.num_computed_tokens = 0
        self.num_cached_blocks = 0
        self.status = RequestStatus.WAITING

    def on_computed(self, now: float) -> None:
        """After a step: close the preemption-loss span once the recompute
        caught up with where the request was when it was preempted."""
        if self._preempted_at and self.num_computed_tokens >= self._recompute_target:
            self.preemption_loss_ms += (now - self._preempted_at) * 1000.0
            self._preempted_at = 0.0
            self._recompute_target = 0

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens}, blocks={self.block_ids})")
