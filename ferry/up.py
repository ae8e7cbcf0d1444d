"""``ferry up``: the whole cluster on this machine, in the foreground."""

from __future__ import annotations

import ipaddress
import pathlib
import signal
import sys
import time

import click

from ferry import targets
from ferry.cluster import ClusterSpec, LocalCluster, StartupError, StartupStopped, usable_cores
from ferry.supervise import Supervisor
from libs.common import cpu_features, rpc
from libs.common.policies import POLICY_NAMES
from services.instance.engine import ENGINES
from services.instance.engine import spec as engine_spec


def _check_machine(engine: str) -> None:
    """Say what this machine runs (the CPU line); with the vLLM engine, refuse
    here, before any process loads a model, where vLLM cannot run. For the
    native engine this also probes vLLM's kernels once, so the instances read
    the cached answer."""
    if engine_spec(engine).native_code is None:
        click.echo(f"ferry up: CPU {cpu_features.summary()}", err=True)
        return
    from ferry import machine
    from services.instance.engine import vllm_kernels

    if engine_spec(engine).native_code == "required":
        try:
            vllm_kernels.require_vllm()
        except RuntimeError as e:
            raise click.ClickException(str(e)) from None
    click.echo(f"ferry up: {machine.line()}", err=True)
def _announce(cluster: LocalCluster, sd_file: str | None) -> pathlib.Path:
    """Print where the metrics are; write the file_sd file and the cluster
    file (ferry/targets.py). Returns the directory of the cluster file."""
    state = targets.state_dir(cluster.spec.port)
    targets.write_cluster_file(cluster, state)
    found = cluster.metrics_targets()
    if cluster.spec.metrics:
        path = targets.write_sd_file(cluster, pathlib.Path(sd_file) if sd_file else state / "targets.json")
        config = targets.write_prometheus_config(state / "prometheus.yml", path)
        click.echo("ferry up: metrics at " + ", ".join(f"{c.name} http://{a}/metrics" for c, a in found), err=True)
        click.echo(f"ferry up: Prometheus file_sd targets in {path}; to scrape them: prometheus "
                   f"--config.file={config}; `ferry top` shows the cluster live", err=True)
    if cluster.spec.otlp_endpoint:
        click.echo(f"ferry up: traces to {cluster.spec.otlp_endpoint} (sampling "
                   f"{cluster.spec.trace_sample_ratio:g} of new requests)", err=True)
    return state


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@click.command()
@click.option("--engine", type=click.Choice(sorted(ENGINES)), default="native", show_default=True,
              help="engine of every instance (vllm: pip install -e '.[vllm]'; vLLM's engine arguments go in "
                   "--instance-arg, e.g. --instance-arg=--vllm-args='--enforce-eager')")
@click.option("--instances", type=click.IntRange(1, 64), default=None,
              help="instances in all [default: 2, or --prefill + --decode when either is given]")
@click.option("--prefill", type=click.IntRange(0, 64), default=0, show_default=True,
              help="Splitwise: instances that run prompts only and hand each request's KV to a decode instance")
@click.option("--decode", type=click.IntRange(0, 64), default=0, show_default=True,
              help="Splitwise: instances that decode requests handed over by prefill instances "
                   "(the rest of --instances are mixed)")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True, help="HTTP port")
@click.option("--host", default="127.0.0.1", show_default=True, help="HTTP address")
@click.option("--model", default="smollm2", show_default=True, help="model name or local HF directory")
@click.option("--dispatch", default="llumnix", show_default=True,
              type=click.Choice(POLICY_NAMES))
@click.option("--grpc-port", type=click.IntRange(-1, 65535), default=-1, show_default=True,
              help="frontend gRPC Generate API port (-1 = off)")
@click.option("--api-key", default="", help="require this Bearer token (generated and printed when --host is not a "
                                           "loopback address and none is given)")
@click.option("--deterministic", is_flag=True,
              help="every instance in its deterministic mode: a request's tokens and logprobs bit for bit the same "
                   "whatever its batch, cache hits, chunking, preemption, handoff or migration (ferry serve "
                   "instance --deterministic; docs/determinism.md)")
@click.option("--instance-arg", "instance_args", multiple=True,
              help="extra argument for every `ferry serve instance` (repeatable), e.g. --instance-arg=--num-blocks=512")
@click.option("--scheduler-arg", "scheduler_args", multiple=True,
              help="extra argument for `ferry serve scheduler` (repeatable), e.g. --scheduler-arg=--kunserve")
@click.option("--meta-store-arg", "meta_store_args", multiple=True,
              help="extra argument for `ferry serve meta-store` (repeatable), e.g. --meta-store-arg=--ttl-s=10")
@click.option("--cluster-token/--no-cluster-token", default=True, show_default=True,
              help="internal gRPC calls carry a token made for this cluster; strangers get UNAUTHENTICATED")
@click.option("--pin-cores/--no-pin-cores", default=False, show_default=True,
              help="pin each instance to its own share of the cores (ferry serve instance --cpus), so that one "
                   "instance's work besides its steps (a migration's copies) does not run on another's core")
@click.option("--etcd/--no-etcd", default=False, show_default=True,
              help="a replicated control plane: start a local etcd (the etcd binary; Debian: etcd-server) and two "
                   "meta stores and two schedulers on it (one leads); the frontend and instances use either")
@click.option("--restart/--no-restart", default=True, show_default=True,
              help="start a process that dies again (an instance whose engine died or hung exits 3 or 4): at once, "
                   "then with a doubling back-off up to 30 s")
