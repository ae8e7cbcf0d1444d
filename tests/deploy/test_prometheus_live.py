"""A real Prometheus (Debian's ``prometheus`` package; .ci/run installs it)
scrapes a `ferry up` cluster through the file_sd file `ferry up` writes,
while the cluster serves load meant to exercise every panel and alert:
requests sharing a prefix, long ones that fill the KV caches (queueing,
preemption, the scheduler's own migrations), requests that fail in the
engine (5xx), and an instance killed (down, its status going stale,
migrations to it aborting). Then every Grafana panel's query
(deploy/grafana/dashboards) and every alerting rule's expression
(deploy/prometheus/ferry-rules.yml) must return a finite value somewhere in
the run, and `promtool check rules` / `check config` pass.

Skipped, with the reason, where the prometheus binary is absent."""

from __future__ import annotations

import asyncio
import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from ferry import targets
from ferry.cluster import free_port
from ferry.dashboards import OUT as DASHBOARDS
from ferry.dashboards import panel_queries
from libs.common import rpc

ROOT = pathlib.Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "ferry-rules.yml"
prometheus = shutil.which("prometheus")
promtool = shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(prometheus is None or promtool is None,
                                      reason="prometheus/promtool not installed (Debian: apt-get install prometheus)")
POISON = 1  # a token id the instances' engines fail on (failpoint engine.poison_token)
# Grafana's template variables, as a dashboard with every instance selected sends them.
VARIABLES = {"$__rate_interval": "15s", "$instance_id": ".*"}


@needs_prometheus
def test_the_rules_pass_promtool():
    r = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 6 rules found" in r.stdout


@needs_prometheus
def test_promtool_catches_a_broken_rule(tmp_path):
    broken = yaml.safe_load(RULES.read_text())
    broken["groups"][0]["rules"][0]["expr"] = "up{job=ferry-instance} == 0"  # an unquoted label value
    path = tmp_path / "broken.yml"
    path.write_text(yaml.safe_dump(broken))
    assert subprocess.run([promtool, "check", "rules", str(path)], capture_output=True).returncode != 0


def _rule_expressions() -> dict[str, str]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r["expr"] for g in doc["groups"] for r in g["rules"]}


def _panel_expressions() -> dict[str, str]:
    out = {}
    for path in sorted(DASHBOARDS.glob("*.json")):
        for title, expr in panel_queries(json.loads(path.read_text())):
            for k, v in VARIABLES.items():
                expr = expr.replace(k, v)
            out[f"{path.stem} / {title} / {expr}"] = expr
    return out


def test_every_dashboard_and_rule_has_queries():
    assert len(_rule_expressions()) == 6
    panels = _panel_expressions()
    assert len({k.split(" / ")[0] for k in panels}) == 5 and len(panels) >= 40


