"""Plain dataclasses shared by services. Generated protobuf types stay at the
service edge; cores work on these (conversion lives in libs/common/convert.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Priority(enum.IntEnum):
    """Scheduling priority; higher is served first."""

    NORMAL = 0
    HIGH = 1

    @classmethod
    def parse(cls, value: str | int | None) -> "Priority":
        if value is None or value == "":
            return cls.NORMAL
        if isinstance(value, int):
            return cls(value)
        try:
            return cls[value.strip().upper()]
        except KeyError:
            names = ", ".join(p.name.lower() for p in cls)
            raise ValueError(f"unknown priority {value!r}; expected one of: {names}") from None


class Role(str, enum.Enum):
    """What an instance runs (Splitwise, docs/design.md §8.1): ``mixed`` runs a request
    from prompt to end; ``prefill`` runs prompts and hands each request's KV to
    a ``decode`` instance on the migration path once its first token is out."""

    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"

    @classmethod
    def parse(cls, value: "str | Role | None") -> "Role":
        if value is None or value == "":
            return cls.MIXED
        if isinstance(value, Role):
            return value
        try:
            return cls(value.strip().lower())
        except ValueError:
            names = ", ".join(r.value for r in cls)
            raise ValueError(f"unknown instance role {value!r}; expected one of: {names}") from None

    @property
    def prefills(self) -> bool:
        return self is not Role.DECODE

    @property
    def decodes(self) -> bool:
        return self is not Role.PREFILL


# A temperature below this samples greedily (vLLM's _SAMPLING_EPS): dividing
# logits by a smaller one overflows float32 (1e-45 made every row NaN and
# killed the engine thread that sampled it).
GREEDY_TEMPERATURE = 1e-5


class GrammarKind(str, enum.Enum):
    """What a structured output's ``spec`` is (vLLM's structured_outputs names)."""

    JSON = "json"  # a JSON schema (its text)
    JSON_OBJECT = "json_object"  # any JSON object (no spec)
    REGEX = "regex"
    CHOICE = "choice"  # one of the strings of a JSON list
    GRAMMAR = "grammar"  # an EBNF grammar (GBNF), as xgrammar and llama.cpp write them


@dataclass(frozen=True)
class Grammar:
    """A structured output: the engine masks every token the grammar does not
    allow next (native: xgrammar; vllm: its own backend)."""

    kind: GrammarKind
    spec: str = ""
    # JSON schemas: no properties beyond the schema's (OpenAI's strict, xgrammar's strict_mode).
    strict: bool = True
    compact: bool = False  # JSON without whitespace between its tokens (vLLM's disable_any_whitespace)


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler, as vLLM defines each field. Every
    field moves with a migration, a handoff and a resume; what the sampler
    derives from the tokens so far (penalty counts, the grammar's state) is
    rebuilt from them wherever the request runs."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16  # 0: the prompt only (its prompt_logprobs), no token sampled
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    # Log-probabilities of each output token and of the ``logprobs`` most likely
    # ones (None: none); vLLM's definition: the model's log-softmax before any
    # sampling parameter. Cost only where asked for.
    logprobs: int | None = None
    # The same for every prompt token but the first (None: none); such a
    # request is computed whole, not from a cached prefix (as vLLM).
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0  # minus this for every token the output has
    frequency_penalty: float = 0.0  # minus this times how often the output has it
    repetition_penalty: float = 1.0  # tokens of the prompt or output: logit / p if > 0, else x p
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    allowed_token_ids: tuple[int, ...] = ()  # only these (empty: any)
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences never completed
    grammar: Grammar | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes the logits before the draw (penalties,
        biases, masks, a grammar): requests without take the plain path."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.allowed_token_ids or self.bad_words or self.grammar is not None)


@dataclass(frozen=True)
class Logprobs:
    """One output token's log-probabilities (SamplingParams.logprobs)."""

    logprob: float  # the chosen token's
    top: tuple[tuple[int, float], ...] = ()  # the most likely (token id, logprob), best first


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"  # this request failed alone (TokenOutput.error says why); the engine goes on


