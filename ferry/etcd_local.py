"""A one-member etcd on loopback, as a child process: ``ferry up --etcd``,
the tests and the benchmarks start it like any other component. It uses the
``etcd`` binary on PATH (Debian: ``apt-get install etcd-server``).

Its raft timing is tightened (heartbeat 50 ms, election 250 ms) so that etcd
grants leases of 1 s: a scheduler's leadership lease of 1 s is what bounds the
takeover after its leader dies without a word."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from ferry.cluster import free_port

BINARY = "etcd"

_EXEC_DYING_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def binary() -> str | None:
    return shutil.which(os.environ.get("FERRY_ETCD_BIN", BINARY))


class LocalEtcd:
    def __init__(self, data_dir: str | None = None, log_path: str | None = None, die_with_parent: bool = True):
        self.client_port = free_port()
        self.peer_port = free_port()
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="ferry-etcd-")
        self.data_dir = data_dir or self._tmp.name
        self.log_path = log_path
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def command(self) -> list[str]:
        exe = binary()
        if exe is None:
            raise FileNotFoundError("no etcd binary on PATH (Debian: apt-get install etcd-server)")
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        return [exe, "--name", "ferry", "--data-dir", os.path.join(self.data_dir, "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"ferry={peer}", "--heartbeat-interval", "50", "--election-timeout", "250",
                "--log-level", "warn", "--logger", "zap"]

    def start(self, timeout_s: float = 20.0) -> "LocalEtcd":
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        cmd = self.command()
        if self.die_with_parent:
            # Not a preexec_fn (see ferry/cluster.py): a small interpreter
            # sets the parent-death signal, which survives its exec of etcd.
            cmd = [sys.executable, "-c", _EXEC_DYING_WITH_PARENT, str(os.getpid()), *cmd]
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     process_group=0)  # as the services (ferry/cluster.py): its starter stops it
        if out is not subprocess.DEVNULL:
            out.close()
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with code {self.proc.returncode}"
                                   + (f" (log: {self.log_path})" if self.log_path else ""))
            try:
                if httpx.get(f"http://{self.endpoint}/health", timeout=0.5).json().get("health") == "true":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd not healthy after {timeout_s:.0f}s")
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.alive():
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> "LocalEtcd":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
