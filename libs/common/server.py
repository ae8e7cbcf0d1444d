"""The one serve() skeleton of every gRPC service: uvloop, the standard gRPC
health checking service, graceful stop on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import signal
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from libs.common.errors import FerryError, grpc_status
from libs.common.logging import get_logger

log = get_logger(__name__)

# KV chunks are a few MiB; leave room.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
    # Reconnect to a restarted peer (scheduler, meta store, instance) within a
    # second, not after gRPC's default exponential backoff of up to 120 s.
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class Service:
    """What serve() needs from a service: register servicers, then optional
    start/stop hooks (background tasks, deregistration)."""

    name: str = "service"
    service_names: tuple[str, ...] = ()
    exit_code: int = 0  # what serve() returns (the process's exit status)
    _request_stop: Callable[[], None] | None = None  # set by serve()

    def register(self, server: grpc.aio.Server) -> None:
        raise NotImplementedError

    async def start(self, bound_address: str) -> None:  # after the port is bound
        pass

    async def stop(self) -> None:  # before the server stops
        pass

    def shutdown(self, exit_code: int) -> None:
        """Stop from inside, for a fatal error: serve() reports NOT_SERVING,
        runs stop() and returns ``exit_code``."""
        self.exit_code = exit_code
        if self._request_stop is not None:
            self._request_stop()


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
                    return await fn(request, context)
                except FerryError as e:
                    await context.abort(grpc_status(e), e.message)
            return wrapped

        def wrap_stream(fn):
            async def wrapped(request, context):
                try:
                    async for item in fn(request, context):
                        yield item
                except FerryError as e:
                    await context.abort(grpc_status(e), e.message)
            return wrapped

        kinds = {
            "unary_unary": (grpc.unary_unary_rpc_method_handler, wrap_unary),
            "unary_stream": (grpc.unary_stream_rpc_method_handler, wrap_stream),
            "stream_unary": (grpc.stream_unary_rpc_method_handler, wrap_unary),
            "stream_stream": (grpc.stream_stream_rpc_method_handler, wrap_stream),
        }
        for attr, (make, wrap) in kinds.items():
            fn = getattr(handler, attr)
            if fn is not None:
                return make(wrap(fn), request_deserializer=handler.request_deserializer,
                            response_serializer=handler.response_serializer)
        return handler


async def serve(service: Service, host: str, port: int, *, grace_s: float = 5.0,
                ready: Callable[[str], Awaitable[None] | None] | None = None,
                stop_event: asyncio.Event | None = None) -> int:
    """Run ``service`` until SIGTERM/SIGINT (or ``stop_event``, or the
    service's own shutdown()), then stop gracefully. Returns the exit code."""
    stop = stop_event or asyncio.Event()
    service._request_stop = stop.set
    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=[ErrorInterceptor()])
    service.register(server)
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    address = f"{host}:{bound}"
    await server.start()
    await service.start(address)
    for name in ("", *service.service_names):
        await _set(health_servicer, name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving", service=service.name, address=address)
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
    for name in ("", *service.service_names):
        await _set(health_servicer, name, health_pb2.HealthCheckResponse.NOT_SERVING)
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
