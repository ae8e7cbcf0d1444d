"""``ferry bench handoff``: what Splitwise's serialized prefill->decode handoff
costs one request, live. Two clusters of real processes, one after the other:
1 prefill + 1 decode instance, and 1 mixed instance (the colocated run), the
same engine and per-instance threads. Requests go one at a time at several
prompt lengths (greedy), so nothing but the handoff differs: TTFT (the prompt
runs on one instance either way), the gap between the first and the second
token (the handoff happens there: hold, pre-allocate, copy the whole prompt KV,
commit, re-attach), and the median gap after it. The split run's text must
equal the colocated run's."""

from __future__ import annotations

import asyncio
import itertools
import random
import time

import click
import httpx

from ferry.bench.harness import (bench_command, cells, instance_arg_option, int_list, median, median_of,
                                 started)
from ferry.bench.sse import stream_completion
from ferry.cluster import ClusterSpec, free_port

HEADER = ("prompt", "ttft_colo", "ttft_pd", "2nd_colo", "2nd_pd", "added", "tbt_colo", "tbt_pd", "same")


async def _measure(url: str, lens: list[int], reps: int, max_tokens: int, vocab: int) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        warm = {"prompt": list(range(100, 164)), "max_tokens": 4, "temperature": 0}
        for _ in range(2):
            await stream_completion(http, warm)
        for n in lens:
            rows = []
            for r in range(reps):
                rng = random.Random(n * 1000 + r)
                body = {"prompt": [rng.randrange(100, vocab) for _ in range(n)], "max_tokens": max_tokens,
                        "ignore_eos": True, "temperature": 0}
                t0 = time.perf_counter()
                c = await stream_completion(http, body)
                t = c.token_times
                gaps = [(b - a) * 1000 for a, b in itertools.pairwise(t[1:])]
                rows.append({"ttft_ms": (t[0] - t0) * 1000, "second_ms": (t[1] - t[0]) * 1000,
                             "tbt_ms": median(gaps), "text": c.text,
                             "instances": c.final["instances"] if c.final else None})
            out[n] = rows
    return out


def _run_cluster(spec: ClusterSpec, lens, reps, max_tokens, vocab) -> dict[int, list[dict]]:
    with started(spec, timeout_s=600) as cluster:
        return asyncio.run(_measure(cluster.url, lens, reps, max_tokens, vocab))


@bench_command()
@click.option("--lengths", default="256,1024,2048", show_default=True, help="prompt lengths (tokens)")
@click.option("--reps", default=3, show_default=True, help="requests per length (medians reported)")
@click.option("--max-tokens", default=16, show_default=True)
@click.option("--engine", default="native", show_default=True, type=click.Choice(["native", "fake", "sim"]))
@click.option("--model", default="smollm2", show_default=True)
@click.option("--torch-threads", default=1, show_default=True, help="per instance (both clusters)")
@click.option("--num-blocks", default=600, show_default=True)
@click.option("--vocab", default=49152, show_default=True, help="prompt token ids are drawn below this")
@instance_arg_option()
def handoff(lengths, reps, max_tokens, engine, model, torch_threads, num_blocks, vocab, instance_args) -> dict:
    """Latency added by the serialized prefill->decode handoff vs a colocated run."""
    lens = int_list(lengths)
    args = ["--num-blocks", str(num_blocks), "--max-model-len", str(max(lens) + max_tokens + 64),
            *instance_args]
    common = {"engine": engine, "model": model, "instance_args": args, "dispatch": "llumnix",
              "scheduler_args": ["--no-migration"], "log_level": "warning", "torch_threads": torch_threads}
    colo = _run_cluster(ClusterSpec(instances=1, port=free_port(), **common), lens, reps, max_tokens, vocab)
    split = _run_cluster(ClusterSpec(instances=2, prefill=1, decode=1, port=free_port(), **common),
                         lens, reps, max_tokens, vocab)
    summary = {"config": {"engine": engine, "model": model, "torch_threads": torch_threads, "reps": reps,
                          "max_tokens": max_tokens}, "lengths": {}}
    click.echo(cells(HEADER, 10))
    for n in lens:
        c, s = colo[n], split[n]
        same = all(a["text"] == b["text"] for a, b in zip(c, s))
        handed = all(r["instances"] == ["instance-0", "instance-1"] for r in s)
        row = {"ttft_colocated_ms": median_of(c, "ttft_ms"), "ttft_split_ms": median_of(s, "ttft_ms"),
               "second_token_colocated_ms": median_of(c, "second_ms"),
               "second_token_split_ms": median_of(s, "second_ms"),
               "tbt_colocated_ms": median_of(c, "tbt_ms"), "tbt_split_ms": median_of(s, "tbt_ms"),
               "same_tokens": same, "every_request_handed_off": handed}
        row["handoff_added_ms"] = row["second_token_split_ms"] - row["second_token_colocated_ms"]
        summary["lengths"][n] = row
        click.echo(cells([n, *(row[k] for k in (
            "ttft_colocated_ms", "ttft_split_ms", "second_token_colocated_ms", "second_token_split_ms",
            "handoff_added_ms", "tbt_colocated_ms", "tbt_split_ms")), same and handed], 10, 1))
    click.echo("(ms, medians; 2nd = first -> second token, where the handoff happens; added = 2nd_pd - 2nd_colo; "
               "tbt = median gap after the second token; same = identical text and every split request prefilled "
               "on instance-0, decoded on instance-1)")
    return summary
