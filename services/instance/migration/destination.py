"""The destination side of a migration: reservations with a deadline that
every call renews, KV chunks scattered into the reserved blocks as they
arrive, and the commit that installs the request.

NOTE: blocks change hands only on the engine thread, in one step with the
bookkeeping that records them (``_take``, ``_give_back``): a reservation's
blocks are recorded the moment the pool hands them out, so a caller cancelled
while waiting cannot drop them on the floor; whatever a reservation holds is
freed by its abort or its expiry."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass, field

from libs.common import tracing
from libs.common.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound
from libs.common.logging import get_logger
from libs.common.prefix_hash import block_hashes
from libs.common.types import InstanceStatus, RequestState
from services.instance.engine.shared_kv import KvShareError, PeerKv, runs
from services.instance.migration.host import MigrationHost
from services.instance.engine.base import ProgramKv
from services.instance.migration.messages import Admission, KvChunk, LastStage, PreAllocate
from services.instance.migration.metrics import MigrationCounters
from libs.common.policies.migration import accepts_migration
from services.instance.migration.states import DestState, Machine
from services.instance.status import instance_status

log = get_logger("migration")
# An expected commit further out than this is not held for (expect_commit): a
# source's prediction a second ahead is a guess.
MAX_EXPECT_MS = 1000.0


@dataclass
class Reservation:
    machine: Machine
    source_instance_id: str
    deadline: float
    deadline_s: float
    # The request's first blocks, linked from this cache instead of sent (PreAllocate.link), and their hashes.
    linked: list[int] = field(default_factory=list)
    linked_hashes: tuple = ()
    stages: dict[int, list[int]] = field(default_factory=dict)  # stage -> reserved block ids
    received: dict[int, int] = field(default_factory=dict)  # stage -> blocks written
    # NOTE: stage -> positions written: a chunk sent twice counts once, so a
    # block never written cannot pass the commit's check with stale content.
    written: dict[int, set[int]] = field(default_factory=dict)
    bytes: int = 0
    committed_at: float | None = None
    spare: list[int] = field(default_factory=list)  # held for the last stage
    closed: bool = False  # its blocks went back to the pool or into a request
    installed: asyncio.Event = field(default_factory=asyncio.Event)  # in the batch from the next step
    # NOTE: held by whoever changes stages/spare/closed (the engine thread, or
    # the event loop when a stage is served from the spare blocks alone).
    lock: threading.Lock = field(default_factory=threading.Lock)
    writers: int = 0  # scatters in flight
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    handoff: bool = False  # Splitwise handoff: counted against max_handoff_in
    # stage -> one byte per (block, layer) written, for stages sent per layer
    layer_marks: dict[int, bytearray] = field(default_factory=dict)
    peer_kv: PeerKv | None = None  # the source's shared KV cache, mapped (PreAllocate.kv_share)
    expected_at: float | None = None  # when the source said its commit would come (expect_commit)
    clock: Callable[[], float] = time.monotonic  # MigrationHost.clock

    @property
    def open(self) -> bool:
        return self.machine.state in (DestState.NONE, DestState.RESERVED)

    @property
    def blocks(self) -> list[int]:
        return self.linked + [b for s in sorted(self.stages) for b in self.stages[s]]

    @property
    def held(self) -> list[int]:
        return self.blocks + self.spare

    def renew(self) -> None:
        self.deadline = self.clock() + self.deadline_s


class Destination:
    def __init__(self, host: MigrationHost, max_migrate_in: int, counters: MigrationCounters | None = None,
                 max_handoff_in: int = 16, join_hold_s: float = 0.0, shared_kv: bool = True):
        self.host = host
        self.shared_kv = shared_kv  # map a source's shared KV cache when offered (MigrationConfig.shared_kv)
        self.counters = counters or MigrationCounters()
        self.engine = host.engine
        self.runner = host.runner
        self.max_migrate_in = max_migrate_in
        self.max_handoff_in = max_handoff_in
        self.join_hold_s = join_hold_s  # MigrationConfig.join_hold_ms
        self.reservations: dict[str, Reservation] = {}
        self.settled: OrderedDict[str, float] = OrderedDict()  # migration id -> commit ack -> first step (ms)
        self._committed: dict[str, Reservation] = {}  # migration id -> committed, until settled
        self.expiry_interval_s = 0.05  # how often expire() runs (MigrationManager's expiry loop)
        self._last_expiry: float | None = None

    @property
    def active(self) -> int:
        """Migrations and handoffs coming in now."""
        return sum(1 for r in self.reservations.values() if r.open)

    def _active(self, handoff: bool) -> int:
        return sum(1 for r in self.reservations.values() if r.open and r.handoff == handoff)

    def _get(self, migration_id: str, state: DestState = DestState.RESERVED) -> Reservation:
        res = self.reservations.get(migration_id)
        if res is None:
            raise NotFound(f"no reservation for migration {migration_id!r} (expired or aborted)")
        if res.machine.state is not state:
            raise FailedPrecondition(f"migration {migration_id!r} is {res.machine.state.value}")
        res.renew()
        return res

    # --- on the engine thread ------------------------------------------------------
    @staticmethod
    def _want(res: Reservation, num_blocks: int, spare: int) -> int:
        """Fresh blocks a stage needs beyond the spare ones held."""
        from_spare = min(num_blocks, len(res.spare))
        return num_blocks - from_spare + max(0, spare - (len(res.spare) - from_spare))

    def _take(self, res: Reservation, stage: int, num_blocks: int, spare: int, link: tuple = ()) -> bool:
        """Reserve what the stage needs and record it in the reservation, in
        one step. False if it does not fit (or the reservation ended). On the
        engine thread, or on the loop when no fresh block is needed.
        ``link``: the request's block hashes (first stage): the blocks of
        their longest prefix cached here are linked, and the stage's
        ``num_blocks`` (counted from the request's first block) shrinks by as
        many."""
        with res.lock:
            if res.closed:
                return False
            linked = self.engine.link_cached(list(link)) if link and not res.linked else []
            num_blocks = max(0, num_blocks - len(linked))
            want = self._want(res, num_blocks, spare)
            fresh = self.engine.reserve_blocks(want) if want else []
            if fresh is None:
                if linked:
                    self.engine.release_blocks(linked)
                return False
            res.linked += linked
            res.linked_hashes += tuple(link[:len(linked)])
            pool = res.spare + fresh
            res.stages[stage], res.spare = pool[:num_blocks], pool[num_blocks:]
            res.received[stage] = 0
            res.written[stage] = set()
            return True

    def _give_back(self, res: Reservation) -> int:
        """Free everything the reservation holds; it holds nothing after."""
        with res.lock:
            if res.closed:
                return 0
            held = res.held
            res.closed = True
            res.linked, res.stages, res.spare = [], {}, []
            res.peer_kv = None  # unmapped once no copy in flight holds it
        self.engine.release_blocks(held)
        return len(held)

    def _close(self, res: Reservation) -> list[int] | None:
        """At the commit's install: the reservation closes, its spare blocks go
        back, and its blocks are the caller's to install; None if it closed
        already (aborted between the commit and this step boundary)."""
        with res.lock:
            if res.closed:
                return None
            blocks, spare = res.blocks, res.spare
            res.closed = True
            res.peer_kv = None
        if spare:
            self.engine.release_blocks(spare)
        return blocks

    def _install(self, res: Reservation, state: RequestState) -> None:
        """NOTE: the commit was validated; a failure here is a bug, and the
        client's stream is ended rather than left hanging."""
        blocks = self._close(res)
        if blocks is None:
            return
        try:
            self.engine.install_request(state, blocks)
        except Exception as e:  # noqa: BLE001
            log.error("install after commit failed", request_id=state.request_id, error=repr(e))
            self.engine.release_blocks(blocks)
            self.runner.loop.call_soon_threadsafe(self.host.end_stream, state.request_id, "abort")
            return
        # Installed between two steps: its first step here starts now.
        self.runner.loop.call_soon_threadsafe(self._installed, res, self.host.clock())

    async def _release(self, res: Reservation) -> int:
        """Wait for scatters in flight into the blocks (they must not land
        in blocks someone else owns by then), then free them."""
        while res.writers:
            res.idle.clear()
            await res.idle.wait()
        return await self.runner.call(self._give_back, res)

    # --- the protocol --------------------------------------------------------------
    async def pre_allocate(self, p: PreAllocate) -> Admission:
        ok, reason = await self._admit(p)
        if not ok:
            return Admission(False, reason)
        res = self.reservations.get(p.migration_id)
        # NOTE: read off the engine thread: a hint (the cache changes between steps)
        held = tuple(self.engine.holds_hashes(list(p.block_hashes))) if p.block_hashes else ()
        return Admission(True, kv_shared=res is not None and self._map_source_kv(res, p), held=held,
                         linked=len(res.linked) if res is not None and p.stage == 0 else 0)

    def _map_source_kv(self, res: Reservation, p: PreAllocate) -> bool:
        """Map the source's shared KV cache when it offers one (again when it
        changed: the source's cache grew); False: bytes it is."""
        if p.kv_share is None or not self.shared_kv:
            return False
        if res.peer_kv is not None and res.peer_kv.share == p.kv_share:
            return True
        try:
            res.peer_kv = PeerKv(p.kv_share, self.engine.kv_layout.bytes_per_block)
        except KvShareError as e:
            res.peer_kv = None
            log.info("source KV cache not mapped: bytes over gRPC", migration_id=p.migration_id, reason=str(e))
            return False
        return True

    async def _admit(self, p: PreAllocate) -> tuple[bool, str]:
        mine = self.engine.kv_layout
        if p.layout != mine:
            return False, f"kv layout mismatch: source {p.layout}, destination {mine}"
        res = self.reservations.get(p.migration_id)
        if res is None:
            if p.stage > 0:  # NOTE: never start over mid-migration: the earlier stages' blocks are gone
                return False, f"no reservation for migration {p.migration_id!r} (expired or aborted)"
            if self.host.is_terminating():
                return False, "destination is terminating"
            if not self.host.decodes():  # its role changed since the source chose it
                return False, "destination does not decode (role prefill)"
            ok, reason = accepts_migration(self._status(), p.num_blocks + p.spare_blocks, handoff=p.handoff)
            if not ok:
                return False, reason
            if p.handoff and self._active(True) >= self.max_handoff_in:
                return False, f"handoff-in limit {self.max_handoff_in} reached"
            if not p.handoff and self._active(False) >= self.max_migrate_in:
                return False, f"migrate-in limit {self.max_migrate_in} reached"
            if p.program_id and not self.engine.movable_programs_here:
                return False, "this instance keeps no programs' blocks (--program-keep 0)"
            if not p.program_id and p.request_id in self.host.streams:
                return False, f"request {p.request_id!r} already lives here"
            deadline_s = max(0.05, p.deadline_ms / 1000)
            res = Reservation(Machine("destination", p.migration_id, p.request_id, DestState.NONE),
                              p.source_instance_id, self.host.clock() + deadline_s, deadline_s, handoff=p.handoff,
                              clock=self.host.clock)
            # NOTE: recorded before any block is taken: the expiry sees it
            # whatever happens to this call.
            self.reservations[p.migration_id] = res
        elif res.machine.state is not DestState.RESERVED:
            return False, f"migration is {res.machine.state.value}"
        else:
            res.deadline_s = max(0.05, p.deadline_ms / 1000)  # the source's steps may have grown longer
        if p.stage in res.stages:
            return False, f"stage {p.stage} already reserved"
        res.renew()
        link = tuple(p.block_hashes) if p.link and p.stage == 0 else ()
        if not link and self._want(res, p.num_blocks, p.spare_blocks) == 0:
            # From the spare blocks alone (the last stage, right after the
            # suspend): no engine step to wait for.
            ok = self._take(res, p.stage, p.num_blocks, p.spare_blocks)
        else:
            ok = await self.runner.call(self._take, res, p.stage, p.num_blocks, p.spare_blocks, link)
        res.renew()
        if res.machine.terminal:  # aborted or expired while we waited: _give_back freed what _take took
            return False, f"migration is {res.machine.state.value}"
        if not ok:
            if res.machine.state is DestState.NONE and not res.held:
                res.machine.to(DestState.ABORTED, reason="refused")
                self.reservations.pop(p.migration_id, None)
            # else: keep earlier stages until the source aborts (or the deadline)
            return False, f"{p.num_blocks + p.spare_blocks} blocks do not fit above the watermark"
        res.machine.to(DestState.RESERVED, stage=p.stage, blocks=len(res.stages[p.stage]), spare=len(res.spare),
                       total_blocks=len(res.blocks), linked=len(res.linked))
        if p.stage == 0 and not p.program_id:
            # the request's context is about this long: its first step here need not be slow (a cache move has none)
            self.engine.expect_context(len(res.held) * self.engine.block_size)
        if p.last and not p.handoff and self.join_hold_s > 0:
            # The commit is a small copy and a round trip away: keep the boundary open for it. Not for a
            # handoff, whose last stage is the whole prompt's KV (a pause per request here).
            self.runner.hold(p.migration_id, self.join_hold_s)
        self.host.changed()
        return True, ""

    def expect_commit(self, migration_id: str, in_ms: float) -> bool:
        """The source is about to suspend the request: the commit should come
        in about ``in_ms``. Hold the step boundary just before then when that
        keeps the request from waiting on a step (EngineRunner.expect), for
        at most join_hold_s past the expected time; the last pre-allocation,
        the commit or an abort replaces or ends it. False: not held (no such
        reservation, a handoff, holds off, or a time too far out to trust)."""
        res = self.reservations.get(migration_id)
        if (res is None or res.machine.state is not DestState.RESERVED or res.handoff or self.join_hold_s <= 0
                or not 0 <= in_ms <= MAX_EXPECT_MS):
            return False
        res.expected_at = self.host.clock() + in_ms / 1000
        self.runner.expect(migration_id, res.expected_at, self.join_hold_s)
        return True

    def _status(self) -> InstanceStatus:
        """This instance as the consent rule sees it: the latest published
        load (reserved blocks included), as the simulated destination does."""
        return instance_status(self.host.instance_id, 0, time.time(), self.host.current_load(), self.host.headroom,
                               self.host.is_terminating(), self.active)

    async def transfer(self, chunks: AsyncIterable[KvChunk]) -> tuple[int, int]:
        """Consume one stage's chunks; scatter each into its blocks."""
        res = None
        written = nbytes = 0
        bpb = self.engine.kv_layout.bytes_per_block
        async for chunk in chunks:
            if res is None:
                res = self._get(chunk.migration_id)
                stage = chunk.stage
                if stage not in res.stages:
                    raise InvalidArgument(f"stage {stage} was not pre-allocated")
                blocks = res.stages[stage]
            if res.machine.state is not DestState.RESERVED or res.closed:
                raise Aborted("migration aborted during transfer")
            res.renew()
            if chunk.layer is not None or stage in res.layer_marks:
                await self._scatter_layer(res, stage, blocks, chunk)
                nbytes += len(chunk.data)
                continue
            if chunk.offset % bpb or len(chunk.data) % bpb:
                raise InvalidArgument("KV chunk is not aligned to whole blocks")
            first = chunk.offset // bpb
            n = len(chunk.src_blocks) if chunk.src_blocks else len(chunk.data) // bpb
            if chunk.src_blocks and len(chunk.data):
                raise InvalidArgument("KV chunk carries both bytes and source blocks")
            if first + n > len(blocks):
                raise InvalidArgument(f"KV chunk for blocks {first}..{first + n} of a {len(blocks)}-block stage")
            if chunk.src_blocks:
                if res.peer_kv is None:
                    raise InvalidArgument("KV chunk names source blocks, but no shared KV cache is mapped")
                await self._scatter(res, self._copy_from_source, res.peer_kv, blocks[first:first + n],
                                    list(chunk.src_blocks))
            else:
                await self._scatter(res, self.engine.scatter_kv, blocks[first:first + n], chunk.data)
            res.written.setdefault(stage, set()).update(range(first, first + n))
            written += n
            nbytes += n * bpb
        if res is not None:
            if res.machine.state is not DestState.RESERVED:
                raise Aborted("migration aborted during transfer")
            res.received[stage] = len(res.written.get(stage, ()))
            res.bytes += nbytes
            marks = res.layer_marks.get(stage)
            if marks is not None:  # a block counts once every layer of it arrived
                layers = self.engine.kv_layout.num_layers
                written = res.received[stage] = sum(
                    1 for b in range(len(blocks)) if 0 not in marks[b * layers:(b + 1) * layers])
        return written, nbytes

    def _copy_from_source(self, peer: PeerKv, dst: list[int], src: list[int]) -> None:
        """Copy source blocks ``src`` (its shared cache) into reserved blocks
        ``dst``: one scatter per run of consecutive source blocks, each
        reading the source's memory in place."""
        try:
            for pos, first, n in runs(src):
                self.engine.scatter_kv(dst[pos:pos + n], peer.blocks(first, n))
        except KvShareError as e:
            raise InvalidArgument(str(e)) from None

    async def _scatter(self, res: Reservation, fn, *args) -> None:
        """Run a scatter off the loop, counted as a writer of the reservation."""
        res.writers += 1
        try:
            await self.host.offload(fn, *args)
        finally:
            res.writers -= 1
            if not res.writers:
                res.idle.set()

    async def _scatter_layer(self, res: Reservation, stage: int, blocks: list[int], chunk: KvChunk) -> None:
        """One layer's KV for some of the stage's blocks (per-layer transfer);
        empty data only renews the reservation."""
        if chunk.layer is None or (stage not in res.layer_marks and res.received.get(stage)):
            raise InvalidArgument(f"stage {stage} mixes whole-block and per-layer KV chunks")
        if not chunk.data:
            return
        layout = self.engine.kv_layout
        per_block = layout.bytes_per_block // layout.num_layers
        if not 0 <= chunk.layer < layout.num_layers:
            raise InvalidArgument(f"KV chunk for layer {chunk.layer} of {layout.num_layers}")
        if chunk.offset % per_block or len(chunk.data) % per_block:
            raise InvalidArgument("per-layer KV chunk is not aligned to whole blocks")
        first, n = chunk.offset // per_block, len(chunk.data) // per_block
        if first + n > len(blocks):
            raise InvalidArgument(f"KV chunk for blocks {first}..{first + n} of a {len(blocks)}-block stage")
        marks = res.layer_marks.setdefault(stage, bytearray(len(blocks) * layout.num_layers))
        await self._scatter(res, self.engine.scatter_kv_layer, blocks[first:first + n], chunk.layer, chunk.data)
        for b in range(first, first + n):
            marks[b * layout.num_layers + chunk.layer] = 1

    async def commit(self, migration_id: str, state: RequestState, last: LastStage | None = None) -> None:
        """``last``: the last stage carried by the commit (the source's shared
        cache is mapped): its blocks are copied here first, then the commit
        goes on as usual. If the copy fails or is cancelled the reservation
        stays open (the stage's blocks in it) until the source's abort or
        the deadline frees it."""
        try:
            if last is not None:
                await self._last_stage(migration_id, last)
            self._commit(migration_id, state)
        finally:  # a held step boundary (join_hold_s) opens: after the install was queued, or on a refusal
            self.runner.release(migration_id)

    async def _last_stage(self, migration_id: str, last: LastStage) -> None:
        res = self._get(migration_id)
        if res.peer_kv is None:
            raise InvalidArgument("the commit names source blocks, but no shared KV cache is mapped")
        if last.stage in res.stages:
            raise InvalidArgument(f"stage {last.stage} already reserved")
        n = len(last.src_blocks)
        if self._want(res, n, 0) == 0:  # from the spare blocks (the usual case): no engine step to wait for
            ok = self._take(res, last.stage, n, 0)
        else:
            ok = await self.runner.call(self._take, res, last.stage, n, 0)
        if res.machine.state is not DestState.RESERVED or res.closed:
            raise Aborted("migration aborted during the commit")
        if not ok:
            raise FailedPrecondition(f"the last stage's {n} blocks do not fit")
        res.machine.to(DestState.RESERVED, stage=last.stage, blocks=n, spare=len(res.spare),
                       total_blocks=len(res.blocks))
        if n:
            await self._scatter(res, self._copy_from_source, res.peer_kv, res.stages[last.stage],
                                list(last.src_blocks))
        if res.machine.state is not DestState.RESERVED or res.closed:
            raise Aborted("migration aborted during the commit")
        res.received[last.stage] = n
        res.bytes += n * self.engine.kv_layout.bytes_per_block

    def _commit(self, migration_id: str, state: RequestState) -> None:
        res = self._get(migration_id)
        missing = {s: len(b) - res.received.get(s, 0) for s, b in res.stages.items()
                   if res.received.get(s, 0) != len(b)}
        if missing:
            raise FailedPrecondition(f"blocks not received per stage: {missing}")
        n_tokens = len(state.prompt_token_ids) + len(state.output_token_ids)
        need = -(-state.num_computed_tokens // self.engine.block_size)
        if not 0 <= state.num_computed_tokens < n_tokens or len(res.blocks) != need:
            raise InvalidArgument(f"{len(res.blocks)} blocks for {state.num_computed_tokens} computed tokens")
        if res.linked_hashes:  # the linked blocks hold this request's prefix, not what the source named
            bs = self.engine.block_size
            tokens = (list(state.prompt_token_ids) + list(state.output_token_ids))[:len(res.linked) * bs]
            if tuple(block_hashes(tokens, bs)) != res.linked_hashes:
                raise InvalidArgument("the linked blocks' hashes are not those of the request's first tokens")
        # NOTE: a dict lookup from the event loop; the engine thread only adds
        # this id through _install below, which runs after this check.
        if self.engine.request_phase(state.request_id) is not None or state.request_id in self.host.streams:
            raise FailedPrecondition(f"request {state.request_id!r} already lives here")
        # Validated: acknowledge now and install at the engine's next step
        # boundary (waiting for it here would add a step to the downtime).
        self.host.streams.open(state.request_id, next_index=len(state.output_token_ids))
        res.committed_at = self.host.clock()
        if self.engine.traces_requests:  # the engine's span of this incarnation, under the commit's (in the request's trace)
            state = dataclasses.replace(state, trace_headers=tracing.headers())
        self.runner.submit(self._install, res, state)
        self._committed[migration_id] = res
        res.machine.to(DestState.COMMITTED, blocks=len(res.blocks), bytes=res.bytes)
        self.counters.destination_committed()
        self.host.committed_in(state)
        self.host.changed()

    async def commit_cache(self, migration_id: str, kv: ProgramKv) -> None:
        """A cache move's commit (cache_move.py): every block received, the
        linked head the program's own; the blocks join this cache, kept for
        the program, before the acknowledgement (no request waits on it)."""
        res = self._get(migration_id)
        try:
            missing = {s: len(b) - res.received.get(s, 0) for s, b in res.stages.items()
                       if res.received.get(s, 0) != len(b)}
            if missing:
                raise FailedPrecondition(f"blocks not received per stage: {missing}")
            if len(res.blocks) != len(kv.block_hashes):
                raise InvalidArgument(f"{len(res.blocks)} blocks for {len(kv.block_hashes)} block hashes")
            if res.linked_hashes != tuple(kv.block_hashes[:len(res.linked)]):
                raise InvalidArgument("the linked blocks' hashes are not the program's first ones")
            await self.runner.call(self._install_cache, res, kv)
        finally:
            self.runner.release(migration_id)
        res.committed_at = self.host.clock()
        res.machine.to(DestState.COMMITTED, blocks=len(res.blocks), bytes=res.bytes, program_id=kv.program_id)
        self.reservations.pop(migration_id, None)  # nobody attaches to a cache move: done
        self.counters.cache_move_in()
        self.host.changed()

    def _install_cache(self, res: Reservation, kv: ProgramKv) -> None:
        blocks = self._close(res)
        if blocks is None:
            raise Aborted("migration aborted during the commit")
        try:
            self.engine.import_program(kv, blocks)
        except Exception:
            self.engine.release_blocks(blocks)
            raise

    def _installed(self, res: Reservation, at: float) -> None:
        """On the loop: the request joined the batch (at a step boundary);
        its downtime ends as its first step here begins."""
        mid = res.machine.migration_id
        self.settled[mid] = (at - res.committed_at) * 1000
        # How late the commit came against the source's notice, and how long it then waited for a step boundary.
        log.info("migrated request joined the batch", migration_id=mid, after_commit_ms=round(self.settled[mid], 2),
                 commit_late_ms=None if res.expected_at is None else round((res.committed_at - res.expected_at) * 1000, 2))
        while len(self.settled) > 1024:
            self.settled.popitem(last=False)
        self._committed.pop(mid, None)
        res.installed.set()

    async def settle(self, migration_id: str, wait_ms: int) -> float | None:
        """Commit acknowledged -> the request's first step here begins (ms);
        waits up to ``wait_ms`` for it; None if it did not come."""
        if migration_id not in self.settled:
            res = self._committed.get(migration_id)
            if res is None:
                return None
            try:
                async with asyncio.timeout(wait_ms / 1000):
                    await res.installed.wait()
            except TimeoutError:
                return None
        return self.settled.get(migration_id)

    async def abort(self, migration_id: str, reason: str) -> bool:
        res = self.reservations.get(migration_id)
        if res is None or res.machine.terminal:
            return False
        if res.machine.state is DestState.COMMITTED:
            # Commit reply lost: the source goes on; drop our copy unless a
            # client already follows it here (then the source cannot have
            # resumed: it only sends `moved` after a successful commit).
            rid = res.machine.request_id
            stream = self.host.streams.get(rid)
            if stream is not None and stream.attached:
                return False
            self.host.streams.close(rid)
            self._committed.pop(migration_id, None)
            await self.runner.call(self._drop_committed, res, rid)
        else:
            res.machine.to(DestState.ABORTED, reason=reason)  # first: no transfer writes on
            self.runner.release(migration_id)
            await self._release(res)
            self.host.changed()
            return True
        res.machine.to(DestState.ABORTED, reason=reason)
        self.host.changed()
        return True

    async def drop_unattached(self, request_id: str) -> bool:
        """A client resumes ``request_id`` here from its prompt and the tokens
        it has (Generate with resume tokens): its source died after this
        instance committed the migration and before the client learned
        where it went. Drop the committed copy that nobody follows, so that
        the resume runs; True if there was one. NOTE: a copy a client
        follows already (attached) stays, and the resume is refused."""
        for mid, res in list(self.reservations.items()):
            if res.machine.request_id == request_id and res.machine.state is DestState.COMMITTED:
                # abort() of a committed migration keeps a copy a client follows (False)
                dropped = await self.abort(mid, "the client resumed the request here")
                if dropped:
                    log.warning("dropped a committed copy nobody followed: its client resumes it here",
                                migration_id=mid, request_id=request_id)
                return dropped
        return False

    def _excuse_own_stall(self, now: float) -> None:
        """NOTE: a deadline measures the source's silence while this process
        listened. When this process itself stalled (no CPU for it on a loaded
        machine, a long pause), the source's renewals of that time may still
        be queued unread; expire() would run first and free a reservation
        whose source is alive (CI saw it: 'no reservation ... (expired or
        aborted)' at the next pre-allocation). So the time expire() ran late
        is added to every open deadline before any is judged."""
        last, self._last_expiry = self._last_expiry, now
        stall = 0.0 if last is None else now - last - self.expiry_interval_s
        if stall > 0:
            for res in self.reservations.values():
                if res.open:
                    res.deadline += stall

    def _drop_committed(self, res: Reservation, request_id: str) -> None:
        if not res.closed:  # not installed yet: its blocks are still ours
            self._give_back(res)
        else:
            self.engine.abort_request(request_id)

    async def expire(self) -> None:
        """Free reservations whose deadline passed (the source died), and drop
        committed requests nobody attached to in time."""
        now = self.host.clock()
        self._excuse_own_stall(now)
        for mid, res in list(self.reservations.items()):
            st = res.machine.state
            if st in (DestState.NONE, DestState.RESERVED) and now > res.deadline:
                res.machine.to(DestState.EXPIRED, blocks=len(res.held))
                self.runner.release(mid)
                await self._release(res)
                self.host.changed()
            elif st is DestState.COMMITTED:
                stream = self.host.streams.get(res.machine.request_id)
                if stream is None or stream.attached:
                    del self.reservations[mid]  # the client follows the request here: done
                    continue
                if now > res.committed_at + res.deadline_s:
                    log.warning("committed request never attached; dropping", migration_id=mid,
                                request_id=res.machine.request_id)
                    await self.abort(mid, "not attached before the deadline")
            if res.machine.terminal:
                self.reservations.pop(mid, None)
