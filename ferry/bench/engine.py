"""``ferry bench engine``: tokens per second of the native engine against
transformers ``generate`` and vLLM's offline ``LLM.generate`` on the same
weights, in the same run, one after the other.

Prompts of --prompt-len random tokens, --output-len output tokens (ignore_eos),
batch sizes --batch-sizes for native and vLLM (the same prompts) and
--hf-batch-sizes for transformers. vLLM runs in a subprocess under
--vllm-python (default: this interpreter when it imports vllm; neither: no
vLLM column) with its own defaults (its CPU backend binds its threads
itself); native and vLLM take turns, --repeats rounds per batch size, and
the ratio is the median of the rounds' ratios (a shared machine's load
changes by the minute; each round's two runs are seconds apart).
Each round is also split into its two phases, measured the same way on both
sides: prefill = until every request has its first token (vLLM: a batch with
one output token, timed apart); decode = the rest of the run per output step
((run - prefill) / (output_len - 1)).
Every round sends prompts of its own (a prefix cache would otherwise serve a
round's prompts from the one before); --no-prefix-caching runs the native
engine with its prefix cache off (A/B: the cost of the cache's bookkeeping).
Also: instance ready time (engine construction + warmup from the cached model)
and ``matches_reference``: greedy tokens of the native engine equal
transformers' for 5 prompts x 64 tokens (fp32 on both sides, run on the spot).
"""

from __future__ import annotations

import time

import click
from ferry.bench.harness import int_list, json_option, median, random_prompts, report

REFERENCE_TEXTS = [
    "Paris is",
    "def fibonacci(n):",
    "The three primary colors are",
    "Write a haiku about the sea, then explain which words carry the rhythm.",
    " ".join(f"Item {i}: a list entry that makes the prompt long." for i in range(10)),
]


def native_run(engine, prompts: list[list[int]], output_len: int, grammar=None) -> dict:
    """tok/s, CPU seconds (this process) and the prefill time of one batch,
    as vllm_offline reports them (prefill: until every request has its first
    token); each request under ``grammar`` where one is given."""
    from libs.common.types import SamplingParams
    from services.instance.engine.base import EngineRequest

    sp = SamplingParams(max_tokens=output_len, ignore_eos=True, grammar=grammar)
    c0, t0 = time.process_time(), time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"bench-{i}", tuple(p), sp))
    n, started, prefill_s = 0, set(), None
    while engine.has_work():
        out = engine.step()
        n += len(out)
        if prefill_s is None:
            started.update(o.request_id for o in out if o.token_id is not None)
            if len(started) == len(prompts):
                prefill_s = time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    return {"tok_s": n / seconds, "tokens": n, "seconds": seconds, "cpu_s": time.process_time() - c0,
            "prefill_s": prefill_s}


def decode_step_ms(seconds: float, prefill_s: float | None, output_len: int) -> float | None:
    """The rest of a run after its prefill, per output step."""
    if prefill_s is None or output_len < 2:
        return None
    return 1000 * (seconds - prefill_s) / (output_len - 1)


def _vllm_settings() -> str:
    import os

    env = {k: v for k, v in os.environ.items() if k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")}
    binding = ", ".join(f"{k}={v}" for k, v in sorted(env.items())) or \
        "vLLM defaults: its CPU backend binds its own threads"
    return f"{binding}; LLM.generate, greedy, ignore_eos"


def hf_tok_s(model, prompts: list[list[int]], output_len: int, device: str) -> float:
    import torch

    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding needed
    model.generate(ids[:, :8], max_new_tokens=2, do_sample=False)  # warm up
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                         min_new_tokens=output_len, do_sample=False)
    el = time.perf_counter() - t0
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / el


