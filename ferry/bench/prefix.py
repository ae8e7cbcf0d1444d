"""``ferry bench prefix``: what prefix caching buys on one native instance.

1. TTFT over prefix lengths: for each length L, a prompt of L tokens whose
   prefix is cached (the same L tokens ran before with another suffix) plus
   --new-tokens new ones, against a prompt of the same shape whose prefix was
   never seen; both on the same engine (the instance's own configuration:
   dtype auto, its block size, its token budget per step), the cached and the
   uncached request taking turns (who goes first alternates) for --repeats
   rounds; medians and the median of the rounds' ratios. TTFT here is the
   engine's: from adding the request to its first token (no network).
2. The hit rate of a workload (ferry/measure/prefixes.py: --prefix, --arrivals,
   --lengths, -n) replayed on the same kind of engine at its arrival times,
   against its upper bound: one unbounded cache that sees every request in
   order (ferry/measure/hit_rate.py). --workload-engine fake replays it without
   the model (the hit rate depends on the cache's size and what runs at once,
   not on the model's speed; the fake engine steps every --token-delay-ms).
"""

from __future__ import annotations

import time

import click

from ferry.bench.harness import bench_command, int_list, median, median_of, seed_option


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(1000, min(vocab, 32000), n).tolist()


def ttft_s(engine, rid: str, prompt: list[int]) -> tuple[float, int]:
    """(seconds from add to the first token, tokens of its cached prefix)."""
    from libs.common.types import SamplingParams
    from services.instance.engine.base import EngineRequest

    t0 = time.perf_counter()
    engine.add_request(EngineRequest(rid, tuple(prompt), SamplingParams(max_tokens=1, ignore_eos=True)))
    hit = 0
    while engine.has_work():
        stats = engine.request_stats(rid)
        hit = stats.get("prefix_hit_tokens", hit) if stats else hit
        for o in engine.step():
            if o.request_id == rid and o.token_id is not None:
                t = time.perf_counter() - t0
                while engine.has_work():
                    engine.step()
                return t, (o.stats or {}).get("prefix_hit_tokens", hit)
    raise RuntimeError(f"{rid} produced no token")


def measure_ttft(engine, prefix_lens: list[int], new_tokens: int, repeats: int, vocab: int) -> dict:
    out = {}
    for L in prefix_lens:
        rounds = []
        for rep in range(repeats):
            base = 1_000_000 * (L + 1) + 1000 * rep
            cached_prefix = _tokens(L, base + 1, vocab)
            ttft_s(engine, f"warm-{L}-{rep}", cached_prefix + _tokens(new_tokens, base + 2, vocab))

            def cached():
                return ttft_s(engine, f"cached-{L}-{rep}", cached_prefix + _tokens(new_tokens, base + 3, vocab))

            def uncached():
                return ttft_s(engine, f"uncached-{L}-{rep}", _tokens(L + new_tokens, base + 4, vocab))

            res = {}
            for name, fn in ((("cached", cached), ("uncached", uncached))[:: -1 if rep % 2 else 1]):
                res[name] = fn()
            rounds.append({"cached_ms": 1000 * res["cached"][0], "uncached_ms": 1000 * res["uncached"][0],
                           "cached_hit_tokens": res["cached"][1], "uncached_hit_tokens": res["uncached"][1]})
            click.echo(f"prefix {L}: round {rep + 1}: cached {rounds[-1]['cached_ms']:.1f} ms "
                       f"(hit {res['cached'][1]}), uncached {rounds[-1]['uncached_ms']:.1f} ms", err=True)
        med = {k: median_of(rounds, k) for k in ("cached_ms", "uncached_ms")}
        ratios = [r["cached_ms"] / r["uncached_ms"] for r in rounds]
        out[str(L)] = {**{k: round(v, 2) for k, v in med.items()}, "ratio": round(median(ratios), 4),
                       "ratio_rounds": [round(x, 4) for x in ratios],
                       "hit_tokens": [r["cached_hit_tokens"] for r in rounds], "rounds": rounds}
    return out


def replay_hit_rate(engine, work, seed: int, token_range: tuple[int, int]) -> dict:
    """Replay the workload on one engine at its arrival times (a session's
    next turn after its previous answer and think time); the engine's hit
    rate and the upper bound of the same requests."""
    from ferry.measure import hit_rate
    from ferry.measure import workload as wl
    from libs.common.types import SamplingParams
    from services.instance.engine.base import EngineRequest

    reqs = work.requests
    prompts: dict[int, list[int]] = {}
    outputs: dict[int, list[int]] = {}
    nxt = {}
    last: dict[int, int] = {}
    for i, r in enumerate(reqs):
        if r.session >= 0:
            if r.session in last:
                nxt[last[r.session]] = i
            last[r.session] = i
    due = sorted(((r.arrival_s, i) for i, r in enumerate(reqs) if r.session < 0 or r.turn == 0))
    context: dict[int, list[int]] = {}
    before = engine.prefix_cache_stats()
    t0 = time.perf_counter()
    order, done = [], 0
    while done < len(reqs):
        now = time.perf_counter() - t0
        while due and due[0][0] <= now:
            _, i = due.pop(0)
            r = reqs[i]
            prompts[i] = context.get(i, []) + wl.prompt_ids(r, seed, *token_range)
            order.append(i)
            sp = SamplingParams(max_tokens=r.output_len, min_tokens=r.output_len, ignore_eos=True)
            engine.add_request(EngineRequest(f"w{i}", tuple(prompts[i]), sp))
        if not engine.has_work():
            time.sleep(min(0.01, max(0.0, (due[0][0] - now) if due else 0.01)))
            continue
        for o in engine.step():
            i = int(o.request_id[1:])
            if o.token_id is not None:
                outputs.setdefault(i, []).append(o.token_id)
            if o.finish_reason is not None:
                done += 1
                if i in nxt:
                    j = nxt[i]
                    context[j] = prompts[i] + outputs.get(i, [])
                    due.append((time.perf_counter() - t0 + reqs[j].think_s, j))
                    due.sort()
    after = engine.prefix_cache_stats()
    q, h = after.queries - before.queries, after.hits - before.hits
    bound = hit_rate.upper_bound([(prompts[i], outputs.get(i, [])) for i in order], engine.block_size)
    return {"workload": work.describe(), "queries": q, "hits": h, "hit_rate": h / q if q else None,
            "evictions": after.evictions - before.evictions, "upper_bound": bound,
            "of_upper_bound": (h / q) / bound["hit_rate"] if q and bound["hit_rate"] else None,
            "seconds": round(time.perf_counter() - t0, 2)}


