"""The engine interface (docs/design.md §3).

An engine is step-based and single-threaded: the instance agent runs it in its
own thread and calls every method from that thread, between steps, except where
a method's docstring says otherwise. An engine step is the unit of time:
requests join, leave, are suspended or installed only between steps.

Three implementations share this interface: ``native`` (PyTorch, paged KV
cache), ``sim`` (same scheduler and block pool, a latency profile instead of
the forward pass) and ``fake`` (deterministic tokens, for service tests).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from libs.common.kv_events import KvEvent
from libs.common.prefix_hash import BlockHash
from libs.common.types import (
    PrefixCacheStats,
    Priority,
    RequestLoad,
    RequestState,
    SamplingParams,
    TokenOutput,
)
from services.instance.engine.shared_kv import KvShare


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    priority: Priority = Priority.NORMAL
    arrival_time: float = 0.0  # time.time() at the frontend
    # Tokens already delivered for this request by an instance that died:
    # they extend the context, count against max_tokens, and the first new
    # token has index len(resume_token_ids).
    resume_token_ids: tuple[int, ...] = ()
    # Splitwise serialized handoff: once the step that produces the first new
    # token has run (the prompt is done), take the request out of the batch
    # as suspend_request would, so that it decodes nowhere until its handoff
    # commits (drop_request) or aborts (resume_request). An engine that cannot
    # hold leaves it running; the handoff then suspends it itself.
    hold_after_prefill: bool = False
    # The program (an agent's session) it is a turn of (GenerateOrder.program_id; "" = none):
    # kept with the request, carried by its migrations, in its stats.
    program_id: str = ""
    # W3C trace headers of its caller's span (libs/common/tracing.headers(); {} when tracing is
    # off, or the engine does not trace requests: Engine.traces_requests): vLLM records its span under it.
    trace_headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class KvLayout:
    """Shape of one KV block in the fused transfer buffer
    ``[n_blocks, layers, 2, block_size, kv_heads, head_dim]``.

    ``k_transposed``: within a (block, layer) the K part is stored
    ``[kv_heads, head_dim, block_size]`` and the V part ``[kv_heads,
    block_size, head_dim]`` (the layout vLLM's CPU attention kernel reads:
    the native engine's bf16 CPU path, native/cpu_kernels.py); the bytes per
    block are the same, but blocks move only between engines that agree."""

    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    k_transposed: bool = False

    @property
    def bytes_per_block(self) -> int:
        itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[self.dtype]
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize


@dataclass(frozen=True)
class LayerKv:
    """One layer's KV for the blocks a step's chunk of a request wrote,
    handed to the request's layer tap right after that layer ran (per-layer
    KV transfer, Splitwise). Blocks are named by their index in the request's
    block table (``first_block`` ..) and by id; the chunk's first block may
    be partial from an earlier chunk and its last one partial: positions
    before ``end`` are final, later ones are written by later steps."""

    request_id: str
    layer: int
    num_layers: int
    first_block: int  # index in the request's block table of block_ids[0]
    block_ids: tuple[int, ...]
    start: int  # the chunk computed tokens start .. end-1
    end: int
    samples: bool  # the chunk reached the last known token: the prompt is done
    # CPU copy ``[n, 2, block_size, kv_heads, head_dim]`` (kv_layout dtype),
    # or None for a tap registered without data.
    data: memoryview | None = None


LayerTap = Callable[[LayerKv], None]


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of the engine's load, for status reports (docs/design.md §4).

    ``requests`` lists waiting and running requests (not suspended ones) with
    their physical blocks (with prefix caching: the blocks each holds alone;
    ``shared_blocks`` counts the others once); virtual usage is computed by
    the agent. ``free_blocks`` includes cached blocks no request uses (they
    are evictable), and a waiting request's demand is net of its cached prefix.
    """

    total_blocks: int
    free_blocks: int
    block_size: int
    requests: tuple[RequestLoad, ...] = ()
    head_of_line_demand_blocks: int = 0  # blocks the head of the waiting queue needs
    waiting_demand_blocks: int = 0  # blocks all waiting requests need
    num_preemptions: int = 0  # total since start
    reserved_blocks: int = 0  # held for incoming migrations
    # Prefix caching: blocks in use by more than one request, counted once
    # (each request's physical_blocks counts only the blocks it holds alone).
    shared_blocks: int = 0
    prefix_cache: PrefixCacheStats = PrefixCacheStats()
    # Prompt tokens running requests have yet to compute (chunked prefill).
    running_prefill_tokens: int = 0
    # Waiting requests that were preempted (to run again): vLLM 0.4's
    # num_killed_request, which llumnix-v0 pairs by.
    preempted_waiting: int = 0
    # Free blocks programs keep between turns (core/pins.py ProgramKeep), withheld from free_blocks.
    kept_blocks: int = 0


