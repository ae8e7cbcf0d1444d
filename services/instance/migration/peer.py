"""The destination as the source sees it: the protocol's calls on domain
types. Two implementations: in-process (a Destination object in this
process: tests, the simulator) and gRPC (grpc_peer.py: chunking, protobuf,
credentials)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Protocol

import numpy as np

from libs.common.types import RequestState
from services.instance.engine.base import ProgramKv
from services.instance.migration.destination import Destination
from services.instance.migration.messages import Admission, KvChunk, LastStage, PreAllocate


class DestinationPeer(Protocol):
    """Every call raises PeerError (or another exception) when the
    destination cannot be reached or fails; a refusal is a result."""

    async def pre_allocate(self, p: PreAllocate) -> Admission:
        """Accepted or why not; whether the source's shared KV cache is mapped."""

    async def transfer(self, chunks: AsyncIterator[KvChunk]) -> int:
        """Stream one stage's chunks; returns the blocks the destination wrote."""

    async def commit(self, migration_id: str, state: RequestState, last: LastStage | None = None) -> None:
        """Hand the request over; returns once the destination owns it.
        ``last``: the last stage's source blocks, copied there first."""

    async def commit_cache(self, migration_id: str, kv: ProgramKv) -> None:
        """A cache move's commit: returns once the destination keeps the blocks for the program."""

    async def expect_commit(self, migration_id: str, in_ms: float) -> bool:
        """Best effort, before the suspend: the commit should come in about
        ``in_ms`` (Destination.expect_commit); whether the destination holds for it."""

    async def abort(self, migration_id: str, reason: str) -> None:
        """Best effort: the reservation's deadline frees it otherwise."""

    async def settled(self, migration_id: str, wait_ms: int) -> float | None:
        """Commit acknowledged -> the request's first step there (ms), or None."""


def copy_state(state: RequestState) -> RequestState:
    """A state that shares no list with the source's (the destination's
    engine appends to its request's token lists)."""
    return dataclasses.replace(state, prompt_token_ids=list(state.prompt_token_ids),
                               output_token_ids=list(state.output_token_ids), extra=dict(state.extra))


def _copy(data: bytes | memoryview) -> memoryview:
    """A copy of a chunk's bytes by numpy, which lets other threads run
    while it copies (``bytes(view)`` holds the interpreter lock: with 16 MiB
    chunks, the engines' threads in this process waited on it)."""
    return memoryview(np.frombuffer(data, dtype=np.uint8).copy())


class InProcessPeer:
    """A Destination in this process, called directly."""

    def __init__(self, dest: Destination):
        self.dest = dest

    async def pre_allocate(self, p: PreAllocate) -> Admission:
        return await self.dest.pre_allocate(p)

    async def transfer(self, chunks: AsyncIterator[KvChunk]) -> int:
        async def copied():
            async for c in chunks:  # the source's buffer is reused after a chunk goes
                yield dataclasses.replace(c, data=_copy(c.data))

        written, _ = await self.dest.transfer(copied())
        return written

    async def commit(self, migration_id: str, state: RequestState, last: LastStage | None = None) -> None:
        await self.dest.commit(migration_id, copy_state(state), last)

    async def commit_cache(self, migration_id: str, kv: ProgramKv) -> None:
        await self.dest.commit_cache(migration_id, kv)

    async def expect_commit(self, migration_id: str, in_ms: float) -> bool:
        return self.dest.expect_commit(migration_id, in_ms)

    async def abort(self, migration_id: str, reason: str) -> None:
        await self.dest.abort(migration_id, reason)

    async def settled(self, migration_id: str, wait_ms: int) -> float | None:
        return await self.dest.settle(migration_id, wait_ms)