def reference_check(model_dir, device: str, n_tokens: int = 64) -> bool:
    """Greedy tokens of the native engine (fp32) == transformers (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from libs.common.types import SamplingParams
    from services.instance.engine import create_engine
    from services.instance.engine.base import EngineConfig, EngineRequest

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    engine = create_engine(EngineConfig(engine="native", model=str(model_dir), device=device, dtype="float32",
                                        num_blocks=128, extra={"warmup": False}))
    sp = SamplingParams(max_tokens=n_tokens, min_tokens=n_tokens)  # min_tokens masks EOS like HF
    prompts = [tok(t)["input_ids"] for t in REFERENCE_TEXTS]
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), tuple(p), sp))
    got: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            got.setdefault(o.request_id, []).append(o.token_id)
    ok = True
    for i, p in enumerate(prompts):
        ids = torch.tensor([p], device=device)
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_tokens,
                          min_new_tokens=n_tokens, do_sample=False)[0, len(p):].tolist()
        ok &= ref == got[str(i)]
    engine.check_integrity()
    return bool(ok)


@click.command()
@click.option("--model", default="smollm2", show_default=True, help="model name, HF dir, or random shape")
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default="auto", show_default=True, help="auto: bfloat16 where the CPU has BF16, else float32")
@click.option("--batch-sizes", default="1,8,32", show_default=True)
@click.option("--hf-batch-sizes", default="1,8", show_default=True)
@click.option("--prompt-len", default=128, show_default=True)
@click.option("--output-len", default=128, show_default=True)
@click.option("--max-num-batched-tokens", default=2048, show_default=True,
              help="token budget per step (chunked prefill), the same for both engines: `ferry serve "
                   "instance`'s and vLLM's server's default (vLLM's offline LLM would take 4,096 on CPU)")
@click.option("--threads", type=int, default=None,
              help="torch threads for native and transformers (default: every usable core, as `ferry up "
                   "--instances 1` gives its one instance; vLLM's CPU backend binds one compute thread per core "
                   "less the one it reserves for its scheduler process, unless VLLM_CPU_OMP_THREADS_BIND and "
                   "VLLM_CPU_NUM_OF_RESERVED_CPU say otherwise: they reach its process; on a 2-core box that "
                   "other work keeps busy, 2 threads stepped 5-15x slower)")
@click.option("--no-reference", is_flag=True, help="skip transformers (throughput and correctness)")
@click.option("--repeats", default=1, show_default=True,
              help="rounds per batch size, native and vLLM taking turns; medians shown")
@click.option("--vllm-python", envvar="FERRY_VLLM_PYTHON", default=None,
              help="interpreter with vllm installed [env FERRY_VLLM_PYTHON; default: this one if it imports vllm]")
@click.option("--no-vllm", is_flag=True, help="do not run vLLM")
@click.option("--no-vllm-kernels", is_flag=True,
              help="the native engine without vLLM's CPU kernels (attention, RMSNorm, matmul handler): pure PyTorch")
@click.option("--no-shared-kv", is_flag=True,
              help="the native engine's KV cache in ordinary memory, not the memfd a same-host migration maps")
@click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True,
              help="the native engine's prefix cache (each round's prompts are new: no hits either way)")
@click.option("--vllm-log", type=click.Path(dir_okay=False), default=None, help="vLLM's own log (default: dropped)")
@click.option("--deterministic", is_flag=True,
              help="also the native engine in its deterministic mode (docs/determinism.md), taking turns with the "
                   "default on the same prompts: its tokens/s and the ratio to the default per round")
@click.option("--cap-isa", type=click.Choice(["avx2"]), default=None,
              help="run as on a CPU without AVX-512: torch, oneDNN, MKL, vLLM (both engines) and Ferry's own "
                   "choices capped at AVX2 (ferry/bench/isa.py; the instruction set, not the machine)")
@json_option()
def engine(model, device, dtype, batch_sizes, hf_batch_sizes, prompt_len, output_len, max_num_batched_tokens,
           threads, no_reference, repeats, vllm_python, no_vllm, no_vllm_kernels, no_shared_kv, prefix_caching,
           deterministic, cap_isa, vllm_log, json_path):
    """Native engine throughput vs transformers generate and vLLM (same weights, same run)."""
    from ferry.bench.isa import reexec_capped

    isa_caps = reexec_capped(cap_isa)
    import torch

    from ferry.bench.vllm_run import VllmUnavailable, find_vllm_python
    from ferry.cluster import usable_cores

    torch.set_num_threads(threads or usable_cores())
    try:
        vllm = None if no_vllm or device != "cpu" else find_vllm_python(vllm_python)
    except VllmUnavailable as e:
        raise click.ClickException(str(e)) from None

    from services.instance.engine import create_engine
    from services.instance.engine.base import EngineConfig
    from services.instance.engine.native.config import SHAPES
    from services.instance.engine.native.engine import default_block_size

    bss, hf_bss = int_list(batch_sizes), int_list(hf_batch_sizes, allow_empty=True)
    block_size = 16 if no_vllm_kernels else default_block_size(device, dtype)  # as `ferry serve instance` picks
    need_blocks = max(bss) * -(-(prompt_len + output_len) // block_size) + 8
    def native_engine(det: bool = False):
        return create_engine(EngineConfig(engine="native", model=model, device=device, dtype=dtype,
                                          num_blocks=need_blocks, block_size=block_size,
                                          max_num_batched_tokens=max_num_batched_tokens, share_kv=not no_shared_kv,
                                          prefix_caching=prefix_caching, deterministic=det,
                                          extra={"warmup": True, "vllm_kernels": not no_vllm_kernels}))

    t0 = time.perf_counter()
    eng = native_engine()
    ready_s = time.perf_counter() - t0
    det = None
    if deterministic:
        t0 = time.perf_counter()
        det = native_engine(det=True)
        det_ready_s = time.perf_counter() - t0
    dt = str(eng.dtype).replace("torch.", "")
    vocab = eng.model_config.vocab_size
    try:
        load = [round(x, 2) for x in __import__("os").getloadavg()]
    except OSError:
        load = None
    result = {"model": model, "device": device, "dtype": dt, "threads": torch.get_num_threads(), "loadavg": load,
              "prompt_len": prompt_len, "output_len": output_len, "ready_s": round(ready_s, 2),
              "max_num_batched_tokens": max_num_batched_tokens, "kv_shared_memory": eng.kv_share() is not None,
              "repeats": repeats, "native_vllm_kernels": getattr(eng.executor, "kernels", None) is not None,
              "native_prefix_caching": prefix_caching,
              "block_size": block_size, "kv_in_kernel_layout": eng.kv_layout.k_transposed,
              "native_projections": {"VllmPacked": "vLLM onednn_mm", "TorchPacked": "torch prepacked",
                                     "RowSplit": "F.linear at 1 row, else vLLM onednn_mm"}.get(
                  type(getattr(eng.executor.model, "lm_head_packed", None)).__name__, "F.linear"),
              "isa_caps": isa_caps, "native_tok_s": {}, "native_runs": {}, "transformers_tok_s": {},
              "vllm": None, "matches_reference": None,
              "deterministic": None if det is None else {
                  "compute_path": det.compute_path(), "ready_s": round(det_ready_s, 2), "tok_s": {}, "runs": {},
                  "over_default": {}, "over_default_rounds": {}, "phases": {}, "cpu_ms_per_token": {}}}
    vl = _start_vllm(vllm, model, dt, prompt_len + output_len + 16, vllm_log, max_num_batched_tokens) \
        if vllm else None
    result["vllm"] = vl if isinstance(vl, dict) else None
    for bs in bss:
        _measure(eng, vl if not isinstance(vl, dict) else None, bs,
                 lambda rep, bs=bs: random_prompts(bs, prompt_len, vocab, bs + 1000 * rep), output_len, repeats, result,
                 det)
    if vl is not None and not isinstance(vl, dict):
        vl.close()
    for e in (eng, det):
        if e is not None:
            e.check_integrity()
    del eng, det
    if not no_reference and model not in SHAPES:
        from transformers import AutoModelForCausalLM

        from libs.common.models import ensure_model

        mdir = ensure_model(model)
        hf = AutoModelForCausalLM.from_pretrained(mdir, dtype=getattr(torch, dt)).to(device).eval()
        for bs in hf_bss:
            result["transformers_tok_s"][str(bs)] = round(
                hf_tok_s(hf, random_prompts(bs, prompt_len, vocab, bs), output_len, device), 2)
            click.echo(f"transformers bs={bs}: {result['transformers_tok_s'][str(bs)]} tok/s", err=True)
        del hf
        result["matches_reference"] = reference_check(mdir, device)
    base = result["transformers_tok_s"].get("1")
    top = result["native_tok_s"].get(str(max(bss)))
    if base and top:
        result[f"speedup_native_bs{max(bss)}_vs_transformers_bs1"] = round(top / base, 2)
    report(result, json_path, lambda r: _print_table(r, bss, hf_bss))


def _start_vllm(vllm: tuple[str, str], model: str, dtype: str, max_len: int, log_path: str | None,
                max_num_batched_tokens: int | None = None):
    """A running VllmOffline, or the result's ``vllm`` entry saying why not."""
    from ferry.bench.vllm_run import VllmOffline, VllmUnavailable
    from libs.common.models import ensure_model

    python, version = vllm
    click.echo(f"starting vLLM {version} under {python} ...", err=True)
    try:
        return VllmOffline(python, str(ensure_model(model)), dtype, max_len, log_path,
                           max_num_batched_tokens=max_num_batched_tokens)
    except VllmUnavailable as e:
        click.echo(f"vLLM failed: {e}", err=True)
        return {"python": python, "version": version, "error": str(e)}


