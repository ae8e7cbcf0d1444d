"""`ferry top`: the scheduler's view of a running cluster, drawn with rich;
one frame rendered from a real fake-engine cluster under load, and the
frame's arithmetic on a view made here."""

from __future__ import annotations

import threading
import time

import httpx
from click.testing import CliRunner
from rich.console import Console

from ferry.top import Frame, render, top
from libs.common.types import InstanceInfo, InstanceRecord, InstanceStatus, Role


def _text(renderable) -> str:
    console = Console(width=140, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def _row(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if line.strip().startswith(name))


def test_a_frame_shows_each_instance_and_the_totals():
    now = 1000.0
    recs = (InstanceRecord(InstanceInfo("i-a", "a:1", "fake", "m", 16, 100, 2048),
                           InstanceStatus("i-a", timestamp=now - 0.2, total_blocks=100, free_blocks=10, num_running=3,
                                          num_waiting=2, freeness=3.3, migrating_out=1)),
            InstanceRecord(InstanceInfo("i-b", "b:1", "fake", "m", 16, 100, 2048),
                           InstanceStatus("i-b", timestamp=now - 5.0, total_blocks=100, free_blocks=100,
                                          terminating=True, migrating_in=1, role=Role.DECODE)),
            InstanceRecord(InstanceInfo("i-c", "c:1", "fake", "m", 16, 100, 2048)))
    text = _text(render(Frame(now, "llumnix", 12, recs), Frame(now - 2, "llumnix", 8, recs[:1])))
    assert "policy llumnix" in text and "instances 3" in text and "running 3" in text and "waiting 2" in text
    assert "KV 90/200 blocks" in text and "migrating 1" in text and "orders 12 (2.0/s)" in text
    row_a = _row(text, "i-a")
    assert "serving" in row_a and "90.0%" in row_a and "3.3" in row_a and "0.2s" in row_a
    row_b = _row(text, "i-b")
    assert "decode" in row_b and "terminating" in row_b and "0.0%" in row_b and "5.0s" in row_b
    assert "no report yet" in _row(text, "i-c")


def test_top_once_against_a_loaded_cluster(fake_cluster, tmp_path):
    stop = threading.Event()

    def load():
        with httpx.Client(base_url=fake_cluster.url, timeout=30) as http:
            while not stop.is_set():
                http.post("/v1/completions", json={"prompt": "top " * 20, "max_tokens": 40})

    workers = [threading.Thread(target=load) for _ in range(4)]
    for w in workers:
        w.start()
    try:
        time.sleep(1.0)
        svg = tmp_path / "top.svg"
        r = CliRunner().invoke(top, ["--scheduler", fake_cluster.scheduler, "--svg", str(svg), "--interval", "0.5"])
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert any(line.startswith("ferry top") and "policy llumnix" in line and "instances 2" in line for line in lines)
    assert sum(line.strip().startswith("instance-") and "serving" in line for line in lines) == 2
    assert svg.read_text().startswith("<svg")


def test_top_without_a_cluster_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("FERRY_CACHE_DIR", str(tmp_path))
    r = CliRunner().invoke(top, ["--port", "1", "--once"])
    assert r.exit_code != 0 and "no `ferry up` on port 1" in r.output
