"""``ferry bench migration``: live migration of a decoding request between two
instance processes (native engine, default model), each running a background
batch, at several sequence lengths; against two baselines at the same length:
blocking copy (suspend, then copy everything) and recompute (re-prefill prompt
+ output at the destination)."""

from __future__ import annotations

import asyncio
import functools
import os
import random
import time
import uuid
from collections.abc import Awaitable, Callable

import click
import grpc
import httpx

from ferry.bench import harness
from ferry.bench.harness import (cells, first_token_s, instance_arg_option, int_list, json_option, median,
                                 median_of, migrate_out, running_ids, started)
from ferry.bench.sse import stream_completion
from ferry.cluster import ClusterSpec, free_port
from ferry.machine import write_json
from libs.pb import common_pb2 as cpb
from libs.pb import instance_pb2 as ipb
from libs.pb import instance_pb2_grpc as ipb_grpc
from libs.common import rpc

_KV_TOKENS = 17_600  # the KV cache of every run on record (1,100 blocks of 16)


class Background(harness.Background):
    """Requests decoding on one instance through its own gRPC stream; their
    inter-token gaps measure that instance's decode step time. Each slot
    re-issues a request of ``tokens`` output tokens when the last one ends,
    so the load stays the same from the first length to the last.

    NOTE: one endless request per slot grew to thousands of tokens of
    context by the last length, so later lengths ran against a heavier
    batch than earlier ones."""

    def __init__(self, address: str, n: int, prompt_len: int, vocab: int, tokens: int = 256):
        super().__init__(n)
        self.address, self.prompt_len, self.vocab, self.tokens = address, prompt_len, vocab, tokens

    async def _slot(self, i: int):
        rng = random.Random(i)
        async with rpc.channel(self.address) as ch:
            while True:
                call = ipb_grpc.InstanceStub(ch).Generate(ipb.GenerateRequest(
                    request_id=f"bg-{uuid.uuid4().hex[:8]}",
                    prompt_token_ids=[rng.randrange(100, self.vocab) for _ in range(self.prompt_len)],
                    sampling=cpb.SamplingParams(max_tokens=self.tokens, ignore_eos=True)))
                try:
                    first = True
                    async for ev in call:
                        if ev.token_ids and i == 0:  # one stream is enough to time steps
                            now = time.perf_counter()
                            if first and self.times:  # the gap across a new request's prefill is no step
                                self.times.append(None)
                            self.times.append(now)
                            first = False
                except (grpc.aio.AioRpcError, asyncio.CancelledError):
                    return


async def _stream_with(http, body, at_token: int, action: Callable[[str], Awaitable]):
    """One streamed completion; once it has ``at_token`` tokens, ``action(request id)`` runs beside it (never
    inline: the client must keep reading tokens meanwhile). (text, token times, final, {"t0", "t1": the action's
    start and end, "result": what it returned})."""
    info: dict = {}

    async def timed(rid: str) -> None:
        info["t0"] = time.perf_counter()
        info["result"] = await action(rid)
        info["t1"] = time.perf_counter()

    async def on_chunk(c) -> None:
        if len(c.token_times) == at_token and "task" not in info:
            info["task"] = asyncio.create_task(timed(c.request_id))

    c = await stream_completion(http, body, on_chunk)
    await info["task"]
    return c.text, c.token_times, c.final, info


async def _holder(cluster, rid):
    for _ in range(200):
        for inst in cluster.instances():
            if rid in await running_ids(inst, timeout=None):
                return inst
        await asyncio.sleep(0.01)
    raise RuntimeError(f"request {rid} not running anywhere")


async def _migrate(cluster, rid, blocking=False):
    src = await _holder(cluster, rid)
    dst = next(i for i in cluster.instances() if i is not src)
    return src, dst, (await migrate_out(src, rid, dst, timeout=300, blocking=blocking)).results[0]


STALL_TAIL_S = 0.3  # the stall's window runs this long past the migration's end


def client_stall(times: list[float], t0: float, t1: float, through: float = 0.0) -> tuple[float | None, float | None]:
    """(largest gap between consecutive tokens at the client across the
    migration [t0, t1] minus the normal inter-token time, that normal time):
    the normal time is the median gap outside the migration window. The
    window runs STALL_TAIL_S past t1, and at least to ``through`` (the first
    token from the destination: its gap is the switch)."""
    end = max(t1 + STALL_TAIL_S, through)
    gaps = [((b - a) * 1000, b) for a, b in zip(times, times[1:])]
    inside = [g for g, b in gaps if t0 <= b <= end]
    outside = [g for g, b in gaps if not t0 <= b <= end]
    if not inside or not outside:
        return None, None
    itl = median(outside)
    return max(inside) - itl, itl


