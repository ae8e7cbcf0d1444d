"""Starting and stopping instances for the scheduler (docs/design.md §5 auto-scaling).

``Launcher`` is the interface the autoscaler uses; ``LocalProcessLauncher``
runs ``python -m ferry serve instance <launch_args> --port P --instance-id I
--meta-store M`` as child processes of the scheduler on this host. Children
die with the scheduler (PR_SET_PDEATHSIG, the helper of ferry/cluster.py),
except with a replicated control plane (``survive_scheduler``): there they
outlive it, the launcher records each in the leader's state (address, pid),
and the next leader adopts them; they die with the cluster's owner process
instead where one is named (``FERRY_CLUSTER_OWNER_PID``: ``ferry up --etcd``).
``services/scheduler/k8s_launcher.py`` scales a StatefulSet instead.

A launched instance is ready when its gRPC health check answers SERVING; it
then registers with the meta store by itself and the scheduler sees it in its
view like any other instance."""

from __future__ import annotations

import abc
import asyncio
import os
import shlex
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libs.common.procs import OWNER_PID_ENV, ferry_command, free_port
from libs.common import rpc
from libs.common.logging import get_logger
from services.scheduler.state import LeaderState, MemoryState

log = get_logger(__name__)


class LaunchError(RuntimeError):
    pass


class Launcher(abc.ABC):
    """Starts and stops model instances."""

    @abc.abstractmethod
    async def launch(self) -> str:
        """Start one instance; return its id once it serves."""

    @abc.abstractmethod
    async def stop(self, instance_id: str) -> None:
        """Stop an instance this launcher started (gracefully, then by force)."""

    @abc.abstractmethod
    def instances(self) -> list[str]:
        """Ids of the live instances this launcher started (and did not stop)."""

    def stoppable(self) -> list[str]:
        """The instances a scale-in may pick (all it started, unless the
        launcher can only stop some, as a StatefulSet its highest ordinal)."""
        return self.instances()

    async def adopt(self) -> None:
        """Take over what a previous leader's launcher started (its state)."""

    def release(self) -> None:
        """Stop managing the instances without stopping them (leadership
        lost: the next leader adopts them)."""

    async def close(self) -> None:
        """Stop every instance this launcher started."""
        await asyncio.gather(*(self.stop(i) for i in self.instances()), return_exceptions=True)


@dataclass
class _Proc:
    instance_id: str
    address: str
    proc: "subprocess.Popen | AdoptedProcess"
    started_at: float


