"""uvicorn's HTTP protocol with a deadline on a request's headers, and its
own 400 (a request the HTTP parser refuses: a control character in a header,
a malformed request line) in OpenAI error JSON like every other error. uvicorn
times out idle keep-alive connections between requests, but a connection
that was just opened, or that sends its headers a byte at a time (a
slowloris), stays open for as long as the client likes; a few hundred of
them held every file descriptor the frontend had. Here a connection whose
request headers are not complete ``header_timeout_s`` after it opened (or
after the previous response) is closed."""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from libs.common.errors import InvalidArgument, openai_error
from services.frontend import metrics

_STATUS_400 = b"HTTP/1.1 400 Bad Request\r\n"


class _HeaderDeadline(HttpToolsProtocol):
    header_timeout_s: float = 30.0
    _deadline: asyncio.TimerHandle | None = None
    _armed_at: float = 0.0

    def _arm(self) -> None:
        self._disarm()
        self._armed_at = self.loop.time()
        self._deadline = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        # NOTE: a timer that fires late says the event loop was behind (a burst of
        # thousands of connections on a busy host): the headers may be sitting
        # unread in the socket. The server's lag is not the client's fault: wait again.
        late = self.loop.time() - (self._armed_at + self.header_timeout_s)
        if late > min(1.0, self.header_timeout_s / 2):
            self._arm()
            return
        if not self.transport.is_closing():
            metrics.DISCONNECTS.labels("slow_headers").inc()
            self.transport.close()

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:  # the next request of a kept connection
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        status, body = openai_error(InvalidArgument(f"{msg.rstrip('.')}: the HTTP request is malformed"))
        payload = json.dumps(body).encode()
        head = [_STATUS_400]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(payload),
                 b"connection: close\r\n\r\n", payload]
        self.transport.write(b"".join(head))
        self.transport.close()


def header_deadline_protocol(header_timeout_s: float) -> type[HttpToolsProtocol]:
    """The protocol class for uvicorn.Config(http=...)."""
    return type("HttpWithHeaderDeadline", (_HeaderDeadline,), {"header_timeout_s": header_timeout_s})
