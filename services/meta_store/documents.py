"""Documents the frontends share through the meta store: the Responses API's
stored responses (``store``), which a continuation (``previous_response_id``)
reads on whichever frontend replica it lands.

Peers keep them per frontend process, so a continuation that reaches another
replica fails there (vLLM issue 37938). Here they live in the meta store:

- ``MemoryDocuments``: in the store's memory, each for its TTL, at most
  ``max_bytes`` in all (the oldest go first); they do not outlive the process;
- ``EtcdDocuments`` (``--etcd``): in etcd under ``documents/<kind>/<key>``
  on a lease of the document's TTL, so every meta-store replica reads them
  and they outlive any one of them.
"""

from __future__ import annotations

import abc
import time
from collections import OrderedDict

from libs.common import etcd as etcdlib

DEFAULT_TTL_S = 30 * 24 * 3600.0  # OpenAI keeps stored responses 30 days
MAX_DOCUMENT_BYTES = 16 << 20


class Documents(abc.ABC):
    @abc.abstractmethod
    async def put(self, kind: str, key: str, data: bytes, ttl_s: float) -> None: ...

    @abc.abstractmethod
    async def get(self, kind: str, key: str) -> bytes | None: ...

    @abc.abstractmethod
    async def delete(self, kind: str, key: str) -> bool: ...


class MemoryDocuments(Documents):
    def __init__(self, max_bytes: int = 256 << 20, clock=time.monotonic):
        self.max_bytes = max_bytes
        self.clock = clock
        self._docs: OrderedDict[tuple[str, str], tuple[bytes, float]] = OrderedDict()
        self._bytes = 0

    async def put(self, kind: str, key: str, data: bytes, ttl_s: float) -> None:
        await self.delete(kind, key)
        self._docs[(kind, key)] = (data, self.clock() + (ttl_s or DEFAULT_TTL_S))
        self._bytes += len(data)
        while self._bytes > self.max_bytes and self._docs:
            _, (old, _) = self._docs.popitem(last=False)
            self._bytes -= len(old)

    async def get(self, kind: str, key: str) -> bytes | None:
        doc = self._docs.get((kind, key))
        if doc is None:
            return None
        if doc[1] < self.clock():
            await self.delete(kind, key)
            return None
        return doc[0]

    async def delete(self, kind: str, key: str) -> bool:
        doc = self._docs.pop((kind, key), None)
        if doc is not None:
            self._bytes -= len(doc[0])
        return doc is not None


class EtcdDocuments(Documents):
    def __init__(self, endpoints: str, prefix: str = "/ferry"):
        self.keys = etcdlib.Keys(prefix)
        self.etcd = etcdlib.client(endpoints)

    async def put(self, kind: str, key: str, data: bytes, ttl_s: float) -> None:
        lease = await self.etcd.lease(etcdlib.lease_ttl(ttl_s or DEFAULT_TTL_S))
        await self.etcd.put(self.keys.document(kind, key), data, lease=lease)

    async def get(self, kind: str, key: str) -> bytes | None:
        got = await self.etcd.get(self.keys.document(kind, key))
        return None if got is None else got.value

    async def delete(self, kind: str, key: str) -> bool:
        return await self.etcd.delete(self.keys.document(kind, key)) is not None

    async def close(self) -> None:
        await self.etcd.close()
