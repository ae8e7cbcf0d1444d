"""``ferry bench handoff-modes``: what a prefill -> decode handoff (Splitwise) adds
to a request's time to its second token, against staying colocated, for
serialized (every block after the prompt) and per-layer (each layer's KV
while the prompt's later layers compute) transfer, at several prompt lengths.

Two native engines (the default model, shared weights) in this process, each
on its own engine thread, with the migration destination of the second
behind the in-process peer: the KV really moves (gathered or tapped on the
prefill engine, copied, scattered into the decode engine's reserved blocks);
no gRPC, so the numbers are the handoff's own cost on this machine, not the
network's. One request at a time, max_tokens 2: its first token comes from
the prefill engine, its second from the decode engine (colocated: both from
the prefill engine). Every repeat runs the three modes back to back (the
order rotates), and ``added`` is the median over repeats of the paired
difference in time to the second token; ``pct`` divides it by the colocated
TTFT. ``ttft_delta`` shows how much streaming slowed the prompt itself.
The greedy tokens of the three modes must agree (``tokens_match``).

The crossover is the shortest prompt from which per-layer adds less than
serialized: the threshold for libs.common.policies.phases.handoff_mode.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time

import click

from ferry.bench.harness import bench_command, int_list, median, median_of

MODES = ("colocated", "serialized", "per_layer")


class _Meter:
    """What the transfer costs while the prompt computes, measured where it
    happens (a loaded machine makes differences of whole runs useless):
    the tap's copies on the prefill engine's thread (the prompt waits for
    them) and the destination's scatters (they compete with the prompt for
    the cores; their wall time, which over-counts on a loaded machine)."""

    def __init__(self, a, b):
        self.emit_s = self.scatter_s = 0.0
        ex = a.engine.executor
        emit = ex._emit_layer

        def timed_emit(tapped, layer):
            t = time.perf_counter()
            emit(tapped, layer)
            self.emit_s += time.perf_counter() - t

        ex._emit_layer = timed_emit
        for name in ("scatter_kv", "scatter_kv_layer"):
            setattr(b.engine, name, self._timed(getattr(b.engine, name)))

    def _timed(self, fn):
        def timed(*args):
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.scatter_s += time.perf_counter() - t

        return timed

    def reset(self) -> None:
        self.emit_s = self.scatter_s = 0.0


async def _one(cluster, mode: str, rid: str, prompt: list[int], meter: _Meter) -> dict:
    """Run one request; times from submission (seconds). A handoff is the
    one production runs: planned and added as the agent adds a request the
    scheduler gave a decode instance (Handoffs.plan / add; the mode forced by
    the per-layer threshold: 1 for per-layer, 0 for serialized, i.e.
    SourceMigration(handoff=True) at the first token). Its client follows the
    handoff with the frontend's loop (ferry/inprocess.py's Client)."""
    from libs.common.types import SamplingParams
    from services.instance.engine.base import EngineRequest
    from ferry.inprocess import Client

    a = cluster.nodes["a"]
    req = EngineRequest(rid, tuple(prompt), SamplingParams(max_tokens=2, ignore_eos=True), 0, time.time())
    a.streams.open(rid)
    meter.reset()
    t0, loop0 = time.perf_counter(), time.thread_time()
    started: list[asyncio.Task] = []
    if mode == "colocated":
        await a.runner.call(a.engine.add_request, req)
    else:
        handoffs = a.manager.handoffs
        handoffs.per_layer_threshold = 1 if mode == "per_layer" else 0
        handoffs.on_start = lambda _rid, task: started.append(task)
        plan = handoffs.plan(rid, "b", "b", len(prompt))
        if plan.mode.value != mode:
            raise click.ClickException(f"the engine cannot hand off {mode}: planned {plan.mode.value}")
        await handoffs.add(req, plan)
    client = Client(cluster, rid)
    tokens = await client.follow("a")
    times = [t - t0 for t in client.times]
    row = {"ttft_s": times[0], "t2_s": times[1], "tokens": tokens,
           # this (event loop) thread: chunks made and copied, the client
           "loop_cpu_ms": (time.thread_time() - loop0) * 1000,
           "emit_ms": meter.emit_s * 1000, "scatter_ms": meter.scatter_s * 1000}
    if mode != "colocated":
        if not started:
            raise click.ClickException(f"the {mode} handoff of {len(prompt)} tokens did not start")
        out = await started[0]
        if not out.committed:
            raise click.ClickException(f"{mode} handoff of {len(prompt)} tokens aborted: {out.reason}")
        # downtime: suspended after the prompt -> its first step at b begins
        row.update(exposed_ms=out.commit_ack_ms, downtime_ms=out.downtime_ms, mb=out.bytes / 2**20)
    for n in cluster.nodes.values():
        await n.check_clean(timeout_s=60)
    return row


async def _bench(lengths: list[int], repeats: int, dtype: str, budget: int, model: str) -> dict:
    import random

    from services.instance.engine import create_engine
    from services.instance.engine.base import EngineConfig
    from services.instance.migration import MigrationConfig
    from ferry.inprocess import Cluster

    max_len = max(lengths) + 64
    blocks = -(-max_len // 16) * 2 + 8

    def engine():
        return create_engine(EngineConfig(engine="native", model=model, num_blocks=blocks, block_size=16,
                                          max_model_len=max_len, dtype=dtype, max_num_batched_tokens=budget,
                                          extra={"share_weights": True}))

    cluster = Cluster()
    for name in "ab":
        cluster.add(name, engine(), MigrationConfig(deadline_ms=10_000, max_migrate_in=4))
    nodes = cluster.nodes
    vocab = nodes["a"].engine.vocab_size
    runs: dict[int, dict[str, list[dict]]] = {n: {m: [] for m in MODES} for n in lengths}
    try:
        meter = _Meter(nodes["a"], nodes["b"])
        await _one(cluster, "per_layer", "warm", list(range(100, 100 + min(lengths))), meter)  # first-use costs
        for n in lengths:  # each prompt length's first run pays for new kernel shapes: not measured
            await _one(cluster, "colocated", f"warm-{n}", [random.Random(n).randrange(100, vocab) for _ in range(n)],
                       meter)
        for rep in range(repeats):
            for n in lengths:
                prompt = [random.Random(n * 1000 + rep + 1).randrange(100, vocab) for _ in range(n)]
                order = MODES[rep % 3:] + MODES[:rep % 3]
                for mode in order:
                    row = await _one(cluster, mode, f"{mode}-{n}-{rep}", prompt, meter)
                    runs[n][mode].append(row)
                    click.echo(f"  {n:>5} tokens  rep {rep}  {mode:<10}  ttft {row['ttft_s'] * 1000:8.1f} ms  "
                               f"2nd {row['t2_s'] * 1000:8.1f} ms  down {row.get('downtime_ms', 0):6.1f} ms  "
                               f"load {os.getloadavg()[0]:.1f}", err=True)
    finally:
        await cluster.stop()
    return {"runs": runs, "dtype": str(nodes["a"].engine.dtype).removeprefix("torch."),
            "model": nodes["a"].engine.model_name}


def summarize(runs: dict[int, dict[str, list[dict]]], threads: int) -> list[dict]:
    rows = []
    for n, by_mode in sorted(runs.items()):
        colo = by_mode["colocated"]
        row = {"prompt_tokens": n, "colocated_ttft_ms": median_of(colo, "ttft_s") * 1000,
               "colocated_t2_ms": median_of(colo, "t2_s") * 1000,
               "tokens_match": all(r["tokens"] == colo[i]["tokens"] for m in MODES for i, r in enumerate(by_mode[m]))}
        for mode in MODES[1:]:
            rs = by_mode[mode]
            added = [(r["t2_s"] - c["t2_s"]) * 1000 for r, c in zip(rs, colo)]
            post = median((r["t2_s"] - r["ttft_s"]) - (c["t2_s"] - c["ttft_s"]) for r, c in zip(rs, colo))
            med = functools.partial(median_of, rs)
            loop_extra = max(0.0, med("loop_cpu_ms") - median_of(colo, "loop_cpu_ms"))
            # The prompt's slowdown: the tap's copies (on its thread) and, for
            # per-layer, the scatters and chunk copies spread over the threads.
            # Serialized moves nothing during the prompt: its cost is all downtime.
            during = med("emit_ms") + ((med("scatter_ms") + loop_extra) / threads if mode == "per_layer" else 0)
            row[mode] = {"added_ms": median(added), "added_ms_all": [round(x, 2) for x in added],
                         "pct_of_ttft": median(added) / row["colocated_ttft_ms"] * 100,
                         "post_ms": post * 1000, "downtime_ms": med("downtime_ms"), "exposed_ms": med("exposed_ms"),
                         "emit_ms": med("emit_ms"), "scatter_ms": med("scatter_ms"),
                         "loop_cpu_extra_ms": loop_extra, "during_prompt_ms": during,
                         "est_added_ms": med("downtime_ms") + during, "mb": rs[0]["mb"]}
            row[mode]["est_pct_of_ttft"] = row[mode]["est_added_ms"] / row["colocated_ttft_ms"] * 100
        rows.append(row)
    return rows


def crossover(rows: list[dict], key: str = "est_added_ms") -> int | None:
    """The shortest measured prompt from which per-layer adds less than
    serialized (by ``key``) at that length and every longer one (None: never)."""
    best = None
    for row in reversed(rows):
        if row["per_layer"][key] < row["serialized"][key]:
            best = row["prompt_tokens"]
        else:
            break
    return best


def table(rows: list[dict]) -> str:
    cols = f"{'wall+ms':>8} {'%':>6} {'down':>6} {'during':>6} {'est+ms':>7} {'est%':>6}"
    head = f"{'prompt':>6} {'TTFT ms':>8} {'KV MB':>6} | serialized {cols} | per-layer  {cols} | same"
    lines = [("wall+ms: added to the 2nd token, paired median, and its % of the colocated TTFT; "
              "down: suspend -> 1st step at the decode engine; during: the prompt's slowdown from "
              "the stream; est = down + during"), head, "-" * len(head)]
    for r in rows:
        cells = []
        for m in ("serialized", "per_layer"):
            x = r[m]
            cells.append(f"{x['added_ms']:>8.1f} {x['pct_of_ttft']:>6.2f} {x['downtime_ms']:>6.1f} "
                         f"{x['during_prompt_ms']:>6.1f} {x['est_added_ms']:>7.1f} {x['est_pct_of_ttft']:>6.2f}")
        lines.append(f"{r['prompt_tokens']:>6} {r['colocated_ttft_ms']:>8.0f} {r['serialized']['mb']:>6.1f} | "
                     f"{'':>10} {cells[0]} | {'':>10} {cells[1]} | {'yes' if r['tokens_match'] else 'NO'}")
    return "\n".join(lines)


@bench_command(None, None, json_default="docs/results/handoff_modes.json")
@click.option("--lengths", default="256,1024,2048,4096", show_default=True, help="prompt lengths, comma-separated")
@click.option("--repeats", default=3, show_default=True, help="runs of each mode per length (median)")
@click.option("--dtype", default="auto", show_default=True, help="KV and weights dtype (auto: bf16 where fast)")
@click.option("--budget", default=2048, show_default=True, help="max_num_batched_tokens (prefill chunk)")
@click.option("--model", default="smollm2", show_default=True)
@click.option("--threads", default=0, show_default=True, help="torch threads (0: torch's default)")
def handoff_modes(lengths: str, repeats: int, dtype: str, budget: int, model: str, threads: int) -> dict:
    """TTFT-to-second-token added by a prefill->decode handoff, serialized vs per-layer."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    ns = int_list(lengths)
    load0 = os.getloadavg()[0]
    result = asyncio.run(_bench(ns, repeats, dtype, budget, model))
    load1 = os.getloadavg()[0]
    rows = summarize(result["runs"], torch.get_num_threads())
    click.echo(table(rows))
    cross, cross_wall = crossover(rows), crossover(rows, "added_ms")
    click.echo(f"crossover (per-layer adds less from here on): est {cross or 'none measured'}, "
               f"wall {cross_wall or 'none measured'} (prompt tokens)")
    doc = {"bench": "handoff-modes", "model": result["model"], "dtype": result["dtype"], "threads": torch.get_num_threads(),
           "budget": budget, "repeats": repeats, "transport": "in-process peer", "rows": rows,
           "crossover_prompt_tokens": cross, "crossover_prompt_tokens_wall": cross_wall, "load_average_before_after": [load0, load1],
           "command": f"ferry bench handoff-modes --lengths {lengths} --repeats {repeats} --dtype {dtype} "
                      f"--budget {budget}" + (f" --threads {threads}" if threads else "")}
    return doc