# --------------------------------------------------------------------------- the live run
def _wait(what: str, ok, timeout_s: float = 60.0, every_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = ok()
            if got:
                return got
        except (httpx.HTTPError, OSError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every_s)


class Prom:
    def __init__(self, url: str):
        self.url = url

    def range(self, expr: str, start: float, end: float) -> list[dict]:
        r = httpx.get(f"{self.url}/api/v1/query_range",
                      params={"query": expr, "start": start, "end": end, "step": "1s"}, timeout=30)
        body = r.json()
        assert body.get("status") == "success", f"{expr}: {body}"
        return body["data"]["result"]

    def finite(self, expr: str, start: float, end: float) -> bool:
        return any(math.isfinite(float(v)) for s in self.range(expr, start, end) for _, v in s["values"])


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    if prometheus is None:
        pytest.skip("prometheus not installed (Debian: apt-get install prometheus)")
    tmp = tmp_path_factory.mktemp("prometheus-live")
    port = free_port()
    env = {**os.environ, "FERRY_CACHE_DIR": str(tmp / "cache"), "PYTHONUNBUFFERED": "1"}
    up = subprocess.Popen(
        [sys.executable, "-m", "ferry", "up", "--engine", "fake", "--instances", "3", "--port", str(port),
         "--no-restart", "--instance-arg=--token-delay-ms=20", "--instance-arg=--num-blocks=64",
         f"--instance-arg=--failpoints=engine.poison_token={POISON}",
         # the killed instance stays in the view: its status goes stale, migrations to it abort
         "--meta-store-arg=--ttl-s=120"],
        stdout=subprocess.PIPE, stderr=open(tmp / "up.log", "w"), text=True, env=env)
    prom = None
    try:
        assert up.stdout.readline().strip() == f"http://127.0.0.1:{port}/v1", (tmp / "up.log").read_text()
        state = tmp / "cache" / f"up-{port}"
        sd_file = state / "targets.json"
        log = (tmp / "up.log").read_text()
        assert f"Prometheus file_sd targets in {sd_file}" in log and "scheduler http://127.0.0.1:" in log
        config = targets.write_prometheus_config(tmp / "prometheus.yml", sd_file, interval_s=1.0, rules=RULES)
        r = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        web = free_port()
        prom = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{web}", "--log.level=warn"],
                                stdout=subprocess.DEVNULL, stderr=open(tmp / "prometheus.log", "w"))
        url = f"http://127.0.0.1:{web}"
        jobs = {g["labels"]["job"] for g in json.loads(sd_file.read_text())}
        assert jobs == set(targets.JOBS.values())

        def all_up():
            got = httpx.get(f"{url}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
            return len(got) == 6 and all(t["health"] == "up" for t in got)
        _wait("Prometheus to scrape all six processes", all_up)
        start = time.time()
        cluster = json.loads((state / "cluster.json").read_text())
        asyncio.run(_load(cluster, port, Prom(url), start))
        time.sleep(3)  # the last scrapes and evaluations
        yield Prom(url), start, time.time()
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(10)
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()


def _committed(prom: "Prom") -> tuple[float, float]:
    """Committed migrations so far, as the instances and as the scheduler's orders counted them."""
    def total(name: str) -> float:
        got = httpx.get(f"{prom.url}/api/v1/query", params={"query": f"sum({name})"}, timeout=10).json()
        return sum(float(r["value"][1]) for r in got["data"]["result"])
    return (total("ferry_migration_downtime_seconds_count"), total("ferry_scheduler_migration_downtime_seconds_count"))


MIXED = [300 if i % 3 == 0 else 40 for i in range(12)]  # the short ones leave the instances unequal
LONG = [300] * 12  # four a 64-block instance: they outgrow it together, and some wait while it is full


async def _load_until(what: str, done, complete, lengths: list[int] = MIXED, waves: int = 4) -> None:
    """When the scheduler migrates, or an instance's KV cache is full while requests wait there, depends
    on how the requests' ends fall, so on the machine's speed: waves of requests of ``lengths`` until
    ``done()`` holds, a few waves at most."""
    for wave in range(waves):
        await asyncio.sleep(2)  # the last scrape
        if done():
            return
        got = await asyncio.gather(*[complete("z" * 380 + f"{what[:3]}{wave}-{i}", n) for i, n in enumerate(lengths)])
        assert got == [200] * len(lengths), got
    await asyncio.sleep(2)
    assert done(), f"not seen after {waves} waves of load: {what}"


async def _load(cluster: dict, port: int, prom: "Prom", start: float) -> None:
    base = f"http://127.0.0.1:{port}"
    creds = rpc.Credentials(token=pathlib.Path(cluster["token_file"]).read_text().strip())
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        async def complete(prompt, max_tokens: int) -> int:
            r = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens})
            return r.status_code

        shared = "You are a helpful assistant who answers briefly and well. " * 2
        # Short requests sharing a prefix (cache hits), long ones filling the KV caches (64 blocks of 16
        # tokens each: queueing, preemption, and the imbalance the scheduler migrates away), and a few the
        # engines fail on (resumed once elsewhere, then a 500).
        # NOTE: a counter series born with its first increments has no rate until it grows again: the
        # failing requests come in two waves, seconds apart.
        async def failing() -> list[int]:
            first = await asyncio.gather(*[complete([POISON, 2, 3], 8) for _ in range(2)])
            await asyncio.sleep(3)
            return first + list(await asyncio.gather(*[complete([POISON, 2, 3], 8) for _ in range(8)]))
        work = [complete(shared + f"question {i}", 24) for i in range(60)]
        work += [complete("x" * 380 + str(i), 300) for i in range(12)]
        statuses = await asyncio.gather(failing(), *work)
        assert statuses[0] == [500] * 10 and statuses[1:] == [200] * 72, statuses
        await _load_until("a committed migration counted by the instances and by the scheduler",
                          lambda: all(_committed(prom)), complete)
        exhausted = _rule_expressions()["FerryKvCacheExhausted"]
        await _load_until("an instance's KV cache full while requests wait there",
                          lambda: prom.finite(exhausted, start, time.time()), complete, LONG)
        # An instance killed: it stays in the view (long TTL), so migrations ordered to it abort, its
        # scrape fails and its status ages; dispatches to it resume elsewhere.
        await _kill_and_migrate_to_it(http, creds, cluster)