def _measure(eng, vl, bs: int, prompts_of, output_len: int, repeats: int, result: dict, det=None) -> None:
    """``repeats`` rounds of native, the deterministic native engine (``det``)
    and vLLM (if running) on the same prompts (``prompts_of(round)``: new ones
    every round, the same for every side), taking turns (the order reverses
    every round), so each round's ratios are measured under the same machine
    load. Beside wall-clock tok/s, CPU milliseconds per output token (all of
    each side's processes): on a loaded machine the share of the cores each
    side gets swings, its CPU cost per token much less."""
    key = str(bs)
    runs: dict[str, list[dict]] = {"native": [], "deterministic": [], "vllm": []}

    def vllm_run(prompts) -> dict:
        first = vl.generate(prompts, 1)  # its prefill: the same prompts with one output token
        return {**vl.generate(prompts, output_len), "prefill_s": first["seconds"]}

    for rep in range(repeats):
        prompts = prompts_of(rep)
        turns = [("native", lambda: native_run(eng, prompts, output_len))]
        if det is not None:
            turns.append(("deterministic", lambda: native_run(det, prompts, output_len)))
        if vl is not None:
            turns.append(("vllm", lambda: vllm_run(prompts)))
        for name, run in turns[:: -1 if rep % 2 else 1]:
            runs[name].append(run())
        click.echo(f"bs={bs} round {rep + 1}: " + "  ".join(
            f"{n} {r[-1]['tok_s']:.2f} tok/s" for n, r in runs.items() if r), err=True)

    def side(name: str, into: dict, prefix: str = "") -> list[float]:
        """One side's rounds into ``into``: tok/s of each and their median, CPU ms per token, the phases."""
        tok_s = [r["tok_s"] for r in runs[name]]
        into.setdefault(prefix + "runs", {})[key] = [round(x, 2) for x in tok_s]
        into.setdefault(prefix + "tok_s", {})[key] = round(median(tok_s), 2)
        into.setdefault(prefix + "cpu_ms_per_token", {})[key] = _cpu_ms(runs[name])
        into.setdefault(prefix + "phases", {})[key] = _phases(runs[name], output_len)
        return tok_s

    native = side("native", result, "native_")
    if det is not None:
        d = result["deterministic"]
        mine = side("deterministic", d)
        d["over_default_rounds"][key] = [round(m / n, 3) for m, n in zip(mine, native)]
        d["over_default"][key] = round(median(d["over_default_rounds"][key]), 3)
    if vl is None:
        return
    v = result["vllm"] = result["vllm"] or {
        "python": vl.proc.args[0], "version": vl.version, "error": None, "tok_s": {}, "runs": {},
        "cpu_ms_per_token": {}, "native_over_vllm": {}, "native_over_vllm_rounds": {},
        "settings": _vllm_settings()}
    other = side("vllm", v)
    rounds = [n / o for n, o in zip(native, other)]
    v["native_over_vllm_rounds"][key] = [round(x, 3) for x in rounds]
    v["native_over_vllm"][key] = round(median(rounds), 3)


