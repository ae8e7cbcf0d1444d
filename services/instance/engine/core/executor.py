"""What the shared step loop delegates: the forward pass (or its stand-in) and
access to the KV storage."""

from __future__ import annotations

import abc
from dataclasses import dataclass

from libs.common.types import Logprobs
from services.instance.engine.base import EngineError, KvLayout, LayerKv
from services.instance.engine.core.request import Request
from services.instance.engine.core.scheduler import ScheduledChunk, cdiv
from services.instance.engine.shared_kv import KvShare


@dataclass(frozen=True)
class Sampled:
    """A sampled token with its log-probabilities (a request that asked for
    them, SamplingParams.logprobs); executors return plain ints otherwise."""

    token: int
    logprobs: Logprobs


class Executor(abc.ABC):
    eos_token_ids: frozenset[int] = frozenset()
    vocab_size: int = 0  # token ids 0 .. vocab_size-1
    # True where execute() calls the chunks' layer taps (Request.layer_tap)
    # and scatter_kv_layer works.
    layer_taps: bool = False

    @property
    @abc.abstractmethod
    def kv_layout(self) -> KvLayout: ...

    @abc.abstractmethod
    def execute(self, chunks: list[ScheduledChunk]) -> list[int | Sampled | None]:
        """Compute KV for every chunk (writing it into the chunk's blocks) and
        return, aligned with ``chunks``, the next token of every chunk that
        ``samples`` (None for the others): an int, or a ``Sampled`` with its
        logprobs where the request asked for them. Raise base.RequestFailed naming
        the requests when the failure is theirs; it must be raised before any
        request's sampler state (RNG) moved, so that the step can run again
        for the others with the same result."""

    def kv_share(self) -> KvShare | None:
        """See Engine.kv_share; None: the cache is not in shared memory."""
        return None

    @abc.abstractmethod
    def gather_kv(self, block_ids: list[int]) -> memoryview:
        """Fused ``[n, layers, 2, block_size, kv_heads, head_dim]`` CPU copy."""

    @abc.abstractmethod
    def scatter_kv(self, block_ids: list[int], data: bytes | memoryview) -> None: ...

    def scatter_kv_layer(self, block_ids: list[int], layer: int, data: bytes | memoryview) -> None:
        """One layer ``[n, 2, block_size, kv_heads, head_dim]`` into the blocks."""
        raise NotImplementedError

    def grow_kv(self, num_blocks: int, fresh=None, holding=None) -> None:
        """Make the KV storage hold block ids 0 .. num_blocks-1 (KunServe:
        parameter memory lent to the KV cache); ``fresh``: storage made ahead
        for it, if the executor makes any. Executors that cannot say so."""
        raise EngineError(f"{type(self).__name__} cannot grow its KV cache")

    # --- pipelined execution (KunServe; native/kunserve.py) ---------------------------
    @property
    def remote_requests(self) -> frozenset[str]:
        """Requests whose KV is partly on a pipeline peer (they cannot migrate)."""
        return frozenset()

    @property
    def pipelined(self) -> bool:
        """Whether a request that joins now runs some layers on a pipeline
        peer (which holds no KV of this engine's cached prefixes)."""
        return False

    def kv_all_here(self, request_id: str) -> bool:
        """Whether this request's KV of every layer is in this engine's blocks
        (the prefix cache names only such blocks)."""
        return True

    def release_requests(self, request_ids: list[str]) -> None:
        """These requests finished, were preempted or left: whatever a peer
        keeps for them goes."""

    def forward_guest(self, layers: range, chunks: list[ScheduledChunk], hidden):
        """Run ``layers`` for a peer's requests (this engine's guests)."""
        raise EngineError(f"{type(self).__name__} cannot run layers for a pipeline peer")

    def gather_kv_layers(self, block_ids: list[int], layers: range) -> memoryview:
        raise EngineError(f"{type(self).__name__} cannot hand KV to a pipeline peer")

    def scatter_kv_layers(self, block_ids: list[int], layers: range, data: bytes | memoryview) -> None:
        raise EngineError(f"{type(self).__name__} cannot take KV from a pipeline peer")

    def expect_context(self, num_tokens: int) -> None:
        """A hint from any thread: a request with this much context may join
        the batch soon. An executor may get buffers ready off the step path."""

    # --- per-request sampler state (native only) ----------------------------------
    def init_request(self, req: Request) -> None:
        """Called once when a request enters the engine."""

    def resume_sampler(self, req: Request, num_tokens: int) -> None:
        """A request resumed with ``num_tokens`` already delivered (by recompute,
        EngineRequest.resume_token_ids): its sampler as it was after drawing
        them, so that a seeded request goes on with the draws it would have had."""

    def rng_state(self, req: Request) -> bytes:
        return b""

    def set_rng_state(self, req: Request, state: bytes) -> None:
        """Restore the sampler state exported by rng_state (after init_request)."""


class TappedChunk:
    """A chunk whose request has a layer tap: the blocks it wrote, and the
    tap called per layer (executors share this).

    NOTE: the first chunk after a prefix-cache hit also hands over the hit
    blocks (from block 0): the tap's receiver never saw them computed."""

    def __init__(self, chunk: ScheduledChunk, block_size: int, num_layers: int):
        req = chunk.request
        self.tap, self.copy = req.layer_tap
        self.chunk = chunk
        self.num_layers = num_layers
        hit_first = chunk.start > 0 and chunk.start == req.prefix_hit_tokens
        self.first_block = 0 if hit_first else chunk.start // block_size
        self.block_ids = tuple(req.block_ids[self.first_block: cdiv(chunk.end, block_size)])

    def layer_kv(self, layer: int, data: memoryview | None) -> LayerKv:
        """What the tap gets for ``layer``, as the chunk is now (``samples``
        reads the request: build it during the step)."""
        c = self.chunk
        return LayerKv(c.request.request_id, layer, self.num_layers, self.first_block, self.block_ids,
                       c.start, c.end, c.samples, data)

    def emit(self, layer: int, data: memoryview | None) -> None:
        self.tap(self.layer_kv(layer, data))


def tapped_chunks(chunks: list[ScheduledChunk], layout: KvLayout) -> list[TappedChunk]:
    return [TappedChunk(c, layout.block_size, layout.num_layers) for c in chunks
            if c.request.layer_tap is not None and c.num_new > 0]
