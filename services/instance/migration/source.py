"""The source side of one migration (docs/design.md §6): multi-stage pre-copy of
full blocks while the request keeps decoding, pre-allocate before and verify
after every stage, suspend at a step boundary, last stage, commit with the
full request state. Any failure aborts: the request goes on at the source as
if nothing happened.

NOTE: cancellation-safe. A cancel (the order's caller went away, the
instance stops) at any await aborts like a failure, and the abort itself runs
to its end even if cancelled again: the request runs on exactly one instance.
After the commit acknowledgement nothing awaits until the request is handed
over (``moved`` pushed, the local copy dropped at the next step boundary).

A Splitwise handoff (``handoff=True``, serialized mode) is the same protocol
without pre-copy: SELECT -> SUSPEND -> PRE_ALLOC_LAST -> COPY_LAST -> COMMIT.
The engine held the request right after the step that produced its first
token (EngineRequest.hold_after_prefill), so the whole prompt KV goes in one
last stage; an engine that cannot hold leaves it running and the suspend
takes it out of the batch as for a migration."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

from libs.common.types import Outcome
from libs.common import failpoints
from libs.common.logging import get_logger
from services.instance.migration.host import MigrationHost
from services.instance.migration.messages import (
    KvChunk,
    LastStage,
    MigrationAborted,
    MigrationConfig,
    PeerError,
    PreAllocate,
)
from services.instance.migration.peer import DestinationPeer
from services.instance.migration.states import Machine, SourceState
from services.instance.streams import Event
from libs.common.types import RequestPhase, RequestState

log = get_logger("migration")
S = SourceState
# A reservation outlives this many of the source's engine steps unrenewed.
STEPS_PER_DEADLINE = 10
Fault = Callable[[str], None]

__all__ = ["MigrationAborted", "MigrationConfig", "Outcome", "SourceMigration", "failpoint_faults"]


def _cancel_now_if_asked() -> None:
    """The last point a cancel stops a migration: just before the commit.
    A cancel asked earlier lands at the next await that suspends, and the
    stages after the suspend may have none (blocks from the spare ones, a
    shared-cache copy, a synchronous destination): without this check the
    commit would go out, and the cancel land after the request moved."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()


def failpoint_faults(name: str) -> None:
    """The process-wide failpoints (``--failpoints``) at the source's fault
    points. NOTE: source.crash_mid_transfer simulates the source process
    being killed (SIGKILL): it exits, from the source core, not from inside
    the transport's chunk generator; source.crash_after_commit, between the
    commit's acknowledgement and the client's ``moved``."""
    if name in ("source.crash_mid_transfer", "source.crash_after_commit") and failpoints.enabled(name):
        import os

        os._exit(17)


# (suspended, the clock when it was, its state, its blocks not yet sent)
Exported = tuple[bool, float, RequestState | None, list[int]]


def export_suspended(engine, request_id: str, sent: int, clock: Callable[[], float]) -> Exported:
    """On the engine thread, between two steps, a suspended request: its
    state (counted as migrated once more) and its blocks after the first
    ``sent`` (the partial last block included). Downtime starts here."""
    t = clock()
    state = engine.export_state(request_id)
    state.num_migrations += 1
    return True, t, state, engine.all_blocks(request_id)[sent:]


def _noticed(task: asyncio.Task) -> None:
    """A commit notice's answer, for the log (an optimization: nothing depends on it)."""
    if not task.cancelled() and task.exception() is not None:
        log.info("commit notice failed", error=repr(task.exception()))