@click.option("--metrics/--no-metrics", default=True, show_default=True,
              help="every process serves Prometheus /metrics (the frontend on --port, the others on a port each); "
                   "their addresses are printed and written as a Prometheus file_sd file (--sd-file)")
@click.option("--sd-file", type=click.Path(dir_okay=False), default=None,
              help="where to write the Prometheus file-based service-discovery file "
                   "[default: $FERRY_CACHE_DIR/up-PORT/targets.json]")
@click.option("--otlp-endpoint", default="", envvar="FERRY_OTLP_ENDPOINT",
              help="export traces (OpenTelemetry, OTLP/gRPC) from every process to this endpoint, e.g. "
                   "http://127.0.0.1:4317 (empty = tracing off)")
@click.option("--trace-sample-ratio", type=click.FloatRange(0, 1), default=1.0, show_default=True,
              envvar="FERRY_TRACE_SAMPLE_RATIO", help="share of new requests traced (a client's sampled "
                                                      "traceparent is always followed)")
@click.option("--log-format", type=click.Choice(["console", "json"]), default="console", show_default=True)
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
def up(engine, instances, prefill, decode, port, host, model, dispatch, grpc_port, api_key, deterministic,
       instance_args, scheduler_args, meta_store_args, cluster_token, pin_cores, etcd, restart, metrics, sd_file, otlp_endpoint,
       trace_sample_ratio, log_format, log_level) -> None:
    """Start meta store, scheduler, N instances and the frontend; stop them all on Ctrl-C/SIGTERM."""
    if instances is None:
        instances = prefill + decode if prefill or decode else 2
    if not api_key and not _loopback(host):
        # NOTE: an endpoint others can reach is never open by mistake.
        api_key = f"sk-ferry-{rpc.new_token()}"
        click.echo(f"ferry up: --host {host} is reachable from other machines: clients need the API key "
                   f"{api_key} (Authorization: Bearer …; --api-key to choose one)", err=True)
    spec = ClusterSpec(instances=instances, engine=engine, model=model, port=port, host=host,
                       dispatch=dispatch, grpc_port=grpc_port,
                       instance_args=(["--deterministic"] if deterministic else []) + list(instance_args),
                       scheduler_args=list(scheduler_args), meta_store_args=list(meta_store_args),
                       frontend_args=["--api-key", api_key] if api_key else [],
                       log_format=log_format, log_level=log_level,
                       cluster_token=rpc.new_token() if cluster_token else "", prefill=prefill, decode=decode,
                       pin_cores=pin_cores, etcd=etcd, metrics=metrics, otlp_endpoint=otlp_endpoint,
                       trace_sample_ratio=trace_sample_ratio)
    try:
        spec.check_roles()
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if etcd:
        from ferry.etcd_local import binary

        if binary() is None:
            raise click.UsageError("--etcd needs the etcd binary on PATH (Debian: apt-get install etcd-server)")
    real = engine_spec(engine).real_model
    _check_machine(engine)
    if real:
        from libs.common.models import KNOWN_MODELS, ensure_model

        if not engine_spec(engine).prepares_any_model or model in KNOWN_MODELS:  # vLLM loads hub names itself
            click.echo(f"ferry up: preparing model {model} …", err=True)
            ensure_model(model)
    threads = spec.instance_threads()
    if threads:
        click.echo(f"ferry up: {usable_cores()} cores, {instances} native instances: {threads} torch thread(s) "
                   f"each (--instance-arg=--torch-threads=N overrides)", err=True)
    if pin_cores:
        click.echo("ferry up: instances pinned to cores " + "; ".join(
            f"instance-{i}: {spec.instance_cpus(i) or 'as --instance-arg says'}" for i in range(instances)), err=True)
    cluster = LocalCluster(spec)
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_signal)  # the terminal closed: the services are in their own groups
    try:
        # A signal during start-up (a model may take minutes to load) stops
        # at once, not once every service is healthy.
        cluster.start(timeout_s=600 if real else 60, should_stop=lambda: stopping)
    except StartupStopped as e:
        click.echo(f"ferry up: {e}; stopped all services", err=True)
        sys.exit(0)
    except StartupError as e:
        click.echo(f"ferry up: {e}; stopped all services", err=True)
        sys.exit(1)
    if stopping:
        cluster.stop()
        sys.exit(0)
    split = f": {prefill} prefill, {decode} decode, {instances - prefill - decode} mixed" if prefill or decode else ""
    click.echo(f"ferry up: ready at {cluster.url}/v1 (model {model if real else 'fake'}, {instances} {engine} instances"
               f"{split}, dispatch {dispatch}); Ctrl-C to stop", err=True)
    if etcd:
        click.echo(f"ferry up: control plane on etcd {cluster.etcd_endpoints}: meta stores {cluster.meta_store}, "
                   f"schedulers {cluster.scheduler}", err=True)
    state = _announce(cluster, sd_file)
    print(f"{cluster.url}/v1", flush=True)
    reported: set[str] = set()
    supervisor = Supervisor(cluster, say=lambda m: click.echo(f"ferry up: {m}", err=True))
    while not stopping:
        if restart:
            supervisor.tick()
        else:
            for c in cluster.children:
                if not c.alive() and c.name not in reported:
                    reported.add(c.name)
                    click.echo(f"ferry up: {c.name} exited with code {c.proc.returncode}", err=True)
        time.sleep(0.2)
    click.echo("ferry up: stopping …", err=True)
    targets.remove(state)
    cluster.stop()
    click.echo("ferry up: stopped", err=True)
