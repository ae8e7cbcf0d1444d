"""The step loop shared by every engine (base.Engine on top of the block pool,
the scheduler and an executor). Engines differ only in their executor."""

from __future__ import annotations

import time
from collections.abc import Callable

from libs.common import failpoints
from libs.common.validation import out_of_vocab_message, sampling_problem
from libs.common.types import FinishReason, RequestLoad, RequestPhase, RequestState, SamplingParams, TokenOutput
from services.instance.engine.base import (
    Engine,
    EngineBroken,
    EngineConfig,
    EngineError,
    EngineLoad,
    EngineRequest,
    ProgramKv,
    IntegrityError,
    KvLayout,
    MigrationHooks,
    PeerShort,
    RequestFailed,
)
from services.instance.engine.core.block_pool import BlockPool
from services.instance.engine.core.executor import Executor, Sampled
from services.instance.engine.core.pins import program_hold
from services.instance.engine.core.probe import executor_works
from services.instance.engine.core.prefix_engine import PrefixCaching
from services.instance.engine.core.request import Request, RequestStatus
from services.instance.engine.core.scheduler import ScheduledChunk, Scheduler, cdiv

# Steps in a row in which every scheduled request failed on its own and no
# canary could be run (no free block): past this, the engine (not a request)
# is what is broken. With a free block the canary decides (core/probe.py).
MAX_FAILED_STEPS = 3


def check_token_ids(ids, vocab_size: int, what: str) -> None:
    """Raise EngineError naming the first id outside 0 .. vocab_size-1."""
    message = out_of_vocab_message(what, ids, vocab_size)
    if message:
        raise EngineError(message)


def check_request(request: EngineRequest, max_model_len: int, vocab_size: int) -> int:
    """Raise EngineError if the request can never run on an engine of this
    context length and vocabulary; returns its context length (prompt and
    resumed tokens). Shared by every engine that takes EngineRequests."""
    if not request.prompt_token_ids:
        raise EngineError("empty prompt")
    sp = request.sampling
    n_ctx = len(request.prompt_token_ids) + len(request.resume_token_ids)
    if request.resume_token_ids and sp.max_tokens <= len(request.resume_token_ids):
        raise EngineError("max_tokens already reached by resume_token_ids")
    if n_ctx >= max_model_len:
        raise EngineError(f"prompt of {n_ctx} tokens does not fit max_model_len {max_model_len}")
    problem = sampling_problem(sp, vocab_size)
    if problem:
        raise EngineError(problem)
    check_token_ids(request.prompt_token_ids, vocab_size, "the prompt")
    check_token_ids(request.resume_token_ids, vocab_size, "resume_token_ids")
    return n_ctx


