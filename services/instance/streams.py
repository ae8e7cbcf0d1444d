"""Per-request token streams on an instance. The engine thread's outputs land
here; Generate/Attach read from here (``serve_stream``: the agent's, and the
in-process cluster's of ferry/inprocess.py). Unbounded queues, so a slow
client never stalls the engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from libs.common.errors import Code, FerryError, NotFound
from libs.common.types import Logprobs, Moved, StreamEvent


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
    logprobs: Logprobs | None = None  # the token's, when its request asked for them
    prompt_logprobs: tuple | None = None  # the prompt's, with the request's first output (when asked for)

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
                yield Event(ev.index, None, ev.finish_reason, ev.moved_to, ev.stats, ev.error,
                            prompt_logprobs=ev.prompt_logprobs)
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
        the in-process cluster's of ferry/inprocess.py). A finished request's
        stream closes once its client is attached (NOTE: a migrated-in request
        that finishes before its client re-attached keeps its stream until
        Attach drains it). ``on_output(out)`` runs after the stream has the
        token (a Splitwise handoff's ``moved`` comes next)."""
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            reason = out.finish_reason.value if out.finish_reason else None
            stream.push(Event(out.index, out.token_id, reason, stats=out.stats, error=out.error,
                              logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs))
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


def flush_event(ev: Event, tokens: list[int], first_index: int, num_prompt_tokens: int = 0,
                logprobs: list | None = None, prompt_logprobs: tuple | None = None) -> StreamEvent:
    """What goes to the client at once: ``tokens`` (output positions from
    ``first_index``, with their ``logprobs`` if any) and whatever ``ev``, the
    last event they came with, says (finished, moved, failed, stats)."""
    stats = ev.stats or {}
    return StreamEvent(first_index if tokens else ev.index, tuple(tokens), ev.finish_reason or "",
                       Moved(ev.moved_to[0], ev.moved_to[1], ev.index) if ev.moved_to is not None else None,
                       ev.error, num_prompt_tokens, int(stats.get("num_preemptions", 0)),
                       float(stats.get("preemption_loss_ms", 0.0)), int(stats.get("num_migrations", 0)),
                       tuple(logprobs or ()), tuple(prompt_logprobs or ()),
                       max(0, int(stats.get("cached_prompt_tokens", 0))))


async def serve_stream(streams: StreamTable, stream: RequestStream, from_index: int, num_prompt_tokens: int,
                       flush_interval_ms: int, client_gone: Callable[[str], None]) -> AsyncIterator[StreamEvent]:
    """A request's stream as Generate and Attach serve it, from
    ``from_index``: its events as StreamEvents. With a flush interval,
    tokens after the first are held and sent together at most that often; a
    final event (finished, or moved away) always goes at once with what is
    held. An error without a finish reason (the instance cannot go on) ends
    the call with that status. The stream leaves ``streams`` at the end;
    ``client_gone(request_id)`` when the reader left before the final event
    (it aborts the request and frees its blocks)."""
    rid = stream.request_id
    stream.attached = True
    final = False
    interval_s = max(0, flush_interval_ms) / 1000.0
    held: list[int] = []
    held_lp: list = []  # their logprobs (when asked for)
    prompt_lp = None
    held_from = 0
    last_sent: float | None = None
    try:
        async for ev in stream.events(from_index):
            final = ev.final
            if ev.error is not None and ev.finish_reason is None:
                if held:  # what the client has not seen yet goes first
                    yield flush_event(Event(held_from), held, held_from, logprobs=held_lp, prompt_logprobs=prompt_lp)
                raise FerryError(ev.error[1], code=Code(ev.error[0]))
            if ev.prompt_logprobs is not None:
                prompt_lp = ev.prompt_logprobs
            if ev.token_id is not None:
                if not held:
                    held_from = ev.index
                held.append(ev.token_id)
                if ev.logprobs is not None:
                    held_lp.append(ev.logprobs)
            now = time.monotonic()
            if final or last_sent is None or now - last_sent >= interval_s:
                f = flush_event(ev, held, held_from, num_prompt_tokens, held_lp, prompt_lp)
                held, held_lp, prompt_lp, last_sent = [], [], None, now
                yield f
    finally:
        if streams.get(rid) is stream:
            streams.close(rid)
        if not final:
            client_gone(rid)


async def serve_attached(streams: StreamTable, request_id: str, from_index: int, flush_interval_ms: int,
                         client_gone: Callable[[str], None]) -> AsyncIterator[StreamEvent]:
    """Attach: the stream of a request that migrated in (nobody reads it
    yet), served from ``from_index``; NotFound if there is none to attach to."""
    stream = streams.get(request_id)
    if stream is None or stream.attached:
        raise NotFound(f"request {request_id!r} is not here to attach to")
    async for f in serve_stream(streams, stream, from_index, 0, flush_interval_ms, client_gone):
        yield f