def stall_breakdown(times: list[float], suspend: float, ack_ms: float, downtime_ms: float) -> dict | None:
    """Where the client's gap across the switch goes, on the client's clock
    (``suspend``: the source's suspend on that clock). The switch gap runs
    from the last token before the first one the destination produced (the
    first arriving after the request joined the destination's batch) to that
    one: source tail (last source token at the client -> suspend; negative
    when the token reached the client after the suspend), suspend -> commit
    acknowledged, acknowledged -> joined the batch, joined -> the first token
    at the client (a destination step, the stream and the frontend's switch).
    None without a downtime or a token on both sides."""
    if not downtime_ms or not suspend:
        return None
    install = suspend + downtime_ms / 1000
    b = next((i for i, t in enumerate(times) if t > install), None)
    if not b:
        return None

    def ms(s: float) -> float:
        return round(s * 1000, 3)

    return {"source_tail_ms": ms(suspend - times[b - 1]), "commit_ack_ms": round(ack_ms, 3),
            "ack_to_batch_ms": round(downtime_ms - ack_ms, 3), "batch_to_client_ms": ms(times[b] - install),
            "switch_gap_ms": ms(times[b] - times[b - 1]), "switch_token": b}


def largest_gap(times: list[float], t0: float, t1: float, through: float = 0.0) -> tuple[float, int] | None:
    """(largest gap in ms among those ending in the stall's window (see
    client_stall), index of the token ending it)."""
    end = max(t1 + STALL_TAIL_S, through)
    gaps = [((times[i] - times[i - 1]) * 1000, i) for i in range(1, len(times)) if t0 <= times[i] <= end]
    return max(gaps) if gaps else None


def switch_point(times: list[float], res) -> tuple[float, dict | None, float]:
    """(the source's suspend on this process's clock (both are this host's),
    the switch's breakdown, when its gap ends). NOTE: a slow first step at
    the destination can end the switch gap past t1 + STALL_TAIL_S; the stall's
    window always takes it in."""
    suspend = res.suspended_at - (time.time() - time.perf_counter()) if res.suspended_at else 0.0
    parts = stall_breakdown(times, suspend, res.commit_ack_ms, res.downtime_ms)
    return suspend, parts, (times[parts["switch_token"]] if parts else 0.0)


