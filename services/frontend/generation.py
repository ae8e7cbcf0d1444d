"""One request's token stream as the client sees it: dispatch, follow the
request across migrations (re-attach where it moved, only to a registered
instance), resume it on another instance by recompute if its instance dies
or fails it. Delivery is exactly once and in order by index: the frontend
keeps every token it delivered.

NOTE: a request's retry budget (``max_resumes``, default 1) bounds how often
it is resumed after a failure: its instance died, stalled, or failed it
alone. A poison request then breaks at most two instances' work for it, never
the cluster, and fails alone with its error. An instance that refuses it for
load (RESOURCE_EXHAUSTED) is no failure: the request goes elsewhere, else the
client gets 429."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from libs.common.errors import Code, FerryError, InvalidArgument, ResourceExhausted, Unavailable
from libs.common.logging import get_logger
from libs.common.types import GenerateOrder, Priority, SamplingParams, StreamEvent
from services.frontend import metrics
from services.frontend.peers import PeerError
from services.frontend.router import Router

log = get_logger(__name__)


@dataclass
class Generation:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    priority: Priority = Priority.NORMAL
    # Filled in as the stream goes.
    delivered: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    instances: list[str] = field(default_factory=list)
    num_preemptions: int = 0
    preemption_loss_ms: float = 0.0
    num_migrations: int = 0
    cached_tokens: int = 0  # prompt tokens a prefix cache served (the final event's)
    num_resumes: int = 0
    recomputed_tokens: int = 0  # tokens instances computed again after a resume (prompt + delivered)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    # Above 0: the instance may hold tokens after the first and send them
    # together this often (for clients that read only the whole completion).
    flush_interval_ms: int = 0
    logprobs: list = field(default_factory=list)  # with SamplingParams.logprobs: one per delivered token
    prompt_logprobs: tuple | None = None  # with SamplingParams.prompt_logprobs: one per prompt token
    # An instance to go to if it can take the request (n > 1: where the first choice
    # computed the shared prompt: Router.dispatch's affinity).
    affinity: str = ""
    # The program (an agent's session) it is a turn of (completions.program_of; "" = none).
    program_id: str = ""


async def run_generation(router: Router, gen: Generation, max_resumes: int = 1) -> AsyncIterator[int]:
    """Yield the request's token ids in order, each once. On return,
    ``gen.finish_reason`` is set. Cancelling the iteration cancels the
    instance call, which aborts the request there and frees its blocks."""
    exclude: set[str] = set()
    address = None
    instance_id = None
    attach = False
    handoff = None
    last_token_at = None

    def resume_elsewhere(why: str, error: BaseException | None = None, final: FerryError | None = None) -> None:
        """The instance failed the stream (crashed, ended it early, stalled,
        failed the request): resume the request on another one by recompute,
        or give up (with ``final`` if given)."""
        nonlocal address
        if gen.num_resumes >= max_resumes:
            if final is not None:
                raise final from error
            raise Unavailable(f"{why}; the request was resumed {max_resumes} times already") from error
        gen.num_resumes += 1
        gen.recomputed_tokens += len(gen.prompt_ids) + len(gen.delivered)
        metrics.RESUMES.inc()
        log.warning("instance failed the request; resuming elsewhere", request_id=gen.request_id,
                    instance_id=instance_id, delivered=len(gen.delivered), reason=why)
        exclude.add(instance_id)
        address = None

    while True:
        if address is None:
            placed = await router.dispatch(
                gen.request_id, len(gen.prompt_ids) + len(gen.delivered), gen.priority, frozenset(exclude),
                token_ids=list(gen.prompt_ids) + list(gen.delivered), affinity=gen.affinity,
                program_id=gen.program_id)
            instance_id, address, run_priority = placed.instance_id, placed.address, placed.run_priority
            # Splitwise: the decode instance goes with the request; its stream ends
            # with `moved` there once the prompt is done, followed like a migration.
            handoff = (placed.decode_instance_id, placed.decode_address) if placed.decode_instance_id else None
            metrics.PER_INSTANCE.labels(instance_id).inc()
            gen.instances.append(instance_id)
            attach = False
        order = None if attach else GenerateOrder(
            gen.request_id, tuple(gen.prompt_ids), gen.sampling, run_priority, tuple(gen.delivered), handoff,
            gen.flush_interval_ms, gen.program_id)
        try:
            call = router.peers.attach(address, gen.request_id, len(gen.delivered), gen.flush_interval_ms) \
                if attach else router.peers.generate(address, order)
        except PeerError as e:
            resume_elsewhere(f"instance {instance_id} cannot be reached: {e.code.name}", e)
            continue
        watched = router.watchdog.watch(gen.request_id, instance_id, address, call)
        moved = None
        failed = None
        try:
            async for ev in call:
                watched.touch()
                if ev.prompt_logprobs and gen.prompt_logprobs is None:
                    gen.prompt_logprobs = ev.prompt_logprobs
                if ev.token_ids:
                    skip = len(gen.delivered) - ev.index  # of these, already delivered
                    if skip < 0:
                        raise FerryError(f"token stream gap: got index {ev.index}, "
                                         f"expected {len(gen.delivered)}")
                    new = ev.token_ids[skip:]
                    if new:
                        now = time.perf_counter()
                        if gen.first_token_at is None:
                            gen.first_token_at = now
                            metrics.TTFT.observe(now - gen.arrival)
                        elif last_token_at is not None:
                            gap = (now - last_token_at) / len(new)
                            for _ in new:
                                metrics.ITL.observe(gap)
                        last_token_at = now
                        lps = ev.logprobs[skip:] if ev.logprobs else ()
                        for k, token_id in enumerate(new):
                            gen.delivered.append(token_id)
                            if k < len(lps):
                                gen.logprobs.append(lps[k])
                            yield token_id
                if ev.finish_reason == "error":
                    err = _request_error(ev, instance_id)
                    if err.code is not Code.INTERNAL:
                        raise err
                    failed = err  # the engine failed it: once more elsewhere, then the error
                    break
                if ev.finish_reason:
                    gen.finish_reason = ev.finish_reason
                    gen.num_preemptions += ev.num_preemptions
                    gen.preemption_loss_ms += ev.preemption_loss_ms
                    gen.num_migrations = max(gen.num_migrations, ev.num_migrations)
                    gen.cached_tokens = min(ev.num_cached_tokens, len(gen.prompt_ids))
                    return
                if ev.moved is not None:
                    moved = ev.moved
                    break
        except PeerError as e:
            if e.code is Code.INVALID_ARGUMENT:
                raise InvalidArgument(str(e) or "rejected by the instance") from e
            if e.code is Code.RESOURCE_EXHAUSTED and not gen.delivered:
                # Refused for load before it started: not a failure; another instance, else 429.
                exclude.add(instance_id)
                if len(exclude) >= max(1, len(router.view.records)):
                    raise ResourceExhausted(f"every instance is full: {e}") from e
                address = None
                continue
            resume_elsewhere(f"instance {instance_id} failed: {e.code.name}", e)
            continue
        except asyncio.CancelledError:
            if watched.stalled is None or asyncio.current_task().cancelling():
                raise  # the client went away (or the server stops)
            resume_elsewhere(f"no progress for {router.watchdog.stall_s:g}s: {watched.stalled}")
            continue
        finally:
            router.watchdog.unwatch(watched)
            call.cancel()
        if failed is not None:
            resume_elsewhere(f"instance {instance_id} failed the request", final=failed)
            continue
        if moved is None:
            # The stream ended without a final event: the instance went away.
            resume_elsewhere(f"instance {instance_id} ended the stream early")
            continue
        if not await router.is_registered(moved.instance_id, moved.address):
            # NOTE: a move is followed only to an instance the meta store
            # knows at that address: the cluster token is not enough to send
            # a client's stream anywhere.
            log.warning("move to an unregistered instance refused", request_id=gen.request_id,
                        instance_id=moved.instance_id, address=moved.address)
            resume_elsewhere(f"instance {instance_id} moved the request to an unregistered instance")
            continue
        metrics.MIGRATIONS_FOLLOWED.inc()
        gen.num_migrations += 1
        instance_id, address, attach = moved.instance_id, moved.address, True
        gen.instances.append(instance_id)


def _request_error(ev: StreamEvent, instance_id: str) -> FerryError:
    """The error of a request its instance failed on its own (the engine went
    on for the others): not resumed elsewhere, it would fail there too."""
    code_value, message = ev.error or ("", "")
    try:
        code = Code(code_value)
    except ValueError:
        code = Code.INTERNAL
    metrics.REQUEST_ERRORS.labels(code.value).inc()
    return FerryError(f"the request failed on instance {instance_id}: {message or 'engine error'}", code=code)
