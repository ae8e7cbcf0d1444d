"""Admission at an instance: a bound on its queued prefill work. A new
request whose prompt would take the tokens waiting for their first step past
``max_tokens`` is refused (RESOURCE_EXHAUSTED): the frontend places it on
another instance, or tells its client 429 with Retry-After. An empty queue
always admits one request (whatever its size), and a resumed request
(tokens already delivered to its client) is never refused: its client's
stream is under way. Pure bookkeeping over the engine's published load."""

from __future__ import annotations

from services.instance.engine.base import EngineLoad
from libs.common.types import RequestPhase


def queued_tokens(load: EngineLoad) -> int:
    """Tokens of the requests waiting for their first step."""
    return sum(r.num_tokens for r in load.requests if r.state == RequestPhase.WAITING)


class QueueBound:
    def __init__(self, max_tokens: int):
        """``max_tokens`` 0: no bound."""
        self.max_tokens = max_tokens
        self._adding = 0  # tokens of admitted requests the engine has not taken yet
        self._unreported = 0  # taken since the latest published load

    def queued(self, load: EngineLoad) -> int:
        return queued_tokens(load) + self._adding + self._unreported

    def admit(self, load: EngineLoad, num_tokens: int, resumed: bool = False) -> str | None:
        """Why the request is refused, or None (then ``added`` or ``dropped``
        must follow)."""
        queued = self.queued(load)
        if self.max_tokens and not resumed and queued > 0 and queued + num_tokens > self.max_tokens:
            return (f"this instance's queue is full ({queued} prompt tokens waiting, at most "
                    f"{self.max_tokens}); try another instance")
        self._adding += num_tokens
        return None

    def added(self, num_tokens: int) -> None:
        self._adding -= num_tokens
        self._unreported += num_tokens

    def dropped(self, num_tokens: int) -> None:
        self._adding -= num_tokens

    def on_load(self) -> None:
        """A newer load was published: what the engine took is in it."""
        self._unreported = 0
