"""Conversion between generated protobuf messages and libs.common.types.
Generated types stay at the service edge; cores see dataclasses."""

from __future__ import annotations

from libs.pb import common_pb2 as pb
from libs.pb import instance_pb2 as ipb
from libs.common.errors import InvalidArgument
from libs.common.kv_events import AllCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch, KvSnapshot
from libs.common.types import (
    GenerateOrder,
    Grammar,
    GrammarKind,
    Logprobs,
    Moved,
    StreamEvent,
    InstanceInfo,
    InstanceRecord,
    InstanceStatus,
    MigrateOutOrder,
    OrderResult,
    Outcome,
    PrefixCacheStats,
    Priority,
    RequestLoad,
    RequestPhase,
    RequestState,
    Role,
    SamplingParams,
)

_STATES = {RequestPhase.WAITING: pb.RequestLoad.WAITING, RequestPhase.RUNNING: pb.RequestLoad.RUNNING,
           RequestPhase.MIGRATING: pb.RequestLoad.MIGRATING}
_STATE_NAMES = {v: k for k, v in _STATES.items()}
_ROLES = {Role.MIXED: pb.ROLE_MIXED, Role.PREFILL: pb.ROLE_PREFILL, Role.DECODE: pb.ROLE_DECODE}
_ROLE_OF = {v: k for k, v in _ROLES.items()}


def role_to_pb(r: Role) -> int:
    return _ROLES[r]


def role_from_pb(value: int) -> Role:
    """A wire role; an unknown value is the caller's mistake (INVALID_ARGUMENT)."""
    try:
        return _ROLE_OF[value]
    except KeyError:
        known = ", ".join(f"{int(v)} ({r.value})" for r, v in _ROLES.items())
        raise InvalidArgument(f"unknown instance role {value}; known: {known}", param="role") from None


def priority_from_pb(value: int) -> Priority:
    """A wire priority; an unknown value is the caller's mistake (INVALID_ARGUMENT)."""
    try:
        return Priority(value)
    except ValueError:
        known = ", ".join(f"{int(p)} ({p.name.lower()})" for p in Priority)
        raise InvalidArgument(f"unknown priority {value}; known: {known}", param="priority") from None


def sampling_to_pb(s: SamplingParams) -> pb.SamplingParams:
    m = pb.SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, has_seed=s.seed is not None,
        seed=s.seed or 0, max_tokens=s.max_tokens, stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos, min_tokens=s.min_tokens,
        has_logprobs=s.logprobs is not None, logprobs=s.logprobs or 0,
        has_prompt_logprobs=s.prompt_logprobs is not None, prompt_logprobs=s.prompt_logprobs or 0,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        has_repetition_penalty=s.repetition_penalty != 1.0, repetition_penalty=s.repetition_penalty,
        min_p=s.min_p, logit_bias=dict(s.logit_bias), allowed_token_ids=list(s.allowed_token_ids),
        bad_words=[pb.TokenSequence(token_ids=list(w)) for w in s.bad_words],
    )
    if s.grammar is not None:
        g = m.grammar
        g.kind, g.spec, g.strict, g.compact = s.grammar.kind.value, s.grammar.spec, s.grammar.strict, s.grammar.compact
    return m


def sampling_from_pb(m: pb.SamplingParams) -> SamplingParams:
    grammar = None
    if m.grammar.kind:
        try:
            grammar = Grammar(GrammarKind(m.grammar.kind), m.grammar.spec, m.grammar.strict, m.grammar.compact)
        except ValueError:
            raise InvalidArgument(f"unknown grammar kind {m.grammar.kind!r}; known: "
                                  f"{', '.join(k.value for k in GrammarKind)}", param="sampling.grammar") from None
    return SamplingParams(
        temperature=m.temperature, top_p=m.top_p if m.top_p != 0 else 1.0, top_k=m.top_k,  # 0: unset
        seed=m.seed if m.has_seed else None, max_tokens=m.max_tokens,
        stop_token_ids=tuple(m.stop_token_ids), ignore_eos=m.ignore_eos, min_tokens=m.min_tokens,
        logprobs=m.logprobs if m.has_logprobs else None,
        prompt_logprobs=m.prompt_logprobs if m.has_prompt_logprobs else None,
        presence_penalty=m.presence_penalty, frequency_penalty=m.frequency_penalty,
        repetition_penalty=m.repetition_penalty if m.has_repetition_penalty else 1.0, min_p=m.min_p,
        logit_bias=tuple(sorted(m.logit_bias.items())), allowed_token_ids=tuple(m.allowed_token_ids),
        bad_words=tuple(tuple(w.token_ids) for w in m.bad_words), grammar=grammar,
    )


