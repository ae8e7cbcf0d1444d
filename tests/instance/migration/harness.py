"""Two (or more) instances in one process for protocol tests: each an engine
on its own runner thread, a stream table, a MigrationManager; peers are
in-process. A client follows `moved` events with the frontend's own loop
(run_generation) and checks exactly-once, in-order delivery strictly."""

from __future__ import annotations

from libs.common.types import MigrateOutOrder
from services.instance.engine.base import Engine
from ferry import inprocess
from services.instance.migration import MigrationConfig
from ferry.inprocess import Client, Node

CONFIG = MigrationConfig(max_stages=4, last_stage_max_blocks=1, chunk_bytes=16 * 16 * 2 * 4 * 2, deadline_ms=300,
                         max_migrate_out=4, max_migrate_in=4, max_migrate_out_per_dest=4)

__all__ = ["CONFIG", "Client", "Cluster", "HookedPeer", "Node", "order"]


class Cluster(inprocess.Cluster):
    """The in-process cluster (ferry/inprocess.py) whose
    nodes take the tests' small-chunk, short-deadline CONFIG by default."""

    def add(self, name: str, engine: Engine, config: MigrationConfig = CONFIG) -> Node:
        return super().add(name, engine, config)


def order(dest: str, request_id: str = "", **kw) -> MigrateOutOrder:
    return MigrateOutOrder(dest_instance_id=dest, dest_address=dest, request_id=request_id, **kw)


class HookedPeer:
    """An in-process peer with async hooks before (and instead of) calls:
    delays, lost replies, a destination that stops answering."""

    def __init__(self, inner, before: dict | None = None, after: dict | None = None, lose: set | None = None):
        self.inner, self.before, self.after, self.lose = inner, before or {}, after or {}, lose or set()

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        async def call(*args, **kw):
            if name in self.before:
                await self.before[name]()
            if name in self.lose and name == "abort":
                return None  # the abort never arrives
            result = await fn(*args, **kw)
            if name in self.after:
                await self.after[name]()
            if name in self.lose:
                from services.instance.migration.messages import PeerError

                raise PeerError(f"UNAVAILABLE: {name} reply lost")
            return result

        return call