@dataclass(frozen=True)
class TokenOutput:
    """One token produced by an engine step for one request."""

    request_id: str
    index: int  # position in the output, 0-based
    token_id: int | None  # None on a final output that carries no token (an error)
    finish_reason: FinishReason | None = None
    # Counters of the request (num_preemptions, preemption_loss_ms, …), set
    # by engines on the final output.
    stats: dict | None = None
    # With FinishReason.ERROR: (libs.common.errors.Code value, message).
    error: tuple[str, str] | None = None
    logprobs: Logprobs | None = None  # when the request asked for them (SamplingParams.logprobs)
    # With SamplingParams.prompt_logprobs, on the request's first output: one per prompt token.
    prompt_logprobs: tuple[Logprobs | None, ...] | None = None


class RequestPhase(str, enum.Enum):
    """Where a request is on its instance: queued, in the running batch,
    leaving by migration, or held (suspended) for a migration's commit. A
    ``str`` enum: equal to its value, the name on the wire and in JSON."""

    WAITING = "waiting"
    RUNNING = "running"
    MIGRATING = "migrating"
    SUSPENDED = "suspended"


@dataclass(frozen=True)
class RequestLoad:
    request_id: str
    priority: Priority
    state: RequestPhase  # WAITING, RUNNING or MIGRATING
    physical_blocks: int
    num_tokens: int
    virtual_usage: float = 0.0


@dataclass(frozen=True)
class InstanceInfo:
    instance_id: str
    address: str
    engine: str
    model: str
    block_size: int
    total_blocks: int
    max_model_len: int
    started_at_ms: int = 0
    vocab_size: int = 0  # token ids 0 .. vocab_size-1; 0 = not reported
    no_migration: str = ""  # why it cannot live-migrate ("" = it can); the rescheduler leaves it out


@dataclass(frozen=True)
class PrefixCacheStats:
    """An instance's prefix cache: counters since its start (``queries`` and
    ``hits`` in tokens, vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``:
    a request admitted with N tokens whose cached prefix covers H counts N
    and H; a preempted request admitted again counts in ``preempted_*``)
    and its size now (``cached_blocks`` named blocks, in use or free;
    ``evictable_blocks`` of them free, counted as free everywhere)."""

    enabled: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    evictions: int = 0
    cached_blocks: int = 0
    evictable_blocks: int = 0
    # Preempted requests admitted again count here, not above (vLLM's split).
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True)
class InstanceStatus:
    instance_id: str
    seq: int = 0
    timestamp: float = 0.0
    total_blocks: int = 0
    free_blocks: int = 0
    block_size: int = 16
    num_running: int = 0
    num_waiting: int = 0
    head_of_line_demand_blocks: int = 0
    virtual_usage: float = 0.0
    freeness: float = 0.0
    normal_freeness: float = 0.0
    terminating: bool = False
    num_preemptions: int = 0
    migrating_in: int = 0
    migrating_out: int = 0
    requests: tuple[RequestLoad, ...] = ()
    used_blocks: int = 0
    waiting_demand_blocks: int = 0
    running_prefill_tokens: int = 0  # prompt tokens running requests have yet to compute (chunked prefill)
    engine_steps: int = 0  # steps run since start (progress, for the frontend's stall check)
    role: Role = Role.MIXED  # Splitwise: which phases this instance runs
    unschedulable: bool = False  # its engine is stuck in a step (services/instance/hang.py)
    prefix_cache: PrefixCacheStats = PrefixCacheStats()
    shared_blocks: int = 0  # in use by more than one request, counted once
    preempted_waiting: int = 0  # waiting requests that were preempted (llumnix-v0's sources)
    # Free blocks programs keep between turns (keep by expected return), withheld from free_blocks:
    # what a cache move (llumnix-move) can take elsewhere before admission here evicts it.
    kept_blocks: int = 0


@dataclass(frozen=True)
class InstanceRecord:
    info: InstanceInfo
    status: InstanceStatus | None = None
    last_seen: float = 0.0