def _phases(runs: list[dict], output_len: int) -> dict:
    """Medians over the rounds: prefill seconds and decode milliseconds per output step."""
    pre = median(r.get("prefill_s") for r in runs)
    dec = median(decode_step_ms(r["seconds"], r.get("prefill_s"), output_len) for r in runs)
    return {"prefill_s": None if pre is None else round(pre, 3), "decode_step_ms": None if dec is None else round(dec, 2)}


def _cpu_ms(runs: list[dict]) -> float | None:
    m = median(1000 * r["cpu_s"] / r["tokens"] for r in runs if r.get("cpu_s") is not None and r["tokens"])
    return None if m is None else round(m, 2)


def _print_table(r: dict, bss: list[int], hf_bss: list[int]) -> None:
    click.echo(f"model {r['model']}  device {r['device']}  dtype {r['dtype']}  threads {r['threads']}  "
               f"prompt {r['prompt_len']}  output {r['output_len']}  budget {r['max_num_batched_tokens']} tokens/step  "
               f"repeats {r['repeats']} (medians)  "
               f"native: vLLM kernels {'on' if r.get('native_vllm_kernels') else 'off'}, "
               f"projections {r.get('native_projections')}")
    vllm = r["vllm"]["tok_s"] if r["vllm"] and not r["vllm"].get("error") else None
    head = f"{'batch':>5}  {'native tok/s':>12}  {'transformers tok/s':>18}"
    click.echo(head + (f"  {'vLLM tok/s':>10}  {'native/vLLM':>11}  {'CPU ms/token native':>19}  {'vLLM':>6}"
                       if vllm else ""))
    for bs in sorted(set(bss) | set(hf_bss)):
        n = r["native_tok_s"].get(str(bs), "-")
        h = r["transformers_tok_s"].get(str(bs), "-")
        row = f"{bs:>5}  {n:>12}  {h:>18}"
        if vllm:
            row += (f"  {vllm.get(str(bs), '-'):>10}  {r['vllm']['native_over_vllm'].get(str(bs), '-'):>11}"
                    f"  {r.get('native_cpu_ms_per_token', {}).get(str(bs), '-')!s:>19}"
                    f"  {r['vllm']['cpu_ms_per_token'].get(str(bs), '-')!s:>6}")
        click.echo(row)
    phases = r["vllm"].get("phases", {}) if vllm else {}
    click.echo(f"{'batch':>5}  {'prefill s native':>16}" + (f"  {'vLLM':>6}" if vllm else "")
               + f"  {'decode ms/step native':>21}" + (f"  {'vLLM':>6}" if vllm else ""))
    for bs in bss:
        n = r.get("native_phases", {}).get(str(bs), {})
        v = phases.get(str(bs), {})
        click.echo(f"{bs:>5}  {n.get('prefill_s', '-')!s:>16}" + (f"  {v.get('prefill_s', '-')!s:>6}" if vllm else "")
                   + f"  {n.get('decode_step_ms', '-')!s:>21}"
                   + (f"  {v.get('decode_step_ms', '-')!s:>6}" if vllm else ""))
    d = r.get("deterministic")
    if d:
        click.echo(f"deterministic mode: {d['compute_path']}")
        click.echo(f"{'batch':>5}  {'det. tok/s':>10}  {'det./default':>12}  {'rounds':>22}  {'prefill s':>9}"
                   f"  {'decode ms/step':>14}")
        for bs in bss:
            k = str(bs)
            ph = d["phases"].get(k, {})
            click.echo(f"{bs:>5}  {d['tok_s'].get(k, '-')!s:>10}  {d['over_default'].get(k, '-')!s:>12}  "
                       f"{' '.join(str(x) for x in d['over_default_rounds'].get(k, [])):>22}  "
                       f"{ph.get('prefill_s', '-')!s:>9}  {ph.get('decode_step_ms', '-')!s:>14}")
    if r["vllm"] is None:
        click.echo("vLLM: not run (no interpreter with vllm; --vllm-python PATH)")
    elif r["vllm"].get("error"):
        click.echo("vLLM: failed (see the JSON's vllm.error)")
    click.echo(f"ready in {r['ready_s']} s (construction + warmup, cached model); "
               f"matches_reference: {r['matches_reference']}")
