"""The rescheduling loop (docs/design.md §5): every interval, pair migration sources
with destinations by the pure policy and order each source's llumlet to
migrate out. The llumlet chooses the requests and stops when it is no longer
a source or its blocked head of line is admitted. Pairs are made afresh every
round; a source with an order running is not paired again until the order
ends, while a destination may be paired again next round by another source
and guards itself (it refuses with a queue of its own or at its migrate-in
limit: accepts_migration). The simulator runs this loop itself on its
virtual clock (ferry/sim/run.py), its orders reaching the simulated
instances' migration managers through ferry/sim/control.py's clients."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from libs.common.errors import FerryError
from libs.common.instance_client import GrpcInstanceClients, InstanceClients
from libs.common.logging import get_logger
from libs.common.policies.cache_moves import CacheMovePair, pair_cache_moves
from libs.common.types import MigrateOutOrder, OrderResult
from services.scheduler import metrics
from services.scheduler.policies import HeldPrefix, MigrationPair, MoveCosts, PromptHashes, pair_migrations

log = get_logger(__name__)


class Rescheduler:
    def __init__(self, view, config, on_order: Callable[[], None] = lambda: None,
                 prompt_hashes: PromptHashes | None = None, held_prefix: HeldPrefix | None = None,
                 clients: InstanceClients | None = None, interval_s: float | None = None,
                 on_result: Callable[[OrderResult], None] = lambda r: None):
        """``view``: the cluster view (libs/common/cluster_view.py);
        ``config``: the scheduler's (thresholds, interval, policy);
        ``on_order``: called for every migrate-out order sent, ``on_result``
        with every order's result;
        ``prompt_hashes``, ``held_prefix``: the dispatched prompts' block
        hashes and the prefix index, for a policy that pairs by move cost;
        ``clients``: how an order reaches its source
        (libs/common/instance_client.py: gRPC, or the simulator's);
        ``interval_s``: between rounds (the config's unless given)."""
        self.view = view
        self.clients = clients or GrpcInstanceClients()
        self.interval_s = config.migrate_interval_s if interval_s is None else interval_s
        self.on_result = on_result
        self.prompt_hashes = prompt_hashes
        self.held_prefix = held_prefix
        self.config = config
        self.on_order = on_order
        self._task: asyncio.Task | None = None
        self._busy: dict[str, asyncio.Task] = {}  # source instance id -> its migrate-out order
        self.policy = config.policy
        self.freeness_of = self.policy.migration_freeness

    @property
    def busy(self) -> frozenset[str]:
        """Sources with an order under way."""
        return frozenset(self._busy)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        for t in [self._task, *self._busy.values()]:
            if t:
                t.cancel()
        await asyncio.gather(*[t for t in [self._task, *self._busy.values()] if t], return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if not self.view.synced.is_set():
                continue
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - the loop must go on
                log.error("rescheduling tick failed", error=repr(e))

    def tick(self) -> list[MigrationPair]:
        busy = frozenset(self._busy)
        costs = None
        if self.policy.pairs_by_move_cost and self.prompt_hashes is not None and self.held_prefix is not None:
            costs = MoveCosts(self.prompt_hashes, self.held_prefix, self.config.out_threshold,
                              self.policy.uses_priorities)
        views = self.view.views()
        pairs = pair_migrations(views, self.config.out_threshold, self.config.in_threshold, self.freeness_of, busy,
                                costs, self.policy)
        by_id = {v.instance_id: v for v in views} if costs is not None else {}
        for p in pairs:
            # the order says which of the source's requests' prefixes the destination holds
            link = costs.linkable(by_id[p.source], p.destination) if costs is not None else {}
            self._busy[p.source] = asyncio.create_task(self._order(p, link))
        if self.policy.moves_kept:  # programs' kept blocks, from instances short of room (cache_moves.py)
            for m in pair_cache_moves(views, frozenset(self._busy)):
                self._busy[m.source] = asyncio.create_task(self._move_cache(m))
        return pairs

    async def _move_cache(self, move: CacheMovePair) -> None:
        result = await self._send(move.source, move.destination, metrics.CACHE_MOVE_ORDERS, "cache move",
                                  lambda dst: MigrateOutOrder(move.destination, dst, cache_blocks=move.blocks))
        if result is not None:
            metrics.CACHE_MOVE_ORDERS.labels("done").inc()
            log.info("cache move done", source=move.source, destination=move.destination, asked=move.blocks,
                     committed=result.committed, aborted=result.aborted)

    async def _order(self, pair: MigrationPair, link: dict[str, int] | None = None) -> None:
        def sent() -> None:
            self.on_order()
            log.debug("migrate-out order", source=pair.source, destination=pair.destination,
                      source_freeness=round(pair.source_freeness, 2),
                      destination_freeness=round(pair.destination_freeness, 2))

        result = await self._send(pair.source, pair.destination, metrics.ORDERS, "migrate-out", lambda dst: (
            MigrateOutOrder(pair.destination, dst, self.config.out_threshold,
                            use_priorities=self.policy.uses_priorities, linkable=link or {},
                            max_requests=self.policy.order_max_requests, pick=self.policy.order_pick)), sent)
        if result is not None:
            metrics.order_done(result)
            if result.started:
                log.info("migrate-out done", source=pair.source, destination=pair.destination,
                         committed=result.committed, aborted=result.aborted)

    async def _send(self, source: str, destination: str, failed, what: str,
                    order: Callable[[str], MigrateOutOrder], sent: Callable[[], None] = lambda: None
                    ) -> OrderResult | None:
        """One order to ``source``, built with the destination's address, and
        its result (to ``on_result`` as well); None when either instance left
        the view or the call failed (counted in ``failed``, labelled by
        outcome). ``sent``: called just before the call. The source is busy
        until this returns."""
        src, dst = self.view.address(source), self.view.address(destination)
        try:
            if src is None or dst is None:
                return None
            sent()
            result = await self.clients(source, src).migrate_out(order(dst))
            self.on_result(result)
            return result
        except FerryError as e:
            failed.labels("failed").inc()
            log.debug(f"{what} order failed", source=source, error=e.code.name, details=str(e))
            return None
        finally:
            self._busy.pop(source, None)
