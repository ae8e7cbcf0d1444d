"""Child processes of a Ferry cluster: ports to give them, and argv that runs
``ferry <args>`` as a child that dies with its parent (PR_SET_PDEATHSIG) or
with a named owner process. Used by ``ferry.cluster`` (``ferry up``, tests,
benchmarks) and by the scheduler's launcher."""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import sys

PR_SET_PDEATHSIG = 1


# Ports for children come from below Linux's default ephemeral range
# (32768-60999): a port the OS hands out for bind(0) is one it also hands out
# as the source port of outgoing connections, and the cluster's own children
# open many of those between the pick and the child's bind (seen once in CI:
# the frontend's port taken, "address already in use").
_PORT_RANGE = (20000, 32000)


# Ports this process handed out: a cluster picks every child's port before any
# child binds, so two picks of the same free port collided (seen in CI: an
# instance "Failed to bind to address"). Never hand one out twice.
_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now and this process did not hand out
    before, preferably outside the ephemeral range."""
    for _ in range(200):
        port = random.randrange(*_PORT_RANGE)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            _handed_out.add(port)
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child, first thing
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


# The child arranges to die with its parent itself, then exits if the parent
# is already gone, then runs ``python -m ferry <args>``. Not a preexec_fn:
# Python code between fork and exec ran gRPC's fork handlers in the child of
# a process with live gRPC threads, which aborted it now and then (SIGABRT,
# "epoll_wait error: Bad file descriptor"); without one, subprocess can vfork.
_BOOTSTRAP = (
    "import os, runpy, sys\n"
    "from libs.common.procs import _die_with_parent\n"
    "_die_with_parent()\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
    "sys.argv = ['ferry', *sys.argv[2:]]\n"
    "runpy.run_module('ferry', run_name='__main__', alter_sys=True)\n"
)


# A replicated control plane (--etcd): instances a scheduler launches outlive
# it (the next leader adopts them), so they cannot die with their parent. They
# die with the process that owns the cluster instead, named here (`ferry up`
# sets it for its children), watched through a pidfd.
OWNER_PID_ENV = "FERRY_CLUSTER_OWNER_PID"

_BOOTSTRAP_OWNED = (
    "import sys, runpy\n"
    "from libs.common.procs import _exit_with\n"
    "_exit_with(int(sys.argv[1]))\n"
    "sys.argv = ['ferry', *sys.argv[2:]]\n"
    "runpy.run_module('ferry', run_name='__main__', alter_sys=True)\n"
)


def _exit_with(pid: int) -> None:  # runs in the child, first thing
    """SIGTERM this process when ``pid`` exits (0: never)."""
    import select
    import threading

    if not pid:
        return
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        sys.exit(1)

    def wait() -> None:
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, name="exit-with-owner", daemon=True).start()


def ferry_command(args: list[str], owner_pid: int | None = None) -> list[str]:
    """argv that runs ``ferry <args>`` as a child that dies with this process
    (or, given ``owner_pid``, outlives it and dies with that one; 0: with none)."""
    if owner_pid is not None:
        return [sys.executable, "-c", _BOOTSTRAP_OWNED, str(owner_pid), *args]
    return [sys.executable, "-c", _BOOTSTRAP, str(os.getpid()), *args]
