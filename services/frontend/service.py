"""Runs the frontend: the HTTP API on uvicorn and, optionally, the gRPC
Generate API, on one event loop. On SIGTERM/SIGINT it drains: new requests
get 503 (and /health 503) while the streams under way finish, for up to
--shutdown-grace-s; then both servers stop. A second signal stops at once."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import signal

import uvicorn

from libs.pb import frontend_pb2_grpc
from libs.common.logging import get_logger
from libs.common.server import Service, freeze_startup_heap, serve
from services.frontend.admission import Admission
from services.frontend.app import create_app
from services.frontend.responses import ResponseStore
from services.frontend.config import FrontendConfig
from services.frontend.grpc_api import FrontendServicer
from services.frontend.router import Router
from services.frontend.slow_clients import header_deadline_protocol
from services.frontend.tokenizer import load_tokenizer

log = get_logger(__name__)


class _FrontendGrpc(Service):
    name = "frontend-grpc"
    service_names = ("ferry.v1.Frontend",)
    internal = False  # the public edge: API keys (if any), not the cluster token

    def __init__(self, servicer: FrontendServicer, max_message_bytes: int):
        self.servicer = servicer
        self.max_message_bytes = max_message_bytes

    def register(self, server) -> None:
        frontend_pb2_grpc.add_FrontendServicer_to_server(self.servicer, server)


class _Server(uvicorn.Server):
    """uvicorn re-raises a captured SIGTERM after shutting down, so the process
    would die by the signal; we handle SIGTERM/SIGINT ourselves and exit 0."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit: every
    client connection is a file, and the default soft limit (often 1,024)
    made accept() fail under a few thousand streams. Returns the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        return soft
    return hard


def tool_parser_factory(name: str, tokenizer):
    """tools -> the parser of tool_choice auto's calls (tools.py), or None; its library is imported now."""
    if not name:
        return None
    from services.frontend.tools import HermesParser

    HermesParser(getattr(tokenizer, "tok", None), [])  # imports vLLM's parser before the first request
    return lambda tools: HermesParser(tokenizer.tok, tools)


async def run_frontend(config: FrontendConfig, freeze_heap: bool = False) -> None:
    """``freeze_heap``: this process is the frontend alone (``ferry serve
    frontend``): freeze its start-up heap (libs.common.server.freeze_startup_heap)."""
    files = raise_open_file_limit()
    tokenizer = load_tokenizer(config.model)
    router = Router(config.scheduler, config.meta_store, config.dispatch_timeout_s, config.bypass_retry_s,
                    config.status_interval_s, config.stall_timeout_s, config.dispatch_stream,
                    config.bypass_prefix_index)
    router.start()
    admission = Admission(config.max_in_flight)
    app = create_app(config, router, tokenizer, admission, tool_parser_factory(config.tool_call_parser, tokenizer),
                     ResponseStore(config.meta_store))
    # NOTE: uvicorn's own graceful shutdown cuts what is left after 5 s: the
    # drain below (admission.drain) has let the streams finish first.
    server = _Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                    access_log=False, lifespan="off", timeout_graceful_shutdown=5,
                                    timeout_keep_alive=config.keep_alive_s, backlog=4096,
                                    http=header_deadline_protocol(config.client_timeout_s), loop="none"))
    grpc_stop = asyncio.Event()
    tasks = []
    if config.grpc_port >= 0:
        servicer = FrontendServicer(router, tokenizer, lambda: router.max_model_len(config.default_max_model_len),
                                    config.max_resumes, config.keys(), admission)
        tasks.append(asyncio.create_task(serve(_FrontendGrpc(servicer, config.max_body_bytes), config.host,
                                               config.grpc_port,
                                               stop_event=grpc_stop)))
    loop = asyncio.get_running_loop()
    draining: list[asyncio.Task] = []

    async def drain_then_stop():
        left = await admission.drain(config.shutdown_grace_s)
        log.info("frontend drained", cut=left)
        server.should_exit = True
        grpc_stop.set()

    def on_signal():
        if draining:  # the second signal: stop now
            server.should_exit = server.force_exit = True
            grpc_stop.set()
            return
        log.info("frontend draining", in_flight=admission.in_flight, grace_s=config.shutdown_grace_s)
        draining.append(asyncio.create_task(drain_then_stop()))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    log.info("frontend listening", url=f"http://{config.host}:{config.port}", model=config.model_name,
             open_files=files)
    if freeze_heap:
        freeze_startup_heap()
    try:
        await server.serve()
    finally:
        grpc_stop.set()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await router.close()
        log.info("frontend stopped")