async def _measure_length(cluster, http, bgs, length, runs, out_tokens, at_token, vocab):
    rng = random.Random(length)
    prompt = [rng.randrange(100, vocab) for _ in range(length)]
    body = {"prompt": prompt, "max_tokens": out_tokens, "ignore_eos": True, "temperature": 0}
    # The reference run (no migration) also gives the source's step time
    # with this request decoding there: the baseline of the slowdown. Without
    # it, the steps outside the migration window mix steps with and without
    # the long request (it has left after the window) and read a slowdown
    # that is the request's own attention, not the migration.
    reference, ref_times, _, ref = await _stream_with(http, body, at_token, lambda rid: _holder(cluster, rid))
    baseline_step = bgs[ref["result"].name].step_ms(ref["t0"], ref_times[-1], True)
    rows = []
    for _ in range(runs):
        text, times, final, info = await _stream_with(http, body, at_token, lambda rid: _migrate(cluster, rid))
        src, dst, res = info["result"]
        bg, dst_bg = bgs[src.name], bgs[dst.name]
        suspend, parts, through = switch_point(times, res)
        stall, itl = client_stall(times, info["t0"], info["t1"], through)
        big = largest_gap(times, info["t0"], info["t1"], through)
        if parts is not None and big is not None:
            # Is the stall the switch itself, or a slow step before or after it?
            parts["largest_gap_token"] = big[1]
            parts["largest_gap_from_suspend_ms"] = round((times[big[1]] - suspend) * 1000, 3)
            # The destination's step that the request joined: its background stream's gap across the join.
            join = suspend + res.downtime_ms / 1000
            dts = [t for t in dst_bg.times if t is not None]
            k = next((i for i, t in enumerate(dts) if t > join), None)
            parts["dest_join_step_ms"] = round((dts[k] - dts[k - 1]) * 1000, 3) if k else None
        rows.append({
            "committed": res.outcome == "committed", "reason": res.reason,
            # suspend -> first step on the destination (0 = the destination did not say)
            "downtime_ms": res.downtime_ms or None, "commit_ack_ms": res.commit_ack_ms,
            "total_ms": res.duration_ms, "stages": res.stages, "bytes": res.bytes, "blocks": res.blocks,
            "kv_shared": res.kv_shared,  # through the source's shared cache (else bytes over gRPC)
            "stall_ms": stall, "itl_ms": itl, "breakdown": parts,
            "tokens_match": text == reference and final["migrations"] == 1,
            "step_ms_during": bg.step_ms(info["t0"], info["t1"], True),
            "step_ms_outside": bg.step_ms(info["t0"] - 3, info["t1"] + 3, False),  # mixed; not the baseline
            "dest_step_ms": dst_bg.step_ms(info["t0"] - 3, info["t1"] + 3, False),
        })
    # Baseline 1: blocking copy = suspend, then copy every block (no pre-copy).
    _, btimes, _, info = await _stream_with(http, body, at_token, lambda rid: _migrate(cluster, rid, blocking=True))
    blocked = info["result"][2]
    blocking_ms = blocked.downtime_ms or None
    blocking_stall, _ = client_stall(btimes, info["t0"], info["t1"], switch_point(btimes, blocked)[2])
    # Baseline 2: recompute = prefill prompt + output so far at the destination.
    async with rpc.channel(cluster.instances()[1].address) as ch:
        recompute_ms = 1000 * await first_token_s(ipb_grpc.InstanceStub(ch), f"recompute-{uuid.uuid4().hex[:8]}",
                                                  prompt + [100] * at_token, 1, ignore_eos=True)
    ok = [r for r in rows if r["committed"]]
    itl = median_of(ok, "itl_ms")
    med = functools.partial(median_of, ok)
    during, outside = med("step_ms_during"), baseline_step
    parts = [r["breakdown"] for r in ok if r["breakdown"]]
    keys = {k for p in parts for k in p} - {"switch_token", "largest_gap_token"}
    breakdown = {k: m for k in sorted(keys) if (m := median(p.get(k) for p in parts)) is not None} if parts else None
    if parts:  # how often the largest gap is the switch itself
        breakdown["largest_is_switch"] = sum(p.get("largest_gap_token") == p["switch_token"] for p in parts) / len(parts)
    return {
        "downtime_ms": med("downtime_ms"), "commit_ack_ms": med("commit_ack_ms"), "stall_ms": med("stall_ms"),
        "stall_max_ms": max((r["stall_ms"] for r in ok if r["stall_ms"] is not None), default=None),
        "itl_ms": itl, "stall_breakdown_p50": breakdown, "stall_in_itl": (med("stall_ms") / itl) if itl and med("stall_ms") is not None else None,
        "dest_step_ms": med("dest_step_ms"), "stages": med("stages"), "bytes": med("bytes"),
        "total_ms": med("total_ms"),
        "tokens_match": bool(rows) and all(r["tokens_match"] for r in rows),
        "kv_shared": sum(1 for r in ok if r.get("kv_shared")),  # committed runs whose KV went through shared memory
        # The source's background step: with the request decoding there and no migration (the
        # reference run), and during the migration.
        "decode_step_ms": {"without_migration": outside, "during_migration": during,
                           "slowdown": (during / outside - 1) if during and outside else None},
        # Baselines: blocking copy (downtime to the first destination step, and the client's stall);
        # recompute (prefill of prompt + output at the destination: the client's stall is about this,
        # minus one normal inter-token time).
        "blocking_copy_ms": blocking_ms, "blocking_copy_stall_ms": blocking_stall,
        "recompute_ms": recompute_ms, "recompute_stall_ms": (recompute_ms - itl) if itl else recompute_ms,
        "runs": len(rows), "committed": len(ok), "aborted_reasons": [r["reason"] for r in rows if not r["committed"]],
        "per_run": rows,
    }


HEADER = ["length", "downtime", "ack", "stall", "itl", "join", "stages", "MiB", "total", "match", "step", "step(mig)",
          "blocking", "blk.stall", "recompute"]


def _row(length, r) -> str:
    s = r["decode_step_ms"]
    join = (r.get("stall_breakdown_p50") or {}).get("dest_join_step_ms")
    vals = [str(length), r["downtime_ms"], r["commit_ack_ms"], r["stall_ms"], r["itl_ms"], join, r["stages"],
            (r["bytes"] or 0) / 2**20, r["total_ms"], str(r["tokens_match"]), s["without_migration"],
            s["during_migration"], r["blocking_copy_ms"], r["blocking_copy_stall_ms"], r["recompute_ms"]]
    return cells(vals)