def logprobs_to_pb(lp: Logprobs | None) -> pb.TokenLogprobs:
    if lp is None:
        return pb.TokenLogprobs(none=True)
    return pb.TokenLogprobs(logprob=lp.logprob, top_token_ids=[t for t, _ in lp.top],
                            top_logprobs=[v for _, v in lp.top])


def logprobs_from_pb(m: pb.TokenLogprobs) -> Logprobs | None:
    if m.none:
        return None
    return Logprobs(m.logprob, tuple(zip(m.top_token_ids, m.top_logprobs)))


def info_to_pb(i: InstanceInfo) -> pb.InstanceInfo:
    return pb.InstanceInfo(
        instance_id=i.instance_id, address=i.address, engine=i.engine, model=i.model,
        block_size=i.block_size, total_blocks=i.total_blocks, max_model_len=i.max_model_len,
        started_at_ms=i.started_at_ms, vocab_size=i.vocab_size, no_migration=i.no_migration,
    )


def info_from_pb(m: pb.InstanceInfo) -> InstanceInfo:
    return InstanceInfo(
        instance_id=m.instance_id, address=m.address, engine=m.engine, model=m.model,
        block_size=m.block_size, total_blocks=m.total_blocks, max_model_len=m.max_model_len,
        started_at_ms=m.started_at_ms, vocab_size=m.vocab_size, no_migration=m.no_migration,
    )


def load_to_pb(r: RequestLoad) -> pb.RequestLoad:
    return pb.RequestLoad(
        request_id=r.request_id, priority=int(r.priority), state=_STATES[r.state],
        physical_blocks=r.physical_blocks, num_tokens=r.num_tokens, virtual_usage=r.virtual_usage,
    )


_PRIORITY_OF = {int(p): p for p in Priority}
# NOTE: the scheduler's view and every frontend's convert each status report
# they get (with its requests). The two below fill a frozen dataclass's
# __dict__ at once instead of calling its __init__ (one object.__setattr__ a
# field: 3x the time, 12 of 17 us a status). A field left out here reads its
# class default, as a keyword left out of __init__ would (tests check every
# field comes across: tests/common/test_convert_info.py).
_new = object.__new__
_setattr = object.__setattr__


def load_from_pb(m: pb.RequestLoad) -> RequestLoad:
    p = _PRIORITY_OF.get(m.priority)
    r = _new(RequestLoad)
    _setattr(r, "__dict__", {
        "request_id": m.request_id, "priority": Priority(m.priority) if p is None else p,
        "state": _STATE_NAMES[m.state], "physical_blocks": m.physical_blocks, "num_tokens": m.num_tokens,
        "virtual_usage": m.virtual_usage})
    return r


_STATUS_SCALARS = (
    "instance_id", "seq", "timestamp", "total_blocks", "free_blocks", "block_size", "num_running",
    "num_waiting", "head_of_line_demand_blocks", "virtual_usage", "freeness", "normal_freeness",
    "terminating", "num_preemptions", "migrating_in", "migrating_out", "used_blocks",
    "waiting_demand_blocks", "engine_steps", "unschedulable", "shared_blocks", "running_prefill_tokens",
    "preempted_waiting", "kept_blocks",
)
_PREFIX_FIELDS = ("enabled", "requests", "queries", "hits", "evictions", "cached_blocks", "evictable_blocks",
                  "preempted_queries", "preempted_hits")


