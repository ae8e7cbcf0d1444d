"""The one client layer for gRPC between Ferry's services: every channel a
service opens to another comes from ``channel()`` (asyncio) or
``sync_channel()`` (blocking callers: probes, tools, tests), with the same
options and the cluster's credentials:

- a shared cluster token, sent as call metadata ``x-ferry-token`` on every
  call and checked by one server interceptor (libs/common/server.py);
- optional TLS from certificate files (grpc's own SSL credentials), mutual
  when the servers are given a CA to check clients against;
- with tracing on, the W3C trace context of the current span as call
  metadata (``traceparent``), under which the server opens its span.

A process sets its credentials once at start (``configure``); code that talks
to a cluster it did not start passes ``credentials=`` explicitly.
"""

from __future__ import annotations

import os
import pathlib
import secrets
from dataclasses import dataclass

import grpc

from libs.common import tracing

# KV chunks are a few MiB; leave room.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
    # Reconnect to a restarted peer (scheduler, meta store, instance) within a
    # second, not after gRPC's default exponential backoff of up to 120 s.
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Keepalive on every connection, both ways: a peer that is gone without a
    # word (a host lost, a frozen process, a dropped route) ends the calls on
    # it within KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS, long streams (Generate,
    # Watch, StatusStream, DispatchStream, ForwardLayers) included; without it
    # they waited for TCP's own timeout (minutes to hours). NOTE: an ack timeout
    # of 3 s cut live streams on a 2-core host loaded 5x over (a starved
    # process acks late; `ferry bench rolling-restart`, native): 10 s.
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 10000),
    ("grpc.http2.ping_timeout_ms", 10000),  # gRPC >= 1.6x times a keepalive ping's ack out by this (default 60 s)
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # ... and servers accept those pings (else GOAWAY "too_many_pings").
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 4000),
    ("grpc.http2.max_ping_strikes", 0),
]
KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS = 5000, 10000
TOKEN_METADATA = "x-ferry-token"


def new_token() -> str:
    """A fresh cluster token (``ferry up`` makes one per cluster)."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Credentials:
    """What a process presents to, and asks of, its peers. Paths are PEM files."""

    token: str = ""
    tls_cert: str = ""  # this process's certificate (server, and client for mTLS)
    tls_key: str = ""
    tls_ca: str = ""  # CA to verify peers; on a server it also demands client certificates (mTLS)
    # Host name the peers' certificates are checked against (default: the address's host).
    tls_server_name: str = ""

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert or self.tls_ca)

    def check_token(self, presented: str | None) -> bool:
        return not self.token or (presented is not None and secrets.compare_digest(presented, self.token))

    def server_credentials(self) -> grpc.ServerCredentials:
        if not (self.tls_cert and self.tls_key):
            raise ValueError("a TLS server needs --tls-cert and --tls-key")
        ca = _read(self.tls_ca)
        return grpc.ssl_server_credentials([(_read(self.tls_key), _read(self.tls_cert))],
                                           root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=_read(self.tls_ca),
                                            private_key=_read(self.tls_key), certificate_chain=_read(self.tls_cert))

    def env(self) -> dict[str, str]:
        """The FERRY_* environment that gives a child service these
        credentials (the environment, not the command line: argv is public)."""
        pairs = (("CLUSTER_TOKEN", self.token), ("TLS_CERT", self.tls_cert), ("TLS_KEY", self.tls_key),
                 ("TLS_CA", self.tls_ca), ("TLS_SERVER_NAME", self.tls_server_name))
        return {f"FERRY_{k}": v for k, v in pairs if v}

    def channel_options(self) -> list[tuple[str, object]]:
        if self.tls and self.tls_server_name:
            return [*GRPC_OPTIONS, ("grpc.ssl_target_name_override", self.tls_server_name)]
        return list(GRPC_OPTIONS)


def load_credentials(token: str = "", token_file: str = "", tls_cert: str = "", tls_key: str = "",
                     tls_ca: str = "", tls_server_name: str = "") -> Credentials:
    """Credentials from options: a token given inline or in a file (a
    compose secret), and certificate paths (checked to exist now, not at the
    first call)."""
    if token_file:
        token = pathlib.Path(token_file).read_text().strip()
        if not token:
            raise ValueError(f"cluster token file {token_file} is empty")
    for path in (tls_cert, tls_key, tls_ca):
        if path and not os.path.isfile(path):
            raise ValueError(f"no such certificate file: {path}")
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    return Credentials(token, tls_cert, tls_key, tls_ca, tls_server_name)


def _read(path: str) -> bytes | None:
    return pathlib.Path(path).read_bytes() if path else None


_current = Credentials()


def configure(credentials: Credentials) -> None:
    """This process's credentials, for every channel and server it opens."""
    global _current
    _current = credentials