class AdoptedProcess:
    """An instance process another scheduler started, by pid (the few
    methods of Popen the launcher uses). Its exit code is not ours to read."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not _pid_alive(self.pid):
            self.returncode = -1
        return self.returncode

    def send_signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.02)
        return self.returncode


def _pid_alive(pid: int) -> bool:
    """Alive and not a zombie (a zombie still answers kill(pid, 0))."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _runs_instance(pid: int, instance_id: str) -> bool:
    """The pid is still that instance (pids are reused)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return instance_id.encode() in f.read().split(b"\0")
    except OSError:
        return False


class LocalProcessLauncher(Launcher):
    def __init__(self, meta_store: str, launch_args: str, *, log_dir: str = "", id_prefix: str = "auto",
                 host: str = "127.0.0.1", ready_timeout_s: float = 60.0, stop_timeout_s: float = 10.0,
                 state: LeaderState | None = None, survive_scheduler: bool = False):
        self.state = state or MemoryState()
        self.survive_scheduler = survive_scheduler
        self.meta_store = meta_store
        self.args = shlex.split(launch_args)
        self.log_dir = log_dir
        # A scheduler restarted later must not reuse ids (its old children may
        # still be in the meta store until their TTL passes).
        self.id_prefix = f"{id_prefix}-{uuid.uuid4().hex[:4]}"
        self.host = host
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._procs: dict[str, _Proc] = {}
        self._writes: set[asyncio.Task] = set()
        self._seq = 0
        self.launched = 0
        self.stopped = 0

    def command(self, instance_id: str, port: int) -> list[str]:
        """``ferry serve instance …`` as a child that dies with the scheduler
        (ferry/cluster.py's ferry_command; not a preexec_fn, which crashed
        children of a process with live gRPC threads)."""
        # Ours come last: click keeps the last value of a repeated option.
        args = ["serve", "instance", *self.args, "--host", self.host, "--port", str(port),
                "--instance-id", instance_id, "--meta-store", self.meta_store]
        if self.survive_scheduler:
            owner = os.environ.get(OWNER_PID_ENV, "")
            return ferry_command(args, owner_pid=int(owner) if owner.isdigit() else 0)
        return ferry_command(args)

    def instances(self) -> list[str]:
        return [i for i, p in self._procs.items() if p.proc.poll() is None]

    def address(self, instance_id: str) -> str | None:
        p = self._procs.get(instance_id)
        return p.address if p else None

    async def launch(self) -> str:
        self._seq += 1
        iid = f"{self.id_prefix}-{self._seq}"
        port = free_port(self.host)
        out = None
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{iid}.log"), "ab")
        # Popen on the event loop's thread: PR_SET_PDEATHSIG fires when the
        # parent *thread* exits, so a pool thread must not be the parent.
        # (The fork itself is cheap: no preexec_fn, so vfork/posix_spawn.)
        proc = subprocess.Popen(self.command(iid, port), stdout=out,
                                stderr=subprocess.STDOUT if out else None, stdin=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **rpc.current().env()})
        if out:
            out.close()
        p = _Proc(iid, f"{self.host}:{port}", proc, time.monotonic())
        self._procs[iid] = p
        self.launched += 1
        await self.state.put("launched", iid, {"address": p.address, "pid": proc.pid})
        log.info("launching instance", instance_id=iid, address=p.address, pid=proc.pid)
        deadline = time.monotonic() + self.ready_timeout_s
        while not await _healthy(p.address):
            if proc.poll() is not None or time.monotonic() > deadline:
                await self.stop(iid)
                raise LaunchError(f"instance {iid} did not start (exit code {proc.returncode})")
            await asyncio.sleep(0.1)
        log.info("instance launched", instance_id=iid, seconds=round(time.monotonic() - p.started_at, 2))
        return iid

    async def stop(self, instance_id: str) -> None:
        p = self._procs.pop(instance_id, None)
        if p is None:
            return
        self.stopped += 1
        await self.state.delete("launched", instance_id)
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeout_s
            while p.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if p.proc.poll() is None:
                p.proc.kill()
                await asyncio.to_thread(p.proc.wait, 5)
        log.info("instance stopped", instance_id=instance_id, exit_code=p.proc.returncode)

    def reap(self) -> list[str]:
        """Forget children that died on their own; return their ids."""
        dead = [i for i, p in self._procs.items() if p.proc.poll() is not None]
        for i in dead:
            self._procs.pop(i)
            t = asyncio.get_running_loop().create_task(self.state.delete("launched", i))
            self._writes.add(t)  # held until done (a task nobody holds may be collected)
            t.add_done_callback(self._writes.discard)
        return dead

    async def adopt(self) -> None:
        """The instances the previous leader recorded that still run here."""
        for iid, rec in (await self.state.load("launched")).items():
            pid = int(rec.get("pid", 0))
            if iid in self._procs:
                continue
            if not (pid and _pid_alive(pid) and _runs_instance(pid, iid)):
                await self.state.delete("launched", iid)
                continue
            self._procs[iid] = _Proc(iid, rec["address"], AdoptedProcess(pid), time.monotonic())
            log.info("instance adopted", instance_id=iid, address=rec["address"], pid=pid)

    def release(self) -> None:
        self._procs.clear()

    async def close(self) -> None:
        if self.survive_scheduler:
            self.release()  # the next leader adopts them
        else:
            await super().close()


async def _healthy(address: str) -> bool:
    try:
        async with rpc.channel(address) as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                           timeout=0.5)
            return r.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
