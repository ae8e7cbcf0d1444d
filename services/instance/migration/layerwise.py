"""The per-layer prefill -> decode handoff of one request (Splitwise,
libs.common.policies.phases.HandoffMode.PER_LAYER), on the migration
protocol: same pre-allocate / transfer / commit handshake, same peers, same
abort rules. While the prompt computes here, the engine hands each layer's
K/V of each prompt chunk to a tap (Engine.tap_layers) the moment the layer
wrote it; the chunks go to the destination at once (KvChunk.layer) into the
blocks it reserved first. When the prompt is done only the commit is left:
the copy hid behind the prompt's later layers. (The serialized handoff is
the migration itself: SourceMigration(handoff=True), source.py, from the
request the engine held after its first token; the one production runs and
``ferry bench handoff-modes`` measures.)

The request is suspended at the step boundary right after the step that
finished its prompt (its first token came from here), and the request state
travels in the commit; the client follows ``moved`` as after a migration.
Blocks the prompt computed before the tap went on (the handoff started late)
go first, per layer, gathered here.

States: SELECT -> PRE_ALLOC -> STREAM -> SUSPENDED -> COMMIT -> DONE; any
failure -> ABORT (the request goes on here, as after
an aborted migration; the reservation is released or expires).

NOTE: cancellation-safe like SourceMigration (whose abort path it reuses):
the request runs on exactly one instance, and the tap is gone afterwards.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass

from libs.common.logging import get_logger
from libs.common.policies.phases import HandoffMode
from libs.common.prefix_hash import block_hashes
from libs.common.types import RequestState
from services.instance.engine.base import EngineBroken, EngineRequest, LayerKv
from services.instance.engine.core.scheduler import cdiv
from services.instance.migration.host import MigrationHost
from services.instance.migration.messages import KvChunk, MigrationAborted, MigrationConfig
from services.instance.migration.peer import DestinationPeer
from services.instance.migration.source import Fault, SourceMigration, failpoint_faults
from services.instance.migration.states import Machine, SourceState

log = get_logger("migration")

__all__ = ["HandoffMode", "HandoffState", "LayerwiseHandoff"]


class HandoffState(enum.Enum):
    SELECT = "select"
    PRE_ALLOC = "pre_alloc"
    STREAM = "stream"  # per-layer chunks go as the prompt's layers compute
    SUSPENDED = "suspended"  # out of the batch right after the prompt's last step
    COMMIT = "commit"
    DONE = "done"


H = HandoffState
ABORT = SourceState.ABORT  # the abort state the shared abort path moves to
_EDGES = {
    H.SELECT: {H.PRE_ALLOC},
    H.PRE_ALLOC: {H.STREAM},
    H.STREAM: {H.SUSPENDED},
    H.SUSPENDED: {H.COMMIT},
    H.COMMIT: {H.DONE},
    H.DONE: set(),
    ABORT: set(),
}


class HandoffMachine(Machine):
    """A source-side machine over HandoffState (ABORT from any live state)."""

    @property
    def edges(self) -> dict:
        return _EDGES

    @property
    def terminal(self) -> bool:
        return self.state in (H.DONE, ABORT)


@dataclass(frozen=True)
class _Suspended:
    """Pushed by the engine thread at the step boundary after the prompt:
    the request's state and blocks, or None (it finished or is gone)."""

    at: float = 0.0
    state: RequestState | None = None
    blocks: tuple[int, ...] = ()


