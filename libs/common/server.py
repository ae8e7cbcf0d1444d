"""The one serve() skeleton of every gRPC service: uvloop, the standard gRPC
health checking service, graceful stop on SIGTERM/SIGINT, and the cluster's
credentials (libs/common/rpc.py): TLS when configured, and on internal
services a token check on every call but health checks; with tracing on, a
server span per call under the caller's trace context (libs/common/tracing.py)."""

from __future__ import annotations

import asyncio
import atexit
import gc
import signal
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from libs.common import rpc, tracing
from libs.common.errors import FerryError, InvalidArgument, grpc_status
from libs.common.logging import get_logger
from libs.common.rpc import GRPC_OPTIONS

log = get_logger(__name__)

class Service:
    """What serve() needs from a service: register servicers, then optional
    start/stop hooks (background tasks, deregistration)."""

    name: str = "service"
    service_names: tuple[str, ...] = ()
    # Internal services (all but the frontend's public API) take the cluster's
    # credentials: its TLS certificates and, on every call, its token.
    internal: bool = True
    # Largest request message accepted (bigger ones: RESOURCE_EXHAUSTED);
    # None = GRPC_OPTIONS' (sized for KV chunks).
    max_message_bytes: int | None = None
    exit_code: int = 0  # what serve() returns (the process's exit status)
    _request_stop: Callable[[], None] | None = None  # set by serve()
    _set_health: Callable[[bool], Awaitable[None]] | None = None  # set by serve()

    def register(self, server: grpc.aio.Server) -> None:
        raise NotImplementedError

    async def start(self, bound_address: str) -> None:  # after the port is bound
        pass

    async def stop(self) -> None:  # before the server stops
        pass

    async def set_health(self, serving: bool) -> None:
        """SERVING or NOT_SERVING on the health service, for a service that
        finds itself unable to serve for a while (a hung engine)."""
        if self._set_health is not None:
            await self._set_health(serving)

    def shutdown(self, exit_code: int) -> None:
        """Stop from inside, for a fatal error: serve() reports NOT_SERVING,
        runs stop() and returns ``exit_code``."""
        self.exit_code = exit_code
        if self._request_stop is not None:
            self._request_stop()


class _Undecodable:
    """What a request that is not a valid message decodes to (bad wire
    bytes, a string field that is not UTF-8): the call then ends with
    INVALID_ARGUMENT rather than gRPC's own INTERNAL."""

    def __init__(self, error: Exception):
        self.error = error


def _safe(deserializer):
    if deserializer is None:
        return None

    def decode(raw: bytes):
        try:
            return deserializer(raw)
        except Exception as e:  # noqa: BLE001 - any decoding failure is the caller's bad bytes
            return _Undecodable(e)
    return decode


def _check_decoded(request) -> None:
    if isinstance(request, _Undecodable):
        raise InvalidArgument(f"the request is not a valid message: {request.error}")


def _rewrap(handler, wrap_unary, wrap_stream, request_deserializer=None):
    """``handler`` with its behaviour function wrapped: ``wrap_unary`` for
    calls that return one response, ``wrap_stream`` for server streams."""
    kinds = {
        "unary_unary": (grpc.unary_unary_rpc_method_handler, wrap_unary),
        "unary_stream": (grpc.unary_stream_rpc_method_handler, wrap_stream),
        "stream_unary": (grpc.stream_unary_rpc_method_handler, wrap_unary),
        "stream_stream": (grpc.stream_stream_rpc_method_handler, wrap_stream),
    }
    for attr, (make, wrap) in kinds.items():
        fn = getattr(handler, attr)
        if fn is not None:
            return make(wrap(fn), request_deserializer=request_deserializer or handler.request_deserializer,
                        response_serializer=handler.response_serializer)
    return handler


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Any FerryError escaping a servicer ends the call with its mapped status
    (the one place errors meet gRPC status on the server side)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None

        def wrap_unary(fn):
            async def wrapped(request, context):
                try:
                    _check_decoded(request)
                    return await fn(request, context)
                except FerryError as e:
                    await context.abort(grpc_status(e), e.message)
            return wrapped

        def wrap_stream(fn):
            async def wrapped(request, context):
                try:
                    _check_decoded(request)
                    async for item in fn(request, context):
                        yield item
                except FerryError as e:
                    await context.abort(grpc_status(e), e.message)
            return wrapped

        # NOTE: only single-message requests decode safely here; a client
        # stream's bad message still ends its call with gRPC's own status.
        unary_request = handler.unary_unary or handler.unary_stream
        return _rewrap(handler, wrap_unary, wrap_stream,
                       _safe(handler.request_deserializer) if unary_request else None)