def status_to_pb(s: InstanceStatus) -> pb.InstanceStatus:
    pc = s.prefix_cache
    m = pb.InstanceStatus(**{k: getattr(s, k) for k in _STATUS_SCALARS}, role=role_to_pb(s.role),
                          prefix_cache=pb.PrefixCacheStats(**{k: getattr(pc, k) for k in _PREFIX_FIELDS}))
    m.requests.extend(load_to_pb(r) for r in s.requests)
    return m


_NO_PREFIX_CACHE = PrefixCacheStats()


def status_from_pb(m: pb.InstanceStatus) -> InstanceStatus:
    """(Field by field into its __dict__: see load_from_pb.)"""
    if m.HasField("prefix_cache"):
        pc = m.prefix_cache
        prefix = PrefixCacheStats(pc.enabled, pc.requests, pc.queries, pc.hits, pc.evictions, pc.cached_blocks,
                                  pc.evictable_blocks, pc.preempted_queries, pc.preempted_hits)
    else:
        prefix = _NO_PREFIX_CACHE  # (frozen: one for all)
    s = _new(InstanceStatus)
    _setattr(s, "__dict__", {
        "instance_id": m.instance_id, "seq": m.seq, "timestamp": m.timestamp, "total_blocks": m.total_blocks,
        "free_blocks": m.free_blocks, "block_size": m.block_size, "num_running": m.num_running,
        "num_waiting": m.num_waiting, "head_of_line_demand_blocks": m.head_of_line_demand_blocks,
        "virtual_usage": m.virtual_usage, "freeness": m.freeness, "normal_freeness": m.normal_freeness,
        "terminating": m.terminating, "num_preemptions": m.num_preemptions, "migrating_in": m.migrating_in,
        "migrating_out": m.migrating_out,
        "requests": tuple(map(load_from_pb, m.requests)) if m.requests else (),
        "used_blocks": m.used_blocks, "waiting_demand_blocks": m.waiting_demand_blocks,
        "running_prefill_tokens": m.running_prefill_tokens, "engine_steps": m.engine_steps,
        "role": _ROLE_OF.get(m.role, Role.MIXED),  # a role from a newer peer: treated as mixed
        "unschedulable": m.unschedulable, "prefix_cache": prefix, "shared_blocks": m.shared_blocks,
        "preempted_waiting": m.preempted_waiting, "kept_blocks": m.kept_blocks})
    return s


# --- KV events (libs/common/kv_events.py) -------------------------------------------

def kv_event_to_pb(e: KvEvent) -> pb.KvEvent:
    if isinstance(e, BlockStored):
        return pb.KvEvent(stored=pb.KvBlockStored(block_hashes=e.block_hashes, parent=e.parent))
    if isinstance(e, BlockRemoved):
        return pb.KvEvent(removed=pb.KvBlockRemoved(block_hashes=e.block_hashes))
    if isinstance(e, AllCleared):
        return pb.KvEvent(cleared=pb.KvAllCleared())
    raise TypeError(f"not a KV event: {e!r}")


def kv_event_from_pb(m: pb.KvEvent) -> KvEvent:
    kind = m.WhichOneof("event")
    if kind == "stored":
        st = m.stored
        return BlockStored(tuple(st.block_hashes), st.parent if st.HasField("parent") else None)
    if kind == "removed":
        return BlockRemoved(tuple(m.removed.block_hashes))
    if kind == "cleared":
        return AllCleared()
    raise InvalidArgument(f"a KV event of unknown kind {kind!r}")


def kv_batch_to_pb(b: KvEventBatch) -> pb.KvEventBatch:
    return pb.KvEventBatch(instance_id=b.instance_id, seq=b.seq, events=[kv_event_to_pb(e) for e in b.events])


def kv_batch_from_pb(m: pb.KvEventBatch) -> KvEventBatch:
    return KvEventBatch(m.instance_id, m.seq, tuple(kv_event_from_pb(e) for e in m.events))


