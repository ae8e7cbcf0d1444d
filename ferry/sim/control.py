"""What the scheduler's live loops reach instances through, on the virtual
clock: the autoscaler's launcher (a launch is a new simulated instance after
Delays.launch_s; a stop removes it at once) and the instance clients
(libs/common/instance_client.py), each call charged half a round trip each
way (Delays.rpc_s). With them the simulator runs services/scheduler/autoscaler.py
and services/scheduler/rescheduler.py themselves, on its SimLoop
(ferry/sim/aio.py)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from libs.common.errors import Unavailable
from libs.common.types import InstanceStatus, MigrateOutOrder, OrderResult, Role

if TYPE_CHECKING:
    from ferry.sim.run import Cluster


class SimLauncher:
    """The launcher's interface (services/scheduler/launcher.py) over the
    simulated cluster: the initial fleet is not its own and never stopped."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self._mine: set[str] = set()

    async def launch(self) -> str:
        await asyncio.sleep(self.cluster.delays.launch_s)  # its process starts and loads the model
        inst = self.cluster.add_instance()
        self._mine.add(inst.instance_id)
        return inst.instance_id

    async def stop(self, instance_id: str) -> None:
        self._mine.discard(instance_id)
        self.cluster.stop_instance(instance_id)

    def instances(self) -> list[str]:
        return sorted(self._mine)

    def stoppable(self) -> list[str]:
        return sorted(self._mine)


class SimClient:
    def __init__(self, cluster: Cluster, instance_id: str):
        self.cluster = cluster
        self.instance_id = instance_id

    def _inst(self):
        inst = self.cluster.instances.get(self.instance_id)
        if inst is None or inst.stopped:
            raise Unavailable(f"instance {self.instance_id} is not running")
        return inst

    async def _hop(self) -> None:
        await asyncio.sleep(self.cluster.delays.rpc_s / 2)

    async def set_terminating(self, value: bool) -> None:
        await self._hop()
        self._inst().set_terminating(value)
        await self._hop()

    async def status(self) -> InstanceStatus:
        await self._hop()
        st = self._inst().status()
        if st is None:
            raise Unavailable(f"instance {self.instance_id} has no status yet")
        await self._hop()
        return st

    async def set_role(self, role: Role, drain_to=()) -> tuple[Role, int]:
        raise Unavailable("role changes are not simulated")

    async def migrate_out(self, order: MigrateOutOrder) -> OrderResult:
        """The order run by the source's live MigrationManager on this loop, as its MigrateOut RPC runs it."""
        await self._hop()
        result = await self._inst().manager.migrate_out(order)
        await self._hop()
        return result


class SimClients:
    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    def __call__(self, instance_id: str, address: str) -> SimClient:
        return SimClient(self.cluster, instance_id)

    def forget(self, instance_id: str) -> None:
        pass  # nothing is kept per instance