class SourceMigration:
    measures_downtime = True  # a committed one asks its destination when the request first stepped there

    def __init__(self, host: MigrationHost, request_id: str, dest_id: str, dest_address: str,
                 peer: DestinationPeer, config: MigrationConfig, fault: Fault = failpoint_faults,
                 handoff: bool = False, expected_ack_ms: float = 10.0, exported: Exported | None = None):
        self.host = host
        self.engine = host.engine
        self.runner = host.runner
        self.request_id = request_id
        self.dest_id = dest_id
        self.dest_address = dest_address
        self.peer = peer
        self.config = config
        self.fault = fault
        self.id = f"mig-{uuid.uuid4().hex[:12]}"
        self.m = Machine("source", self.id, request_id, S.SELECT)
        self.out = Outcome(self.id, request_id, False)
        self.sent = 0  # blocks already copied
        self.preemptions = 0
        self.dest_failed = False  # the destination could not be reached or refused
        self.handoff = handoff
        # A held handoff's export, taken at the boundary where its engine held it (Handoffs.at_boundary):
        # the last stage starts without waiting for the next step boundary.
        self.exported = exported
        # The engine's shared KV cache as last offered, if the destination mapped it (shared_kv.py).
        self.shared = None
        self.expected_ack_ms = expected_ack_ms  # suspend -> commit acknowledged, of recent migrations
        self._notice: asyncio.Task | None = None  # the commit announced to the destination (join_notice)

    # --- helpers ---------------------------------------------------------------
    def _to(self, state: SourceState, **fields) -> None:
        self.m.to(state, **fields)
        self.fault(f"source.{state.value}")  # tests inject failures and cancellations here

    @property
    def spare_blocks(self) -> int:
        """Most blocks the last stage can need: the uncopied full blocks that
        allow it, the partial block, and one more the request may fill while
        the suspend waits for the step boundary."""
        return self.config.last_stage_max_blocks + 2

    @property
    def deadline_ms(self) -> int:
        """How long the destination keeps an unrenewed reservation: the
        configured deadline, or longer when this engine's steps are long.
        Between two calls to the destination the source waits on its engine
        (a call runs at a step boundary) a few times: with 1.2-second steps
        (a 4,096-token request on a loaded CPU) a 3-second deadline expired
        mid-migration (`ferry bench migration`)."""
        return max(self.config.deadline_ms, int(STEPS_PER_DEADLINE * 1000 * self.runner.last_step_s))

    async def _pre_allocate(self, stage: int, n: int, spare: int = 0, last: bool = False,
                            full: int = -1, hashes: tuple | None = None) -> int:
        """Returns how many of the request's first blocks the destination
        linked from its prefix cache (the first stage, ``full`` >= 0: the
        request's computed full blocks, the most it may link); those are not
        sent, and ``n`` counts them. ``hashes``: the request's block hashes,
        where the engine has not computed them yet (a per-layer handoff's
        prompt); default: the engine's."""
        share = self.engine.kv_share() if self.config.shared_kv else None
        if stage != 0:
            hashes = ()
        elif hashes is None:
            hashes = tuple(self.engine.block_hashes(self.request_id))
        link = self.config.link_cached and full > 0
        if link:
            hashes = hashes[:full]  # NOTE: never a block whose KV is not computed yet
        a = await self.peer.pre_allocate(PreAllocate(
            self.id, self.request_id, stage, n, self.engine.kv_layout, self.deadline_ms,
            self.host.instance_id, spare, handoff=self.handoff, last=last, kv_share=share, block_hashes=hashes,
            link=link))
        if not a.accepted:
            self.dest_failed = True
            raise MigrationAborted(f"destination refused: {a.reason}")
        self.shared = share if a.kv_shared else None
        if hashes:
            self.out.held_blocks = len(a.held)
        linked = a.linked if link else 0
        if linked:
            self.out.linked_blocks = linked
            self.sent = linked
        return linked

    async def _copy(self, stage: int, blocks: list[int], paced: bool = False) -> int:
        """Gather the blocks in chunks (off the event loop and the engine
        thread) and stream them; returns bytes sent. Paced (pre-copy while
        the request decodes here): smaller chunks, and after each a pause so
        that copying takes at most ``copy_duty`` of the wall time. When the
        destination mapped this engine's shared cache (and it is still the
        one offered: a grown cache is another), the chunks name the blocks
        and the destination copies them: nothing is gathered here."""
        if not blocks:
            return 0
        if self.shared is not None and self.engine.kv_share() == self.shared:
            return await self._copy_shared(stage, blocks)
        bpb = self.engine.kv_layout.bytes_per_block
        chunk_bytes = min(self.config.chunk_bytes, self.config.precopy_chunk_bytes) if paced \
            else self.config.chunk_bytes
        per_chunk = max(1, chunk_bytes // bpb)
        total = len(blocks) * bpb
        duty = self.config.copy_duty if paced else 1.0

        async def chunks():
            for i in range(0, len(blocks), per_chunk):
                t = self.host.clock()
                data = await self.host.offload(self.engine.gather_kv, blocks[i:i + per_chunk])
                yield KvChunk(self.id, stage, i * bpb, data, len(blocks), total)
                # Back here once the transport took the chunk (sent it).
                if i == 0:
                    self.fault("source.crash_mid_transfer")
                if 0 < duty < 1 and i + per_chunk < len(blocks):
                    await asyncio.sleep((self.host.clock() - t) * (1 / duty - 1))

        await self._sent(blocks, await self.peer.transfer(chunks()))
        return total

    async def _copy_shared(self, stage: int, blocks: list[int]) -> int:
        bpb = self.engine.kv_layout.bytes_per_block
        per_chunk = max(1, self.config.chunk_bytes // bpb)
        total = len(blocks) * bpb

        async def chunks():
            for i in range(0, len(blocks), per_chunk):
                yield KvChunk(self.id, stage, i * bpb, b"", len(blocks), total,
                              src_blocks=tuple(blocks[i:i + per_chunk]))
                if i == 0:
                    self.fault("source.crash_mid_transfer")

        await self._sent(blocks, await self.peer.transfer(chunks()))
        self.out.kv_shared = True
        return total

    async def _sent(self, blocks: list[int], written: int) -> None:
        if written != len(blocks):
            raise MigrationAborted(f"destination wrote {written} of {len(blocks)} blocks")
        delay = failpoints.value("source.copy_delay_ms")  # tests: a slow transfer
        if delay and len(blocks) >= int(failpoints.value("source.copy_delay_min_blocks") or 0):
            await asyncio.sleep(float(delay) / 1000)

    async def _verify(self) -> None:
        phase = await self.runner.call(self.engine.request_phase, self.request_id)
        if phase is None:
            raise MigrationAborted("request finished or was aborted at the source")
        status, preemptions = phase
        if preemptions != self.preemptions or status != RequestPhase.RUNNING:
            raise MigrationAborted(f"request was preempted at the source ({status})")

    # --- the protocol ------------------------------------------------------------
    async def run(self) -> Outcome:
        t0 = self.host.clock()
        try:
            await self._run()
        except BaseException as e:
            cancelled = isinstance(e, asyncio.CancelledError)
            if isinstance(e, PeerError):
                self.dest_failed = True
            reason = "cancelled" if cancelled else (str(e) or type(e).__name__)
            await self._abort_to_the_end(reason)
            if cancelled or not isinstance(e, Exception):
                raise
        self.out.duration_ms = (self.host.clock() - t0) * 1000
        self.out.stages += sum(1 for s in self.m.history if s in (S.COPY, S.COPY_LAST))
        if self.out.committed and self.measures_downtime:
            # Off the critical path (the client already follows the request):
            # the downtime ends at the request's first step at the destination.
            try:
                after = await self.peer.settled(self.id, wait_ms=2000)
            except Exception:  # noqa: BLE001 - a measurement only
                after = None
            self.out.downtime_ms = self.out.commit_ack_ms + after if after is not None else 0.0
        return self.out

    async def _run(self) -> None:
        if self.handoff:
            await self._last_stage(0)
            return
        phase = await self.runner.call(self.engine.request_phase, self.request_id)
        if phase is None or phase[0] != RequestPhase.RUNNING:
            raise MigrationAborted("request is not running")
        self.preemptions = phase[1]
        stage = 0
        while True:
            full = await self.runner.call(self.engine.full_blocks, self.request_id)
            todo = full[self.sent:]
            # Stage 0 always runs (with no block if none is full yet): it
            # reserves the spare blocks of the last stage before the suspend.
            last = len(todo) <= self.config.last_stage_max_blocks or stage >= self.config.max_stages
            if stage > 0 and last:
                break
            if last:
                todo = []
            # Every pre-copy stage keeps the spare blocks held (a stage takes
            # them first, and as many fresh ones come back), so that the last
            # stage after the suspend is served from them without waiting on
            # the destination's engine.
            spare = self.spare_blocks
            if stage == 0 and self.config.max_stages == 0:  # blocking baseline: the last stage is everything
                spare += len(await self.runner.call(self.engine.all_blocks, self.request_id))
            self._to(S.PRE_ALLOC, stage=stage, blocks=len(todo))
            linked = await self._pre_allocate(stage, len(todo), spare=spare, full=len(full) if stage == 0 else -1)
            todo = todo[linked:]  # NOTE: stage 0 only (sent was 0): linked there, not sent
            self._to(S.COPY, stage=stage, blocks=len(todo), linked=linked)
            nbytes = await self._copy(stage, todo, paced=True)
            self.out.blocks += len(todo)
            self.out.bytes += nbytes
            self.sent += len(todo)
            self._to(S.VERIFY, stage=stage, blocks=len(todo), bytes=nbytes)
            await self._verify()
            stage += 1
            if last:
                break
        await self._last_stage(stage)

    async def _last_stage(self, stage: int) -> None:
        """Suspend, copy what is left, commit, hand the client's stream over."""
        self._to(S.SUSPEND, stage=stage)
        if self.config.join_notice and not self.handoff:
            self._announce_commit()
        if self.exported is not None:  # a held handoff, exported where it was held
            suspended, t_suspend, state, rest = self.exported
            self._still_wanted()
        else:
            # One engine-thread call at a step boundary: suspend, export, and list
            # what is left to copy (a second call would wait a whole step).
            suspended, t_suspend, state, rest = await self.runner.call(self._suspend_and_export)
        if not suspended:
            raise MigrationAborted("request finished or was preempted before suspend")
        if self._fuse_last_stage():
            await self._commit_with_last_stage(stage, rest, state, t_suspend)
            return
        self._to(S.PRE_ALLOC_LAST, stage=stage, blocks=len(rest))
        # A handoff's only stage is its first: the prompt's blocks cached at the destination are linked.
        full = state.num_computed_tokens // self.engine.block_size if stage == 0 else -1
        linked = await self._pre_allocate(stage, len(rest), last=True, full=full)
        if self.exported is not None:
            self._still_wanted()  # before its blocks are read
        rest = rest[linked:]
        self._to(S.COPY_LAST, stage=stage, blocks=len(rest), linked=linked)
        nbytes = await self._copy(stage, rest)
        self.out.blocks += len(rest)
        self.out.bytes += nbytes
        self._to(S.COMMIT, blocks=self.out.blocks, bytes=self.out.bytes)
        next_index = len(state.output_token_ids)
        _cancel_now_if_asked()
        if self.exported is not None:
            self._still_wanted()
        await self.peer.commit(self.id, state)
        self.fault("source.crash_after_commit")  # tests: killed before the client learns where it went
        self._hand_over(t_suspend, next_index, S.DONE)

    def _fuse_last_stage(self) -> bool:
        """The last stage rides on the commit: the destination mapped this
        engine's shared cache (still the one offered: a grown cache is
        another), so the stage is block ids, small enough for the commit."""
        return (self.config.fuse_last_stage and not self.handoff and self.shared is not None
                and self.engine.kv_share() == self.shared)

    async def _commit_with_last_stage(self, stage: int, rest: list[int], state, t_suspend: float) -> None:
        """SUSPEND -> COMMIT: one round trip after the suspend; the
        destination copies ``rest`` from the shared cache, then installs."""
        bpb = self.engine.kv_layout.bytes_per_block
        self.out.blocks += len(rest)
        self.out.bytes += len(rest) * bpb
        self.out.kv_shared = True
        self.out.stages += 1  # the last stage, copied by the commit
        self._to(S.COMMIT, stage=stage, last_blocks=len(rest), blocks=self.out.blocks, bytes=self.out.bytes)
        next_index = len(state.output_token_ids)
        _cancel_now_if_asked()
        await self.peer.commit(self.id, state, LastStage(stage, tuple(rest)))
        self.fault("source.crash_after_commit")
        self._hand_over(t_suspend, next_index, S.DONE)

    def _announce_commit(self) -> None:
        """Tell the destination, without waiting for its answer, when the
        commit should reach it: the suspend runs at this engine's next step
        boundary, and the commit is acknowledged about ``expected_ack_ms``
        after it. Best effort: a lost or late notice leaves the hold of the
        last pre-allocation."""
        in_ms = self.runner.to_boundary_s() * 1000 + self.expected_ack_ms
        self._notice = asyncio.ensure_future(self.peer.expect_commit(self.id, in_ms))
        self._notice.add_done_callback(_noticed)

    def _hand_over(self, t_suspend: float, next_index: int, done) -> None:
        """After the commit acknowledgement. NOTE: nothing awaits here (no
        cancel can land): the destination owns the request. Tell the client's
        stream where to go on first (it is suspended here, no token can come
        between), then forget it here at the next step boundary."""
        self.out.commit_ack_ms = (self.host.clock() - t_suspend) * 1000
        self.out.suspended_at = time.time() - self.out.commit_ack_ms / 1000
        self.out.committed = True
        stream = self.host.streams.get(self.request_id)
        if stream is not None:
            stream.push(Event(next_index, moved_to=(self.dest_id, self.dest_address)))
            self.host.streams.close(self.request_id)
        self.runner.submit(self._drop)
        self.m.to(done, blocks=self.out.blocks, bytes=self.out.bytes,
                  commit_ack_ms=round(self.out.commit_ack_ms, 3))

    def _suspend_and_export(self) -> Exported:
        """On the engine thread, between two steps: take the request out of
        the batch, and export it (export_suspended). A handoff's request may
        be suspended already: held by the engine after its prompt, for this
        handoff."""
        phase = self.engine.request_phase(self.request_id)
        held = self.handoff and phase is not None and phase[0] == RequestPhase.SUSPENDED
        if not held and not self.engine.suspend_request(self.request_id):
            return False, 0.0, None, []
        return export_suspended(self.engine, self.request_id, self.sent, self.host.clock)

    def _still_wanted(self) -> None:
        """A handoff exported at its hold has not asked the engine since:
        the request must still be held there (an abort drops it). NOTE: a
        dict lookup from the event loop, as Destination._commit's; an abort
        queued behind it is the race of any migration's last stage (the
        stream it closes is not followed)."""
        phase = self.engine.request_phase(self.request_id)
        if phase is None or phase[0] != RequestPhase.SUSPENDED:
            raise MigrationAborted("request finished or was aborted at the source")

    def _drop(self) -> None:
        """On the engine thread: forget the request after the commit."""
        if self.engine.request_phase(self.request_id) is not None:
            self.engine.drop_request(self.request_id)

    def _resume_if_suspended(self) -> bool:
        """On the engine thread. NOTE: runs after any suspend this migration
        queued (commands run in order), so a suspend whose caller was
        cancelled is undone too. Only this migration suspends its request."""
        phase = self.engine.request_phase(self.request_id)
        if phase is not None and phase[0] == RequestPhase.SUSPENDED:
            self.engine.resume_request(self.request_id)
            return True
        return False

    async def _abort(self, reason: str) -> None:
        self.out.reason = reason
        if not self.m.terminal:
            self.m.to(S.ABORT, reason=reason)
        try:
            await self.runner.call(self._resume_if_suspended)
        except Exception as e:  # noqa: BLE001 - the engine died: its streams end anyway
            log.warning("resume after abort failed", request_id=self.request_id, error=repr(e))
        try:
            await self.peer.abort(self.id, reason)
        except Exception as e:  # noqa: BLE001 - the destination's deadline frees its blocks
            log.info("abort not delivered to the destination", migration_id=self.id, error=repr(e))

    async def _abort_to_the_end(self, reason: str) -> None:
        task = asyncio.ensure_future(self._abort(reason))
        cancelled = False
        while not task.done():
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                cancelled = True  # again: finish the abort first
        if cancelled:
            raise asyncio.CancelledError()
        task.result()
