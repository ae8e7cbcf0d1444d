"""Helpers for the handoff tests: start a request together with its handoff
(LayerwiseHandoff adds it with the tap on) with a client that follows it
across the ``moved`` event (harness.Client.follow: it attaches to the stream
opened here and follows with the frontend's loop), and peers that watch or
break the chunk stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from libs.common.types import SamplingParams
from services.instance.engine.base import EngineRequest
from services.instance.migration.layerwise import LayerwiseHandoff
from services.instance.migration.messages import KvChunk, MigrationConfig
from tests.instance.migration.harness import CONFIG, Client, Cluster


def engine_request(rid: str, prompt: list[int], n: int, **sampling) -> EngineRequest:
    return EngineRequest(rid, tuple(prompt), SamplingParams(max_tokens=n, ignore_eos=True, **sampling), 0,
                         time.time())


def open_client(c: Cluster, rid: str, node: str) -> Client:
    """The request's stream at ``node``, for the client's follow(node)."""
    c.nodes[node].streams.open(rid)
    return Client(c, rid)


def handoff(c: Cluster, rid: str, prompt: list[int], n: int, src: str = "a",
            dst: str = "b", config: MigrationConfig = CONFIG, add: bool = True,
            **sampling) -> LayerwiseHandoff:
    a = c.nodes[src]
    return LayerwiseHandoff(a.host, rid, dst, dst, c.peer(dst), config,
                            request=engine_request(rid, prompt, n, **sampling) if add else None,
                            fault=a._fault)


async def run_with_handoff(c: Cluster, rid: str, prompt: list[int], n: int, **kw) -> tuple[Client, asyncio.Task, LayerwiseHandoff, asyncio.Task]:
    """Open the client's stream at a, start the handoff (it adds the request)."""
    cl = open_client(c, rid, kw.get("src", "a"))
    h = handoff(c, rid, prompt, n, **kw)
    ht = asyncio.create_task(h.run())
    return cl, asyncio.create_task(cl.follow(kw.get("src", "a"))), h, ht


class WatchedPeer:
    """An in-process peer whose transfer passes every chunk to ``on_chunk``
    on its way (which may record it, or raise to break the stream)."""

    def __init__(self, inner, on_chunk: Callable[[KvChunk], None]):
        self.inner, self.on_chunk = inner, on_chunk

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def transfer(self, chunks):
        async def watched():
            async for ch in chunks:
                self.on_chunk(ch)
                yield ch

        return await self.inner.transfer(watched())