class EngineError(Exception):
    """A request the engine cannot take (bad parameters, too long)."""


class RequestFailed(EngineError):
    """Raised inside a step by an executor that can name the requests it
    cannot go on with (NaN logits, a token id the model rejects). The engine
    fails those requests alone, with ``code`` (a libs.common.errors.Code
    value) and the message, and runs the step again for the others."""

    def __init__(self, message: str, request_ids: list[str], code: str = "internal"):
        super().__init__(message)
        self.request_ids = list(request_ids)
        self.code = code


class PeerShort(EngineError):
    """A pipeline peer has not the KV blocks for this step's guests (KunServe).
    The engine preempts the step's lowest-priority, latest request and runs
    the step again without it, as it would when short of blocks itself."""


class EngineBroken(RuntimeError):
    """The engine cannot step for anyone (every request of a step fails on
    its own, step after step): the instance must stop and let its requests
    resume elsewhere."""


class IntegrityError(AssertionError):
    """The block pool's bookkeeping is inconsistent."""


class Engine(abc.ABC):
    name: str = "base"
    # Records spans of its own under each request's trace (EngineRequest.trace_headers): only
    # then does the agent make the headers (vLLM with tracing on).
    traces_requests: bool = False

    # --- static facts -------------------------------------------------------
    @property
    @abc.abstractmethod
    def block_size(self) -> int: ...

    @property
    @abc.abstractmethod
    def num_total_blocks(self) -> int: ...

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int: ...

    @property
    @abc.abstractmethod
    def kv_layout(self) -> KvLayout: ...

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Token ids this engine accepts are 0 .. vocab_size-1."""

    @property
    def model_name(self) -> str:
        return self.name

    @property
    def layer_taps(self) -> bool:
        """Whether ``tap_layers`` works here (per-layer handoffs)."""
        return False

    @property
    def no_migration(self) -> str:
        """Why this engine cannot live-migrate requests ("" = it can). The
        instance publishes it so the rescheduler leaves the instance alone.
        Default: it can if it implements ``MigrationHooks``."""
        return "" if isinstance(self, MigrationHooks) else f"the {self.name} engine has no migration hooks"

    # --- serving ------------------------------------------------------------
    @abc.abstractmethod
    def add_request(self, request: EngineRequest) -> None:
        """Queue a request. Raises EngineError if it can never run here."""

    @abc.abstractmethod
    def abort_request(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks. False if unknown."""

    @abc.abstractmethod
    def step(self) -> list[TokenOutput]:
        """Run one step; returns the tokens it produced (finished requests carry
        a finish_reason and are gone from the engine afterwards). A request
        that fails on its own ends with FinishReason.ERROR and the others go
        on; raises EngineBroken (or anything else) only when the engine
        cannot go on for anyone."""

    @abc.abstractmethod
    def has_work(self) -> bool:
        """True while any request is waiting or running."""

    @abc.abstractmethod
    def load(self) -> EngineLoad: ...

    @property
    @abc.abstractmethod
    def num_free_blocks(self) -> int: ...

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Raise IntegrityError if blocks leaked or are double-owned."""

    def request_stats(self, request_id: str) -> dict:
        """Counters of a live request (num_preemptions, preemption_loss_ms)."""
        return {}

    # --- prefix caching -------------------------------------------------------
    def take_kv_events(self) -> list[KvEvent]:
        """The prefix cache's events (libs/common/kv_events.py) since the last
        call, in order; the first call starts recording them (nothing is kept
        for nobody). Engine thread, between steps."""
        return []

    def cached_hashes(self) -> list[BlockHash]:
        """Every block hash the prefix cache holds now. Engine thread."""
        return []

    def holds_hashes(self, hashes: list[BlockHash]) -> list[BlockHash]:
        """Those of ``hashes`` the prefix cache holds now (a destination's
        answer to a pre-allocation). Any thread: a hint, the cache changes
        between steps."""
        return []

    def block_hashes(self, request_id: str) -> list[BlockHash]:
        """The prefix-cache hashes of a live request's full blocks known so
        far ([] if unknown). Any thread: a copy, possibly short."""
        return []


class MigrationHooks(abc.ABC):
    """What live migration (services/instance/migration) needs of an engine,
    an interface an engine implements besides ``Engine`` (``CoreEngine``,
    ``VllmEngine``). One that does not cannot migrate: ``Engine.no_migration``
    says so, the instance publishes it, and the rescheduler, Splitwise roles
    and drains leave it alone. Called between steps on the engine thread
    unless a method says otherwise."""

    @abc.abstractmethod
    def request_phase(self, request_id: str) -> tuple[str, int] | None:
        """("waiting"|"running"|"suspended", num_preemptions) or None if the
        request is unknown (finished or aborted)."""

    @abc.abstractmethod
    def full_blocks(self, request_id: str) -> list[int]:
        """Block ids of the request's full blocks, in order. Full blocks are
        never written again while the request keeps them."""

    @abc.abstractmethod
    def all_blocks(self, request_id: str) -> list[int]:
        """Block ids holding the request's KV (full and the partial last one)."""

    def kv_share(self) -> KvShare | None:
        """Where another process on this host can map this engine's KV cache
        (shared_kv.py), laid out as gather_kv's buffer over every block id;
        None: it cannot (migrations then send bytes). It changes when the
        cache is reallocated (grown)."""
        return None

    @abc.abstractmethod
    def gather_kv(self, block_ids: list[int]) -> memoryview:
        """Copy blocks into one contiguous CPU buffer laid out as
        ``[n, layers, 2, block_size, kv_heads, head_dim]`` (kv_layout).
        NOTE: may be called from any thread, for full blocks of a request."""

    @abc.abstractmethod
    def reserve_blocks(self, n: int) -> list[int] | None:
        """Take n free blocks for an incoming migration, keeping the admission
        watermark; None if they do not fit (an expected result, not an error)."""

    def expect_context(self, num_tokens: int) -> None:
        """A hint, from any thread: a request with this many tokens of context
        is coming in (a migration reserved its blocks here). An engine may get
        its buffers ready so that the step it joins is not slow. Default:
        nothing."""

    @abc.abstractmethod
    def scatter_kv(self, block_ids: list[int], data: bytes | memoryview) -> None:
        """Write a fused buffer into reserved blocks.
        NOTE: may be called from any thread, for reserved blocks."""

    def scatter_kv_layer(self, block_ids: list[int], layer: int, data: bytes | memoryview) -> None:
        """Write one layer's KV ``[n, 2, block_size, kv_heads, head_dim]``
        into reserved blocks (the other layers untouched).
        NOTE: may be called from any thread, for reserved blocks."""
        raise EngineError(f"the {self.name} engine cannot take per-layer KV")

    def tap_layers(self, request_id: str, tap: LayerTap | None, copy: bool = True) -> bool:
        """From the next step on, call ``tap`` on the engine thread after
        every layer of every chunk the request computes, with that layer's
        KV for the chunk's blocks (``copy``) or without it; None removes the
        tap. It goes with the request (finished, aborted, dropped). The tap
        must be quick (hand the data on). False if the request is unknown or
        this engine cannot."""
        return False

    def link_cached(self, hashes: list[BlockHash]) -> list[int]:
        """An incoming migration's first blocks that this engine's prefix
        cache holds already: the blocks of the longest cached prefix of
        ``hashes``, referenced for the migration (nothing is copied into
        them). They go into ``install_request``'s block list like reserved
        ones, or back with ``release_blocks``. Engine thread. Default: none
        (every block is copied)."""
        return []

    @abc.abstractmethod
    def release_blocks(self, block_ids: list[int]) -> None:
        """Return reserved (or linked) blocks that were never installed."""

    @abc.abstractmethod
    def suspend_request(self, request_id: str) -> bool:
        """Take a running request out of the batch, keeping its blocks and
        state. False if it is not running."""

    @abc.abstractmethod
    def resume_request(self, request_id: str) -> None:
        """Put a suspended request back into the batch (migration aborted)."""

    @abc.abstractmethod
    def export_state(self, request_id: str) -> RequestState:
        """State of a suspended request (tokens, sampling, RNG, counters).
        ``num_computed_tokens`` says how many tokens have KV in all_blocks()."""

    @abc.abstractmethod
    def install_request(self, state: RequestState, block_ids: list[int]) -> None:
        """Adopt a migrated request whose KV for ``num_computed_tokens`` tokens
        is in the reserved ``block_ids``; it runs from the next step."""

    @abc.abstractmethod
    def drop_request(self, request_id: str) -> None:
        """Forget a suspended request after its migration committed: free its
        blocks, emit nothing."""

    # A cache move (issue 53, move instead of evict): a program's kept blocks,
    # with no request attached, go to another instance's prefix cache.
    movable_programs_here = False  # whether it takes programs' kept blocks from other instances

    def movable_programs(self) -> list[tuple[str, int]]:
        """Programs whose kept blocks could move now (none in use here), the
        first to move first, with their blocks. Default: none."""
        return []

    def export_program(self, program_id: str) -> ProgramKv | None:
        """Pin ``program_id``'s kept blocks for a move (a reference each, so
        nothing evicts them while they are copied); None if none can move.
        ``end_export`` ends it."""
        return None

    def end_export(self, program_id: str, moved: bool) -> None:
        """The move ended: ``moved``, the program's hold here ends and its
        blocks are plain cache (evicted before any kept block, when room is
        needed: until then a turn sent here still finds them); else they are
        kept here as before."""
        raise EngineError(f"the {self.name} engine moves no cached blocks")

    def import_program(self, kv: ProgramKv, block_ids: list[int]) -> None:
        """A moved program's blocks, written into reserved (or linked)
        ``block_ids`` in ``kv.block_hashes``' order: named in the prefix cache
        and kept for the program as if its turn had ended here."""
        raise EngineError(f"the {self.name} engine takes no cached blocks")