def _print(r: dict) -> None:
    click.echo(f"model {r['model']}  dtype {r['dtype']}  block {r['block_size']}  threads {r['threads']}  "
               f"+{r['new_tokens']} new tokens  budget {r['max_num_batched_tokens']}  {r['repeats']} rounds (medians)")
    click.echo(f"{'prefix':>7}  {'cached ms':>10}  {'uncached ms':>12}  {'ratio':>7}  {'hit tokens':>10}")
    for L, v in r["ttft"].items():
        click.echo(f"{L:>7}  {v['cached_ms']:>10.1f}  {v['uncached_ms']:>12.1f}  {v['ratio']:>7.3f}  "
                   f"{min(v['hit_tokens'])!s:>10}")
    h = r.get("hit_rate")
    if h:
        b = h["upper_bound"]["hit_rate"]
        click.echo(f"workload {h['workload']['prefix']} ({h['engine']}, n={h['workload']['num_requests']}): hit rate "
                   f"{100 * (h['hit_rate'] or 0):.1f}% vs upper bound {100 * (b or 0):.1f}% "
                   f"({h['evictions']} evictions)")


@bench_command("prefix", _print)
@click.option("--model", default="smollm2", show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--prefix-lens", default="256,512,1024,2048", show_default=True,
              help="cached prefix lengths in tokens (rounded down to whole blocks by the cache)")
@click.option("--new-tokens", default=64, show_default=True, help="tokens after the prefix")
@click.option("--repeats", default=5, show_default=True, help="rounds per length (cached and uncached alternate)")
@click.option("--num-blocks", default=1024, show_default=True, help="the instance's KV blocks")
@click.option("--max-num-batched-tokens", default=2048, show_default=True)
@click.option("--threads", type=int, default=None, help="torch threads (default: every usable core)")
@click.option("--prefix", "workload_prefix", default="system:4:512:1.0", show_default=True,
              help="the hit-rate workload's prefix structure (ferry bench serving --prefix); none: skip")
@click.option("--arrivals", default="poisson:4", show_default=True)
@click.option("--lengths", default="fixed:64:8", show_default=True)
@click.option("--num-requests", "-n", default=60, show_default=True)
@click.option("--workload-engine", type=click.Choice(["native", "fake"]), default="native", show_default=True)
@click.option("--token-delay-ms", default=20.0, show_default=True, help="fake workload engine: time per step")
@seed_option()
def prefix(model, dtype, prefix_lens, new_tokens, repeats, num_blocks, max_num_batched_tokens, threads,
           workload_prefix, arrivals, lengths, num_requests, workload_engine, token_delay_ms, seed) -> dict:
    """TTFT with a cached prefix vs uncached, and a workload's hit rate vs its upper bound."""
    import torch

    from ferry.measure import prefixes
    from ferry.cluster import usable_cores
    from services.instance.engine import create_engine
    from services.instance.engine.base import EngineConfig
    from services.instance.engine.native.engine import default_block_size

    torch.set_num_threads(threads or usable_cores())
    block = default_block_size("cpu", dtype)
    cfg = EngineConfig(engine="native", model=model, dtype=dtype, num_blocks=num_blocks, block_size=block,
                       max_num_batched_tokens=max_num_batched_tokens, extra={"warmup": True})
    eng = create_engine(cfg)
    vocab = eng.model_config.vocab_size
    result = {"model": model, "dtype": str(eng.dtype).replace("torch.", ""), "block_size": block,
              "threads": torch.get_num_threads(), "num_blocks": num_blocks, "new_tokens": new_tokens,
              "max_num_batched_tokens": max_num_batched_tokens, "repeats": repeats,
              "loadavg": [round(x, 2) for x in __import__("os").getloadavg()],
              "ttft": measure_ttft(eng, int_list(prefix_lens), new_tokens, repeats, vocab)}
    eng.check_integrity()
    if workload_prefix != "none":
        work = prefixes.build(arrivals, lengths, num_requests, workload_prefix, seed,
                              max_model_len=eng.max_model_len)
        if workload_engine == "fake":
            eng = create_engine(EngineConfig(engine="fake", num_blocks=num_blocks, block_size=block,
                                             token_delay_ms=token_delay_ms))
            token_range = (97, 123)
        else:
            eng = create_engine(cfg)  # a fresh cache
            token_range = (1000, min(vocab, 32000))
        result["hit_rate"] = {"engine": workload_engine, **replay_hit_rate(eng, work, seed, token_range)}
        eng.check_integrity()
    return result