def kv_snapshot_to_pb(s: KvSnapshot) -> pb.KvSnapshot:
    return pb.KvSnapshot(instance_id=s.instance_id, seq=s.seq,
                         blocks=[pb.KvBlock(hash=h, parent=p) for h, p in s.blocks.items()])


def kv_snapshot_from_pb(m: pb.KvSnapshot) -> KvSnapshot:
    return KvSnapshot(m.instance_id, m.seq, {b.hash: b.parent if b.HasField("parent") else None for b in m.blocks})


def record_to_pb(r: InstanceRecord, into: pb.InstanceRecord | None = None,
                 info: pb.InstanceInfo | None = None) -> pb.InstanceRecord:
    """The status may already be in wire form (the meta store keeps reports
    as received). ``into``: the message to fill (e.g. a field of another);
    ``info``: the record's info in wire form already."""
    m = pb.InstanceRecord() if into is None else into
    m.info.CopyFrom(info_to_pb(r.info) if info is None else info)
    m.last_seen = r.last_seen
    st = r.status
    if st is not None:
        m.status.CopyFrom(st if isinstance(st, pb.InstanceStatus) else status_to_pb(st))
    return m


def record_from_pb(m: pb.InstanceRecord) -> InstanceRecord:
    return InstanceRecord(
        info=info_from_pb(m.info),
        status=status_from_pb(m.status) if m.HasField("status") else None,
        last_seen=m.last_seen,
    )


def state_to_pb(s: RequestState) -> ipb.RequestState:
    return ipb.RequestState(
        request_id=s.request_id, prompt_token_ids=s.prompt_token_ids,
        output_token_ids=s.output_token_ids, sampling=sampling_to_pb(s.sampling),
        rng_state=s.rng_state, arrival_time=s.arrival_time, first_token_time=s.first_token_time,
        num_preemptions=s.num_preemptions, priority=int(s.priority),
        frontend_address=s.frontend_address, preemption_loss_ms=s.preemption_loss_ms,
        num_migrations=s.num_migrations, num_computed_tokens=s.num_computed_tokens, program_id=s.program_id,
        cached_prompt_tokens=s.cached_prompt_tokens,
    )


def state_from_pb(m: ipb.RequestState) -> RequestState:
    return RequestState(
        request_id=m.request_id, prompt_token_ids=list(m.prompt_token_ids),
        output_token_ids=list(m.output_token_ids), sampling=sampling_from_pb(m.sampling),
        priority=Priority(m.priority), rng_state=m.rng_state, arrival_time=m.arrival_time,
        first_token_time=m.first_token_time, num_preemptions=m.num_preemptions,
        preemption_loss_ms=m.preemption_loss_ms, num_migrations=m.num_migrations,
        num_computed_tokens=m.num_computed_tokens, frontend_address=m.frontend_address, program_id=m.program_id,
        cached_prompt_tokens=m.cached_prompt_tokens,
    )


def order_to_pb(o: GenerateOrder) -> ipb.GenerateRequest:
    m = ipb.GenerateRequest(request_id=o.request_id, prompt_token_ids=o.prompt_token_ids,
                            sampling=sampling_to_pb(o.sampling), priority=int(o.priority),
                            resume_token_ids=o.resume_token_ids, flush_interval_ms=o.flush_interval_ms,
                            program_id=o.program_id)
    if o.handoff is not None:
        m.handoff.instance_id, m.handoff.address = o.handoff
    return m


def order_from_pb(m: ipb.GenerateRequest) -> GenerateOrder:
    h = m.handoff
    return GenerateOrder(m.request_id, tuple(m.prompt_token_ids), sampling_from_pb(m.sampling),
                         priority_from_pb(m.priority), tuple(m.resume_token_ids),
                         (h.instance_id, h.address) if h.instance_id or h.address else None, m.flush_interval_ms,
                         m.program_id)


