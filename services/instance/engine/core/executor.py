"""What the shared step loop delegates: the forward pass (or its stand-in) and
access to the KV storage."""

from __future__ import annotations

import abc

from services.instance.engine.base import KvLayout
from services.instance.engine.core.request import Request
from services.instance.engine.core.scheduler import ScheduledChunk


class Executor(abc.ABC):
    eos_token_ids: frozenset[int] = frozenset()
    vocab_size: int = 0  # token ids 0 .. vocab_size-1

    @property
    @abc.abstractmethod
    def kv_layout(self) -> KvLayout: ...

    @abc.abstractmethod
    def execute(self, chunks: list[ScheduledChunk]) -> list[int | None]:
        """Compute KV for every chunk (writing it into the chunk's blocks) and
        return, aligned with ``chunks``, the next token of every chunk that
        ``samples`` (None for the others). Raise base.RequestFailed naming
        the requests when the failure is theirs; it must be raised before any
        request's sampler state (RNG) moved, so that the step can run again
        for the others with the same result."""

    @abc.abstractmethod
    def gather_kv(self, block_ids: list[int]) -> memoryview:
        """Fused ``[n, layers, 2, block_size, kv_heads, head_dim]`` CPU copy."""

    @abc.abstractmethod
    def scatter_kv(self, block_ids: list[int], data: bytes | memoryview) -> None: ...

    # --- per-request sampler state (native only) ----------------------------------
    def init_request(self, req: Request) -> None:
        """Called once when a request enters the engine."""

    def rng_state(self, req: Request) -> bytes:
        return b""

    def set_rng_state(self, req: Request, state: bytes) -> None:
        """Restore the sampler state exported by rng_state (after init_request)."""