def _flat(res: dict, key: str) -> float | None:
    """Longest length's value over the shortest's (1.0 = flat)."""
    keys = list(res)
    first, last = res[keys[0]][key], res[keys[-1]][key]
    return (last / first) if first and last else None


def _summary(res: dict, config: dict) -> dict:
    return {"lengths": res, "flatness": {"downtime": _flat(res, "downtime_ms"), "stall": _flat(res, "stall_ms")},
            "config": config}


async def _run(cluster, lengths, runs, background, out_tokens, at_token, vocab, on_length):
    bgs = {i.name: Background(i.address, background, 128, vocab) for i in cluster.instances()}
    for b in bgs.values():
        b.start()
    await asyncio.sleep(2.0)
    results = {}
    try:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=600) as http:
            for length in lengths:
                results[str(length)] = await _measure_length(cluster, http, bgs, length, runs, out_tokens,
                                                             at_token, vocab)
                on_length(results)
    finally:
        for b in bgs.values():
            await b.stop()
    return results


@click.command()
@click.option("--lengths", default="256,1024,4096,8000", show_default=True)
@click.option("--runs", default=5, show_default=True, help="migrations per length (p50 reported)")
@click.option("--background", default=4, show_default=True, help="background requests per instance")
@click.option("--out-tokens", default=48, show_default=True)
@click.option("--at-token", default=12, show_default=True, help="migrate after this many output tokens")
@click.option("--engine", default="native", show_default=True, type=click.Choice(["native", "sim", "fake", "vllm"]),
              help="vllm: add --instance-arg=--vllm-args='--enforce-eager --no-enable-prefix-caching' (without "
                   "the prefix cache the recompute baseline cannot reuse the migrated runs' blocks)")
@click.option("--model", default="smollm2", show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--num-blocks", type=int, default=None,
              help="KV blocks per instance (default: 17,600 tokens' worth at the instance's default block size: "
                   "1,100 of 16, 550 of 32)")
@click.option("--vocab", default=49152, show_default=True, help="prompt token ids are drawn below this")
@instance_arg_option()
@click.option("--pin-cores/--no-pin-cores", default=False, show_default=True,
              help="pin the two instances to their own share of the cores each (ferry up --pin-cores)")
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="the services' logs at info level into this folder (each migration's transitions, and how "
                   "long each request waited to join the destination's batch); else warnings to the terminal")
@json_option()
def migration(lengths, runs, background, out_tokens, at_token, engine, model, device, dtype, num_blocks, vocab,
              instance_args, pin_cores, log_dir, json_path) -> None:
    """Downtime of live migration vs sequence length, against blocking copy and recompute."""
    lens = int_list(lengths)
    if num_blocks is None:
        from services.instance.config import default_block_size

        num_blocks = _KV_TOKENS // default_block_size(engine, device, dtype)
    args = ["--num-blocks", str(num_blocks), "--device", device, "--dtype", dtype,
            "--max-model-len", str(max(lens) + out_tokens + 64), *instance_args]
    spec = ClusterSpec(instances=2, engine=engine, model=model, port=free_port(), dispatch="round_robin",
                       instance_args=args, scheduler_args=["--no-migration"], log_level="info" if log_dir else "warning",
                       log_dir=log_dir, pin_cores=pin_cores)
    config = {"engine": engine, "model": model, "device": device, "dtype": dtype, "runs": runs,
              "num_blocks": num_blocks,
              "instance_cpus": [spec.instance_cpus(i) for i in range(spec.instances)],
              "background_per_instance": background, "out_tokens": out_tokens, "at_token": at_token,
              "cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()}

    def on_length(results: dict) -> None:
        # Print and save each length as it completes: long lengths take minutes on a CPU.
        if len(results) == 1:
            click.echo(cells(HEADER))
        length = list(results)[-1]
        click.echo(_row(length, results[length]))
        config["loadavg_at_end"] = os.getloadavg()  # other work on the machine skews every number
        if json_path:
            write_json(json_path, _summary(results, config))

    with started(spec, timeout_s=600) as cluster:
        res = asyncio.run(_run(cluster, lens, runs, background, out_tokens, at_token, vocab, on_length))
    out = _summary(res, config)
    for k, v in out["flatness"].items():
        click.echo(f"flatness of {k} (at {lens[-1]} / at {lens[0]}): " + (f"{v:.2f}" if v else "n/a"))
    click.echo("(times in ms; downtime = suspend -> first step on the destination; ack = suspend -> commit "
               "acknowledged; stall = largest client inter-token gap across the migration minus itl, the normal "
               "one; join = the destination's step that the request joined; step = background decode step on the source, median)")
