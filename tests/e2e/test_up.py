"""`ferry up` as a user runs it: start, serve, stop with no process left;
a child dying at start-up makes it exit non-zero and say which."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from ferry.cluster import free_port
from tests.helpers import expected_fake_text


def _ferry_up(*args):
    return subprocess.Popen([sys.executable, "-m", "ferry", "up", "--engine", "fake", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _descendants(pid):
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_up_serves_then_stops_everything_on_sigterm():
    port = free_port()
    proc = _ferry_up("--instances", "2", "--port", str(port))
    try:
        line = proc.stdout.readline()  # the endpoint, printed once all are healthy
        assert line.strip() == f"http://127.0.0.1:{port}/v1"
        children = _descendants(proc.pid)
        assert len(children) == 5  # meta store, scheduler, 2 instances, frontend
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hey", "max_tokens": 6})
        assert r.json()["choices"][0]["text"] == expected_fake_text("hey", 6)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert alive == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_child_dying_at_startup_is_named_and_nothing_is_left():
    port = free_port()
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", port))
    blocker.listen()
    try:
        proc = _ferry_up("--instances", "1", "--port", str(port))
        t0 = time.monotonic()
        seen = set()
        while proc.poll() is None and time.monotonic() - t0 < 60:
            seen |= {c.pid for c in _descendants(proc.pid)}
            time.sleep(0.05)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode != 0
        assert "frontend exited" in err and "during start-up" in err
        for pid in seen:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        blocker.close()


def test_a_stop_asked_during_start_up_stops_every_service_without_waiting_for_the_rest(tmp_path):
    """A signal while the services start (a real model can take minutes to
    load): every service is stopped at once, not once all are healthy."""
    from ferry.cluster import ClusterSpec, LocalCluster, StartupStopped

    cluster = LocalCluster(ClusterSpec(engine="fake", instances=2, port=free_port(), log_dir=str(tmp_path)))
    asked = []

    def should_stop():
        asked.append(1)
        return len(asked) > 1  # the second poll: the services were spawned and are not all healthy yet

    with pytest.raises(StartupStopped, match="stopped during start-up"):
        cluster.start(timeout_s=60, should_stop=should_stop)
    assert len(asked) == 2
    assert len(cluster.children) == 5
    for c in cluster.children:
        assert not c.alive()


def test_ctrl_c_during_start_up_stops_everything_and_exits_zero():
    """A terminal's Ctrl-C reaches its foreground process group: `ferry up`
    (each service has a group of its own) stops them all and says it stopped;
    it did say that the frontend had died, and exited 1."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ferry", "up", "--engine", "fake", "--instances", "2",
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        seen = []
        t0 = time.monotonic()
        while len(seen) < 5 and time.monotonic() - t0 < 30:  # every service spawned (the signal handler is set)
            seen = _descendants(proc.pid)
            time.sleep(0.01)
        assert len(seen) == 5
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "exited with code" not in err, err
        assert "stopped during start-up" in err or "ferry up: stopped" in err, err
        _, alive = psutil.wait_procs(seen, timeout=10)
        assert alive == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_children_die_with_a_killed_parent():
    port = free_port()
    proc = _ferry_up("--instances", "1", "--port", str(port))
    try:
        assert proc.stdout.readline().strip().endswith("/v1")
        children = _descendants(proc.pid)
        proc.kill()  # no chance to clean up: PR_SET_PDEATHSIG must do it
        proc.wait(10)
        _, alive = psutil.wait_procs(children, timeout=15)
        assert alive == []
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("args, message", [
    (["--prefill", "2"], "need a decode or mixed instance"),
    (["--decode", "1"], "need a prefill or mixed instance"),
    (["--instances", "1", "--prefill", "1", "--decode", "1"], "more than --instances 1"),
])
def test_up_refuses_a_split_that_cannot_serve(args, message):
    from click.testing import CliRunner

    from ferry.up import up

    r = CliRunner().invoke(up, ["--engine", "fake", *args])
    assert r.exit_code == 2 and message in r.output, r.output


def test_cluster_spec_roles():
    from ferry.cluster import ClusterSpec

    spec = ClusterSpec(instances=4, prefill=1, decode=2)
    assert [spec.role_of(i) for i in range(4)] == ["prefill", "decode", "decode", "mixed"]
    spec.check_roles()


def test_up_passes_scheduler_arguments_to_the_scheduler(monkeypatch):
    """`ferry up --scheduler-arg` reaches the scheduler's command line (e.g. KunServe's flags)."""
    from click.testing import CliRunner

    from ferry import up as up_mod
    from ferry.cluster import StartupError

    seen = {}

    class Stub:
        def __init__(self, spec):
            seen["spec"] = spec

        def start(self, timeout_s, should_stop=None):
            raise StartupError("stub: not started")

    monkeypatch.setattr(up_mod, "LocalCluster", Stub)
    r = CliRunner().invoke(up_mod.up, ["--engine", "fake", "--scheduler-arg=--kunserve",
                                       "--scheduler-arg=--kunserve-layers=30"])
    assert r.exit_code == 1 and "stub: not started" in r.output, r.output
    assert seen["spec"].scheduler_args == ["--kunserve", "--kunserve-layers=30"]


def test_a_dead_instance_is_started_again():
    """Issue 39: whoever started an instance starts it again when it dies:
    `ferry up` restarts a killed instance, and the cluster serves again."""
    port = free_port()
    proc = _ferry_up("--instances", "2", "--port", str(port))
    try:
        assert proc.stdout.readline().strip().endswith("/v1")
        instances = [c for c in _descendants(proc.pid) if "instance" in " ".join(c.cmdline())
                     and "--instance-id" in c.cmdline()]
        assert len(instances) == 2
        victim = instances[0]
        name = victim.cmdline()[victim.cmdline().index("--instance-id") + 1]
        victim.kill()
        t0 = time.monotonic()
        restarted = None
        while time.monotonic() - t0 < 60 and restarted is None:
            for c in _descendants(proc.pid):
                try:
                    cmd = c.cmdline()
                except psutil.NoSuchProcess:
                    continue
                if c.pid != victim.pid and "--instance-id" in cmd and cmd[cmd.index("--instance-id") + 1] == name:
                    restarted = c
            time.sleep(0.1)
        assert restarted is not None, "the killed instance was not started again"
        for _ in range(300):  # it registers again and the cluster is whole
            h = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()
            if h.get("serving") == 2:
                break
            time.sleep(0.1)
        assert h["serving"] == 2, h
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "again", "max_tokens": 4})
        assert r.json()["choices"][0]["text"] == expected_fake_text("again", 4)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        _, err = proc.communicate(timeout=10)
        assert f"{name} exited with code -9; restarting now" in err
    finally:
        if proc.poll() is None:
            proc.kill()
