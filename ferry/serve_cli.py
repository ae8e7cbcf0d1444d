"""``ferry serve <service>``: run one service in this process (what `ferry up`
and the compose file start)."""

from __future__ import annotations

import sys

import click

from libs.common.config import ConfigError, click_options, from_options
from libs.common.logging import get_logger, setup_logging
from libs.common.server import freeze_startup_heap, run
from libs.common.server import serve as serve_grpc
from services.frontend.config import FrontendConfig
from services.instance.config import InstanceConfig
from services.meta_store.service import MetaStoreConfig
from services.scheduler.service import SchedulerConfig

log = get_logger("ferry.serve")


def _setup(config_cls, options: dict, name: str):
    """The service's config from its options; logging and this process's
    internal gRPC credentials set up from it."""
    from libs.common import rpc, tracing

    cfg = from_options(config_cls, options)
    setup_logging(cfg.log_level, cfg.log_format, name)
    # First: the channels and servers made from here on carry trace context or not.
    if tracing.configure(f"ferry-{name}", cfg.otlp_endpoint, cfg.trace_sample_ratio,
                         instance=getattr(cfg, "instance_id", "")):
        log.info("tracing on", endpoint=cfg.otlp_endpoint, sample_ratio=cfg.trace_sample_ratio)
    try:
        rpc.configure(cfg.credentials())
    except ConfigError as e:
        raise click.BadParameter(str(e)) from e
    return cfg


def _started(cfg):
    """Called once the service serves: what start-up allocated is frozen
    (--freeze-heap, the default: fewer objects for the collector to scan)."""
    def ready(address: str) -> None:
        if cfg.freeze_heap:
            freeze_startup_heap()
    return ready


@click.group()
def serve() -> None:
    """Run one Ferry service."""


@serve.command("meta-store")
@click_options(MetaStoreConfig)
def meta_store(**options) -> None:
    """The cluster meta store (instance registry and live status)."""
    from services.meta_store.service import MetaStoreService

    cfg = _setup(MetaStoreConfig, options, "meta-store")
    sys.exit(run(serve_grpc(MetaStoreService(cfg), cfg.host, cfg.port, ready=_started(cfg))))


@serve.command("scheduler")
@click_options(SchedulerConfig)
def scheduler(**options) -> None:
    """The global scheduler (dispatch, migration pairing)."""
    from services.scheduler.service import SchedulerService

    cfg = _setup(SchedulerConfig, options, "scheduler")
    sys.exit(run(serve_grpc(SchedulerService(cfg), cfg.host, cfg.port, ready=_started(cfg))))


@serve.command("instance", context_settings={"ignore_unknown_options": True})
@click_options(InstanceConfig)
@click.argument("engine_args", nargs=-1, type=click.UNPROCESSED)
def instance(engine_args, **options) -> None:
    """An instance agent (llumlet) running one engine. With --engine vllm,
    arguments Ferry does not know are vLLM's engine arguments, e.g.
    `ferry serve instance --engine vllm --model DIR --enforce-eager`."""
    import shlex

    from services.instance.service import InstanceService

    if engine_args:
        if options.get("engine") != "vllm":
            raise click.UsageError(f"unexpected arguments {' '.join(engine_args)} (engine arguments are "
                                   "for --engine vllm only)")
        options["vllm_args"] = " ".join(filter(None, [options.get("vllm_args") or "",
                                                      shlex.join(a for a in engine_args if a != "--")]))
    cfg = _setup(InstanceConfig, options, "instance")
    if cfg.cpus:  # first: the engine's and gRPC's threads inherit the affinity
        from libs.common.cpus import format_cpus, pin

        try:
            cores = pin(cfg.cpus)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--cpus") from None
        log.info("pinned to cores %s", format_cpus(cores))
    sys.exit(run(serve_grpc(InstanceService(cfg), cfg.host, cfg.port, ready=_started(cfg))))


@serve.command("frontend")
@click_options(FrontendConfig)
def frontend(**options) -> None:
    """The OpenAI-compatible HTTP frontend (and its gRPC Generate API)."""
    from services.frontend.service import run_frontend

    cfg = _setup(FrontendConfig, options, "frontend")
    sys.exit(run(run_frontend(cfg, freeze_heap=cfg.freeze_heap)))