class CoreEngine(PrefixCaching, Engine, MigrationHooks):
    name = "core"

    def __init__(self, config: EngineConfig, executor: Executor, num_blocks: int, max_model_len: int,
                 model_name: str | None = None, clock: Callable[[], float] = time.time):
        """``clock``: where the engine reads the time of a step's tokens and of
        preemptions (a virtual clock in the discrete-event simulator)."""
        self.config = config
        self.clock = clock
        self.executor = executor
        self._block_size = executor.kv_layout.block_size
        self._max_model_len = max_model_len
        self._model_name = model_name or config.model
        watermark = int(config.watermark * num_blocks)
        self.pool = BlockPool(num_blocks, watermark_blocks=watermark, caching=config.prefix_caching)
        self.scheduler = Scheduler(self.pool, self._block_size, config.max_num_seqs,
                                   config.max_num_batched_tokens, clock=clock, prefill_first=config.prefill_first)
        self.requests: dict[str, Request] = {}  # every live request, any status
        # A pipeline peer's requests whose layers run here (KunServe): their blocks only.
        self.guests: dict[str, Request] = {}
        self._seq = 0
        self._failed_steps = 0  # steps in a row where every request failed
        # What is held of programs' blocks between turns (pins.py): Continuum's TTL pins, or keep by
        # expected return; off at ttl 0 and keep 0.
        self.pins = program_hold(self.pool, config.program_ttl_s, config.program_keep, config.program_gap_s,
                                 self._block_size, clock)
        self._exports: dict[str, list[int]] = {}  # program -> its blocks pinned for a cache move out

    # --- static facts -------------------------------------------------------
    block_size = property(lambda self: self._block_size)
    num_total_blocks = property(lambda self: self.pool.capacity)
    max_model_len = property(lambda self: self._max_model_len)
    kv_layout: KvLayout = property(lambda self: self.executor.kv_layout)
    num_free_blocks = property(lambda self: self.pool.num_free)
    model_name = property(lambda self: self._model_name)
    vocab_size = property(lambda self: self.executor.vocab_size)
    layer_taps = property(lambda self: self.executor.layer_taps)

    # --- serving ----------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise EngineError(f"request {rid!r} already exists")
        sp = request.sampling
        n_ctx = check_request(request, self._max_model_len, self.vocab_size)
        if cdiv(n_ctx + 1, self._block_size) > self.pool.capacity - self.pool.watermark_blocks:
            raise EngineError(f"prompt of {n_ctx} tokens needs more KV blocks than this engine has")
        self._seq += 1
        req = Request(rid, list(request.prompt_token_ids), sp, request.priority, request.arrival_time,
                      output_token_ids=list(request.resume_token_ids), seq=self._seq)
        req.hold_after_prefill = request.hold_after_prefill
        req.program_id = request.program_id
        self.executor.init_request(req)
        if request.resume_token_ids:
            self.executor.resume_sampler(req, len(request.resume_token_ids))
        self.executor.expect_context(n_ctx)
        self.requests[rid] = req
        self.scheduler.add_waiting(req)

    def abort_request(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, FinishReason.ABORT)
        return True

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def _expire_pins(self) -> None:
        if self.pins.watching:
            # a program whose next turn is here: its blocks go back to the cache, where that turn's admission
            # finds them (this step's), then holds them itself
            self.pins.expire({r.program_id for r in self.requests.values() if r.program_id})

    def step(self) -> list[TokenOutput]:
        self._expire_pins()
        self.scheduler.prefix_reuse = not self.executor.pipelined
        sched = self.scheduler.schedule()
        if sched.preempted:  # recomputed from scratch: a pipeline peer's part goes too
            self.executor.release_requests([r.request_id for r in sched.preempted])
        if not sched.chunks:
            return []
        chunks, tokens, outputs = self._execute(sched.chunks)
        now = self.clock()
        for chunk, tok in zip(chunks, tokens):
            req = chunk.request
            samples = chunk.samples
            req.num_computed_tokens = chunk.end
            self._cache_computed(req)
            req.on_computed(now)
            if not samples:
                continue
            if req.sampling.max_tokens == 0:  # the prompt only (its logprobs): done, nothing drawn
                req.first_token_time = now
                outputs.append(TokenOutput(req.request_id, 0, None, FinishReason.LENGTH, self._final_stats(req),
                                           prompt_logprobs=self._take_prompt_logprobs(req)))
                self._finish(req, FinishReason.LENGTH)
                continue
            logprobs = None
            if isinstance(tok, Sampled):
                tok, logprobs = tok.token, tok.logprobs
            tok = int(tok)
            req.output_token_ids.append(tok)
            if not req.first_token_time:
                req.first_token_time = now
            reason = self._stop_reason(req, tok)
            stats = None
            if reason is not None:  # counters travel with the final token to the client
                stats = self._final_stats(req)
            outputs.append(TokenOutput(req.request_id, len(req.output_token_ids) - 1, tok, reason, stats,
                                       logprobs=logprobs, prompt_logprobs=self._take_prompt_logprobs(req)))
            if reason is not None:
                self._finish(req, reason)
            elif req.hold_after_prefill:
                self._hold(req)
        return outputs

    @staticmethod
    def _take_prompt_logprobs(req: Request) -> tuple | None:
        """The prompt's logprobs (None for its first token) with the request's
        first output, once; None after, or when not asked for."""
        if req.sampling.prompt_logprobs is None or req.prompt_logprobs_sent:
            return None
        req.prompt_logprobs_sent = True
        return (None,) + tuple(req.prompt_logprobs.get(j) for j in range(1, req.num_prompt_tokens))

    def _hold(self, req: Request) -> None:
        """Its prompt is done: out of the batch until its handoff ends
        (EngineRequest.hold_after_prefill). Held once: a handoff that aborts
        resumes it and it decodes here."""
        req.hold_after_prefill = False
        self.scheduler.remove(req)
        req.status = RequestStatus.SUSPENDED

    @staticmethod
    def _final_stats(req: Request) -> dict:
        return {"num_preemptions": req.num_preemptions, "preemption_loss_ms": req.preemption_loss_ms,
                "num_migrations": req.num_migrations, "prefix_hit_tokens": req.prefix_hit_tokens,
                "program_id": req.program_id, "cached_prompt_tokens": req.cached_prompt_tokens}

    # --- one request's failure fails that request only ----------------------------------
    def _run(self, chunks: list[ScheduledChunk]) -> list[int | None]:
        poison = failpoints.value("engine.poison_token")
        if poison is not None and any(int(poison) in c.request.tokens(c.start, c.end) for c in chunks):
            # An exception that names no request, as a kernel's would.
            raise RuntimeError(f"failpoint: engine.poison_token={poison}")
        return self.executor.execute(chunks)

    def _execute(self, chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], list, list[TokenOutput]]:
        """Run the step's chunks. A failure fails only the requests it
        belongs to: those the executor names (RequestFailed), else those that
        fail when each chunk runs alone. Returns (the chunks that ran, their
        tokens, the final outputs of the failed requests). Raises EngineBroken
        when the engine fails for everyone."""
        try:
            tokens = self._run(chunks)
        except PeerShort:
            # A pipeline peer cannot hold the step's guests: make room as for
            # our own blocks (NOTE: the step wrote KV for the others at the
            # layers held here; the rerun writes the same KV again).
            victim = min((c.request for c in chunks), key=lambda r: (int(r.priority), -r.arrival_time, -r.seq))
            self.scheduler.preempt(victim)
            self.executor.release_requests([victim.request_id])
            rest = [c for c in chunks if c.request is not victim]
            return self._execute(rest) if rest else ([], [], [])
        except RequestFailed as e:
            failed = {rid: (e.code, str(e)) for rid in e.request_ids}
            rest = [c for c in chunks if c.request.request_id not in failed]
            if not failed or len(rest) == len(chunks):
                raise EngineBroken(f"the executor failed naming no request of this step: {e}") from e
            errors = self._fail(failed, all_failed=not rest)
            if not rest:
                return [], [], errors
            ran, tokens, more = self._execute(rest)  # NOTE: no RNG moved, so the rerun is exact
            return ran, tokens, errors + more
        except EngineBroken:
            raise
        except Exception as e:  # noqa: BLE001 - whose fault it is decides what happens
            if len(chunks) > 1:
                return self._isolate(chunks, e)
            rid = chunks[0].request.request_id
            return [], [], self._fail({rid: ("internal", f"engine error: {e!r}")}, all_failed=True)
        self._failed_steps = 0
        return chunks, tokens, []

    def _isolate(self, chunks: list[ScheduledChunk], error: Exception):
        """A batch failed naming nobody: run each chunk alone; the ones that
        still fail are the culprits. If every one fails, a canary decides
        whether they are, or the engine (``_fail``)."""
        ran, tokens, failed = [], [], {}
        for c in chunks:
            try:
                tokens += self._run([c])
                ran.append(c)
            except Exception as e:  # noqa: BLE001
                failed[c.request.request_id] = (getattr(e, "code", "internal"), f"engine error: {e!r}")
        if not ran:
            return [], [], self._fail(failed, all_failed=True, what=f"every request of a {len(chunks)}-request "
                                      f"step fails alone: {error!r}")
        self._failed_steps = 0
        return ran, tokens, self._fail(failed)

    def _fail(self, failed: dict[str, tuple[str, str]], all_failed: bool = False,
              what: str = "") -> list[TokenOutput]:
        """End the failed requests with FinishReason.ERROR and free their
        blocks. ``all_failed``: nobody ran this step: a canary then says
        whether the engine still works (else EngineBroken); without a block
        to run it in, such steps count towards EngineBroken."""
        outputs = self._end_failed(failed)
        if all_failed:
            why = what or next(iter(failed.values()))[1]
            works = executor_works(self.executor, self.pool)
            if works is False:
                raise EngineBroken(f"{why}; a canary request fails too")
            self._failed_steps = 0 if works else self._failed_steps + 1
            if self._failed_steps >= MAX_FAILED_STEPS:
                raise EngineBroken(f"{self._failed_steps} steps in a row failed for every request: {why}")
        return outputs

    def _end_failed(self, failed: dict[str, tuple[str, str]]) -> list[TokenOutput]:
        outputs = []
        for rid, (code, message) in failed.items():
            req = self.requests.get(rid)
            if req is None:
                continue
            self._finish(req, FinishReason.ERROR)
            outputs.append(TokenOutput(rid, len(req.output_token_ids), None, FinishReason.ERROR,
                                       self._final_stats(req), error=(code, message)))
        return outputs

    def _stop_reason(self, req: Request, tok: int) -> FinishReason | None:
        sp = req.sampling
        n_out = len(req.output_token_ids)
        if req.grammar_done:  # its structured output is complete (the grammar accepted a stop token)
            return FinishReason.STOP
        if n_out >= sp.min_tokens:
            if tok in sp.stop_token_ids:
                return FinishReason.STOP
            if not sp.ignore_eos and tok in self.executor.eos_token_ids:
                return FinishReason.STOP
        if n_out >= sp.max_tokens or req.num_tokens >= self._max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.executor.release_requests([req.request_id])
        self.scheduler.remove(req)
        if req.program_id and reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.pins.pin(req.program_id, req.block_ids[:req.num_cached_blocks])
        if req.block_ids:
            self.pool.free(req.block_ids)
        req.block_ids = []
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.request_id, None)

    # --- load -------------------------------------------------------------------
    def load(self) -> EngineLoad:
        self._expire_pins()
        s = self.scheduler
        shared: set[int] = set()
        reqs = [RequestLoad(r.request_id, r.priority, state, self._own_blocks(r, shared), r.num_tokens)
                for state, queue in ((RequestPhase.RUNNING, s.running), (RequestPhase.WAITING, s.waiting)) for r in queue]
        demands = [s.demand_blocks(r) for r in s.waiting]
        # A running request with more than one token to compute is computing
        # its prompt in chunks (a decoding one computes one token a step).
        prefill = sum(n for r in s.running if (n := r.num_tokens - r.num_computed_tokens) > 1)
        return EngineLoad(
            total_blocks=self.pool.capacity,
            free_blocks=self.pool.num_free - self.pins.withheld(),  # kept blocks: held for dispatch
            block_size=self._block_size,
            requests=tuple(reqs),
            head_of_line_demand_blocks=demands[0] if demands else 0,
            waiting_demand_blocks=sum(demands),
            running_prefill_tokens=prefill,
            num_preemptions=s.num_preemptions,
            reserved_blocks=self.pool.num_reserved,
            shared_blocks=len(shared),
            prefix_cache=self.prefix_cache_stats(),
            preempted_waiting=sum(1 for r in s.waiting if r.num_preemptions),
            kept_blocks=self.pins.withheld(),
        )

    def check_integrity(self) -> None:
        live = list(self.requests.values())
        queued = self.scheduler.waiting + self.scheduler.running
        if len({id(r) for r in queued}) != len(queued):
            raise IntegrityError("a request is queued twice")
        for r in live:
            have = cdiv(r.num_computed_tokens, self._block_size)
            if len(r.block_ids) < have:
                raise IntegrityError(f"{r.request_id}: {len(r.block_ids)} blocks for {have} computed blocks")
            self._check_named(r)
            if (r.status is RequestStatus.SUSPENDED) == (r in queued):
                raise IntegrityError(f"{r.request_id}: status {r.status} disagrees with the queues")
        self.pool.check_integrity([r.block_ids for r in live] + [g.block_ids for g in self.guests.values()]
                                  + self.pins.owned() + list(self._exports.values()))

    def request_stats(self, request_id: str) -> dict:
        r = self.requests.get(request_id)
        if r is None:
            return {}
        return {"arrival_time": r.arrival_time, "first_token_time": r.first_token_time,
                "num_preemptions": r.num_preemptions, "preemption_loss_ms": r.preemption_loss_ms,
                "num_computed_tokens": r.num_computed_tokens, "num_tokens": r.num_tokens,
                "prefix_hit_tokens": r.prefix_hit_tokens, "program_id": r.program_id}

    # --- migration hooks --------------------------------------------------------
    def _get(self, request_id: str) -> Request:
        try:
            return self.requests[request_id]
        except KeyError:
            raise EngineError(f"unknown request {request_id!r}") from None

    def request_phase(self, request_id: str) -> tuple[str, int] | None:
        r = self.requests.get(request_id)
        return None if r is None else (r.status.value, r.num_preemptions)

    def _local_kv(self, request_id: str) -> Request:
        r = self._get(request_id)
        if request_id in self.executor.remote_requests:
            raise EngineError(f"request {request_id!r} has KV on a pipeline peer: it cannot migrate")
        return r

    def full_blocks(self, request_id: str) -> list[int]:
        r = self._local_kv(request_id)
        return list(r.block_ids[: r.num_computed_tokens // self._block_size])

    def all_blocks(self, request_id: str) -> list[int]:
        return self._computed_blocks(self._local_kv(request_id))

    def _computed_blocks(self, r: Request) -> list[int]:
        """The blocks that hold the request's computed tokens (the last one may be partial)."""
        return list(r.block_ids[: cdiv(r.num_computed_tokens, self._block_size)])

    # --- a pipeline peer's requests (KunServe; native/kunserve.py) ------------------------
    def forward_guest(self, layers: range, chunks, hidden, attend=None):
        """Run ``layers`` here for a peer's step (pipeline.GuestChunk's, the
        hidden rows in their order); the guests' KV takes blocks of this
        pool. Raises EngineError when the blocks are not there (nothing taken).
        ``attend``: remote attention at the owner for chunks with ``kv_at_owner``."""
        plan = []
        for g in chunks:
            r = self.guests.get(g.request_id)
            need = cdiv(g.start + g.num_new, self._block_size) - (len(r.block_ids) if r else 0)
            plan.append((g, r, max(0, need)))
        total = sum(n for _, _, n in plan)
        if not self.pool.can_allocate(total):
            raise PeerShort(f"{total} KV blocks for a pipeline peer's step, {self.pool.num_free} free here")
        sched, created = [], []
        for g, r, need in plan:
            if r is None:
                r = self._new_guest(g.request_id, 0)
                created.append(g.request_id)
            if need:
                r.block_ids += self.pool.allocate(need)
            sched.append(ScheduledChunk(r, g.start, g.num_new))
        try:
            return self.executor.forward_guest(layers, sched, hidden, attend,
                                               [getattr(g, "kv_at_owner", False) for g in chunks])
        except Exception:
            self.release_guests(created)  # a step that did not run here leaves no new guest behind
            raise

    def guest_kv(self, request_id: str, layers: range, num_tokens: int) -> memoryview:
        """A guest's KV of these layers for its first ``num_tokens`` tokens
        (whole blocks, layer-major), for its owner taking it back."""
        r = self.guests.get(request_id)
        n = cdiv(num_tokens, self._block_size)
        if r is None or len(r.block_ids) < n:
            raise EngineError(f"no KV here for {num_tokens} tokens of guest {request_id!r}")
        return self.executor.gather_kv_layers(r.block_ids[:n], layers)

    def adopt_guest_kv(self, request_id: str, layers: range, num_tokens: int, data: bytes | memoryview) -> None:
        """A guest with its owner's KV of these layers for ``num_tokens``
        tokens (``guest_kv``'s layout): the owner enters a pipeline while the
        request runs. A guest of that size takes more layers (a transfer in
        pieces). Raises EngineError when the blocks are not there."""
        n = cdiv(num_tokens, self._block_size)
        g = self.guests.get(request_id)
        if g is not None:
            if len(g.block_ids) != n:
                raise EngineError(f"guest {request_id!r} is here with {len(g.block_ids)} blocks, not {n}")
            self.executor.scatter_kv_layers(g.block_ids, layers, data)
            return
        if not self.pool.can_allocate(n):
            raise EngineError(f"{n} KV blocks for guest {request_id!r}, {self.pool.num_free} free here")
        r = self._new_guest(request_id, n)
        try:
            self.executor.scatter_kv_layers(r.block_ids, layers, data)
        except Exception:
            self.release_guests([request_id])
            raise

    def _new_guest(self, request_id: str, num_blocks: int) -> Request:
        """A peer's request here: no tokens, only blocks (call can_allocate first)."""
        r = self.guests[request_id] = Request(request_id, [], SamplingParams(), arrival_time=1.0)
        r.block_ids = self.pool.allocate(num_blocks) if num_blocks else []
        return r

    def release_guests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            r = self.guests.pop(rid, None)
            if r is not None and r.block_ids:
                self.pool.free(r.block_ids)

    def kv_share(self):
        return self.executor.kv_share()

    def gather_kv(self, block_ids: list[int]) -> memoryview:
        return self.executor.gather_kv(list(block_ids))

    def reserve_blocks(self, n: int) -> list[int] | None:
        return self.pool.reserve(n)

    def expect_context(self, num_tokens: int) -> None:
        self.executor.expect_context(num_tokens)

    def scatter_kv(self, block_ids: list[int], data: bytes | memoryview) -> None:
        bad = [b for b in block_ids if not self.pool.is_reserved(b)]
        if bad:
            raise EngineError(f"scatter_kv into blocks {bad} that are not reserved")
        self.executor.scatter_kv(list(block_ids), data)

    def scatter_kv_layer(self, block_ids: list[int], layer: int, data: bytes | memoryview) -> None:
        if not self.executor.layer_taps:
            raise EngineError(f"the {self.name} engine cannot take per-layer KV")
        bad = [b for b in block_ids if not self.pool.is_reserved(b)]
        if bad:
            raise EngineError(f"scatter_kv_layer into blocks {bad} that are not reserved")
        if not 0 <= layer < self.kv_layout.num_layers:
            raise EngineError(f"layer {layer} of a {self.kv_layout.num_layers}-layer KV cache")
        self.executor.scatter_kv_layer(list(block_ids), layer, data)

    def tap_layers(self, request_id: str, tap, copy: bool = True) -> bool:
        r = self.requests.get(request_id)
        if r is None or not self.executor.layer_taps:
            return False
        r.layer_tap = None if tap is None else (tap, copy)
        return True

    def grow_blocks(self, n: int, fresh=None) -> int:
        """n more KV blocks (KunServe: a layer range's parameter memory),
        storage first (``fresh``: the executor's storage made ahead); returns
        the pool's capacity. ``pool.shrink`` gives them back."""
        self.executor.grow_kv(self.pool.ids_after_grow(n), fresh, self.pool.holding())
        return self.pool.grow(n)

    def link_cached(self, hashes: list) -> list[int]:
        return self.pool.link(hashes)

    def release_blocks(self, block_ids: list[int]) -> None:
        self.pool.release(list(block_ids))

    def suspend_request(self, request_id: str) -> bool:
        r = self.requests.get(request_id)
        if r is None or r.status is not RequestStatus.RUNNING:
            return False
        self.scheduler.remove(r)
        r.status = RequestStatus.SUSPENDED
        return True

    def resume_request(self, request_id: str) -> None:
        r = self._get(request_id)
        if r.status is not RequestStatus.SUSPENDED:
            raise EngineError(f"request {request_id!r} is {r.status.value}, not suspended")
        self.scheduler.add_running(r)

    def export_state(self, request_id: str) -> RequestState:
        r = self._get(request_id)
        if r.status is not RequestStatus.SUSPENDED:
            raise EngineError(f"request {request_id!r} is {r.status.value}, not suspended")
        if r.sampling.prompt_logprobs is not None and not r.prompt_logprobs_sent:
            # its prompt's logprobs so far are here, and only sent with its first output
            raise EngineError(f"request {request_id!r} has prompt logprobs not yet delivered: it stays here")
        return RequestState(
            request_id=r.request_id,
            prompt_token_ids=list(r.prompt_token_ids),
            output_token_ids=list(r.output_token_ids),
            sampling=r.sampling,
            priority=r.priority,
            rng_state=self.executor.rng_state(r),
            arrival_time=r.arrival_time,
            first_token_time=r.first_token_time,
            num_preemptions=r.num_preemptions,
            preemption_loss_ms=r.preemption_loss_ms,
            num_migrations=r.num_migrations,
            num_computed_tokens=r.num_computed_tokens,
            extra=dict(r.extra),
            program_id=r.program_id,
            cached_prompt_tokens=r.cached_prompt_tokens,
        )

    def install_request(self, state: RequestState, block_ids: list[int]) -> None:
        if state.request_id in self.requests:
            raise EngineError(f"request {state.request_id!r} already exists")
        n_tokens = len(state.prompt_token_ids) + len(state.output_token_ids)
        if not 0 <= state.num_computed_tokens < n_tokens:
            raise EngineError(f"num_computed_tokens {state.num_computed_tokens} out of range")
        check_token_ids(state.prompt_token_ids + state.output_token_ids, self.vocab_size, "the migrated request")
        need = cdiv(state.num_computed_tokens, self._block_size)
        if len(block_ids) != need:
            raise EngineError(f"{len(block_ids)} blocks for {state.num_computed_tokens} computed tokens "
                              f"(need {need})")
        self.pool.adopt(list(block_ids))
        self._seq += 1
        r = Request(state.request_id, state.prompt_token_ids, state.sampling, state.priority,
                    state.arrival_time, output_token_ids=state.output_token_ids, seq=self._seq)
        r.num_computed_tokens = state.num_computed_tokens
        r.block_ids = list(block_ids)
        r.first_token_time = state.first_token_time
        r.num_preemptions = state.num_preemptions
        r.preemption_loss_ms = state.preemption_loss_ms
        r.num_migrations = state.num_migrations
        r.extra = dict(state.extra)
        r.program_id = state.program_id
        r.cached_prompt_tokens = state.cached_prompt_tokens
        self.executor.init_request(r)
        if state.rng_state:
            self.executor.set_rng_state(r, state.rng_state)
        self.requests[r.request_id] = r
        self._cache_computed(r)  # its full blocks are named here as if computed here
        self.scheduler.add_running(r)

    # --- cache moves (base.MigrationHooks; pins.ProgramKeep) ------------------------
    movable_programs_here = property(lambda self: self.pins.movable_holds)

    def movable_programs(self) -> list[tuple[str, int]]:
        if not self.pins.movable_holds:
            return []
        return [(p, n) for p, n in self.pins.movable() if p not in self._exports]

    def export_program(self, program_id: str) -> ProgramKv | None:
        if not self.pins.movable_holds or program_id in self._exports:
            return None
        blocks = self.pins.chain(program_id)
        if not blocks:
            return None
        self.pool.touch(blocks)
        self._exports[program_id] = blocks
        age, gap = self.pins.handover(program_id)
        hashes = tuple(self.pool.cache.hash_of(b) for b in blocks)
        return ProgramKv(program_id, hashes, tuple(blocks), age, gap)

    def end_export(self, program_id: str, moved: bool) -> None:
        blocks = self._exports.pop(program_id, None)
        if blocks is None:
            raise EngineError(f"program {program_id!r} has no cache move out under way")
        if moved:  # kept there now: here plain cache, the first to go when room is needed
            self.pins.release(program_id)
        self.pool.free(blocks)

    def import_program(self, kv: ProgramKv, block_ids: list[int]) -> None:
        if not self.pins.movable_holds:
            raise EngineError("this engine keeps no programs' blocks (--program-keep 0)")
        if len(block_ids) != len(kv.block_hashes):
            raise EngineError(f"{len(block_ids)} blocks for {len(kv.block_hashes)} hashes")
        ids = list(block_ids)
        self.pool.adopt(ids)
        self.pool.cache_blocks(ids, list(kv.block_hashes), None)
        # a hash this cache named meanwhile keeps its own block (ours then goes plain free)
        named = [self.pool.cache.block_of(h) for h in kv.block_hashes]
        held = [b for b in named if b is not None]
        self.pool.touch(held)
        self.pool.free(ids)
        self.pins.adopt(kv.program_id, held, kv.age_s, kv.gap_s)
        self.pool.free(held)

    def drop_request(self, request_id: str) -> None:
        r = self._get(request_id)
        if r.status is not RequestStatus.SUSPENDED:
            raise EngineError(f"request {request_id!r} is {r.status.value}, not suspended")
        self._finish(r, FinishReason.ABORT)
