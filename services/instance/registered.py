"""Which instances the meta store knows, and where: a migration's or a
handoff's destination must be one of them, at the address given. NOTE: the
cluster token is not root: a holder of it who orders a MigrateOut to its own
address gets a refusal, not the request's prompt and KV (and its client's
stream, which would follow). Looked up with a unary List (addresses only),
cached briefly and asked again on a miss."""

from __future__ import annotations

import asyncio
import time

import grpc

from libs.pb import meta_store_pb2 as mpb
from libs.pb import meta_store_pb2_grpc as mpb_grpc
from libs.common import rpc
from libs.common.errors import FailedPrecondition, Unavailable
from libs.common.logging import get_logger

log = get_logger(__name__)


class Registered:
    def __init__(self, meta_store: str, max_age_s: float = 1.0, timeout_s: float = 2.0):
        self.meta_store = meta_store
        self.max_age_s = max_age_s
        self.timeout_s = timeout_s
        self._addresses: dict[str, str] = {}
        self._at = float("-inf")
        self._lock = asyncio.Lock()
        self._channel = None

    async def _refresh(self) -> None:
        if self._channel is None:
            self._channel = rpc.channel(self.meta_store)
        reply = await mpb_grpc.MetaStoreStub(self._channel).List(mpb.ListRequest(info_only=True),
                                                                  timeout=self.timeout_s)
        self._addresses = {r.info.instance_id: r.info.address for r in reply.instances}
        self._at = time.monotonic()

    async def address(self, instance_id: str) -> str | None:
        """The registered address of ``instance_id`` (None: not registered)."""
        async with self._lock:
            stale = time.monotonic() - self._at > self.max_age_s
            if stale or instance_id not in self._addresses:
                try:
                    await self._refresh()
                except grpc.RpcError as e:
                    if stale:
                        raise Unavailable(f"cannot check the destination with the meta store: "
                                          f"{e.code().name}") from None
        return self._addresses.get(instance_id)

    async def check(self, instance_id: str, address: str, what: str = "destination") -> None:
        """Raise FailedPrecondition unless ``instance_id`` is registered at ``address``."""
        registered = await self.address(instance_id)
        if registered != address:
            log.warning("unregistered destination refused", what=what, instance_id=instance_id, address=address,
                        registered=registered)
            where = f"registered at {registered}" if registered else "not registered"
            raise FailedPrecondition(f"{what} {instance_id!r} at {address} is {where}")

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


class Everyone:
    """Who the meta store knows when there is none to ask (agents in one
    process, the simulator's): every instance, at whatever address it is
    named by."""

    async def check(self, instance_id: str, address: str, what: str = "") -> None:
        pass

    async def close(self) -> None:
        pass
