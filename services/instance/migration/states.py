"""The migration state machines (docs/design.md §6): enumerated states, one
transition function each; illegal transitions raise. Every transition is
logged with the migration id, request id, stage, blocks, bytes and time."""

from __future__ import annotations

import enum
import time

from libs.common.logging import get_logger

log = get_logger("migration")


class IllegalTransition(RuntimeError):
    pass


class SourceState(enum.Enum):
    SELECT = "select"
    PRE_ALLOC = "pre_alloc"
    COPY = "copy"
    VERIFY = "verify"
    SUSPEND = "suspend"
    PRE_ALLOC_LAST = "pre_alloc_last"
    COPY_LAST = "copy_last"
    COMMIT = "commit"
    DONE = "done"
    ABORT = "abort"


class DestState(enum.Enum):
    NONE = "none"
    RESERVED = "reserved"
    COMMITTED = "committed"
    ABORTED = "aborted"
    EXPIRED = "expired"


S, D = SourceState, DestState
_SOURCE_EDGES = {
    S.SELECT: {S.PRE_ALLOC, S.SUSPEND},
    S.PRE_ALLOC: {S.COPY},
    S.COPY: {S.VERIFY},
    S.VERIFY: {S.PRE_ALLOC, S.SUSPEND, S.COMMIT},  # COMMIT: a cache move (cache_move.py), no request to suspend
    S.SUSPEND: {S.PRE_ALLOC_LAST, S.COMMIT},  # COMMIT: the last stage rides on it (fuse_last_stage)
    S.PRE_ALLOC_LAST: {S.COPY_LAST},
    S.COPY_LAST: {S.COMMIT},
    S.COMMIT: {S.DONE},
    S.DONE: set(),
    S.ABORT: set(),
}
_DEST_EDGES = {
    D.NONE: {D.RESERVED, D.ABORTED, D.EXPIRED},  # expired: its first pre-allocate never returned
    D.RESERVED: {D.RESERVED, D.COMMITTED, D.ABORTED, D.EXPIRED},
    D.COMMITTED: {D.ABORTED},  # commit lost: the source aborts before anyone attached
    D.ABORTED: set(),
    D.EXPIRED: set(),
}
_TERMINAL = {S.DONE, S.ABORT, D.ABORTED, D.EXPIRED}


class Machine:
    """One migration's state on one side."""

    def __init__(self, side: str, migration_id: str, request_id: str, initial: enum.Enum):
        self.side = side
        self.migration_id = migration_id
        self.request_id = request_id
        self.state = initial
        self.started = time.perf_counter()
        self.history: list[enum.Enum] = [initial]
        self.stamps: list[int] = [time.time_ns()]  # when each state of history began (a trace's stages)

    @property
    def edges(self) -> dict:
        return _SOURCE_EDGES if self.side == "source" else _DEST_EDGES

    @property
    def terminal(self) -> bool:
        return self.state in _TERMINAL

    def to(self, new: enum.Enum, **fields) -> None:
        """Transition; any non-terminal state may go to ABORT (source) or
        ABORTED (destination)."""
        abort = SourceState.ABORT if self.side == "source" else DestState.ABORTED
        allowed = self.edges[self.state] | ({abort} if not self.terminal else set())
        if new not in allowed:
            raise IllegalTransition(f"{self.side} migration {self.migration_id}: "
                                    f"{self.state.value} -> {new.value} is not allowed")
        old, self.state = self.state, new
        self.history.append(new)
        self.stamps.append(time.time_ns())
        log.info("migration transition", side=self.side, migration_id=self.migration_id,
                 request_id=self.request_id, frm=old.value, to=new.value,
                 ms=round((time.perf_counter() - self.started) * 1000, 3), **fields)