@dataclass
class RequestState:
    """Everything a request needs to go on elsewhere (migration commit)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: SamplingParams
    priority: Priority = Priority.NORMAL
    rng_state: bytes = b""
    arrival_time: float = 0.0
    first_token_time: float = 0.0
    num_preemptions: int = 0
    preemption_loss_ms: float = 0.0
    num_migrations: int = 0
    num_computed_tokens: int = 0
    frontend_address: str = ""
    extra: dict = field(default_factory=dict)
    program_id: str = ""  # the program (agent session) it is a turn of (GenerateOrder.program_id)
    # Prompt tokens served from a prefix cache at the admission that gave its first token (-1: not admitted yet).
    cached_prompt_tokens: int = -1
    # W3C trace headers for the engine (EngineRequest.trace_headers): set by the destination from its
    # commit's trace context, for an engine that traces requests; not carried on the wire.
    trace_headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerateOrder:
    """A request for an instance to run. ``resume_token_ids``: tokens already
    delivered (a resume elsewhere: the prompt is recomputed with them);
    ``handoff``: (instance, address) of the Splitwise decode instance, or None."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    priority: Priority = Priority.NORMAL
    resume_token_ids: tuple[int, ...] = ()
    handoff: tuple[str, str] | None = None
    flush_interval_ms: int = 0
    program_id: str = ""  # the program (agent session) it is a turn of ("" = none)


@dataclass(frozen=True)
class Moved:
    instance_id: str
    address: str
    next_index: int


@dataclass(frozen=True)
class StreamEvent:
    """What an instance's stream for one request says at once: ``token_ids``
    at output positions from ``index``; a finish reason; ``moved`` (the
    request migrated or was handed off: attach there from ``next_index``);
    ``error`` (code, message) with finish reason "error" when the request
    failed alone; counters with the final event. The same over gRPC
    (TokenEvent) and in process."""

    index: int
    token_ids: tuple[int, ...] = ()
    finish_reason: str = ""
    moved: Moved | None = None
    error: tuple[str, str] | None = None
    num_prompt_tokens: int = 0
    num_preemptions: int = 0
    preemption_loss_ms: float = 0.0
    num_migrations: int = 0
    # With SamplingParams.logprobs: one per token of token_ids, in order.
    logprobs: tuple[Logprobs, ...] = ()
    # With SamplingParams.prompt_logprobs, once: one per prompt token (None for the first).
    prompt_logprobs: tuple[Logprobs | None, ...] = ()
    # With the final event: prompt tokens a prefix cache served (OpenAI's usage.prompt_tokens_details.cached_tokens).
    num_cached_tokens: int = 0


# --- a migrate-out order (the scheduler's to an instance; services/instance/migration/manager.py runs it)
@dataclass
class Outcome:
    migration_id: str
    request_id: str
    committed: bool
    reason: str = ""
    stages: int = 0
    blocks: int = 0
    bytes: int = 0
    duration_ms: float = 0.0
    downtime_ms: float = 0.0  # suspend -> its first step at the destination begins (0: unknown)
    commit_ack_ms: float = 0.0
    # Unix time (s) of the suspend at the source: places the downtime on a client's timeline (0: none).
    suspended_at: float = 0.0
    kv_shared: bool = False  # the KV went through the source's shared cache (else bytes)
    held_blocks: int = 0  # of the request's full blocks, how many the destination's prefix cache held
    linked_blocks: int = 0  # of those, the first ones linked there instead of sent (MigrationConfig.link_cached)


@dataclass(frozen=True)
class LayerChange:
    """What a KunServe drop or restore of layers did to an instance's KV pool
    (the scheduler's DropLayers / RestoreLayers RPCs)."""
    blocks: int  # blocks the pool gained (a drop) or gave back (a restore)
    total_blocks: int  # the pool's size after it


@dataclass(frozen=True)
class MigrateOutOrder:
    dest_instance_id: str
    dest_address: str
    stop_when_freeness_above: float = 0.0
    max_requests: int = 0
    request_id: str = ""
    use_priorities: bool = False
    blocking: bool = False
    # Request id -> its first blocks the destination holds (libs/common/policies/migration.Linkable).
    linkable: dict[str, int] = field(default_factory=dict)
    # Which request moves first (libs/common/policies/migration.PICKS): "" =
    # the cheapest; "last_running" = the last admitted (Policy.order_pick).
    pick: str = ""
    # Above 0: a cache move order (llumnix-move): programs' kept blocks, no
    # request, move until this many left (the programs worth least first).
    cache_blocks: int = 0


@dataclass
class OrderResult:
    started: int = 0
    committed: int = 0
    aborted: int = 0
    results: list[Outcome] = field(default_factory=list)
