"""The global scheduler on the virtual clock: its cluster view (the latest
status each instance reported, delivered after Delays.report_s, plus the
pending dispatches of libs/common/pending.py), Dispatch by the live
Dispatcher, and services/scheduler/rescheduler.py's Rescheduler itself on
the cluster's SimLoop (ferry/sim/aio.py): pair_migrations every
migrate_interval_s on a fresh view, one migrate-out order per pair, which
reaches the source's live MigrationManager through ferry/sim/control.py's
clients (half an RPC each way); the source is busy until its reply, the
destination only refuses what it cannot take.

Dispatch is the live one's ``place`` (libs/common/policies/phases.py): in a
cluster with prefill or decode instances (Splitwise) it chooses the prefill
instance and the decode instance at once, and the prefill instance's
MigrationManager hands the request off once its prompt is done."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from ferry.sim.instance import SimInstance
from ferry.sim.kernel import Kernel
from ferry.sim.migration import MigrationModel
from libs.common.pending import PendingDispatches
from libs.common.policies.phases import Placement, count_placed, place, uncounted
from libs.common.prefix_hash import block_hashes
from libs.common.programs import ProgramLedger
from libs.common.types import InstanceStatus, OrderResult, Priority
from services.scheduler.policies import (
    Dispatcher,
    DispatchRequest,
    InstanceView,
    PromptHashes,
)
from services.instance.migration.cache_move import PREFIX as CACHE_MOVE
from services.scheduler.rescheduler import Rescheduler
from services.scheduler.service import SchedulerConfig


class SimScheduler:
    def __init__(self, kernel: Kernel, config: SchedulerConfig, migration: MigrationModel,
                 instances: dict[str, SimInstance], migrate_interval_s: float, loop=None, clients=None):
        """``loop``: the SimLoop the instances' live migration managers run on
        (ferry/sim/aio.py), and the live rescheduler with them; ``clients``:
        how its orders reach the instances (ferry/sim/control.py)."""
        self.k = kernel
        self.config = config
        self.migration = migration
        self.instances = instances
        self.migrate_interval_s = migrate_interval_s
        self.policy = config.policy
        self.dispatcher = Dispatcher(self.policy)
        self.freeness_of = self.policy.migration_freeness
        self.statuses: dict[str, InstanceStatus] = {}
        self.synced = asyncio.Event()  # the live view's: the loops on it wait for none here
        self.synced.set()
        self.pending = PendingDispatches()
        self.clients = clients
        self.rescheduler: Rescheduler | None = None
        self.migrations_ordered = 0
        self.prompt_hashes = PromptHashes()  # for pairs_by_move_cost, as the live scheduler's
        self.loop = loop
        self.outcomes: list = []  # every migration's (services/instance/migration/messages.Outcome)
        self.cache_moves: list = []  # every cache move's (llumnix-move), apart
        # Of the committed ones: blocks sent, and blocks the destinations linked instead (running sums).
        self.blocks_sent = 0
        self.blocks_linked = 0
        self.programs = ProgramLedger()  # the live scheduler's: turns per program (DispatchRequest.program_turn)

    # --- the cluster view (libs/common/cluster_view.py) ------------------------------------
    def deliver(self, status: InstanceStatus) -> None:
        iid = status.instance_id
        if iid not in self.instances or self.instances[iid].stopped:
            return
        self.statuses[iid] = status
        self.pending.settle(iid, (r.request_id for r in status.requests), self.k.now)

    def remove(self, instance_id: str) -> None:
        self.statuses.pop(instance_id, None)
        self.pending.drop(instance_id)

    def address(self, instance_id: str) -> str | None:
        """The live ClusterView's: where a live instance answers (its id
        here), None for one stopped or unknown."""
        inst = self.instances.get(instance_id)
        return None if inst is None or inst.stopped else instance_id

    def views(self) -> list[InstanceView]:
        now = self.k.now
        return [InstanceView(iid, st, *self.pending.totals(iid, now)) for iid, st in self.statuses.items()]

    # --- Dispatch (service.py) ----------------------------------------------------------------
    def place(self, request_id: str, num_tokens: int, priority: Priority,
              token_ids: Sequence[int] | None = None, program_id: str = "") -> Placement | None:
        """Where a request of ``num_tokens`` prompt tokens runs: the live
        Dispatch's ``place`` (Splitwise: the prefill instance and the decode
        instance at once), each counted as pending there until a report
        lists the request (net of its hit there where the policy scores
        prefixes; the decode instance for the prompt and its first token)."""
        req = DispatchRequest(request_id, num_tokens, priority, program_id=program_id,
                              program_turn=self.programs.turns_before(program_id))
        if token_ids is not None and self.policy.uses_prefix:
            req = replace(req, **self.prefix_hits(token_ids, request_id))
        placed = place(self.dispatcher, self.views(), req)
        if placed is None:
            return None
        now = self.k.now
        # prefix_hits lists only instances of the size it hashed at: a hit is at the instance's own size
        add = ((lambda iid, rid, blocks: self.pending.add(iid, rid, blocks, now)) if self.config.dispatch_pending
               else uncounted)
        hit = count_placed(placed, req, lambda iid: self.statuses[iid].block_size,
                           self.statuses[placed.prefill].block_size, add)
        if program_id:
            cached = ProgramLedger.cached_tokens(num_tokens, hit, self.statuses[placed.prefill].block_size)
            self.programs.record(program_id, num_tokens, cached, now)
        return placed

    def prefix_hits(self, token_ids: Sequence[int], request_id: str = "") -> dict:
        """DispatchRequest's prefix fields for a prompt: the live scheduler's
        (services/scheduler/service.py ``prefix_hits``: each instance's
        longest held prefix of the prompt's full blocks at the cluster's block
        size), read from the engines' caches at the moment of dispatch. So
        the simulated index is exact and instant, where the live one lags the
        engines by their KV event stream (a step and a message)."""
        sizes = Counter(self.statuses[i].block_size for i in self.statuses)
        if not sizes:
            return {}
        bs = min(sizes, key=lambda b: (-sizes[b], b))
        hashes = block_hashes(token_ids, bs)
        if request_id:
            self.prompt_hashes.put(request_id, hashes)
        hits = {}
        for iid, st in self.statuses.items():
            inst = self.instances[iid]
            if st.block_size == bs and not inst.stopped:
                n = len(inst.engine.pool.lookup(hashes))
                if n:
                    hits[iid] = n
        return {"prefix_blocks": len(hashes), "hits": hits}

    def dispatch(self, request_id: str, num_prompt_tokens: int, priority: Priority,
                 token_ids: Sequence[int] | None = None, program_id: str = "") -> tuple[Placement, Priority] | None:
        placed = self.place(request_id, num_prompt_tokens, priority, token_ids, program_id)
        if placed is None:
            return None
        return placed, (priority if self.dispatcher.uses_priorities else Priority.NORMAL)

    # --- rescheduling: services/scheduler/rescheduler.py itself, on the SimLoop ----------------
    def start(self) -> None:
        if self.config.migration and self.dispatcher.migrates:
            self.rescheduler = Rescheduler(self, self.config, on_order=self._ordered, prompt_hashes=self.prompt_hashes,
                                           held_prefix=self.held_prefix, clients=self.clients,
                                           interval_s=self.migrate_interval_s, on_result=self._result)
            with self.loop.running():
                self.rescheduler.start()

    def held_prefix(self, hashes: tuple) -> dict[str, int]:
        """Per instance, how many of the first ``hashes`` its cache holds
        now (exact, as ``prefix_hits``)."""
        out = {}
        for iid, inst in self.instances.items():
            n = 0 if inst.stopped else len(inst.engine.pool.lookup(hashes))
            if n:
                out[iid] = n
        return out

    def _ordered(self) -> None:
        self.migrations_ordered += 1

    def _result(self, result: OrderResult) -> None:
        for o in result.results:
            if o.request_id.startswith(CACHE_MOVE):  # a program's kept blocks, no request (llumnix-move)
                self.cache_moves.append(o)
                continue
            self.outcomes.append(o)
            if o.committed:
                self.blocks_sent += o.blocks
                self.blocks_linked += o.linked_blocks

    def cache_move_summary(self, bytes_per_block: int) -> dict:
        """Cache moves (llumnix-move): committed and aborted, blocks sent and
        linked by the committed ones, and the bytes sent (the profile's block bytes)."""
        done = [o for o in self.cache_moves if o.committed]
        sent = sum(o.blocks for o in done)
        return {"committed": len(done), "aborted": len(self.cache_moves) - len(done), "blocks_sent": sent,
                "blocks_linked": sum(o.linked_blocks for o in done), "bytes_sent": sent * bytes_per_block}
