"""``ferry bench vllm``: the same workload against ``ferry up --engine vllm``
(frontend, scheduler, meta store, vLLM instances) and against vLLM's own
OpenAI server, one after the other on this machine, with the same model and
the same vLLM engine arguments: TTFT, TPOT (time per output token after the
first), throughput. With ``--ferry-engine native`` the Ferry side is
``ferry up``'s default serving (native engine instances, threads split over
the cores) against the same vLLM server: Ferry's serving vs vLLM's serving.
TTFT is taken at the first chunk that carries generated text, on both sides. What differs is everything around the engine: Ferry's
processes and hops, and how each drives vLLM (Ferry: in-process engine core
stepped by the agent's engine thread, synchronous scheduling; vLLM's server:
engine core in its own process, its default scheduling)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time

import click
import httpx

from ferry.bench import client
from ferry.bench.harness import bench_command, fmt, seed_option, started
from ferry.measure import metrics
from ferry.measure import workload as wl
from ferry.cluster import ClusterSpec, free_port


def vllm_server(argv: list[str], served_name: str, log_path: str, timeout_s: float) -> tuple[subprocess.Popen, str]:
    """Start vLLM's OpenAI server; wait for /health. Returns (process, base URL)."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", served_name, *argv]
    log = open(log_path, "w")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise click.ClickException(f"vLLM's server exited with {proc.returncode} (log: {log_path})")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise click.ClickException(f"vLLM's server not ready after {timeout_s:.0f}s (log: {log_path})")


def run_one(url: str, work: wl.Workload, model: str | None, seed: int) -> dict:
    """The workload after a warm-up of four short requests."""
    for w in (wl.build("poisson:4", "fixed:16:4", 4, seed + 1), work):
        records = asyncio.run(client.replay(url, w, (1000, 32000), model=model, ferry_priority=model is None))
    s = metrics.summarize(records)
    return {"summary": s, "requests": [r.to_dict() for r in records]}


def table(runs: dict[str, dict]) -> str:
    f = fmt
    head = (f"{'':22}{'TTFT mean':>11}{'p50':>9}{'p99':>9}{'TPOT mean':>11}{'p50':>8}{'p99':>8}"
            f"{'req/s':>8}{'tok/s':>8}{'failed':>8}")
    lines = [head]
    for name, run in runs.items():
        s = run["summary"]
        t, d = s["ttft_ms"], s["decode_ms"]
        lines.append(f"{name:22}{f(t['mean']):>11}{f(t['p50']):>9}{f(t['p99']):>9}{f(d['mean'], 2):>11}"
                     f"{f(d['p50'], 2):>8}{f(d['p99'], 2):>8}{f(s['throughput_rps'], 2):>8}"
                     f"{f(s['output_tokens_per_s'], 0):>8}{s['failed']:>8}")
    return "\n".join(lines)


@bench_command("vllm")
@click.option("--model", default="smollm2", show_default=True, help="Ferry model name or HF directory")
@click.option("--rate", type=float, default=1.0, show_default=True, help="Poisson arrivals per second")
@click.option("--lengths", default="fixed:256:64", show_default=True, help="as `ferry bench serving --lengths`")
@click.option("--num-requests", "-n", type=click.IntRange(1), default=60, show_default=True)
@seed_option()
@click.option("--dtype", default="float32", show_default=True)
@click.option("--max-model-len", type=int, default=2048, show_default=True)
@click.option("--num-blocks", type=int, default=512, show_default=True)
@click.option("--max-num-seqs", type=int, default=32, show_default=True)
@click.option("--instances", type=click.IntRange(1, 8), default=1, show_default=True,
              help="Ferry's vLLM instances (vLLM's server is one engine)")
@click.option("--vllm-arg", "vllm_args", multiple=True, help="vLLM engine argument for both (repeatable), "
              "e.g. --vllm-arg=--enforce-eager")
@click.option("--ferry-engine", type=click.Choice(["vllm", "native"]), default="vllm", show_default=True,
              help="the engine of Ferry's instances (native: ferry up's default serving)")
@click.option("--only", type=click.Choice(["both", "ferry", "vllm"]), default="both", show_default=True)
@click.option("--startup-timeout-s", type=float, default=900, show_default=True)
def vllm_bench(model, rate, lengths, num_requests, seed, dtype, max_model_len, num_blocks, max_num_seqs, instances,
               vllm_args, ferry_engine, only, startup_timeout_s) -> dict:
    """Ferry over vLLM vs vLLM's own OpenAI server, same model, same rate."""
    from services.instance.engine.base import EngineConfig
    from services.instance.engine.vllm.args import default_block_size, engine_argv, resolve_model

    model_dir = resolve_model(model)
    cfg = EngineConfig(engine="vllm", model=model, num_blocks=num_blocks, block_size=default_block_size(),
                       max_num_seqs=max_num_seqs, max_model_len=max_model_len, dtype=dtype)
    argv = engine_argv(cfg, model_dir) + list(vllm_args)
    work = wl.build(f"poisson:{rate}", lengths, num_requests, seed, max_model_len=max_model_len)
    logs = tempfile.mkdtemp(prefix="ferry-bench-vllm-")
    runs: dict[str, dict] = {}
    if only in ("both", "ferry"):
        inst_args = ["--num-blocks", str(num_blocks), "--dtype", dtype, "--max-model-len", str(max_model_len),
                     "--max-num-seqs", str(max_num_seqs)]
        if ferry_engine == "vllm":
            inst_args.append(f"--vllm-args={' '.join(vllm_args)}")
        spec = ClusterSpec(instances=instances, engine=ferry_engine, model=model, port=free_port(),
                           instance_args=inst_args, log_dir=logs, log_level="warning",
                           frontend_args=["--priority-api-key", client.BENCH_API_KEY])
        with started(spec, timeout_s=startup_timeout_s) as c:
            runs[f"ferry {ferry_engine} ({instances} inst.)"] = run_one(c.url, work, None, seed)
    if only in ("both", "vllm"):
        proc, url = vllm_server(argv, model, os.path.join(logs, "vllm-server.log"), startup_timeout_s)
        try:
            runs["vllm serve"] = run_one(url, work, model, seed)
        finally:
            proc.terminate()
            proc.wait(60)
    click.echo(f"workload: poisson:{rate} {lengths} x{num_requests} (seed {seed}); vLLM args: {' '.join(argv)}")
    click.echo(table(runs))
    click.echo(f"logs: {logs}")
    return {"command": " ".join(sys.argv), "workload": work.describe(), "vllm_argv": argv,
            "ferry_engine": ferry_engine, "ferry_instances": instances, "loadavg": list(os.getloadavg()),
            "runs": {k: {"summary": v["summary"]} for k, v in runs.items()}}
