"""Every service's serve(): health checking, a graceful stop on SIGTERM, and
the start-up heap frozen once serving."""

import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ferry.cluster import free_port, grpc_healthy


def test_service_reports_health_and_stops_gracefully_on_sigterm():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ferry", "serve", "meta-store", "--port", str(port)],
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not grpc_healthy(f"127.0.0.1:{port}"):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="ferry.v1.MetaStore"), timeout=2)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        proc.terminate()
        assert proc.wait(15) == 0
        err = proc.stderr.read()
        assert "stopping" in err and "stopped" in err
        # Once serving, the process froze its start-up heap (freeze_startup_heap), with objects in it.
        frozen = [line for line in err.splitlines() if "start-up heap frozen" in line]
        assert len(frozen) == 1 and int(frozen[0].split("objects=")[1].split()[0]) > 1000, frozen
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bad_flag_is_refused_with_a_clear_message():
    r = subprocess.run([sys.executable, "-m", "ferry", "serve", "scheduler", "--dispatch", "best"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "llumnix" in r.stderr and "round_robin" in r.stderr


@pytest.mark.parametrize("grpc_api", [False, True])
def test_frontend_exits_zero_on_sigterm(grpc_api):
    port = free_port()
    extra = ["--grpc-port", str(free_port())] if grpc_api else []
    proc = subprocess.Popen([sys.executable, "-m", "ferry", "serve", "frontend", "--model", "fake", "--port",
                             str(port), "--scheduler", f"127.0.0.1:{free_port()}",
                             "--meta-store", f"127.0.0.1:{free_port()}", *extra],
                            stderr=subprocess.PIPE, text=True)
    try:
        import httpx

        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5)
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
        t0 = time.monotonic()
        proc.terminate()
        assert proc.wait(15) == 0
        assert time.monotonic() - t0 < 5  # HTTP and gRPC both heard SIGTERM
        assert "frontend stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_free_port_is_bindable_and_outside_the_ephemeral_range():
    import socket

    from libs.common.procs import _PORT_RANGE

    for _ in range(20):
        port = free_port()
        assert _PORT_RANGE[0] <= port < _PORT_RANGE[1]  # not a port outgoing connections get
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_freezing_the_heap_leaves_only_new_objects_to_collect():
    code = ("import gc; from libs.common.server import freeze_startup_heap; "
            "kept = [[] for _ in range(5000)]; n = freeze_startup_heap(); "
            "assert n >= 5000 and gc.get_freeze_count() == n, n; "
            "assert sum(gc.get_count()) < 100; print(n)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr


def test_what_start_up_froze_is_freed_at_exit():
    """A frozen object in a reference cycle is freed at exit: the heap is
    thawed first. Frozen, the interpreter's last collection skipped it, and an
    extension counting its objects at teardown reported each as leaked
    (nanobind's in triton, which importing vLLM loads: ~600 lines from each
    instance that ran vLLM's kernels, at every stop)."""
    code = ("import sys; from libs.common.server import freeze_startup_heap\n"
            "class Node:\n"
            "    def __del__(self): sys.stdout.write('freed\\n'); sys.stdout.flush()\n"
            "a, b = Node(), Node(); a.other, b.other = b, a\n"
            "freeze_startup_heap(); del a, b\n")  # garbage once frozen: only a collection at exit frees it
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("freed") == 2, (r.stdout, r.stderr)
