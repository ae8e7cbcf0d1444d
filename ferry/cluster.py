"""A Ferry cluster as local processes on loopback: meta store, scheduler, N
instances and the frontend, each its own process. Used by `ferry up`, the
benchmarks and the tests. Children die with their parent (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libs.common import rpc
from libs.common.cpus import available_cores, cores_for, format_cpus
from services.instance.engine import spec as engine_spec
from libs.common.procs import _BOOTSTRAP_OWNED, OWNER_PID_ENV, ferry_command, free_port  # noqa: F401  (free_port: for callers)

class StartupError(RuntimeError):
    pass


class StartupStopped(Exception):
    """A stop was asked (``should_stop``) before every service was healthy;
    every service has been stopped."""


@dataclass
class Child:
    name: str
    kind: str  # meta-store | scheduler | instance | frontend
    args: list[str]
    port: int
    proc: subprocess.Popen | None = None
    log_path: str | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class ClusterSpec:
    instances: int = 2
    engine: str = "native"
    model: str = "smollm2"
    port: int = 8000
    host: str = "127.0.0.1"
    dispatch: str = "llumnix"
    instance_args: list[str] = field(default_factory=list)
    per_instance_args: dict[int, list[str]] = field(default_factory=dict)  # by instance index
    # Splitwise: the first ``prefill`` instances prefill only, the next
    # ``decode`` decode only, the rest are mixed (instances counts them all).
    prefill: int = 0
    decode: int = 0
    scheduler_args: list[str] = field(default_factory=list)
    frontend_args: list[str] = field(default_factory=list)
    meta_store_args: list[str] = field(default_factory=list)
    log_format: str = "console"
    log_level: str = "info"
    log_dir: str | None = None  # children's output to files (else inherited)
    grpc_port: int = -1
    # Give the scheduler a launcher: the instance command it may start
    # (--launch-args), so that auto-scaling (scheduler_args) can add instances.
    launcher: bool = False
    # Internal gRPC credentials of every service (libs/common/rpc.py): a
    # token (``ferry up`` makes one per cluster; children get it through the
    # environment, not their command line) and optional TLS files.
    cluster_token: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    # A replicated control plane: a local etcd (``etcd``) or one at these
    # endpoints (``etcd_endpoints``), and ``control_replicas`` meta stores and
    # schedulers on it; the other services get every replica's address.
    etcd: bool = False
    etcd_endpoints: str = ""
    control_replicas: int = 2
    # Every process serves Prometheus metrics: the frontend on its HTTP port,
    # the others on a --metrics-port each (``LocalCluster.metrics_targets``).
    metrics: bool = False
    # Tracing (libs/common/tracing.py): every process exports its spans to this
    # OTLP/gRPC endpoint, sampling new traces at this ratio ("" = off).
    otlp_endpoint: str = ""
    trace_sample_ratio: float = 1.0

    @property
    def replicated(self) -> bool:
        return self.etcd or bool(self.etcd_endpoints)

    @property
    def credentials(self) -> rpc.Credentials:
        return rpc.Credentials(self.cluster_token, self.tls_cert, self.tls_key, self.tls_ca)

    # torch intra-op threads per native instance (None: cores // instances, see
    # threads_per_instance; a --torch-threads in instance_args wins)
    torch_threads: int | None = None
    # Pin each instance started with the cluster to its own share of this
    # process's cores (--cpus; libs/common/cpus.py). Instances the
    # auto-scaler adds later are not pinned. A --cpus in the args wins.
    pin_cores: bool = False

    def instance_cpus(self, index: int) -> str | None:
        """The --cpus of the index-th instance started with the cluster, or None."""
        if not self.pin_cores or any(a.startswith("--cpus") for a in
                                     [*self.instance_args, *self.per_instance_args.get(index, [])]):
            return None
        return format_cpus(cores_for(index, self.instances, available_cores()))

    def role_of(self, index: int) -> str:
        """The --role of the index-th instance started with the cluster."""
        if index < self.prefill:
            return "prefill"
        if index < self.prefill + self.decode:
            return "decode"
        return "mixed"

    def check_roles(self) -> None:
        """Raise ValueError for a split that cannot serve."""
        if self.prefill < 0 or self.decode < 0:
            raise ValueError("--prefill and --decode cannot be negative")
        if self.prefill + self.decode > self.instances:
            raise ValueError(f"{self.prefill} prefill + {self.decode} decode instances are more than "
                             f"--instances {self.instances}")
        mixed = self.instances - self.prefill - self.decode
        if self.prefill and not (self.decode or mixed):
            raise ValueError("prefill instances need a decode or mixed instance to hand requests to")
        if self.decode and not (self.prefill or mixed):
            raise ValueError("decode instances need a prefill or mixed instance to take new requests")

    def policy_instance_args(self, index: int | None = None) -> list[str]:
        """What the dispatch policy needs of an instance (``index``; None: one
        the scheduler launches), unless its arguments say it: engines that hold
        programs' blocks between turns (Policy.program_keep, program_ttl_s;
        the simulator sets them on its engines). Without this, ``--dispatch
        llumnix-keep`` would run its dispatch over instances that keep nothing."""
        from libs.common.policies import POLICIES

        p = POLICIES.get(self.dispatch)
        own = self.per_instance_args.get(index, []) if index is not None else []
        given = {a.split("=", 1)[0] for a in [*self.instance_args, *own]}
        out = []
        if p is not None and p.program_keep and "--program-keep" not in given:
            out += ["--program-keep", f"{p.program_keep:g}"]
        if p is not None and p.program_ttl_s and "--program-ttl-s" not in given:
            out += ["--program-ttl-s", f"{p.program_ttl_s:g}"]
        return out

    def instance_threads(self) -> int | None:
        """The --torch-threads this cluster gives its instances, or None."""
        if not engine_spec(self.engine).torch_threads or any(a.startswith("--torch-threads") for a in self.instance_args):
            return None
        return self.torch_threads or threads_per_instance(self.instances)


def usable_cores() -> int:
    return len(available_cores())


def threads_per_instance(instances: int, cores: int | None = None) -> int:
    """Cores split evenly between native instances, at least one each: with
    torch's default (one thread per core) in every instance, N instances run
    N x cores spinning OpenMP threads, and a step waits for any sibling the
    kernel descheduled (measured on 2 cores: 2 threads in a loaded process
    stepped 5-15x slower than 1)."""
    return max(1, (cores or usable_cores()) // max(1, instances))


class LocalCluster:
    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.children: list[Child] = []
        n = spec.control_replicas if spec.replicated else 1
        self.meta_store_ports = [free_port() for _ in range(n)]
        self.scheduler_ports = [free_port() for _ in range(n)]
        self.meta_store_port, self.scheduler_port = self.meta_store_ports[0], self.scheduler_ports[0]
        self.etcd = None  # ferry/etcd_local.LocalEtcd when spec.etcd
        self._instance_seq = 0
        self.metrics_ports: dict[str, int] = {}  # child name -> its --metrics-port (spec.metrics)

    # --- addresses -------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"

    @property
    def meta_store(self) -> str:
        return _target(self.meta_store_ports)

    @property
    def scheduler(self) -> str:
        return _target(self.scheduler_ports)

    @property
    def etcd_endpoints(self) -> str:
        return self.etcd.endpoint if self.etcd is not None else self.spec.etcd_endpoints

    @property
    def credentials(self) -> rpc.Credentials:
        """What a client of this cluster's internal services presents."""
        return self.spec.credentials

    def metrics_targets(self) -> list[tuple[Child, str]]:
        """Each child with the address of its /metrics (spec.metrics)."""
        out = []
        for c in self.children:
            if c.kind == "frontend":
                out.append((c, f"127.0.0.1:{c.port}"))
            elif c.name in self.metrics_ports:
                out.append((c, f"127.0.0.1:{self.metrics_ports[c.name]}"))
        return out

    def _metrics_args(self, name: str) -> list[str]:
        if not self.spec.metrics:
            return []
        port = self.metrics_ports.setdefault(name, free_port())
        return ["--metrics-port", str(port)]

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def instances(self) -> list[Child]:
        return [c for c in self.children if c.kind == "instance"]

    # --- processes ---------------------------------------------------------------
    def _common(self) -> list[str]:
        return ["--log-format", self.spec.log_format, "--log-level", self.spec.log_level]

    def _spawn(self, child: Child) -> Child:
        cmd = ferry_command(["serve", child.kind, *child.args, *self._common()])
        out = None
        if self.spec.log_dir:
            os.makedirs(self.spec.log_dir, exist_ok=True)
            child.log_path = os.path.join(self.spec.log_dir, f"{child.name}.log")
            out = open(child.log_path, "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.credentials.env()}
        if self.spec.otlp_endpoint:
            env |= {"FERRY_OTLP_ENDPOINT": self.spec.otlp_endpoint,
                    "FERRY_TRACE_SAMPLE_RATIO": str(self.spec.trace_sample_ratio)}
        if self.spec.replicated:
            env[OWNER_PID_ENV] = str(os.getpid())  # what schedulers launch dies with this process
        # A process group of its own: a terminal's Ctrl-C (or hang-up) reaches
        # only the process that started the cluster, which stops the services
        # in order (stop()); each still dies with it (its parent-death signal).
        child.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None,
                                      stdin=subprocess.DEVNULL, env=env, process_group=0)
        if out:
            out.close()
        return child

    def meta_store_child(self, index: int = 0) -> Child:
        port = self.meta_store_ports[index]
        etcd = ["--etcd", self.etcd_endpoints] if self.spec.replicated else []
        name = _replica_name("meta-store", index)
        return Child(name, "meta-store",
                     ["--port", str(port), *etcd, *self._metrics_args(name), *self.spec.meta_store_args], port)

    def instance_launch_args(self) -> str:
        """The arguments every instance of this cluster gets (less port, id
        and meta store), shell-quoted: the scheduler launcher's template."""
        return shlex.join(["--engine", self.spec.engine, "--model", self.spec.model,
                           *self.spec.policy_instance_args(), *self.spec.instance_args, *self._common()])

    def scheduler_child(self, index: int = 0) -> Child:
        launch = []
        if self.spec.launcher:
            launch = ["--launch-args", self.instance_launch_args()]
            if self.spec.log_dir:
                launch += ["--launch-log-dir", self.spec.log_dir]
        name, port = _replica_name("scheduler", index), self.scheduler_ports[index]
        etcd = ["--etcd", self.etcd_endpoints, "--scheduler-id", name] if self.spec.replicated else []
        return Child(name, "scheduler",
                     ["--port", str(port), "--meta-store", self.meta_store,
                      "--dispatch", self.spec.dispatch, *launch, *etcd, *self._metrics_args(name),
                      *self.spec.scheduler_args], port)

    def control_plane(self) -> list[Child]:
        return ([self.meta_store_child(i) for i in range(len(self.meta_store_ports))]
                + [self.scheduler_child(i) for i in range(len(self.scheduler_ports))])

    def instance_child(self, extra: list[str] | None = None) -> Child:
        i = self._instance_seq
        self._instance_seq += 1
        port = free_port()
        return Child(f"instance-{i}", "instance",
                     ["--port", str(port), "--instance-id", f"instance-{i}", "--meta-store", self.meta_store,
                      *self._metrics_args(f"instance-{i}"),
                      "--engine", self.spec.engine, "--model", self.spec.model,
                      *(["--torch-threads", str(t)] if (t := self.spec.instance_threads()) else []),
                      *(["--cpus", c] if (c := self.spec.instance_cpus(i)) else []),
                      *(["--role", r] if (r := self.spec.role_of(i)) != "mixed" else []),
                      *self.spec.policy_instance_args(i),
                      *self.spec.instance_args, *self.spec.per_instance_args.get(i, []), *(extra or [])], port)

    def frontend_child(self, port: int | None = None, name: str = "frontend") -> Child:
        model = self.spec.model if engine_spec(self.spec.engine).real_model else "fake"
        port = self.spec.port if port is None else port
        grpc_port = self.spec.grpc_port if name == "frontend" else -1
        return Child(name, "frontend",
                     ["--host", self.spec.host, "--port", str(port), "--scheduler", self.scheduler,
                      "--meta-store", self.meta_store, "--model", model, "--grpc-port", str(grpc_port),
                      *self.spec.frontend_args], port)

    def add_frontend(self, wait_s: float = 60.0) -> Child:
        """Another frontend replica on the same control plane (its own port:
        ``f"http://{host}:{child.port}"``)."""
        n = sum(1 for c in self.children if c.kind == "frontend")
        c = self._spawn(self.frontend_child(free_port(), f"frontend-{n}"))
        self.children.append(c)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if httpx.get(f"http://{self.spec.host}:{c.port}/health", timeout=1.0).status_code == 200:
                    return c
            except httpx.HTTPError:
                pass
            if not c.alive() or time.monotonic() > deadline:
                raise StartupError(f"{c.name} did not start")
            time.sleep(0.1)

    def start(self, timeout_s: float = 120.0, should_stop: Callable[[], bool] | None = None) -> None:
        """Start every service and wait until all are healthy. On failure,
        stop everything and raise StartupError naming the culprit; once
        ``should_stop()`` is true (a signal came), stop everything and raise
        StartupStopped, without waiting for the rest of the start-up."""
        self.spec.check_roles()
        try:
            if self.spec.etcd:
                from ferry.etcd_local import LocalEtcd

                log = os.path.join(self.spec.log_dir, "etcd.log") if self.spec.log_dir else None
                if log:
                    os.makedirs(self.spec.log_dir, exist_ok=True)
                self.etcd = LocalEtcd(log_path=log).start()
            self.children = self.control_plane()
            self.children += [self.instance_child() for _ in range(self.spec.instances)]
            self.children.append(self.frontend_child())
            for c in self.children:
                self._spawn(c)
            self.wait_healthy(timeout_s, should_stop)
        except BaseException:
            self.stop()
            raise

    def wait_healthy(self, timeout_s: float, should_stop: Callable[[], bool] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(self.children)
        stop_asked = should_stop or (lambda: False)
        while pending:
            # Before the liveness checks: whoever asked for the stop may have
            # signalled the services too (their groups, a container's stop).
            if stop_asked():
                raise StartupStopped(f"stopped during start-up ({len(pending)} of {len(self.children)} services "
                                     "not healthy yet)")
            for c in list(pending):
                if not c.alive():
                    if stop_asked():  # it may have been told to go, too
                        raise StartupStopped(f"stopped during start-up ({c.name} already gone)")
                    code = c.proc.returncode if c.proc else None
                    raise StartupError(f"{c.name} exited with code {code} during start-up"
                                       + (f" (log: {c.log_path})" if c.log_path else ""))
                if self._healthy(c):
                    pending.remove(c)
            if not pending:
                break
            if time.monotonic() > deadline:
                raise StartupError(f"not healthy after {timeout_s:.0f}s: {', '.join(c.name for c in pending)}")
            time.sleep(0.1)

    def _healthy(self, c: Child) -> bool:
        if c.kind == "frontend":
            # Ready (/health 200) with every live instance serving; with no
            # instance (yet), alive (/live) is all a frontend can be.
            want = len([i for i in self.instances() if i.alive()])
            try:
                if not want:
                    return httpx.get(f"{self.url}/live", timeout=1.0).status_code == 200
                r = httpx.get(f"{self.url}/health", timeout=1.0)
                return r.status_code == 200 and r.json().get("serving", 0) >= want
            except httpx.HTTPError:
                return False
        return grpc_healthy(c.address, credentials=self.credentials)

    def add_instance(self, extra: list[str] | None = None, wait_s: float = 60.0) -> Child:
        c = self._spawn(self.instance_child(extra))
        self.children.append(c)
        deadline = time.monotonic() + wait_s
        while not grpc_healthy(c.address, credentials=self.credentials):
            if not c.alive() or time.monotonic() > deadline:
                raise StartupError(f"{c.name} did not start")
            time.sleep(0.05)
        return c

    def restart(self, name: str, wait_s: float = 60.0) -> Child:
        c = self.child(name)
        self._spawn(c)
        deadline = time.monotonic() + wait_s
        while not (self._healthy(c) if c.kind != "frontend" else grpc_healthy(c.address, credentials=self.credentials) or self._healthy(c)):
            if not c.alive() or time.monotonic() > deadline:
                raise StartupError(f"{name} did not restart")
            time.sleep(0.05)
        return c

    def respawn(self, name: str) -> Child:
        """Start a dead child again, same arguments and port, without waiting."""
        c = self.child(name)
        if c.alive():
            raise RuntimeError(f"{name} is alive")
        return self._spawn(c)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        c = self.child(name)
        if c.alive():
            c.proc.send_signal(sig)
            c.proc.wait(10)

    def launched_pids(self) -> list[int]:
        """Instances the schedulers of this (replicated) cluster launched:
        they outlive the scheduler that started them, so this process finds
        them by their command line (the owner bootstrap, this cluster's meta
        store)."""
        if not self.spec.replicated:
            return []
        pids = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    argv = f.read().decode(errors="replace").split("\0")
            except OSError:
                continue
            if (len(argv) > 3 and argv[2] == _BOOTSTRAP_OWNED and argv[3] == str(os.getpid())
                    and self.meta_store in argv):
                pids.append(int(d))
        return pids

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM everyone (frontend first, meta store last), then SIGKILL stragglers."""
        launched = self.launched_pids()
        for pid in launched:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for c in reversed(self.children):
            if c.alive():
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for c in reversed(self.children):
            if c.proc is None:
                continue
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait(5)
        for pid in launched:
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if self.etcd is not None:
            self.etcd.close()
            self.etcd = None

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _target(ports: list[int]) -> str:
    """One replica's address, or every replica's as one gRPC target (pick
    first: a client goes to the next when the one it uses dies)."""
    if len(ports) == 1:
        return f"127.0.0.1:{ports[0]}"
    return "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in ports)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _replica_name(kind: str, index: int) -> str:
    return kind if index == 0 else f"{kind}-{index}"


def grpc_healthy(address: str, timeout: float = 0.5, credentials: rpc.Credentials | None = None) -> bool:
    try:
        with rpc.sync_channel(address, credentials or rpc.Credentials()) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            return r.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
