"""``ferry bench features``: what the API's features cost, each against the
same work without it, taking turns in one run.

- **grammar, decode**: a batch (``--batch``) of requests decoding
  ``--output-len`` tokens on the native engine, each under a JSON-schema
  grammar (a string field long enough never to close) or under none; output
  tokens per second, the median of the rounds' ratios (the engine's prefix cache off
  for both parts: a round's two runs share their prompts but for the last token);
- **grammar, TTFT**: one request's time to its first token with a grammar
  already compiled (the engine's xgrammar cache) against none;
- **n**: through a one-instance cluster (frontend, scheduler, native
  instance), the first streamed token of n=4 against n=1 on new prompts of
  ``--prompt-len`` tokens, and the prompt tokens the instance's prefix cache
  served to the siblings (3 x the prompt's full blocks when it is computed once).
"""

from __future__ import annotations

import asyncio
import json
import time

import click

from ferry.bench.harness import bench_command, instance_status, median, random_prompts, started
from ferry.bench.sse import stream_completion

STRING_SCHEMA = json.dumps({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})


def _engine_rounds(model: str, dtype: str, batch: int, prompt_len: int, output_len: int, repeats: int) -> dict:
    from ferry.bench.engine import native_run
    from libs.common.types import Grammar, GrammarKind, SamplingParams
    from services.instance.engine import create_engine
    from services.instance.engine.base import EngineConfig, EngineRequest
    from services.instance.engine.native.engine import default_block_size

    bs = default_block_size("cpu", dtype)
    eng = create_engine(EngineConfig(engine="native", model=model, dtype=dtype, block_size=bs,
                                     num_blocks=batch * -(-(prompt_len + output_len) // bs) + 16,
                                     # off: the two runs of a round share all but their prompts' last token, and the
                                     # second one's prefix-cache hits made it the faster whichever it was
                                     prefix_caching=False, extra={"warmup": True}))
    vocab = eng.model_config.vocab_size
    grammar = Grammar(GrammarKind.JSON, STRING_SCHEMA)

    def run(prompts, with_grammar: bool) -> dict:
        return native_run(eng, prompts, output_len, grammar if with_grammar else None)

    run(random_prompts(1, prompt_len, vocab, 7), True)  # compile the grammar once: the cache serves every later run
    out: dict = {"decode": {"plain": [], "grammar": [], "ratio": []}, "ttft_ms": {"plain": [], "grammar": []}}
    for rep in range(repeats):
        prompts = random_prompts(batch, prompt_len, vocab, 100 + rep)
        order = (False, True) if rep % 2 == 0 else (True, False)
        got = {g: run([[*p[:-1], p[-1] + int(g)] for p in prompts], g) for g in order}
        out["decode"]["plain"].append(got[False]["tok_s"])
        out["decode"]["grammar"].append(got[True]["tok_s"])
        out["decode"]["ratio"].append(got[True]["tok_s"] / got[False]["tok_s"])
        one = random_prompts(1, prompt_len, vocab, 900 + rep)[0]
        for g in order:
            sp = SamplingParams(max_tokens=1, grammar=grammar if g else None)
            t0 = time.perf_counter()
            eng.add_request(EngineRequest(f"t-{rep}-{g}", tuple([*one[:-1], one[-1] + int(g)]), sp))
            while eng.has_work():
                eng.step()
            out["ttft_ms"]["grammar" if g else "plain"].append(1000 * (time.perf_counter() - t0))
        click.echo(f"round {rep + 1}: decode {got[False]['tok_s']:.1f} vs {got[True]['tok_s']:.1f} tok/s with a "
                   f"grammar; TTFT {out['ttft_ms']['plain'][-1]:.1f} vs {out['ttft_ms']['grammar'][-1]:.1f} ms",
                   err=True)
    eng.check_integrity()
    return out


async def _n_rounds(url: str, prompt_len: int, repeats: int, instance) -> dict:
    import httpx

    out = {"ttft_ms": {"1": [], "4": []}, "sibling_hit_tokens": [], "prompt_tokens": []}

    async def hits() -> int:
        return (await instance_status(instance.address, timeout=5)).prefix_cache.hits

    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        for rep in range(repeats):
            for n in ((1, 4) if rep % 2 == 0 else (4, 1)):
                prompt = " ".join(f"w{rep}x{n}x{i}" for i in range(prompt_len // 3))
                before = await hits()
                t0 = time.perf_counter()
                c = await stream_completion(http, {"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": rep,
                                                   "n": n, "stream_options": {"include_usage": True}})
                out["ttft_ms"][str(n)].append(1000 * (c.token_times[0] - t0))
                if n == 4:
                    out["prompt_tokens"].append(c.usage["prompt_tokens"])
                    out["sibling_hit_tokens"].append(await hits() - before)
    return out


def _print(result: dict) -> None:
    g = result["grammar"]
    click.echo("model {model} dtype {dtype} batch {batch} prompt {prompt_len} output {output_len} "
               "repeats {repeats}".format(**result))
    click.echo(f"{'what':<34} {'value':>10}  rounds")
    click.echo(f"{'decode tok/s, grammar / none':<34} {g['decode_ratio']:>10}  {g['decode_ratio_rounds']}")
    click.echo(f"{'TTFT added by a cached grammar ms':<34} {g['ttft_added_ms']:>10}  "
               f"{g['ttft_ms_cached_grammar']} vs {g['ttft_ms_plain']}")
    if "n" in result:
        r = result["n"]
        click.echo(f"{'TTFT n=4 / n=1':<34} {r['ttft_ratio']:>10}  {r['ttft_ratio_rounds']}")
        click.echo(f"{'siblings prefix-cache hit tokens':<34} {median(r['sibling_hit_tokens']):>10}  "
                   f"{r['sibling_hit_tokens']} (prompts of {r['prompt_tokens']} tokens)")


@bench_command(None, _print)
@click.option("--model", default="smollm2", show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--batch", default=32, show_default=True, help="requests decoding together (the grammar cost)")
@click.option("--prompt-len", default=128, show_default=True)
@click.option("--output-len", default=64, show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--no-n", is_flag=True, help="skip the n=4 part (it starts a one-instance cluster)")
def features(model, dtype, batch, prompt_len, output_len, repeats, no_n) -> dict:
    """What structured outputs and n cost (against the same work without, in turns)."""
    result: dict = {"model": model, "dtype": dtype, "batch": batch, "prompt_len": prompt_len,
                    "output_len": output_len, "repeats": repeats}
    eng = _engine_rounds(model, dtype, batch, prompt_len, output_len, repeats)
    result["grammar"] = {"decode_tok_s_plain": [round(x, 2) for x in eng["decode"]["plain"]],
                         "decode_tok_s_grammar": [round(x, 2) for x in eng["decode"]["grammar"]],
                         "decode_ratio_rounds": [round(x, 3) for x in eng["decode"]["ratio"]],
                         "decode_ratio": round(median(eng["decode"]["ratio"]), 3),
                         "ttft_ms_plain": [round(x, 2) for x in eng["ttft_ms"]["plain"]],
                         "ttft_ms_cached_grammar": [round(x, 2) for x in eng["ttft_ms"]["grammar"]],
                         "ttft_added_ms": round(median(eng["ttft_ms"]["grammar"])
                                                - median(eng["ttft_ms"]["plain"]), 2)}
    if not no_n:
        import tempfile

        from ferry.cluster import ClusterSpec, free_port

        with started(ClusterSpec(instances=1, engine="native", model=model, port=free_port(),
                                 instance_args=["--dtype", dtype], log_dir=tempfile.mkdtemp(prefix="ferry-n-")),
                     timeout_s=300) as c:
            n = asyncio.run(_n_rounds(c.url, prompt_len, repeats, c.instances()[0]))
        ratio = [a / b for a, b in zip(n["ttft_ms"]["4"], n["ttft_ms"]["1"])]
        result["n"] = {**n, "ttft_ratio_rounds": [round(x, 3) for x in ratio],
                       "ttft_ratio": round(median(ratio), 3)}
    return result
