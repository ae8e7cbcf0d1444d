"""``ferry bench rolling-update``: what a Kubernetes rolling update does to
the instances (deploy/k8s: one pod at a time, SIGTERM, the pod replaced
once it is gone), with ``ferry`` processes under streaming load: each
instance in turn gets SIGTERM, exits, and is started again before the next.

Counts streams cut (a request that failed or came back wrong), requests
resumed by recompute (the frontend's ``resumes``: tokens computed again) and
migrations. The target of issue 43: 0 cut, 0 recomputed, which needs an
instance that drains its requests by live migration on SIGTERM (issue 39);
until then SIGTERM ends its streams and the frontend resumes them elsewhere."""

from __future__ import annotations

import asyncio
import random
import signal
import tempfile
import time

import click
import httpx

from ferry.bench.chaos import Stats, _account, _leaks, _stream
from ferry.bench.sse import StreamError
from ferry.cluster import ClusterSpec, LocalCluster, free_port


def _write_json(path: str, obj: dict) -> None:
    try:
        from ferry.machine import write_json
    except ImportError:  # a tree without ferry/machine.py
        from ferry.bench.serving import write_json
    write_json(path, obj)


async def run_rolling(instances: int = 3, concurrency: int = 6, rounds: int = 1, settle_s: float = 3.0,
                      stop_timeout_s: float = 60.0, seed: int = 0, log_dir: str | None = None) -> dict:
    log_dir = log_dir or tempfile.mkdtemp(prefix="ferry-rolling-")
    spec = ClusterSpec(instances=instances, engine="fake", port=free_port(), log_dir=log_dir,
                       instance_args=["--token-delay-ms", "20", "--num-blocks", "512"],
                       frontend_args=["--max-resumes", "6"])
    cluster = LocalCluster(spec)
    await asyncio.to_thread(cluster.start, 120)
    stats = Stats()
    stop = asyncio.Event()
    steps: list[dict] = []
    try:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=300) as http:
            async def client(k: int) -> None:
                i = 0
                rng = random.Random(seed * 1000 + k)
                while not stop.is_set():
                    prompt, n = f"rolling {k} {i} " * rng.randint(1, 3), rng.randint(100, 300)
                    i += 1
                    stats.requests += 1
                    try:
                        text, final = await _stream(http, prompt, n)
                    except Exception as e:  # noqa: BLE001 - every failure is counted by kind
                        stats.lost += 1
                        stats.errors_by_kind[e.kind if isinstance(e, StreamError) else type(e).__name__] += 1
                        continue
                    _account(stats, prompt, n, text, final)

            tasks = [asyncio.create_task(client(k)) for k in range(concurrency)]
            t0 = time.monotonic()
            await asyncio.sleep(settle_s)
            for _ in range(rounds):
                for inst in list(cluster.instances()):
                    before = (stats.lost, stats.resumes, stats.migrations)
                    t = time.monotonic()
                    inst.proc.send_signal(signal.SIGTERM)
                    try:
                        code = await asyncio.to_thread(inst.proc.wait, stop_timeout_s)
                    except Exception:  # noqa: BLE001 - past the grace period: killed, as Kubernetes does
                        inst.proc.kill()
                        code = await asyncio.to_thread(inst.proc.wait, 10)
                    exited = time.monotonic() - t
                    await asyncio.to_thread(cluster.restart, inst.name)
                    await asyncio.sleep(settle_s)  # requests of this step end before counting
                    steps.append({"instance": inst.name, "at_s": round(t - t0, 2), "exit_code": code,
                                  "stop_s": round(exited, 2), "lost": stats.lost - before[0],
                                  "resumes": stats.resumes - before[1], "migrations": stats.migrations - before[2]})
                    print(f"  {inst.name}: SIGTERM -> exit {code} after {exited:.2f}s; lost "
                          f"{steps[-1]['lost']}, resumed {steps[-1]['resumes']}, migrated {steps[-1]['migrations']}",
                          flush=True)
            stop.set()
            await asyncio.gather(*tasks)
            leaked, integrity_errors, _ = await _leaks(cluster)
    finally:
        await asyncio.to_thread(cluster.stop)
    return {"instances": instances, "concurrency": concurrency, "rounds": rounds, "requests": stats.requests,
            "completed": stats.completed, "lost": stats.lost, "duplicated_tokens": stats.duplicated_tokens,
            "resumed_by_recompute": stats.resumes, "migrations": stats.migrations, "leaked_blocks": leaked,
            "integrity_errors": integrity_errors, "errors_by_kind": dict(stats.errors_by_kind), "steps": steps,
            "log_dir": log_dir}


@click.command("rolling-update")
@click.option("--instances", type=int, default=3, show_default=True)
@click.option("--concurrency", type=int, default=6, show_default=True, help="concurrent client streams")
@click.option("--rounds", type=int, default=1, show_default=True, help="times every instance is replaced")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default="docs/results/rolling_update.json",
              show_default=True)
def rolling_update(instances, concurrency, rounds, json_path) -> None:
    """SIGTERM to each instance in turn under streaming load (a rolling update): streams cut, tokens recomputed."""
    res = asyncio.run(run_rolling(instances, concurrency, rounds))
    print(f"\nrolling update: {res['requests']} requests, {res['completed']} completed, {res['lost']} cut, "
          f"{res['duplicated_tokens']} duplicated tokens, {res['resumed_by_recompute']} resumed by recompute, "
          f"{res['migrations']} migrations, {res['leaked_blocks']} leaked blocks")
    if json_path:
        _write_json(json_path, res)
        print(f"wrote {json_path}")
