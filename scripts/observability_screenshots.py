"""The screenshots of docs/observability.md: a fake-engine `ferry up`
cluster under a mixed load (shared prefixes, long requests that fill the KV
caches and make the scheduler migrate, a few that fail), a local Prometheus
over its file_sd targets, then `ferry top --svg` mid-run and every dashboard's
panels plotted from Prometheus (`ferry dashboards --render`). Needs the
prometheus binary. Run from the repository root:

    python -m scripts.observability_screenshots docs/images
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from ferry import targets
from ferry.cluster import free_port
from ferry.dashboard_render import render_all


async def _load(url: str, seconds: float) -> None:
    rng = random.Random(7)
    shared = "You are a helpful assistant who answers briefly and well. " * 2
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        tasks = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            r = rng.random()
            if r < 0.75:
                body = {"prompt": shared + f"question {rng.randrange(10**6)}", "max_tokens": rng.randrange(8, 48)}
            elif r < 0.97:
                body = {"prompt": "x" * rng.randrange(200, 400) + str(rng.random()), "max_tokens": rng.randrange(100, 300)}
            else:
                body = {"prompt": [1, 2, 3], "max_tokens": 4}  # the engines fail on token 1 (failpoint): a 500
            tasks.append(asyncio.create_task(http.post("/v1/completions", json=body)))
            await asyncio.sleep(rng.expovariate(8.0))
        await asyncio.gather(*tasks, return_exceptions=True)


def main(out: pathlib.Path, seconds: float = 120.0) -> None:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="ferry-shots-"))
    port = free_port()
    env = {**os.environ, "FERRY_CACHE_DIR": str(tmp / "cache")}
    up = subprocess.Popen([sys.executable, "-m", "ferry", "up", "--engine", "fake", "--instances", "3", "--port",
                           str(port), "--instance-arg=--token-delay-ms=20", "--instance-arg=--num-blocks=96",
                           "--instance-arg=--failpoints=engine.poison_token=1"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    prom = None
    try:
        url = up.stdout.readline().strip().removesuffix("/v1")
        state = tmp / "cache" / f"up-{port}"
        config = targets.write_prometheus_config(tmp / "prometheus.yml", state / "targets.json", interval_s=1.0)
        web = free_port()
        prom = subprocess.Popen([shutil.which("prometheus"), f"--config.file={config}",
                                 f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(3)
        start = time.time()
        loader = subprocess.Popen([sys.executable, "-c", f"import asyncio, sys; sys.path.insert(0, '.'); "
                                   f"from scripts.observability_screenshots import _load; "
                                   f"asyncio.run(_load({url!r}, {seconds}))"])
        time.sleep(seconds * 0.6)
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "ferry", "top", "--port", str(port), "--svg", str(out / "ferry-top.svg")],
                       env=env, check=True)
        loader.wait()
        time.sleep(5)
        for path in render_all(f"http://127.0.0.1:{web}", start, time.time(), out):
            print(f"wrote {path}")
    finally:
        if prom is not None:
            prom.terminate()
        up.send_signal(signal.SIGTERM)
        up.wait(60)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else pathlib.Path("docs/images"))
