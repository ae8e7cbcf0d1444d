"""Both sides of migration on one instance: the scheduler's migrate-out
orders (choose requests, migrate until no longer a source, a few at once) and
the destination. Owns the migration counters.

NOTE: an order runs as a task of this manager, not of the RPC that brought
it: when the caller goes away (its deadline passed, it restarted) the order
starts no new migration and lets the ones in flight finish or abort; nothing
is cancelled half-way by a caller."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

from libs.common.types import MigrateOutOrder, OrderResult, Outcome
from libs.common import rpc, tracing
from libs.common.errors import ResourceExhausted
from libs.common.logging import get_logger
from libs.common.policies.phases import HandoffMode
from services.instance.engine.base import EngineRequest
from services.instance.migration.cache_move import CacheMove
from services.instance.migration.destination import Destination
from services.instance.migration.grpc_peer import GrpcPeer
from services.instance.migration.handoff import Handoffs
from services.instance.migration.host import MigrationHost
from services.instance.migration.layerwise import LayerwiseHandoff
from services.instance.migration.messages import MigrationConfig
from services.instance.migration.metrics import MigrationCounters
from services.instance.migration.peer import DestinationPeer
from libs.common.policies.migration import next_to_migrate
from services.instance.migration.selection import status_without
from services.instance.migration.source import Exported, Fault, SourceMigration, failpoint_faults
from services.instance.request_traces import describe, migration_span

log = get_logger("migration")

PeerFactory = Callable[[str], DestinationPeer]  # destination address -> peer
DEFAULT_ACK_MS = 10.0  # before any migration out has committed (bench migration: 7-15 ms on one host)
ACK_WEIGHT = 0.3  # of the latest migration in the moving average


class MigrationManager:
    def __init__(self, host: MigrationHost, config: MigrationConfig, peers: PeerFactory | None = None,
                 fault: Fault = failpoint_faults, expire_interval_s: float = 0.05):
        self.host = host
        self.config = config
        self.counters = MigrationCounters()
        self.dest = Destination(host, config.max_migrate_in, self.counters, max_handoff_in=config.max_handoff_in,
                                join_hold_s=config.join_hold_ms / 1000, shared_kv=config.shared_kv)
        self.outgoing: dict[str, SourceMigration] = {}  # request id -> migration in flight
        self.fault = fault
        self._peers = peers or self._grpc_peer
        self._grpc_peers: dict[str, GrpcPeer] = {}
        self._channels = []
        self._tasks: set[asyncio.Task] = set()  # orders and their migrations
        self._expiry = asyncio.create_task(self._expire_forever(expire_interval_s))
        self.handoffs = Handoffs(host, self.hand_off, self.outgoing, config.handoff_per_layer_threshold)
        self._drain: asyncio.Task | None = None  # a role change's drain (drain.py)
        # Suspend -> commit acknowledgement of recent migrations out (ms, a moving
        # average): when a new one's commit should reach its destination.
        self.ack_ms = DEFAULT_ACK_MS

    @property
    def reservations(self):
        return self.dest.reservations

    @property
    def migrating_out(self) -> int:
        return len(self.outgoing)

    @property
    def migrating_in(self) -> int:
        return self.dest.active

    async def close(self) -> None:
        """Stop: migrations in flight abort (the requests stay here)."""
        self._expiry.cancel()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(self._expiry, *tasks, return_exceptions=True)
        for ch in self._channels:
            await ch.close()

    def _grpc_peer(self, address: str) -> DestinationPeer:
        peer = self._grpc_peers.get(address)
        if peer is None:
            ch = rpc.channel(address)
            self._channels.append(ch)
            peer = self._grpc_peers[address] = GrpcPeer(ch, self.config.rpc_timeout_s)
        return peer

    async def _expire_forever(self, interval_s: float) -> None:
        self.dest.expiry_interval_s = interval_s
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.dest.expire()
            except Exception as e:  # noqa: BLE001
                log.error("reservation expiry failed", error=repr(e))

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    # --- source ------------------------------------------------------------------
    def _to_dest(self, dest_id: str) -> int:
        return sum(1 for m in self.outgoing.values() if m.dest_id == dest_id and not m.handoff)

    def can_start(self, dest_id: str) -> bool:
        """Whether a load-balancing migration may start (handoffs have their
        own limit, at the destination: max_handoff_in)."""
        migrating = sum(1 for m in self.outgoing.values() if not m.handoff)
        return (migrating < self.config.max_migrate_out
                and self._to_dest(dest_id) < self.config.max_migrate_out_per_dest)

    def _start(self, request_id: str, dest_id: str, dest_address: str, blocking: bool) -> SourceMigration:
        """Register a migration (synchronously: limits hold with several
        orders at once)."""
        if request_id in self.outgoing:
            raise ResourceExhausted(f"request {request_id!r} is already migrating")
        if not self.can_start(dest_id):
            raise ResourceExhausted(f"migrate-out limit reached ({self.config.max_migrate_out} in all, "
                                    f"{self.config.max_migrate_out_per_dest} per destination)")
        config = replace(self.config, max_stages=0) if blocking else self.config
        mig = SourceMigration(self.host, request_id, dest_id, dest_address, self._peers(dest_address), config,
                              self.fault, expected_ack_ms=self.ack_ms)
        self.outgoing[request_id] = mig
        self.host.changed()
        return mig

    def _spawn_run(self, mig: SourceMigration) -> asyncio.Task:
        t = self._spawn(self._run(mig))
        t.add_done_callback(lambda _t: self._forget(mig))  # also when cancelled before it ran (close())
        return t

    def _forget(self, mig: SourceMigration) -> None:
        if self.outgoing.get(mig.request_id) is mig:
            del self.outgoing[mig.request_id]
            self.host.changed()

    async def _run(self, mig: SourceMigration) -> Outcome:
        parent = None
        if tracing.enabled():  # under its request's trace (a handoff starts inside the Generate that made it)
            parent = self.host.trace_context(mig.request_id) or (tracing.sampled_context() if mig.handoff else None)
        with migration_span(parent, mig) as s:
            try:
                out = await mig.run()
            finally:
                self._forget(mig)
            if s is not None:
                describe(s, mig, out)
        if mig.handoff:
            self.counters.handoff_done(out)
        else:
            self.counters.source_done(out)
            if out.committed:
                self.ack_ms += ACK_WEIGHT * (out.commit_ack_ms - self.ack_ms)
        return out

    def hand_off(self, request_id: str, dest_id: str, dest_address: str,
                 mode: HandoffMode = HandoffMode.SERIALIZED, request: EngineRequest | None = None,
                 exported: Exported | None = None) -> asyncio.Task:
        """Start a Splitwise handoff as a task of this manager, so that it
        outlives whoever started it. Serialized: the request's prompt is done
        (one last stage). Per-layer: ``request`` is added by the handoff, with
        the engine's layer tap on, and its KV streams while the prompt
        computes (layerwise.py). ``exported``: a serialized handoff's export,
        taken where the engine held the request (Handoffs.at_boundary).
        Raises ResourceExhausted if the request is migrating already."""
        if request_id in self.outgoing:
            raise ResourceExhausted(f"request {request_id!r} is already migrating")
        peer = self._peers(dest_address)
        if mode is HandoffMode.PER_LAYER:
            mig = LayerwiseHandoff(self.host, request_id, dest_id, dest_address, peer, self.config,
                                   request=request, fault=self.fault)
        else:
            mig = SourceMigration(self.host, request_id, dest_id, dest_address, peer, self.config, self.fault,
                                  handoff=True, exported=exported)
        self.outgoing[request_id] = mig
        self.host.changed()
        return self._spawn_run(mig)

    def leaving(self, request_id: str) -> bool:
        """The request is migrating out, or planned for a handoff."""
        return request_id in self.outgoing or request_id in self.handoffs.plans

    def decoding_here(self) -> tuple[list[str], int]:
        """(requests running here that would decode here; how many more wait): drain.py."""
        from services.instance.migration.drain import decoding_here

        return decoding_here(self.host, self.leaving)

    def drain(self, targets: list[tuple[str, str]], still: Callable[[], bool] = lambda: True,
              max_s: float = 60.0):
        """Move the requests decoding here to ``targets`` (drain.py): a coroutine."""
        from services.instance.migration.drain import drain

        return drain(self.host, self.migrate_one, self.leaving, targets, still, max_s)

    def start_drain(self, targets: list[tuple[str, str]], still: Callable[[], bool]) -> asyncio.Task:
        """Move the requests decoding here to ``targets`` (drain.py), as a
        task of this manager; a drain already running is superseded."""
        if self._drain is not None:
            self._drain.cancel()
        self._drain = self._spawn(self.drain(targets, still))
        return self._drain

    async def migrate_one(self, request_id: str, dest_id: str, dest_address: str, blocking: bool = False) -> Outcome:
        return await self._run(self._start(request_id, dest_id, dest_address, blocking))

    def order_status(self):
        """The status an order chooses from: requests already leaving (or
        planned to leave by a handoff once their prompt is done) excluded."""
        leaving = frozenset(self.outgoing) | frozenset(self.handoffs.plans)
        return status_without(self.host.instance_id, self.host.current_load(), self.host.headroom,
                              self.host.is_terminating(), leaving)

    async def migrate_out(self, order: MigrateOutOrder) -> OrderResult:
        """Run an order to its end; if the caller is cancelled meanwhile the
        order goes on without starting new migrations."""
        if order.cache_blocks > 0:
            return await self._shielded(self._cache_order(order))
        if not self.can_start(order.dest_instance_id):
            raise ResourceExhausted("already migrating out")
        if order.request_id and order.request_id in self.outgoing:
            raise ResourceExhausted(f"request {order.request_id!r} is already migrating")
        stop = asyncio.Event()
        return await self._shielded(self._order(order, stop), stop)

    async def _shielded(self, coro, stop: asyncio.Event | None = None):
        """An order as a task of this manager; a cancelled caller sets ``stop``."""
        task = self._spawn(coro)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if stop is not None:
                stop.set()
            raise

    async def _cache_order(self, order: MigrateOutOrder) -> OrderResult:
        """Cache moves to the order's destination (cache_move.py), one
        program at a time, the programs worth least first, until
        ``order.cache_blocks`` blocks left, none can move, or the
        destination refuses. Runs to its end (no request waits on it)."""
        result = OrderResult()
        moved = 0
        tried: set[str] = set()
        while moved < order.cache_blocks:
            programs = [p for p, _ in await self.host.runner.call(self.host.engine.movable_programs)
                        if p not in tried]
            if not programs:
                break
            tried.add(programs[0])
            mig = CacheMove(self.host, programs[0], order.dest_instance_id, order.dest_address,
                            self._peers(order.dest_address), self.config, self.fault)
            self.outgoing[mig.request_id] = mig
            try:
                out = await mig.run()
            finally:
                self._forget(mig)
            self.counters.cache_move_done(out)
            result.started += 1
            result.results.append(out)
            if out.committed:
                result.committed += 1
                moved += out.blocks + out.linked_blocks
            else:
                result.aborted += 1
                if mig.dest_failed:
                    break
        return result

    async def _order(self, order: MigrateOutOrder, stop: asyncio.Event) -> OrderResult:
        result = OrderResult()
        tried: set[str] = set()
        limit = order.max_requests or 64
        running: set[asyncio.Task] = set()
        choosing = True
        try:
            while True:
                while choosing and not stop.is_set() and result.started < limit \
                        and self.can_start(order.dest_instance_id):
                    rid = self._choose(order, result.started, tried)
                    if rid is None:
                        choosing = False
                        break
                    tried.add(rid)
                    try:
                        mig = self._start(rid, order.dest_instance_id, order.dest_address, order.blocking)
                    except ResourceExhausted:
                        continue  # leaving already (another order): choose again
                    result.started += 1
                    running.add(self._spawn_run(mig))
                    if order.request_id:
                        choosing = False
                if not running:
                    return result
                done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    out = t.result()
                    result.results.append(out)
                    if out.committed:
                        result.committed += 1
                    else:
                        result.aborted += 1
                        if self.outgoing_dest_failed(out):
                            choosing = False  # the destination is full or gone: ask the scheduler again
        except asyncio.CancelledError:
            for t in running:
                t.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            raise

    @staticmethod
    def outgoing_dest_failed(out: Outcome) -> bool:
        return "refused" in out.reason or "UNAVAILABLE" in out.reason.upper()

    def _choose(self, order: MigrateOutOrder, started: int, tried: set[str]) -> str | None:
        if order.request_id:
            return None if order.request_id in tried else order.request_id
        return next_to_migrate(self.order_status(), started, order.stop_when_freeness_above,
                               order.use_priorities, frozenset(tried), order.linkable, order.pick)
