"""The streaming responses' SSE (services/frontend/event_stream.py), driven
as ASGI with a recording ``send`` and a scripted ``receive``."""

import asyncio
import json

import pytest

from services.frontend.event_stream import EventStream


class Wire:
    """A client's side of one response: what was sent, and a disconnect to give."""

    def __init__(self):
        self.sent: list[dict] = []
        self.gone = asyncio.Event()
        self.got_body = asyncio.Event()

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body":
            self.got_body.set()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]

    def events(self) -> list[str]:
        return [b.decode().removeprefix("data: ").rstrip("\r\n") for b in self.bodies() if b.startswith(b"data: ")]


async def test_the_headers_and_the_first_event_leave_before_the_rest_is_asked_for():
    asked = asyncio.Event()
    release = asyncio.Event()

    async def rest():
        asked.set()
        await release.wait()
        yield "second"

    wire = Wire()
    task = asyncio.create_task(EventStream(json.dumps({"n": 1}), rest())({"type": "http"}, wire.receive, wire.send))
    await wire.got_body.wait()
    start, first = wire.sent[0], wire.sent[1]
    assert start["type"] == "http.response.start" and start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"text/event-stream; charset=utf-8" and b"content-length" not in headers
    assert headers[b"cache-control"] == b"no-store"
    assert first["body"] == b'data: {"n": 1}\r\n\r\n' and first["more_body"]
    assert not asked.is_set()  # the first event did not wait on the rest's task
    release.set()
    await task
    assert wire.events() == ['{"n": 1}', "second"]
    assert wire.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


async def test_every_event_in_order_then_the_end():
    async def rest():
        for i in range(2, 6):
            yield str(i)
            await asyncio.sleep(0)

    wire = Wire()
    await EventStream("1", rest())({"type": "http"}, wire.receive, wire.send)
    assert wire.events() == ["1", "2", "3", "4", "5"]
    assert [m.get("more_body") for m in wire.sent[1:]] == [True] * 5 + [False]


async def test_a_client_that_goes_away_cancels_the_events_and_their_cleanup_runs():
    cleaned = asyncio.Event()
    waiting = asyncio.Event()

    async def rest():
        try:
            yield "2"
            waiting.set()
            await asyncio.sleep(3600)  # the request would go on for an hour
            yield "never"
        finally:
            cleaned.set()

    wire = Wire()
    task = asyncio.create_task(EventStream("1", rest())({"type": "http"}, wire.receive, wire.send))
    await asyncio.wait_for(waiting.wait(), 5)
    wire.gone.set()
    await asyncio.wait_for(task, 5)  # the response returns once the client is gone
    assert cleaned.is_set()
    assert wire.events() == ["1", "2"]
    assert not any(m.get("more_body") is False for m in wire.sent)  # no end sent to a closed connection


async def test_pings_keep_an_idle_stream_open():
    release = asyncio.Event()

    async def rest():
        await release.wait()
        yield "2"

    wire = Wire()
    task = asyncio.create_task(EventStream("1", rest(), ping_s=0.02)({"type": "http"}, wire.receive, wire.send))
    for _ in range(500):
        if sum(b.startswith(b": ping") for b in wire.bodies()) >= 2:
            break
        await asyncio.sleep(0.01)
    release.set()
    await asyncio.wait_for(task, 5)
    assert sum(b.startswith(b": ping") for b in wire.bodies()) >= 2
    assert wire.events() == ["1", "2"]
    n_before_end = len(wire.sent)
    await asyncio.sleep(0.06)
    assert len(wire.sent) == n_before_end  # the pings stopped with the stream


async def test_an_error_in_the_events_is_the_responses_and_nothing_is_left_running():
    async def rest():
        yield "2"
        raise RuntimeError("broken generator")

    wire = Wire()
    before = len(asyncio.all_tasks())
    with pytest.raises(RuntimeError, match="broken generator"):
        await EventStream("1", rest(), ping_s=0.01)({"type": "http"}, wire.receive, wire.send)
    assert len(asyncio.all_tasks()) == before
    assert wire.events() == ["1", "2"]


async def test_a_client_that_goes_away_while_an_event_is_being_written_still_ends_the_events():
    """The client goes away while the stream's task writes an event, at each of
    several points of that write (a write of 0-7 turns of the loop).
    Python 3.11's asyncio.wait_for drops a cancel that comes as the write it
    waits on completes: such a stream went on (its request ran to the end on
    its instance) until its events ran out. Each must end with its client."""
    for turns in range(8):
        async def rest():
            for _ in range(2000):  # a long request's events, each awaited
                await asyncio.sleep(0)
                yield "more"

        wire = Wire()

        async def send(message: dict, wire=wire, turns=turns) -> None:
            if len(wire.sent) == 3:
                wire.gone.set()
            for _ in range(turns):
                await asyncio.sleep(0)
            wire.sent.append(message)

        await EventStream("1", rest(), ping_s=0)({"type": "http"}, wire.receive, send)
        assert len(wire.events()) < 10, (turns, len(wire.events()))
