"""A replicated control plane on a real etcd (`ferry up --etcd`): two meta
stores and two schedulers; the leader scheduler killed, the standby takes
over with what the leader launched (the instance keeps running, adopted);
a meta-store replica killed, the cluster goes on; `ferry up --etcd` stops
everything, launched instances included."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from ferry.cluster import ClusterSpec, LocalCluster, free_port
from ferry.etcd_local import binary
from libs.pb import meta_store_pb2 as mpb
from libs.pb import meta_store_pb2_grpc as mpb_grpc
from libs.common import etcd as etcdlib
from libs.common import rpc
from tests.helpers import expected_fake_text

pytestmark = pytest.mark.skipif(binary() is None, reason="no etcd binary on PATH (apt-get install etcd-server)")


def leader(cluster: LocalCluster) -> str | None:
    async def read():
        c = etcdlib.client(cluster.etcd_endpoints)
        try:
            got = await c.get(etcdlib.Keys().leader)
            return got.value.decode().split()[0] if got else None
        finally:
            await c.close()
    return asyncio.run(read())


def instance_ids(cluster: LocalCluster, replica: int = 0) -> set[str]:
    with rpc.sync_channel(f"127.0.0.1:{cluster.meta_store_ports[replica]}", cluster.credentials) as ch:
        return {r.info.instance_id for r in mpb_grpc.MetaStoreStub(ch).List(mpb.ListRequest(), timeout=2).instances}


def wait_for(cond, timeout_s: float, what: str):
    t0 = time.monotonic()
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() - t0 < timeout_s, f"{what}: not after {timeout_s} s"
        time.sleep(0.05)


def _three(ids: set[str]) -> set[str] | None:
    return ids if len(ids) == 3 else None


def _other(now: str | None, old: str) -> str | None:
    return now if now not in (None, old) else None


def complete(cluster: LocalCluster, prompt: str) -> None:
    r = httpx.post(f"{cluster.url}/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected_fake_text(prompt, 4)


@pytest.fixture
def cluster(tmp_path):
    spec = ClusterSpec(instances=2, engine="fake", port=free_port(), etcd=True, launcher=True,
                       log_dir=str(tmp_path / "logs"),
                       scheduler_args=["--autoscale", "--min-instances", "3", "--max-instances", "3",
                                       "--autoscale-interval-s", "0.2"],
                       meta_store_args=["--ttl-s", "4"])  # 2 s expired under CI load 13
    c = LocalCluster(spec)
    c.start(timeout_s=60)
    yield c
    c.stop()


def test_the_standby_takes_over_the_leaders_launched_instance(cluster, tmp_path):
    # The leader launches a third instance (min 3) as a process that outlives it.
    assert leader(cluster) in ("scheduler", "scheduler-1")
    ids = wait_for(lambda: _three(instance_ids(cluster)), 30, "the launched instance")
    launched = (ids - {"instance-0", "instance-1"}).pop()
    pids = cluster.launched_pids()
    assert len(pids) == 1
    old = leader(cluster)
    cluster.kill(old)  # SIGKILL: no resignation, its lease runs out
    t0 = time.monotonic()
    new = wait_for(lambda: _other(leader(cluster), old), 10, "a new leader")
    took = time.monotonic() - t0
    assert took < 5, took
    complete(cluster, "during a takeover")
    # The launched instance still runs, is still registered, and the new leader adopted it.
    assert psutil.pid_exists(pids[0]) and psutil.Process(pids[0]).status() != psutil.STATUS_ZOMBIE
    log = (tmp_path / "logs" / f"{new}.log")
    wait_for(lambda: "instance adopted" in log.read_text() and launched in log.read_text(), 10, "adoption")
    time.sleep(1.0)  # nothing more launched: it counts the adopted one
    assert instance_ids(cluster) == ids
    assert cluster.launched_pids() == pids


def test_a_meta_store_replica_dies_and_the_cluster_goes_on(cluster):
    wait_for(lambda: len(instance_ids(cluster, 1)) == 3, 30, "three instances")
    cluster.kill("meta-store")  # the replica everyone uses first
    for i in range(10):
        complete(cluster, f"after the kill {i}")
    time.sleep(4.5)  # longer than the TTL: instances kept their leases through the other replica
    assert len(instance_ids(cluster, 1)) == 3
    cluster.restart("meta-store")
    wait_for(lambda: len(instance_ids(cluster, 0)) == 3, 10, "the restarted replica learns every instance")


def test_ferry_up_etcd_stops_everything():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ferry", "up", "--engine", "fake", "--etcd", "--instances", "1",
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout.readline().strip() == f"http://127.0.0.1:{port}/v1"
        children = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert names.count("serve meta-store") == 2 and names.count("serve scheduler") == 2
        assert any(os.path.basename(c.cmdline()[0]) == "etcd" for c in children)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hey", "max_tokens": 3})
        assert r.json()["choices"][0]["text"] == expected_fake_text("hey", 3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        _, alive = psutil.wait_procs(children, timeout=10)
        assert alive == []
    finally:
        if proc.poll() is None:
            proc.kill()