def stream_event_to_pb(e: StreamEvent) -> ipb.TokenEvent:
    m = ipb.TokenEvent(index=e.index, token_ids=e.token_ids, finish_reason=e.finish_reason,
                       num_prompt_tokens=e.num_prompt_tokens, num_preemptions=e.num_preemptions,
                       preemption_loss_ms=e.preemption_loss_ms, num_migrations=e.num_migrations,
                       logprobs=[logprobs_to_pb(lp) for lp in e.logprobs],
                       prompt_logprobs=[logprobs_to_pb(lp) for lp in e.prompt_logprobs],
                       num_cached_tokens=e.num_cached_tokens)
    if e.moved is not None:
        m.moved.instance_id, m.moved.address = e.moved.instance_id, e.moved.address
        m.moved.next_index = e.moved.next_index
    if e.error is not None:
        m.error_code, m.error_message = e.error
    return m


def stream_event_from_pb(m: ipb.TokenEvent) -> StreamEvent:
    moved = Moved(m.moved.instance_id, m.moved.address, m.moved.next_index) if m.HasField("moved") else None
    error = (m.error_code, m.error_message) if m.error_code or m.error_message else None
    return StreamEvent(m.index, tuple(m.token_ids), m.finish_reason, moved, error, m.num_prompt_tokens,
                       m.num_preemptions, m.preemption_loss_ms, m.num_migrations,
                       tuple(logprobs_from_pb(x) for x in m.logprobs),
                       tuple(logprobs_from_pb(x) for x in m.prompt_logprobs), m.num_cached_tokens)


# --- a migrate-out order and its result (the scheduler's MigrateOut RPC to an instance)
def migrate_out_to_pb(o: MigrateOutOrder) -> ipb.MigrateOutRequest:
    return ipb.MigrateOutRequest(dest_instance_id=o.dest_instance_id, dest_address=o.dest_address,
                                 stop_when_freeness_above=o.stop_when_freeness_above, max_requests=o.max_requests,
                                 request_id=o.request_id, use_priorities=o.use_priorities, blocking=o.blocking,
                                 linkable_blocks=o.linkable, pick=o.pick, cache_blocks=o.cache_blocks)


def migrate_out_from_pb(m: ipb.MigrateOutRequest) -> MigrateOutOrder:
    return MigrateOutOrder(m.dest_instance_id, m.dest_address, m.stop_when_freeness_above, m.max_requests,
                           m.request_id, m.use_priorities, m.blocking, dict(m.linkable_blocks), m.pick,
                           m.cache_blocks)


def outcome_to_pb(o: Outcome) -> ipb.MigrationResult:
    return ipb.MigrationResult(
        migration_id=o.migration_id, request_id=o.request_id, outcome="committed" if o.committed else "aborted",
        reason=o.reason, stages=o.stages, blocks=o.blocks, bytes=o.bytes, duration_ms=o.duration_ms,
        downtime_ms=o.downtime_ms, commit_ack_ms=o.commit_ack_ms, suspended_at=o.suspended_at,
        kv_shared=o.kv_shared, linked_blocks=o.linked_blocks)


def outcome_from_pb(m: ipb.MigrationResult) -> Outcome:
    return Outcome(m.migration_id, m.request_id, m.outcome == "committed", m.reason, m.stages, m.blocks, m.bytes,
                   m.duration_ms, m.downtime_ms, m.commit_ack_ms, m.suspended_at, m.kv_shared,
                   linked_blocks=m.linked_blocks)


def order_result_to_pb(r: OrderResult) -> ipb.MigrateOutReply:
    return ipb.MigrateOutReply(started=r.started, committed=r.committed, aborted=r.aborted,
                               results=[outcome_to_pb(o) for o in r.results])


def order_result_from_pb(m: ipb.MigrateOutReply) -> OrderResult:
    return OrderResult(m.started, m.committed, m.aborted, [outcome_from_pb(r) for r in m.results])


# --- KunServe's layer ranges (DropLayers, SetPipeline, RestoreLayers)
def layers_to_pb(r: range) -> ipb.LayerRange:
    return ipb.LayerRange(start=r.start, stop=r.stop)


def layers_from_pb(m: ipb.LayerRange) -> range:
    return range(m.start, m.stop)
