"""vLLM behind Ferry's Engine interface, with live migration through Ferry's
KV connector (connector.py) and no change to vLLM.

vLLM's ``LLMEngine`` runs in this process with its engine core in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the uni-process executor), so one
``step()`` here is one vLLM schedule + forward + update on the agent's
engine thread, as Engine requires; the connector objects vLLM builds are
then reachable (connector.REGISTRY).

A Ferry request maps to one vLLM request at a time (an "incarnation"):
suspending aborts it in vLLM with its blocks held by the connector; resuming
or installing a migrated request adds a new incarnation whose prompt is
every token so far and whose KV the connector copies from the held or
reserved blocks (no recompute).

Status (load()) is read from vLLM's scheduler between steps: its queues,
its requests' counters and its block pool. It is exact at each step
boundary (the instance publishes it after every step).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from libs.common import cpu_features
from libs.common.logging import get_logger
from libs.common.types import FinishReason, Priority, RequestLoad, RequestPhase, RequestState, SamplingParams, TokenOutput
from services.instance.engine.base import (
    Engine,
    EngineConfig,
    EngineError,
    EngineLoad,
    EngineRequest,
    IntegrityError,
    KvLayout,
    MigrationHooks,
)
from services.instance.engine import vllm_kernels
from services.instance.engine.core.engine import check_request, check_token_ids
from services.instance.engine.vllm import args as vargs

log = get_logger(__name__)
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Req:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    priority: Priority
    arrival_time: float
    output: list[int] = field(default_factory=list)
    iid: str = ""  # vLLM's id of the current incarnation
    trace_headers: dict = field(default_factory=dict)  # its caller's span (EngineRequest.trace_headers)
    suspended: bool = False
    computed: int = 0  # tokens with KV in the held blocks while suspended
    first_token_time: float = 0.0
    preemptions: int = 0  # of earlier incarnations and earlier instances
    preemption_loss_ms: float = 0.0
    num_migrations: int = 0
    extra: dict = field(default_factory=dict)
    prompt_logprobs_sent: bool = False
    cached: int = -1  # prompt tokens vLLM's prefix cache served for its first token (-1: none yet)


class VllmEngine(Engine, MigrationHooks):
    name = "vllm"

    def __init__(self, config: EngineConfig):
        t0 = time.perf_counter()
        self.config = config
        try:  # before anything loads vLLM's kernels: a CPU it has no build for would die of SIGILL
            platform = vllm_kernels.require_vllm()
        except RuntimeError as e:
            raise EngineError(str(e)) from None
        log.info("vLLM runs here", **platform, cpu=cpu_features.summary())
        vargs.in_process()
        if config.deterministic:
            vargs.batch_invariant()
        model = vargs.resolve_model(config.model)
        vargs.offline_if_local(model)  # before vLLM (and the hub client) is imported
        from vllm.engine.llm_engine import LLMEngine

        from services.instance.engine.vllm.connector import REGISTRY

        eargs, wired = vargs.engine_args(config, model, config.extra.get("vllm_args", ""))
        try:
            self.llm = LLMEngine.from_engine_args(eargs, stat_loggers=vargs.stat_loggers(eargs))
        except Exception as e:  # vLLM raises many kinds at start-up
            raise EngineError(f"vLLM could not start: {e}") from e
        self.scheduler = self.llm.engine_core.engine_core.scheduler
        self.traces_requests = bool(eargs.otlp_traces_endpoint)
        self.pool = self.scheduler.kv_cache_manager.block_pool
        self._block_size = self.llm.vllm_config.cache_config.block_size
        self._max_model_len = self.llm.model_config.max_model_len
        self._model_name = config.model
        self.reqs: dict[str, _Req] = {}
        self.by_iid: dict[str, str] = {}
        self._seq = itertools.count()
        self._preemptions_seen: dict[str, int] = {}
        self._num_preemptions = 0
        self.sconn = self.wconn = None
        self.migration_error = "" if wired else "a user-given kv-transfer-config replaces Ferry's connector"
        if wired:
            conns = REGISTRY.get(eargs.kv_transfer_config.engine_id, {})
            self.sconn, self.wconn = conns.get("scheduler"), conns.get("worker")
            if self.sconn is None or self.wconn is None:
                self.migration_error = "Ferry's KV connector is not reachable (vLLM engine core out of process)"
            elif self.wconn.views is None:
                self.migration_error = self.wconn.layout_error or "KV caches were never registered"
        self._layout = self.wconn.views.layout if self.migratable else self._plain_layout()
        self._watermark = int(config.watermark * self.num_total_blocks)
        self._events = self._kv_events()
        self._fresh: dict[str, int] = {}  # incarnations of new requests -> tokens queried (prefix stats)
        self._prefix = {"requests": 0, "queries": 0, "hits": 0}
        log.info("vllm engine ready", model=model, blocks=self.num_total_blocks, block_size=self._block_size,
                 migratable=self.migratable, why_not=self.migration_error or None,
                 seconds=round(time.perf_counter() - t0, 1))

    def _kv_events(self):
        """vLLM's KV-event publisher, replaced by one Ferry reads in process
        (kv_events.py), when vLLM's prefix cache records events."""
        from services.instance.engine.vllm.kv_events import KvEventTranslator, publisher_class

        if not getattr(self.scheduler, "enable_kv_cache_events", False):
            return None
        self.scheduler.kv_event_publisher = publisher_class()()
        return KvEventTranslator(self.pool, self._block_size)

    # --- prefix caching (vLLM's own) ------------------------------------------------
    def take_kv_events(self) -> list:
        if self._events is None:
            return []
        pub = self.scheduler.kv_event_publisher
        pub.recording = True
        events, pub.pending = pub.pending, []
        return self._events.translate(events)

    def cached_hashes(self) -> list:
        return [] if self._events is None else self._events.hashes()

    def holds_hashes(self, hashes: list) -> list:
        held = self._events.count if self._events is not None else {}
        return [h for h in hashes if h in held]

    def block_hashes(self, request_id: str) -> list:
        from libs.common.prefix_hash import block_hashes

        r = self.reqs.get(request_id)
        if r is None:
            return []
        v = None if r.suspended else self._vreq(r)
        n = r.computed if v is None else v.num_computed_tokens
        return block_hashes((r.prompt + r.output)[:n], self._block_size)

    def prefix_cache_stats(self):
        from libs.common.types import PrefixCacheStats

        p = self._prefix
        cached = len(self.pool.cached_block_hash_to_block)
        return PrefixCacheStats(bool(self.llm.vllm_config.cache_config.enable_prefix_caching), p["requests"],
                                p["queries"], p["hits"], self._events.evictions if self._events else 0, cached)

    # --- static facts -------------------------------------------------------
    block_size = property(lambda self: self._block_size)
    num_total_blocks = property(lambda self: self.pool.num_gpu_blocks - 1)  # block 0 is vLLM's null block
    max_model_len = property(lambda self: self._max_model_len)
    kv_layout: KvLayout = property(lambda self: self._layout)
    num_free_blocks = property(lambda self: self.pool.get_num_free_blocks())
    model_name = property(lambda self: self._model_name)
    vocab_size = property(lambda self: self.llm.model_config.get_vocab_size())

    @property
    def migratable(self) -> bool:
        """Whether live migration works here; without it the instance only serves."""
        return not self.migration_error

    @property
    def no_migration(self) -> str:
        return self.migration_error

    def _plain_layout(self) -> KvLayout:
        m = self.llm.model_config
        return KvLayout(dtype=str(m.dtype).removeprefix("torch."), block_size=self._block_size,
                        num_layers=m.get_num_layers(self.llm.vllm_config.parallel_config),
                        num_kv_heads=m.get_total_num_kv_heads(), head_dim=m.get_head_size())

    # --- serving ----------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        rid = request.request_id
        if rid in self.reqs:
            raise EngineError(f"request {rid!r} already exists")
        check_request(request, self._max_model_len, self.vocab_size)
        r = _Req(rid, list(request.prompt_token_ids), request.sampling, request.priority,
                 request.arrival_time or time.time(), output=list(request.resume_token_ids),
                 trace_headers=dict(request.trace_headers))
        self._submit(r)

    def _submit(self, r: _Req, load=None) -> None:
        """Add the request's next incarnation to vLLM (with KV to load, if any)."""
        from vllm.inputs import TokensPrompt

        key = f"{r.request_id}#{next(self._seq)}" if load is not None else None
        # Traced: vLLM's span of this incarnation under its caller's (the Generate's; for a request that
        # migrated in, the destination's commit: RequestState.trace_headers).
        headers = (r.trace_headers or vargs.unsampled_trace_headers()) if self.traces_requests else None
        try:
            iid = self.llm.add_request(r.request_id, TokensPrompt(prompt_token_ids=r.prompt + r.output),
                                       vargs.sampling_params(r.sampling, len(r.output), key),
                                       arrival_time=r.arrival_time, priority=vargs.vllm_priority(r.priority),
                                       trace_headers=headers)
        except (ValueError, TypeError) as e:
            raise EngineError(str(e)) from e
        if load is not None:
            self.sconn.expect_load(key, load)
        else:  # a new request (not a resumed or migrated incarnation): a prefix-cache query
            self._fresh[iid] = len(r.prompt) + len(r.output)
        r.iid, r.suspended = iid, False
        self.reqs[r.request_id] = r
        self.by_iid[iid] = r.request_id

    def abort_request(self, request_id: str) -> bool:
        r = self.reqs.pop(request_id, None)
        if r is None:
            return False
        self.by_iid.pop(r.iid, None)
        self._fresh.pop(r.iid, None)
        if r.suspended:
            self.sconn.release_held(r.iid)
        else:
            self.llm.abort_request([r.iid], internal=True)
        return True

    def has_work(self) -> bool:
        return self.llm.has_unfinished_requests() or bool(self.sconn and self.sconn.has_pending_push_work())

    def step(self) -> list[TokenOutput]:
        outs = self.llm.step()
        now = time.time()
        tokens: list[TokenOutput] = []
        for o in outs:
            rid = self.by_iid.get(getattr(o, "request_id", ""))
            if rid is None:  # vLLM reports the external id: Ferry's own
                rid = o.request_id if o.request_id in self.reqs else None
            r = self.reqs.get(rid) if rid else None
            n_query = self._fresh.pop(r.iid if r is not None else getattr(o, "request_id", ""), None)
            if n_query is not None and o.num_cached_tokens is not None:
                self._prefix["requests"] += 1
                self._prefix["queries"] += n_query
                self._prefix["hits"] += o.num_cached_tokens
            if r is None or r.suspended or not o.outputs:
                continue
            c = o.outputs[0]
            new = list(c.token_ids)
            reason = _FINISH.get(c.finish_reason) if o.finished else None
            if o.finished and reason is None:
                reason = FinishReason.STOP
            sp = r.sampling
            prompt_lps = None
            if sp.prompt_logprobs is not None and not r.prompt_logprobs_sent and o.prompt_logprobs is not None:
                ids = r.prompt
                prompt_lps = (None,) + tuple(vargs.logprobs_of(t, e, sp.prompt_logprobs)
                                             for t, e in zip(ids[1:], o.prompt_logprobs[1:]))
                r.prompt_logprobs_sent = True
            if sp.max_tokens == 0:  # the prompt only: vLLM's one token is not the client's
                tokens.append(TokenOutput(r.request_id, 0, None, FinishReason.LENGTH, self._final_stats(r),
                                          prompt_logprobs=prompt_lps))
                if not o.finished:
                    self.llm.abort_request([r.iid], internal=True)
                self.reqs.pop(r.request_id, None)
                self.by_iid.pop(r.iid, None)
                continue
            for i, tok in enumerate(new):
                r.output.append(int(tok))
                if not r.first_token_time:
                    r.first_token_time = now
                if r.cached < 0 and o.num_cached_tokens is not None:
                    r.cached = min(int(o.num_cached_tokens), len(r.prompt))
                last = i == len(new) - 1
                stats = self._final_stats(r) if last and reason else None
                lp = (vargs.logprobs_of(int(tok), c.logprobs[i], sp.logprobs)
                      if sp.logprobs is not None and c.logprobs else None)
                tokens.append(TokenOutput(r.request_id, len(r.output) - 1, int(tok), reason if last else None,
                                          stats, logprobs=lp, prompt_logprobs=prompt_lps if i == 0 else None))
            if o.finished:
                if not new:  # finished without a token (vLLM-side abort)
                    tokens.append(TokenOutput(r.request_id, len(r.output), None, FinishReason.ABORT,
                                              self._final_stats(r)))
                self.reqs.pop(r.request_id, None)
                self.by_iid.pop(r.iid, None)
        return tokens

    def _final_stats(self, r: _Req) -> dict:
        return {"num_preemptions": r.preemptions + self._vreq_preemptions(r),
                "preemption_loss_ms": r.preemption_loss_ms, "num_migrations": r.num_migrations,
                "cached_prompt_tokens": r.cached}

    def _vreq(self, r: _Req):
        return self.scheduler.requests.get(r.iid)

    def _vreq_preemptions(self, r: _Req) -> int:
        v = self._vreq(r)
        return v.num_preemptions if v is not None else 0

    # --- load -------------------------------------------------------------------
    def load(self) -> EngineLoad:
        s = self.scheduler
        kvm = s.kv_cache_manager
        reqs: list[RequestLoad] = []
        demands: list[tuple[tuple, int]] = []
        shared: set[int] = set()
        preempted = 0  # waiting requests that were preempted
        prefill = 0  # prompt tokens running requests have yet to compute (chunked prefill)
        blocks = self.pool.blocks
        for state, queue in ((RequestPhase.RUNNING, s.running), (RequestPhase.WAITING, list(s.waiting) + list(s.kv_holding_waiting))):
            for v in queue:
                rid = self.by_iid.get(v.request_id)
                if rid is None:
                    continue
                self._count_preemptions(v)
                ids = kvm.get_block_ids(v.request_id)[0]
                mine = len(ids)
                for b in ids:  # blocks shared with another request (a prefix hit) count once, apart
                    if blocks[b].ref_cnt > 1:
                        shared.add(b)
                        mine -= 1
                reqs.append(RequestLoad(rid, self.reqs[rid].priority, state, mine, v.num_tokens))
                left = v.num_tokens - v.num_computed_tokens
                if state == RequestPhase.RUNNING and left > 1:  # computing its prompt in chunks
                    prefill += left
                if state == RequestPhase.WAITING:
                    preempted += v.num_preemptions > 0
                    need = max(0, cdiv(v.num_tokens + 1, self._block_size) - len(ids))
                    if not ids:
                        need -= self._hit_saves(v)
                    demands.append(((v.priority, v.arrival_time), need))
        demands.sort(key=lambda d: d[0])  # vLLM's own order for the priority policy
        return EngineLoad(
            total_blocks=self.num_total_blocks, free_blocks=self.pool.get_num_free_blocks(),
            block_size=self._block_size, requests=tuple(reqs),
            head_of_line_demand_blocks=demands[0][1] if demands else 0,
            waiting_demand_blocks=sum(d for _, d in demands), num_preemptions=self._num_preemptions,
            reserved_blocks=len(self.sconn.reserved) if self.sconn else 0, shared_blocks=len(shared),
            prefix_cache=self.prefix_cache_stats(), running_prefill_tokens=prefill, preempted_waiting=preempted)

    def _hit_saves(self, v) -> int:
        """Free blocks a waiting request's prefix-cache hit spares it: the
        cached blocks it would find in use (an evictable one it takes off the
        free count anyway). vLLM's own hashes and lookup, never its last token."""
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        if not self.llm.vllm_config.cache_config.enable_prefix_caching:
            return 0
        cache = self.pool.cached_block_hash_to_block
        saved = 0
        for h in list(v.block_hashes)[: (v.num_tokens - 1) // self._block_size]:
            b = cache.get_one_block(make_block_hash_with_group_id(h, 0))
            if b is None:
                break
            saved += b.ref_cnt > 0
        return saved

    def _count_preemptions(self, v) -> None:
        seen = self._preemptions_seen.get(v.request_id, 0)
        if v.num_preemptions > seen:
            self._num_preemptions += v.num_preemptions - seen
            self._preemptions_seen[v.request_id] = v.num_preemptions

    def check_integrity(self) -> None:
        """Every block is free, owned by a live or held request, or reserved,
        and no block is both free and owned."""
        from services.instance.engine.vllm import integrity

        integrity.check(self)

    def request_stats(self, request_id: str) -> dict:
        r = self.reqs.get(request_id)
        if r is None:
            return {}
        v = self._vreq(r)
        return {"arrival_time": r.arrival_time, "first_token_time": r.first_token_time,
                "num_preemptions": r.preemptions + self._vreq_preemptions(r),
                "num_computed_tokens": r.computed if r.suspended or v is None else v.num_computed_tokens,
                "num_tokens": len(r.prompt) + len(r.output)}

    # --- migration hooks --------------------------------------------------------
    def _get(self, request_id: str) -> _Req:
        r = self.reqs.get(request_id)
        if r is None:
            raise EngineError(f"unknown request {request_id!r}")
        return r

    def _need_migration(self) -> None:
        if not self.migratable:
            raise EngineError(f"live migration is not available on this vLLM instance: {self.migration_error}")

    def request_phase(self, request_id: str) -> tuple[str, int] | None:
        from vllm.v1.request import RequestStatus

        r = self.reqs.get(request_id)
        if r is None:
            return None
        if r.suspended:
            return "suspended", r.preemptions
        v = self._vreq(r)
        running = v is not None and v.status == RequestStatus.RUNNING
        return (RequestPhase.RUNNING if running else RequestPhase.WAITING), r.preemptions + self._vreq_preemptions(r)

    def _blocks(self, r: _Req, n_tokens_of) -> list[int]:
        self._need_migration()
        if r.suspended:
            return self.sconn.block_ids(r.iid)[: n_tokens_of(r.computed)]
        v = self._vreq(r)
        if v is None:
            return []
        return self.sconn.block_ids(r.iid)[: n_tokens_of(v.num_computed_tokens)]

    def full_blocks(self, request_id: str) -> list[int]:
        return self._blocks(self._get(request_id), lambda n: n // self._block_size)

    def all_blocks(self, request_id: str) -> list[int]:
        return self._blocks(self._get(request_id), lambda n: cdiv(n, self._block_size))

    def gather_kv(self, block_ids: list[int]) -> memoryview:
        self._need_migration()
        return self.wconn.views.gather(list(block_ids))

    def reserve_blocks(self, n: int) -> list[int] | None:
        self._need_migration()
        return self.sconn.reserve(n, keep_free=self._watermark)

    def scatter_kv(self, block_ids: list[int], data: bytes | memoryview) -> None:
        self._need_migration()
        bad = [b for b in block_ids if b not in self.sconn.reserved]
        if bad:
            raise EngineError(f"scatter_kv into blocks {bad} that are not reserved")
        self.wconn.views.scatter(list(block_ids), data)

    def release_blocks(self, block_ids: list[int]) -> None:
        if self.sconn is not None:
            self.sconn.release_reserved(list(block_ids))

    def suspend_request(self, request_id: str) -> bool:
        from vllm.v1.request import RequestStatus

        r = self.reqs.get(request_id)
        if r is None or r.suspended or not self.migratable or not vargs.keeps_state_across_incarnations(r.sampling):
            return False
        if r.sampling.prompt_logprobs is not None and not r.prompt_logprobs_sent:
            return False  # its prompt's logprobs come with its first output, here
        v = self._vreq(r)
        if v is None or v.status != RequestStatus.RUNNING:
            return False
        computed = v.num_computed_tokens
        r.preemptions += v.num_preemptions
        self.sconn.hold_ids.add(r.iid)
        self.llm.abort_request([r.iid], internal=True)  # request_finished() keeps the blocks
        if r.iid not in self.sconn.held:
            raise IntegrityError(f"{request_id}: vLLM freed the blocks of a suspended request")
        r.suspended, r.computed = True, computed
        return True

    def resume_request(self, request_id: str) -> None:
        from services.instance.engine.vllm.connector import PendingLoad

        r = self._get(request_id)
        if not r.suspended:
            raise EngineError(f"request {request_id!r} is not suspended")
        old = r.iid
        src = self.sconn.block_ids(old)[: cdiv(r.computed, self._block_size)]
        self.by_iid.pop(old, None)
        self._submit(r, PendingLoad(src, r.computed, held_id=old))

    def export_state(self, request_id: str) -> RequestState:
        r = self._get(request_id)
        if not r.suspended:
            raise EngineError(f"request {request_id!r} is not suspended")
        return RequestState(
            request_id=r.request_id, prompt_token_ids=list(r.prompt), output_token_ids=list(r.output),
            sampling=r.sampling, priority=r.priority, rng_state=b"", arrival_time=r.arrival_time,
            first_token_time=r.first_token_time, num_preemptions=r.preemptions,
            preemption_loss_ms=r.preemption_loss_ms, num_migrations=r.num_migrations,
            num_computed_tokens=r.computed, extra=dict(r.extra), cached_prompt_tokens=r.cached)

    def install_request(self, state: RequestState, block_ids: list[int]) -> None:
        from services.instance.engine.vllm.connector import PendingLoad

        self._need_migration()
        if state.request_id in self.reqs:
            raise EngineError(f"request {state.request_id!r} already exists")
        n_tokens = len(state.prompt_token_ids) + len(state.output_token_ids)
        if not 0 <= state.num_computed_tokens < n_tokens:
            raise EngineError(f"num_computed_tokens {state.num_computed_tokens} out of range")
        check_token_ids(state.prompt_token_ids + state.output_token_ids, self.vocab_size, "the migrated request")
        need = cdiv(state.num_computed_tokens, self._block_size)
        if len(block_ids) != need or any(b not in self.sconn.reserved for b in block_ids):
            raise EngineError(f"{len(block_ids)} reserved blocks for {state.num_computed_tokens} computed tokens "
                              f"(need {need})")
        r = _Req(state.request_id, list(state.prompt_token_ids), state.sampling, state.priority,
                 state.arrival_time, output=list(state.output_token_ids), first_token_time=state.first_token_time,
                 preemptions=state.num_preemptions, preemption_loss_ms=state.preemption_loss_ms,
                 num_migrations=state.num_migrations, extra=dict(state.extra),
                 trace_headers=dict(state.trace_headers), cached=state.cached_prompt_tokens)
        staging = [self.sconn.reserved[b] for b in block_ids]
        self._submit(r, PendingLoad(list(block_ids), state.num_computed_tokens, reserved=staging))

    def drop_request(self, request_id: str) -> None:
        r = self._get(request_id)
        if not r.suspended:
            raise EngineError(f"request {request_id!r} is not suspended")
        self.reqs.pop(request_id, None)
        self.sconn.release_held(r.iid)
