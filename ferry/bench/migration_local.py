"""``ferry bench migration-local``: live migration between two native engines
in this process (ferry/inprocess.py), on any device: the
migration's own costs, with no gRPC, frontend or second process.

Made for a GPU (``--device cuda --model llama-3.1-8b``, random weights): the
two engines share one copy of the weights, each runs on its own engine
thread with ``--background`` requests decoding, and a request of each length
is migrated from ``a`` to ``b`` after ``--at-token`` tokens. On CUDA each run
is repeated with the KV copies through pinned buffers on a side stream
(``staged``, kv_staging.py) and through the plain path (``plain``: the
engine's stream and pageable memory), alternating, so that both see the same
machine. Reported per length and transfer, medians over the runs:

- downtime: suspend -> the request's first step on the destination; ack:
  suspend -> commit acknowledged;
- stall: the client's largest inter-token gap across the migration minus
  its normal one (``client_stall`` of ``ferry bench migration``);
- the source's background decode step during the migration against the
  same request decoding there without one (the reference run): slowdown;
- copy GB/s: the migration's bytes over its duration (pacing included);
- tokens identical to the reference run (greedy).

Python threads share one interpreter here: two engines whose steps are
launch-bound on a GPU slow each other down more than two processes would.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import click

from ferry.bench import harness
from ferry.bench.harness import cells, int_list, json_option, median_of
from ferry.bench.migration import client_stall, switch_point
from ferry.machine import write_json


class _Background(harness.Background):
    """``n`` requests decoding on one node (ferry/inprocess.py's Client), each re-issued when it ends."""

    def __init__(self, cluster, node: str, n: int, prompt_len: int, tokens: int, vocab: int):
        super().__init__(n)
        self.cluster, self.node = cluster, node
        self.prompt_len, self.tokens, self.vocab = prompt_len, tokens, vocab
        self._count = 0

    async def _slot(self, i: int) -> None:
        from ferry.inprocess import Client

        rng = random.Random(i)
        while True:
            self._count += 1
            c = Client(self.cluster, f"bg-{self.node}-{i}-{self._count}")
            task = asyncio.create_task(c.run(self.node, [rng.randrange(3, self.vocab) for _ in range(self.prompt_len)],
                                             self.tokens))
            if i == 0:
                seen = 0
                if self.times:
                    self.times.append(None)
                while not task.done():
                    self.times.extend(c.times[seen:])
                    seen = len(c.times)
                    await asyncio.sleep(0.001)
                self.times.extend(c.times[seen:])
            await task


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


async def _one(cluster, bgs, prompt, out_tokens, at_token, rid, blocking=False) -> dict:
    from ferry.inprocess import Client

    cl = Client(cluster, rid)
    task = asyncio.create_task(cl.run("a", prompt, out_tokens))
    while len(cl.tokens) < at_token:
        if task.done():
            await task
            raise RuntimeError(f"{rid} ended after {len(cl.tokens)} tokens, before token {at_token}")
        await asyncio.sleep(0.001)
    t0 = time.perf_counter()
    res = await cluster.nodes["a"].manager.migrate_one(rid, "b", "b", blocking=blocking)
    t1 = time.perf_counter()
    tokens = await task
    _, parts, through = switch_point(cl.times, res)
    stall, itl = client_stall(cl.times, t0, t1, through)
    return {"committed": res.committed, "reason": res.reason, "downtime_ms": res.downtime_ms or None,
            "commit_ack_ms": res.commit_ack_ms, "total_ms": res.duration_ms, "stages": res.stages,
            "bytes": res.bytes, "copy_gbps": (res.bytes / res.duration_ms / 1e6) if res.duration_ms else None,
            "stall_ms": stall, "itl_ms": itl, "breakdown": parts, "tokens": tokens, "path": cl.path,
            "step_ms_during": bgs["a"].step_ms(t0, t1), "dest_step_ms": bgs["b"].step_ms(t0 - 2, t1 + 2)}


async def _length(cluster, bgs, length, runs, out_tokens, at_token, vocab, modes, set_mode) -> dict:
    from ferry.inprocess import Client

    rng = random.Random(length)
    prompt = [rng.randrange(3, vocab) for _ in range(length)]
    ref = Client(cluster, f"ref-{length}")
    want = await ref.run("a", prompt, out_tokens)
    # The same request again without a migration: in bf16 on a GPU, a batch of other requests can change
    # the rounding (kernels chosen by batch shape), and a greedy token can flip with no migration at all.
    control = await Client(cluster, f"ctl-{length}").run("a", prompt, out_tokens)
    t_ref = ref.times[at_token] if len(ref.times) > at_token else ref.times[0]
    baseline = bgs["a"].step_ms(t_ref, ref.times[-1])
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    for k in range(runs):
        for mode in (modes if k % 2 == 0 else modes[::-1]):  # alternate who goes first
            set_mode(mode)
            r = await _one(cluster, bgs, prompt, out_tokens, at_token, f"r-{length}-{mode}-{k}")
            tokens = r.pop("tokens")
            r["tokens_match"] = tokens == want and r["path"] == ["a", "b"]
            r["first_diff"] = _first_diff(tokens, want)  # the first token unlike the reference's (None: same)
            rows[mode].append(r)
    out = {"reference_step_ms": baseline, "control_match": control == want,
           "control_first_diff": _first_diff(control, want), "at_token": at_token, "by_transfer": {}}
    for i, mode in enumerate(modes):
        set_mode(mode)
        blk = {"downtime_ms": None, "stall_ms": None, "tokens_match": True}
        if i == 0:  # the blocking baseline once (with the first transfer): it is the same suspend-then-copy
            blk = await _one(cluster, bgs, prompt, out_tokens, at_token, f"blk-{length}-{mode}", blocking=True)
            blk["tokens_match"] = blk.pop("tokens") == want
        ok = [r for r in rows[mode] if r["committed"]]
        during = median_of(ok, "step_ms_during")
        out["by_transfer"][mode] = {
            **{k: median_of(ok, k) for k in ("downtime_ms", "commit_ack_ms", "stall_ms", "itl_ms", "total_ms",
                                                      "copy_gbps", "bytes", "stages")},
            "step_ms_during": during, "dest_step_ms": median_of(ok, "dest_step_ms"),
            "slowdown": (during / baseline - 1) if during and baseline else None,
            "tokens_match": bool(rows[mode]) and all(r["tokens_match"] for r in rows[mode]),
            "committed": len(ok), "runs": len(rows[mode]),
            "aborted_reasons": [r["reason"] for r in rows[mode] if not r["committed"]],
            "blocking_downtime_ms": blk["downtime_ms"], "blocking_stall_ms": blk["stall_ms"],
            "blocking_tokens_match": blk["tokens_match"],
            "per_run": rows[mode],
        }
    # Recompute: the prompt and the tokens so far prefilled again at the destination.
    rec = Client(cluster, f"rec-{length}")
    t0 = time.perf_counter()
    task = asyncio.create_task(rec.run("b", prompt + want[:at_token], 1))
    await task
    out["recompute_ms"] = (time.perf_counter() - t0) * 1000
    return out


HEADER = ["length", "transfer", "downtime", "ack", "stall", "itl", "GB/s", "step", "step(mig)", "slowdown",
          "blocking", "blk.stall", "match"]


def _row(length, mode, ref_step, r, control: bool) -> str:
    vals = [str(length), mode, r["downtime_ms"], r["commit_ack_ms"], r["stall_ms"], r["itl_ms"], r["copy_gbps"],
            ref_step, r["step_ms_during"], None if r["slowdown"] is None else f"{r['slowdown'] * 100:+.1f}%",
            r["blocking_downtime_ms"], r["blocking_stall_ms"],
            f"{r['tokens_match'] and r['blocking_tokens_match']}/{control}"]
    return cells(vals)


async def _run(opts: dict, on_length) -> dict:
    from services.instance.engine import create_engine
    from services.instance.engine.base import EngineConfig
    from ferry.inprocess import Cluster
    from services.instance.migration.messages import MigrationConfig

    lengths, out_tokens, bg = opts["lengths"], opts["out_tokens"], opts["background"]
    max_len = max(lengths) + out_tokens + 64
    per_engine = 2 * max_len + bg * (opts["bg_prompt"] + opts["bg_tokens"] + opts["block_size"])
    num_blocks = opts["num_blocks"] or -(-per_engine // opts["block_size"])
    cfg = EngineConfig(engine="native", model=opts["model"], device=opts["device"], dtype=opts["dtype"],
                       num_blocks=num_blocks, block_size=opts["block_size"], max_model_len=max_len,
                       max_num_batched_tokens=opts["budget"], share_kv=False,
                       extra={"share_weights": True, "warmup": True})
    engines = [create_engine(cfg) for _ in range(2)]
    mcfg = MigrationConfig(chunk_bytes=int(opts["chunk_mb"] * 2**20),
                           precopy_chunk_bytes=int(opts["precopy_chunk_mb"] * 2**20), copy_duty=opts["copy_duty"],
                           deadline_ms=30_000, max_migrate_in=4, shared_kv=False)
    cluster = Cluster()
    for name, e in zip("ab", engines):
        cluster.add(name, e, mcfg)
    cuda = engines[0].executor.device.type == "cuda"
    modes = ["staged", "plain"] if cuda and opts["compare"] else (["staged"] if cuda else ["cpu"])

    def set_mode(mode: str) -> None:
        for e in engines:
            e.executor.set_kv_staging(mode != "plain")

    vocab = min(opts["vocab"], engines[0].model_config.vocab_size)
    bgs = {n: _Background(cluster, n, bg, opts["bg_prompt"], opts["bg_tokens"], vocab) for n in "ab"}
    results: dict = {"config": {**opts, "num_blocks": num_blocks, "modes": modes,
                                "device_name": _device_name(engines[0].executor.device)}, "lengths": {}}
    try:
        for b in bgs.values():
            b.start()
        await asyncio.sleep(1.0)
        for length in lengths:
            results["lengths"][str(length)] = await _length(cluster, bgs, length, opts["runs"], out_tokens,
                                                            opts["at_token"], vocab, modes, set_mode)
            on_length(results, length)
    finally:
        for b in bgs.values():
            await b.stop()
        await cluster.stop()
    return results


def _device_name(device) -> str:
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return f"cpu x{os.cpu_count()}"


@click.command("migration-local")
@click.option("--model", default="llama-3.1-8b", show_default=True,
              help="a model name or a random-weight shape (llama-3.1-8b: Llama-3-8B's shape, 128k positions)")
@click.option("--device", default="cuda", show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--lengths", default="1024,8192,32768", show_default=True)
@click.option("--runs", default=3, show_default=True, help="migrations per length and transfer (p50 reported)")
@click.option("--background", default=4, show_default=True, help="requests decoding on each engine")
@click.option("--bg-prompt", default=128, show_default=True)
@click.option("--bg-tokens", default=256, show_default=True)
@click.option("--out-tokens", default=256, show_default=True)
@click.option("--at-token", default=16, show_default=True, help="migrate after this many output tokens")
@click.option("--block-size", default=16, show_default=True)
@click.option("--num-blocks", default=0, show_default=True, help="KV blocks per engine (0: enough for the runs)")
@click.option("--budget", default=2048, show_default=True, help="tokens per step (chunked prefill)")
@click.option("--chunk-mb", default=64.0, show_default=True, help="KV chunk of the last stage (MiB)")
@click.option("--precopy-chunk-mb", default=16.0, show_default=True, help="KV chunk of the pre-copy stages (MiB)")
@click.option("--copy-duty", default=0.5, show_default=True, help="most fraction of wall time pre-copy copies")
@click.option("--compare/--no-compare", default=True, show_default=True,
              help="on CUDA, also the plain transfer (the engine's stream, pageable memory), alternating")
@click.option("--vocab", default=32000, show_default=True, help="prompt token ids are drawn below this")
@json_option()
def migration_local(json_path, lengths, **opts) -> None:
    """Live migration between two engines in this process (GPU: staged vs plain KV transfer)."""
    from libs.common.logging import setup_logging

    setup_logging("warning")
    opts["lengths"] = int_list(lengths)
    started = time.perf_counter()

    def on_length(results: dict, length: int) -> None:
        r = results["lengths"][str(length)]
        if len(results["lengths"]) == 1:
            click.echo(f"{results['config']['device_name']}, {opts['model']} {opts['dtype']}, "
                       f"{results['config']['num_blocks']} blocks per engine")
            click.echo(cells(HEADER))
        for mode, m in r["by_transfer"].items():
            click.echo(_row(length, mode, r["reference_step_ms"], m, r["control_match"]))
        results["config"]["elapsed_s"] = time.perf_counter() - started
        if json_path:
            write_json(json_path, results)

    asyncio.run(_run(opts, on_length))
    click.echo("(ms; downtime = suspend -> first step on the destination; ack = suspend -> commit acknowledged; "
               "stall = largest client inter-token gap across the migration minus itl; GB/s = bytes over the "
               "migration's duration; step = the source's background decode step with the request there, "
               "without and during the migration; blocking = suspend, then copy everything; match = the "
               "migrated runs' tokens equal the reference's / an unmigrated repeat's do)")