class LayerwiseHandoff(SourceMigration):
    """Hand one prefilling request to a destination; ``run()`` returns the
    Outcome (committed, or aborted with the request still here).

    ``request``: add it to the engine in the same engine-thread call that
    puts the tap on, so that its first prompt chunk is already streamed
    (else the request must be live here; what it computed before goes first).
    ``added`` then resolves to None once the request is in the engine, or to
    the reason it is not (the engine's error, or the handoff ended first):
    the caller that gave the request answers its client from it.
    """

    def __init__(self, host: MigrationHost, request_id: str, dest_id: str, dest_address: str,
                 peer: DestinationPeer, config: MigrationConfig, request: EngineRequest | None = None,
                 fault: Fault = failpoint_faults):
        # handoff=True: the destination counts it against max_handoff_in, the
        # manager apart from load-balancing migrations
        super().__init__(host, request_id, dest_id, dest_address, peer, config, fault, handoff=True)
        self.id = self.id.replace("mig-", "hand-", 1)
        self.m = HandoffMachine("source", self.id, request_id, H.SELECT)
        self.out.migration_id = self.id
        self.request = request
        self.loop = self.runner.loop
        self.events: asyncio.Queue = asyncio.Queue()  # LayerKv, then one _Suspended
        # engine-thread flags: the suspend is queued once; after the abort's untap nothing is
        self._suspend_queued = False
        self._untapped = False
        layout = self.engine.kv_layout
        self.layer_bytes = layout.bytes_per_block // layout.num_layers  # one block, one layer
        self.num_blocks = 0  # every block of the prompt
        self.linked = 0  # of them, the first ones the destination linked from its prefix cache: not sent
        self.keepalive_s = max(0.01, config.deadline_ms / 3000)
        self.add_error: Exception | None = None
        self._added = False  # set on the engine thread once add_request took the request
        self.added: asyncio.Future = self.loop.create_future()
        self.suspended: _Suspended | None = None  # what the engine thread pushed after the prompt
        self.caught_up = 0

    def _to(self, state, **fields) -> None:
        self.m.to(state, **fields)
        self.fault(f"handoff.{state.value}")  # tests inject failures and cancellations here

    # --- on the engine thread ------------------------------------------------------
    def _select(self):
        """Add the request (if given) and put the tap on, in one step
        boundary; returns (tokens to compute, preemptions, the full blocks
        computed before the tap) or a reason why not."""
        if self.request is not None:
            try:
                self.engine.add_request(self.request)
            except Exception as e:  # noqa: BLE001 - the caller learns it from run()
                self.add_error = e
                return f"the engine refused the request: {e}"
            self._added = True
        phase = self.engine.request_phase(self.request_id)
        if phase is None or phase[0] == "suspended":
            return "request is not waiting or running"
        stats = self.engine.request_stats(self.request_id)
        if not self.engine.tap_layers(self.request_id, self._tap, copy=True):
            return f"the {self.engine.name} engine has no per-layer hook"
        return stats["num_tokens"], phase[1], self.engine.full_blocks(self.request_id)

    def _tap(self, kv: LayerKv) -> None:
        """After each layer of each chunk of the request: hand the data to the
        loop; after the last layer of the step that finishes the prompt,
        queue the suspend for the coming step boundary (commands run before
        the next step, so the request never decodes here)."""
        if self._untapped:
            return
        if kv.data is not None:
            self.loop.call_soon_threadsafe(self.events.put_nowait, kv)
        if kv.samples and kv.layer == kv.num_layers - 1 and not self._suspend_queued:
            self._suspend_queued = True
            self.runner.submit(self._suspend_after_prompt)

    def _suspend_after_prompt(self) -> None:
        if self._untapped:  # the handoff aborted meanwhile: the request goes on here
            return
        self.engine.tap_layers(self.request_id, None)
        done = _Suspended()
        if self.engine.suspend_request(self.request_id):
            at = self.host.clock()
            state = self.engine.export_state(self.request_id)
            state.num_migrations += 1
            done = _Suspended(at, state, tuple(self.engine.all_blocks(self.request_id)))
        self.loop.call_soon_threadsafe(self.events.put_nowait, done)

    def _resume_if_suspended(self) -> bool:
        """The abort's engine-thread half: no tap, no suspend to come, and
        the request back in the batch if the suspend already ran."""
        self._untapped = True
        self.engine.tap_layers(self.request_id, None)
        return super()._resume_if_suspended()

    # --- the stream ------------------------------------------------------------------
    @property
    def stage_blocks(self) -> int:
        """The blocks sent: the prompt's, less those linked at the destination."""
        return self.num_blocks - self.linked

    def _layer_chunks(self, layer: int, first_block: int, data: memoryview) -> list[KvChunk]:
        """``data``: the layer's KV of the prompt's blocks from ``first_block``
        on; the linked ones are skipped, and offsets count in the stage (the
        blocks after the linked ones)."""
        n = len(data) // self.layer_bytes
        if first_block + n > self.num_blocks:
            raise MigrationAborted(f"layer KV for blocks {first_block}..{first_block + n} "
                                   f"of a {self.num_blocks}-block prompt")
        skip = min(n, max(0, self.linked - first_block))
        data, first, n = data[skip * self.layer_bytes:], first_block + skip - self.linked, n - skip
        per = max(1, self.config.chunk_bytes // self.layer_bytes)
        total = self.stage_blocks * self.engine.kv_layout.bytes_per_block
        return [KvChunk(self.id, 0, (first + i) * self.layer_bytes,
                        data[i * self.layer_bytes:(i + per) * self.layer_bytes], self.stage_blocks, total, layer)
                for i in range(0, n, per)]

    async def _catch_up(self, blocks: list[int]) -> AsyncIterator[KvChunk]:
        """Full blocks computed before the tap, per layer (one stage takes
        one kind of chunk)."""
        if not blocks:
            return
        fused = await self.host.offload(self.engine.gather_kv, blocks)
        layers = self.engine.kv_layout.num_layers
        lb = self.layer_bytes
        for layer in range(layers):
            # [n, layers, ...] -> this layer's rows, contiguous
            part = b"".join(fused[(b * layers + layer) * lb:(b * layers + layer + 1) * lb]
                            for b in range(len(blocks)))
            for c in self._layer_chunks(layer, 0, memoryview(part)):
                yield c

    async def _stream(self, catch_up: list[int]) -> AsyncIterator[KvChunk]:
        """The transfer's chunks until the request is suspended after its
        prompt: the catch-up, then every tapped layer as it comes, with
        empty chunks that renew the reservation meanwhile."""
        async for c in self._catch_up(catch_up):
            self.out.bytes += len(c.data)
            yield c
        sent_first = False
        getter: asyncio.Future | None = None
        try:
            while True:
                # NOTE: one get() kept across timeouts (never cancelled while
                # waiting), so that no event is lost to a timeout.
                if getter is None:
                    getter = asyncio.ensure_future(self.events.get())
                done, _ = await asyncio.wait({getter}, timeout=self.keepalive_s)
                if not done:
                    yield KvChunk(self.id, 0, 0, b"", self.stage_blocks, 0, layer=0)
                    # NOTE: a dict lookup from the loop (as Destination.commit
                    # does): a request gone here never brings the suspend.
                    if self.runner.dead:
                        raise MigrationAborted("the source engine died")
                    if self.engine.request_phase(self.request_id) is None:
                        raise MigrationAborted("request finished or was aborted at the source")
                    continue
                ev, getter = getter.result(), None
                if isinstance(ev, _Suspended):
                    self.suspended = ev
                    return
                # NOTE: the chunk's last block waits for the next chunk (which
                # starts in it) unless the prompt is done: every block goes
                # once per layer, complete, so the destination's count of
                # blocks with every layer is exact (a lost chunk shows).
                n = len(ev.block_ids) if ev.samples else ev.end // self.engine.block_size - ev.first_block
                for c in self._layer_chunks(ev.layer, ev.first_block, ev.data[:n * self.layer_bytes]):
                    self.out.bytes += len(c.data)
                    yield c
                    if not sent_first:
                        sent_first = True
                        self.fault("source.crash_mid_transfer")
        finally:
            if getter is not None:
                getter.cancel()

    # --- the protocol ------------------------------------------------------------------
    def settle_added(self) -> None:
        """Resolve ``added``. NOTE: called once the engine thread ran
        ``_select`` or never will: after it returned, after the abort's
        engine-thread call (queued behind it), or when the task ended
        before it started."""
        if self.added.done():
            return
        if self.add_error is not None:
            self.added.set_result(self.add_error)
        elif self._added or self.request is None:
            self.added.set_result(None)
        else:
            self.added.set_result(EngineBroken("the handoff ended before the request was added"))

    async def run(self):
        try:
            out = await super().run()
        finally:
            self.settle_added()
        self.out.stages = 1 if out.committed else 0
        if self.add_error is not None:
            raise self.add_error
        return out

    async def _run(self) -> None:
        sel = await self.runner.call(self._select)
        self.settle_added()
        if isinstance(sel, str):
            raise MigrationAborted(sel)
        target, self.preemptions, catch_up = sel
        self.num_blocks = cdiv(target, self.engine.block_size)
        self.caught_up = len(catch_up)  # blocks computed before the tap
        self._to(H.PRE_ALLOC, blocks=self.num_blocks, mode=HandoffMode.PER_LAYER.value)
        # The prompt's full blocks the destination's prefix cache holds are linked there, not sent.
        bs = self.engine.block_size
        full = target // bs
        hashes = (tuple(block_hashes(self.request.prompt_token_ids[:full * bs], bs)) if self.request is not None
                  else None)  # a request added here: the engine has not hashed its prompt yet
        self.linked = await self._pre_allocate(0, self.num_blocks, full=full, hashes=hashes)
        self._to(H.STREAM, blocks=self.num_blocks, catch_up=len(catch_up))
        written = await self.peer.transfer(self._stream(catch_up))
        done = self.suspended
        if done is None or done.state is None:
            raise MigrationAborted("request finished or was aborted before its prompt was handed off")
        state = done.state
        self._to(H.SUSPENDED, blocks=len(done.blocks), computed=state.num_computed_tokens)
        if state.num_preemptions != self.preemptions:
            raise MigrationAborted("request was preempted at the source")
        if state.num_computed_tokens != target or len(done.blocks) != self.num_blocks:
            raise MigrationAborted(f"{state.num_computed_tokens} tokens in {len(done.blocks)} blocks "
                                   f"after the prompt, {target} in {self.num_blocks} expected")
        if written != self.stage_blocks:
            raise MigrationAborted(f"destination completed {written} of {self.stage_blocks} blocks")
        self.out.blocks = self.stage_blocks
        self._to(H.COMMIT, blocks=self.out.blocks, bytes=self.out.bytes)
        await self.peer.commit(self.id, state)
        self._hand_over(done.at, len(state.output_token_ids), H.DONE)