HEALTH_PREFIX = "/grpc.health.v1.Health/"


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks that lacks the cluster token
    (UNAUTHENTICATED, before the servicer runs: nothing changes)."""

    def __init__(self, credentials: rpc.Credentials):
        self.credentials = credentials

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        presented = next((v for k, v in handler_call_details.invocation_metadata or ()
                          if k == rpc.TOKEN_METADATA), None)
        if self.credentials.check_token(presented):
            return handler
        log.warning("call refused: missing or wrong cluster token", method=handler_call_details.method)
        message = "missing or wrong cluster token"

        def deny_unary(fn):
            async def denied(request, context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            return denied

        def deny_stream(fn):
            async def denied(request, context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
                yield  # an async generator, as the handler kind wants
            return denied

        return _rewrap(handler, deny_unary, deny_stream)


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """Each call that carries W3C trace context (``traceparent`` metadata,
    libs/common/rpc.py) runs under it: a unary call (a client stream too)
    inside a server span; a server stream (Generate, Attach: a request's whole
    life there) in the caller's context, each step, the service recording its
    own spans of the past (services/instance/request_traces.py), so that none
    is made before its first message. At the public edge (``always``) every
    call has a span, a new trace where the client sent none. Installed only
    with tracing on (libs/common/tracing.py)."""

    def __init__(self, always: bool = False):
        self.always = always

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        parent = tracing.extract(handler_call_details.invocation_metadata)
        if parent is None and not self.always:
            return handler
        name = method.lstrip("/")
        attrs = {"rpc.system": "grpc", "rpc.method": name}

        def wrap_unary(fn):
            async def wrapped(request, context):
                with tracing.span(name, attrs, context=parent, kind="server"):
                    return await fn(request, context)
            return wrapped

        always = self.always

        def wrap_stream(fn):
            async def wrapped(request, context):
                # NOTE: a context is current for each step of the servicer's stream, not across its
                # yields: grpc.aio may close a cancelled stream from another context.
                span = tracing.start(name, attrs, context=parent, kind="server") if always else None
                steps = tracing.stepper(fn(request, context), tracing.context_of(span) if span else parent,
                                        first_only=span is None)
                error = ""
                try:
                    async for item in steps:
                        yield item
                except Exception as e:  # (a cancel, the caller's, is no failure of the call)
                    error = type(e).__name__
                    raise
                finally:
                    tracing.end(span, error=error)
            return wrapped

        return _rewrap(handler, wrap_unary, wrap_stream)


def freeze_startup_heap() -> int:
    """Once a service has started: collect, then move every object the
    garbage collector tracks into its permanent generation (``gc.freeze``),
    so that later full collections scan only what serving allocated. An
    instance with the native engine holds ~390k tracked objects after
    start-up (torch, transformers, the model), and one full collection of
    them took 145 ms on this project's CPU: a pause of every stream on that
    instance whenever one runs. That is rare (Python runs a full pass once
    the objects surviving since the last one reach a quarter of all tracked
    ones; none ran while a native instance served 48 requests in 6.3 s, nor
    did the frontend's freeze move added TTFT in two A/B runs of `ferry bench
    overhead`): this bounds a rare pause, it does not speed up the common
    path. Start-up objects live as long as the process,
    so freezing them frees nothing that would have been freed. For a
    service's process (``ferry serve``), not for one that also runs other
    things (tests serve in-process). Returns the number frozen."""
    gc.collect()
    gc.freeze()
    # At exit, thawed again: a frozen object in a reference cycle is never
    # freed, and an extension that counts its objects at teardown then
    # reports each one (nanobind's, in triton, which importing vLLM loads:
    # ~600 "leaked" lines from every instance that ran vLLM's kernels).
    atexit.register(gc.unfreeze)
    frozen = gc.get_freeze_count()
    log.info("start-up heap frozen", objects=frozen)
    return frozen


async def serve(service: Service, host: str, port: int, *, grace_s: float = 5.0,
                ready: Callable[[str], Awaitable[None] | None] | None = None,
                stop_event: asyncio.Event | None = None) -> int:
    """Run ``service`` until SIGTERM/SIGINT (or ``stop_event``, or the
    service's own shutdown()), then stop gracefully. Returns the exit code."""
    stop = stop_event or asyncio.Event()
    service._request_stop = stop.set
    creds = rpc.current() if service.internal else rpc.Credentials()
    interceptors = [ErrorInterceptor()] + ([TokenInterceptor(creds)] if creds.token else [])
    if tracing.enabled():  # innermost: a span per call, under the caller's context
        interceptors.append(TracingInterceptor(always=not service.internal))
    options = GRPC_OPTIONS if service.max_message_bytes is None else [
        *((k, v) for k, v in GRPC_OPTIONS if k != "grpc.max_receive_message_length"),
        ("grpc.max_receive_message_length", service.max_message_bytes)]
    server = grpc.aio.server(options=options, interceptors=interceptors)
    service.register(server)
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if creds.tls:
        bound = server.add_secure_port(f"{host}:{port}", creds.server_credentials())
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    address = f"{host}:{bound}"
    await server.start()

    async def set_health(serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        if serving and stop.is_set():
            return  # stopping: NOT_SERVING stays
        for name in ("", *service.service_names):
            await _set(health_servicer, name, status)

    service._set_health = set_health
    await service.start(address)
    await set_health(True)
    log.info("serving", service=service.name, address=address, tls=creds.tls, token=bool(creds.token))
    if ready is not None:
        r = ready(address)
        if asyncio.iscoroutine(r):
            await r

    if stop_event is None:  # NOTE: a caller that passes stop_event owns the signals
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass
    await stop.wait()
    log.info("stopping", service=service.name)
    await set_health(False)
    try:
        await service.stop()
    finally:
        await server.stop(grace_s)
    log.info("stopped", service=service.name, exit_code=service.exit_code)
    return service.exit_code


async def _set(servicer, name: str, status) -> None:
    r = servicer.set(name, status)
    if asyncio.iscoroutine(r):
        await r


def run(main: Awaitable[int | None]) -> int:
    """Run a service's main coroutine on uvloop; its exit code (0 for None)."""
    import uvloop

    return uvloop.run(main) or 0