def _kill_listener(address: str) -> None:
    """SIGKILL the process listening at ``address`` (`ferry up --no-restart` leaves it dead)."""
    import psutil

    port = int(address.rsplit(":", 1)[1])
    os.kill(next(c.pid for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port),
            signal.SIGKILL)


async def _kill_and_migrate_to_it(http, creds, cluster: dict) -> None:
    from libs.pb import instance_pb2 as ipb
    from libs.pb import instance_pb2_grpc as ipb_grpc
    from libs.pb import scheduler_pb2 as spb
    from libs.pb import scheduler_pb2_grpc as spb_grpc

    async with rpc.channel(cluster["scheduler"], creds) as ch:
        view = await spb_grpc.SchedulerStub(ch).GetClusterView(spb.ClusterViewRequest(), timeout=5)
    addr = {r.info.instance_id: r.info.address for r in view.instances}
    _kill_listener(addr["instance-2"])
    long = [asyncio.create_task(http.post("/v1/completions", json={"prompt": "y" * 300 + str(i), "max_tokens": 200}))
            for i in range(4)]
    aborted = 0
    deadline = time.monotonic() + 30
    while aborted < 8 and time.monotonic() < deadline:
        for iid in ("instance-0", "instance-1"):
            async with rpc.channel(addr[iid], creds) as ch:
                stub = ipb_grpc.InstanceStub(ch)
                status = await stub.GetStatus(ipb.GetStatusRequest(), timeout=5)
                for req in status.requests[:1]:
                    try:
                        reply = await stub.MigrateOut(ipb.MigrateOutRequest(
                            request_id=req.request_id, dest_instance_id="instance-2",
                            dest_address=addr["instance-2"]), timeout=20)
                        aborted += reply.aborted
                    except Exception:  # noqa: BLE001 - busy migrating: try again
                        pass
        await asyncio.sleep(0.2)
    assert aborted >= 8, f"only {aborted} migrations to the killed instance aborted"
    await asyncio.sleep(4)  # the killed instance's report ages past the rule's 2 s
    assert [r.status_code for r in await asyncio.gather(*long)] == [200] * 4
    # The scheduler killed: the frontend dispatches by itself (bypass).
    _kill_listener(cluster["scheduler"])
    got = await asyncio.gather(*[http.post("/v1/completions", json={"prompt": f"bypass {i}", "max_tokens": 8})
                                 for i in range(10)])
    assert [r.status_code for r in got] == [200] * 10, [(r.status_code, r.text[:300]) for r in got]
    await asyncio.sleep(3)


@needs_prometheus
def test_every_alert_expression_returns_data(live):
    prom, start, end = live
    empty = [name for name, expr in _rule_expressions().items() if not prom.finite(expr, start, end)]
    assert empty == [], f"alert expressions that never returned a value: {empty}"


@needs_prometheus
def test_every_dashboard_panel_returns_data(live):
    prom, start, end = live
    empty = [name for name, expr in _panel_expressions().items() if not prom.finite(expr, start, end)]
    assert empty == [], "panel queries without a finite value:\n" + "\n".join(empty)


@needs_prometheus
def test_a_query_of_a_metric_nobody_exports_returns_nothing(live):
    """The check above can fail: a name no process exports has no data."""
    prom, start, end = live
    assert not prom.finite("vllm:no_such_metric", start, end)
    assert not prom.finite(f"histogram_quantile(0.5, sum by (le) (rate(nope_bucket[{VARIABLES['$__rate_interval']}])))",
                           start, end)

