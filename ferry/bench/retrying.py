"""One streamed completion as a well-behaved client makes it, for the
reliability benchmarks: it retries what a server asks it to retry later
(429, 503 with Retry-After) and what never reached a server (connection
refused: a frontend restarting), until a deadline; a stream that started
and then broke is *cut*, never retried (its client saw a partial answer).
Records TTFT and the gaps between chunks of the attempt that answered."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

import httpx

from ferry.bench.sse import Completion, StreamError, stream_completion


class Outcome(enum.Enum):
    ANSWERED = "answered"  # a whole stream, its final event included
    REFUSED = "refused"  # 429/503 until the deadline (a bound, never a fault)
    CUT = "cut"  # the stream started, then broke or ended with an error
    LOST = "lost"  # no answer at all (an error status, or the deadline with nothing)


@dataclass
class Attempted:
    outcome: Outcome
    sent_at: float  # the first attempt
    started_at: float | None = None  # the attempt that answered
    text: str = ""
    token_times: list[float] = field(default_factory=list)
    final: dict | None = None
    retries: int = 0
    error: str = ""

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.started_at if self.token_times and self.started_at else None

    @property
    def gaps_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


async def stream_with_retries(http: httpx.AsyncClient, body: dict, deadline_s: float = 120.0,
                              retry_refused: bool = True) -> Attempted:
    sent = time.perf_counter()
    res = Attempted(Outcome.LOST, sent)
    while True:
        started = time.perf_counter()
        seen = Completion()

        async def on_chunk(c: Completion) -> None:
            nonlocal seen
            seen = c
        try:
            c = await stream_completion(http, body, on_chunk)
        except StreamError as e:
            if e.kind in ("http_429", "http_503"):
                res.outcome, res.error = Outcome.REFUSED, e.kind
                if retry_refused and time.perf_counter() - sent < deadline_s:
                    res.retries += 1
                    await asyncio.sleep(1.0)  # the Retry-After the frontend sends
                    continue
                return res
            res.outcome = Outcome.CUT if e.kind.startswith("stream_") else Outcome.LOST
            res.error = str(e)[:300]
            return res
        except httpx.HTTPError as e:
            res.error = f"{type(e).__name__}: {e}"[:300]
            # Connection refused, or a kept connection closed before any answer (a frontend
            # stopping): nothing was answered, so a client tries again, as OpenAI's clients do.
            unanswered = isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError,
                                        httpx.ReadError, httpx.WriteError)) and seen.request_id is None
            if unanswered and time.perf_counter() - sent < deadline_s:
                res.retries += 1
                await asyncio.sleep(0.2)
                continue
            res.outcome = Outcome.CUT if seen.request_id is not None else Outcome.LOST
            return res
        res.started_at, res.text, res.token_times, res.final = started, c.text, c.token_times, c.final
        res.outcome = Outcome.ANSWERED if c.final is not None else Outcome.CUT
        return res

