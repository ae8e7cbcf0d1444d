"""Per-request token streams on an instance. The engine thread's outputs land
here; Generate/Attach RPCs read from here. Unbounded queues, so a slow client
never stalls the engine."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass(frozen=True)
class Event:
    index: int
    token_id: int | None = None
    finish_reason: str | None = None
    moved_to: tuple[str, str] | None = None  # (instance_id, address) when migrated away
    stats: dict | None = None  # counters, with the final event
    # (libs.common.errors.Code value, message). With finish_reason "error":
    # the request failed alone and its client is told so. Without a finish
    # reason: the instance cannot go on (its engine died) and the stream's
    # call ends with that status, so the frontend resumes the request elsewhere.
    error: tuple[str, str] | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.moved_to is not None or self.error is not None


class RequestStream:
    def __init__(self, request_id: str, next_index: int = 0):
        self.request_id = request_id
        self.next_index = next_index  # index of the next token to be emitted
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.closed = False
        self.attached = False

    def push(self, ev: Event) -> None:
        if self.closed:
            return
        if ev.token_id is not None:
            self.next_index = ev.index + 1
        self.queue.put_nowait(ev)
        if ev.final:
            self.closed = True

    async def events(self, from_index: int = 0):
        while True:
            ev = await self.queue.get()
            if ev.token_id is None or ev.index >= from_index:
                yield ev
            elif ev.final:  # a final event on a token already delivered
                yield Event(ev.index, None, ev.finish_reason, ev.moved_to, ev.stats, ev.error)
            if ev.final:
                return


class StreamTable:
    def __init__(self):
        self._streams: dict[str, RequestStream] = {}

    def open(self, request_id: str, next_index: int = 0) -> RequestStream:
        s = RequestStream(request_id, next_index)
        self._streams[request_id] = s
        return s

    def get(self, request_id: str) -> RequestStream | None:
        return self._streams.get(request_id)

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def deliver(self, outputs, on_output=None) -> None:
        """A step's outputs (TokenOutput) onto their requests' streams: the
        delivery part of the instance's one step callback (the agent's, and
        the in-process cluster's of migration/local.py). A finished request's
        stream closes once its client is attached (NOTE: a migrated-in request
        that finishes before its client re-attached keeps its stream until
        Attach drains it). ``on_output(out)`` runs after the stream has the
        token (a Splitwise handoff's ``moved`` comes next)."""
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            reason = out.finish_reason.value if out.finish_reason else None
            stream.push(Event(out.index, out.token_id, reason, stats=out.stats, error=out.error))
            if reason and stream.attached:
                self.close(out.request_id)
            if on_output is not None:
                on_output(out)

    def ids(self) -> list[str]:
        return list(self._streams)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)