def current() -> Credentials:
    return _current


# --- the token as call metadata ------------------------------------------------------

class _MetadataCall:
    """A multi-callable of a channel that adds the token and (tracing on) the
    current trace context to each call's metadata."""

    __slots__ = ("_inner", "_token", "_trace")

    def __init__(self, inner, token: tuple[tuple[str, str], ...], trace: bool):
        self._inner, self._token, self._trace = inner, token, trace

    def __call__(self, *args, metadata=None, **kwargs):
        # NOTE: no request argument for a streaming call that writes its own (call.write)
        extra = self._token
        if self._trace:
            extra = (*extra, *tracing.headers().items())  # the context current as the call starts
        return self._inner(*args, metadata=(*(metadata or ()), *extra), **kwargs)


class TokenChannel:
    """A grpc.aio channel whose calls carry the cluster token and, with
    tracing on, the W3C trace context of the span current when each call
    starts (``traceparent``: libs/common/tracing.py). The stubs take their
    multi-callables from it (``unary_unary`` and the rest), and those add the
    metadata to each call, with no client interceptor (grpc.aio wraps each
    intercepted call in an extra layer; ``ferry bench overhead`` measured no
    TTFT difference either way, docs/results/LOG.md). Everything else is
    the channel's own."""

    def __init__(self, channel: grpc.aio.Channel, token: str, trace: bool = False):
        self._channel = channel
        self._token = ((TOKEN_METADATA, token),) if token else ()
        self._trace = trace

    def unary_unary(self, *args, **kwargs):
        return _MetadataCall(self._channel.unary_unary(*args, **kwargs), self._token, self._trace)

    def unary_stream(self, *args, **kwargs):
        return _MetadataCall(self._channel.unary_stream(*args, **kwargs), self._token, self._trace)

    def stream_unary(self, *args, **kwargs):
        return _MetadataCall(self._channel.stream_unary(*args, **kwargs), self._token, self._trace)

    def stream_stream(self, *args, **kwargs):
        return _MetadataCall(self._channel.stream_stream(*args, **kwargs), self._token, self._trace)

    async def __aenter__(self):
        await self._channel.__aenter__()
        return self

    async def __aexit__(self, *exc):
        return await self._channel.__aexit__(*exc)

    def __getattr__(self, name):
        return getattr(self._channel, name)


class _SyncDetails:
    """grpc.ClientCallDetails for the blocking API (it has no constructor)."""

    def __init__(self, d, metadata):
        self.method, self.timeout, self.metadata = d.method, d.timeout, metadata
        self.credentials = d.credentials
        self.wait_for_ready = getattr(d, "wait_for_ready", None)
        self.compression = getattr(d, "compression", None)


class _SyncToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str):
        self.token = token

    def _details(self, d):
        return _SyncDetails(d, [*(d.metadata or ()), (TOKEN_METADATA, self.token)])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


# --- channels ----------------------------------------------------------------------

def channel(address: str, credentials: Credentials | None = None) -> grpc.aio.Channel:
    """An asyncio channel to a Ferry service (use as ``async with`` or close it).
    NOTE: whether its calls carry trace context is decided here, once: a
    process configures tracing before it opens channels (ferry/serve_cli.py)."""
    c = credentials or _current
    if c.tls:
        ch = grpc.aio.secure_channel(address, c.channel_credentials(), options=c.channel_options())
    else:
        ch = grpc.aio.insecure_channel(address, options=c.channel_options())
    trace = tracing.enabled()
    return TokenChannel(ch, c.token, trace) if c.token or trace else ch


def sync_channel(address: str, credentials: Credentials | None = None) -> grpc.Channel:
    """A blocking channel to a Ferry service (use as ``with`` or close it)."""
    c = credentials or _current
    ch = (grpc.secure_channel(address, c.channel_credentials(), options=c.channel_options()) if c.tls
          else grpc.insecure_channel(address, options=c.channel_options()))
    return grpc.intercept_channel(ch, _SyncToken(c.token)) if c.token else ch
