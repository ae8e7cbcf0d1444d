"""What migration may see of the instance that hosts it: the engine (through
its runner thread), the client streams, identity, the terminating mark, the
load, whether it decodes (its role), and a signal that the instance's status
changed. Both state machines and the manager take this instead of the whole
instance service, so the protocol runs in one process in tests and in the
simulator."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from libs.common.types import Priority, RequestState
from services.instance.engine.base import Engine, EngineLoad
from services.instance.runner import EngineRunner
from services.instance.streams import Event, StreamTable


def _nothing() -> None:
    pass


def _ignore(state: RequestState) -> None:
    pass


@dataclass
class MigrationHost:
    instance_id: str
    runner: EngineRunner
    streams: StreamTable
    is_terminating: Callable[[], bool] = lambda: False
    load: Callable[[], EngineLoad] | None = None  # latest engine load (default: ask the engine)
    headroom: dict[Priority, int] = field(default_factory=dict)
    changed: Callable[[], None] = _nothing  # the instance's status changed (report soon)
    decodes: Callable[[], bool] = lambda: True  # Splitwise: False while the instance's role is prefill
    # A request committed here (migrated or handed in), as its commit is acknowledged: the instance's
    # metrics and traces take it from there (the trace context current then is the commit's).
    committed_in: Callable[[RequestState], None] = _ignore
    # The trace context of a request here (services/instance/request_traces.py; None: not traced).
    trace_context: Callable[[str], object] = lambda request_id: None
    # The clock of deadlines and measurements (the event loop's: the simulator's is virtual), from any thread.
    clock: Callable[[], float] = time.monotonic
    # Runs a copy (gather, scatter) off the event loop and the engine thread (the simulator: inline).
    offload: Callable[..., Awaitable] = asyncio.to_thread

    @property
    def engine(self) -> Engine:
        return self.runner.engine

    def current_load(self) -> EngineLoad:
        return self.load() if self.load is not None else self.engine.load()

    def end_stream(self, request_id: str, reason: str) -> None:
        """End a client stream here with a finish reason (nothing follows)."""
        stream = self.streams.get(request_id)
        if stream is not None:
            stream.push(Event(stream.next_index, None, reason))
            self.streams.close(request_id)