@dataclass(frozen=True)
class ProgramKv:
    """A program's kept blocks on their way to another instance (a cache
    move): their prefix-cache hashes head first, the source's block ids
    (``export_program``; empty at the destination), and what its keep knew:
    seconds since its turn ended and its expected gap between turns."""

    program_id: str
    block_hashes: tuple[BlockHash, ...]
    block_ids: tuple[int, ...] = ()
    age_s: float = 0.0
    gap_s: float = 0.0


@dataclass(frozen=True)
class EngineConfig:
    """How to build an engine. Engine-specific fields are ignored by others."""

    engine: str = "fake"
    model: str = "smollm2"
    num_blocks: int | None = None
    kv_cache_gb: float | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    watermark: float = 0.01
    device: str = "cpu"
    dtype: str = "float32"
    token_delay_ms: float = 10.0  # fake engine: time per step
    # The KV cache in shared memory a destination on this host can map
    # (shared_kv.py): fake and native engines on CPU.
    share_kv: bool = True
    # Automatic prefix caching (engine/core/prefix_cache.py; vLLM's own for vllm).
    prefix_caching: bool = True
    # Continuum's TTL pinning (core/pins.py): a program's blocks stay pinned this long after its turn (0: off).
    program_ttl_s: float = 0.0
    # Keep by expected return (core/pins.py ProgramKeep): at most this fraction of the pool kept (0: off),
    # and a program's expected gap between turns before one is seen.
    program_keep: float = 0.0
    program_gap_s: float = 15.0
    profile: str = "llama-7b-a10"  # sim engine: profile name or path
    seed: int = 0
    # A request's tokens (and logprobs) bit for bit independent of its batch, cache hits,
    # chunking and recompute (native: native/batch_invariant.py; vllm: its batch-invariant mode).
    deterministic: bool = False
    # vLLM 0.4's scheduling (core/scheduler.py Scheduler): prefill-only steps of whole prompts first, then decodes.
    prefill_first: bool = False
    extra: dict = field(default_factory=dict)
