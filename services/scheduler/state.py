"""What a leading scheduler hands over to the next: small JSON records by
kind and key, written as it acts, read by a new leader when it takes over.

Kinds written today: ``launched`` (LocalProcessLauncher: instances it started,
their address and pid), ``draining`` (Autoscaler: instances marked terminating
to be stopped once empty), ``autoscaler`` (the last action's time, for the
cooldown), ``kunserve`` (buddy groups formed and not yet restored).

``MemoryState`` (no etcd) keeps them in this process only: nothing to hand
over. ``EtcdState`` keeps them under ``scheduler/state/`` in etcd, every
write fenced by the writer's leadership (a deposed leader's writes fail).
A write that fails is logged, not raised: scheduling goes on; the next
leader then finds the state as it was before that write."""

from __future__ import annotations

import json

from libs.common import etcd as etcdlib
from libs.common.logging import get_logger

log = get_logger(__name__)


class LeaderState:
    async def put(self, kind: str, key: str, value: dict) -> bool:
        raise NotImplementedError

    async def delete(self, kind: str, key: str) -> bool:
        raise NotImplementedError

    async def load(self, kind: str) -> dict[str, dict]:
        raise NotImplementedError


class MemoryState(LeaderState):
    def __init__(self):
        self.records: dict[str, dict[str, dict]] = {}

    async def put(self, kind: str, key: str, value: dict) -> bool:
        self.records.setdefault(kind, {})[key] = dict(value)
        return True

    async def delete(self, kind: str, key: str) -> bool:
        self.records.get(kind, {}).pop(key, None)
        return True

    async def load(self, kind: str) -> dict[str, dict]:
        return {k: dict(v) for k, v in self.records.get(kind, {}).items()}


class EtcdState(LeaderState):
    def __init__(self, leadership):
        """``leadership``: an EtcdLeadership (its client, keys and fence)."""
        self.leadership = leadership

    @property
    def _etcd(self):
        return self.leadership.etcd

    def _key(self, kind: str, key: str) -> bytes:
        return self.leadership.keys.state(kind, key)

    async def _fenced(self, op, what: str) -> bool:
        try:
            ok, _ = await self._etcd.transaction(compare=[self.leadership.fence()], success=[op], failure=[])
        except etcdlib.errors() as e:
            log.warning("leader state not written", what=what, error=repr(e))
            return False
        if not ok:
            log.warning("leader state not written: no longer the leader", what=what)
        return ok

    async def put(self, kind: str, key: str, value: dict) -> bool:
        t = self._etcd.transactions
        return await self._fenced(t.put(self._key(kind, key), json.dumps(value).encode()), f"{kind}/{key}")

    async def delete(self, kind: str, key: str) -> bool:
        t = self._etcd.transactions
        return await self._fenced(t.delete(self._key(kind, key)), f"{kind}/{key}")

    async def load(self, kind: str) -> dict[str, dict]:
        prefix = self._key(kind, "")
        got = await self._etcd.get_prefix(prefix)
        out = {}
        for kv in got.kvs:
            try:
                out[kv.key[len(prefix):].decode()] = json.loads(kv.value)
            except ValueError:
                log.warning("leader state unreadable; ignored", key=kv.key.decode(errors="replace"))
        return out
