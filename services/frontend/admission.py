"""Admission at the frontend: a bound on the requests generating at once
(the HTTP and gRPC APIs share it), and the drain of a frontend that stops.
Over the bound a request is refused at once (429 / RESOURCE_EXHAUSTED, with
Retry-After), before its body is read; a draining frontend refuses new
requests (503 / UNAVAILABLE) while the ones under way finish."""

from __future__ import annotations

import asyncio
import contextlib
import time

from libs.common.errors import ResourceExhausted, Unavailable
from services.frontend import metrics


class Admission:
    def __init__(self, max_in_flight: int = 0):
        """``max_in_flight`` 0: no bound."""
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self.draining = False

    def enter(self) -> None:
        """Take a slot or raise (ResourceExhausted: over the bound;
        Unavailable: this frontend is stopping)."""
        if self.draining:
            metrics.REFUSED.labels("draining").inc()
            raise Unavailable("this frontend is shutting down; retry (another frontend takes it)")
        if self.max_in_flight and self.in_flight >= self.max_in_flight:
            metrics.REFUSED.labels("in_flight").inc()
            raise ResourceExhausted(f"too many requests in flight ({self.max_in_flight}); retry later")
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1

    @contextlib.contextmanager
    def slot(self):
        self.enter()
        try:
            yield
        finally:
            self.leave()

    async def drain(self, grace_s: float, poll_s: float = 0.05) -> int:
        """Refuse new requests from now on; wait until none is in flight or
        ``grace_s`` passed. Returns how many were still in flight."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
        return self.in_flight
