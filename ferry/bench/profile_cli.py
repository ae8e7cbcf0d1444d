"""``ferry profile``: measure the native engine on this machine and write a sim
profile (the JSON format of services/instance/engine/profiles), so sim
instances can mirror the real engine.

Measured directly on an engine (no services):
- prefill: one request of each ``--prefill-lens`` length, the step that
  prefills it timed; ``prefill_ms_per_token`` is the least-squares slope;
- decode: ``--batch-sizes`` requests of each ``--context-lens`` prompt
  length, prefilled first (not timed), then ``--steps`` decode steps timed;
  ``decode_base_ms + decode_ms_per_seq * batch + decode_ms_per_kv_token *
  kv_tokens`` is fitted by least squares (non-negative coefficients).
The JSON keeps every measured point and the fit's error, and says where,
when and how it was measured.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import time

import click
import numpy as np


def fit_step_model(points: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """(base_ms, ms_per_seq, ms_per_kv_token) minimising squared error over
    (batch, kv_tokens, step_ms) points, every coefficient >= 0 (a coefficient
    the data drive negative is dropped and the rest refitted)."""
    if not points:
        raise ValueError("no decode points to fit")
    a = np.array([[1.0, b, kv] for b, kv, _ in points])
    y = np.array([ms for _, _, ms in points])
    keep = [0, 1, 2]
    while True:
        coef, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    out = [0.0, 0.0, 0.0]
    for k, c in zip(keep, coef):
        out[k] = max(0.0, float(c))
    return out[0], out[1], out[2]


def fit_slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope (ms per token) of (tokens, ms) points, >= 0."""
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    if len(points) < 2 or np.ptp(x) == 0:
        return max(0.0, float(y.mean() / max(1.0, x.mean())))
    return max(0.0, float(np.polyfit(x, y, 1)[0]))


def _prompt(n: int, vocab: int, rng: np.random.Generator) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(100, max(101, vocab), n))


def measure_prefill(engine, lengths: list[int], vocab: int, rng, repeats: int = 2) -> list[tuple[int, float]]:
    from libs.common.types import SamplingParams
    from services.instance.engine.base import EngineRequest

    points = []
    for n in lengths:
        best = float("inf")
        for r in range(repeats):
            engine.add_request(EngineRequest(f"prefill-{n}-{r}", _prompt(n, vocab, rng),
                                             SamplingParams(max_tokens=1, ignore_eos=True)))
            t0 = time.perf_counter()
            engine.step()  # the whole prompt fits the step's token budget (checked by the caller)
            best = min(best, (time.perf_counter() - t0) * 1000)
            while engine.has_work():
                engine.step()
        points.append((n, best))
    return points


def decode_tokens(batch: int, context: int, steps: int, budget: int) -> int:
    """Output tokens each request needs to still be running in the timed
    steps: requests prefilled early decode while later ones prefill (chunked
    at ``budget`` tokens per step)."""
    from services.instance.engine.core.scheduler import cdiv

    return steps + 2 + cdiv(batch * context, budget)


def measure_decode(engine, batch: int, context: int, steps: int, vocab: int, rng,
                   budget: int = 2048) -> list[tuple[int, int, float]]:
    from libs.common.types import SamplingParams
    from services.instance.engine.base import EngineRequest

    ids = [f"decode-{batch}-{context}-{i}" for i in range(batch)]
    max_tokens = decode_tokens(batch, context, steps, budget)
    for rid in ids:
        engine.add_request(EngineRequest(rid, _prompt(context, vocab, rng),
                                         SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    started: set[str] = set()
    while len(started) < batch:  # prefill everything (not timed): each request's first token
        started.update(o.request_id for o in engine.step())
    points = []
    for i in range(steps):
        kv = sum(r.num_tokens for r in engine.load().requests)
        t0 = time.perf_counter()
        engine.step()
        points.append((batch, kv, (time.perf_counter() - t0) * 1000))
    for rid in ids:
        engine.abort_request(rid)
    return points


@click.command("profile")
@click.option("--json", "json_path", required=True, help="write the sim profile here")
@click.option("--model", default="smollm2", show_default=True, help="model name, directory or random-weight shape")
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option("--num-blocks", type=click.IntRange(1), default=None, help="KV blocks (default: the engine's)")
@click.option("--block-size", type=click.IntRange(1), default=16, show_default=True)
@click.option("--prefill-lens", default="64,256,512,1024", show_default=True)
@click.option("--batch-sizes", default="1,4,16", show_default=True)
@click.option("--context-lens", default="64,512", show_default=True)
@click.option("--steps", type=click.IntRange(1), default=6, show_default=True, help="decode steps timed per point")
@click.option("--name", default=None, help="profile name (default: <model>-<device>-measured)")
@click.option("--seed", type=int, default=0, show_default=True)
def profile(json_path, model, device, dtype, num_blocks, block_size, prefill_lens, batch_sizes, context_lens,
            steps, name, seed) -> None:
    """Measure the native engine here and write a sim profile (JSON)."""
    import torch

    from ferry.bench.harness import int_list
    from ferry.machine import write_json
    from services.instance.engine import create_engine
    from services.instance.engine.base import EngineConfig, EngineError

    prefill_lens, batch_sizes, context_lens = int_list(prefill_lens), int_list(batch_sizes), int_list(context_lens)
    budget = max(2048, max(prefill_lens))
    try:
        engine = create_engine(EngineConfig(engine="native", model=model, device=device, dtype=dtype,
                                            num_blocks=num_blocks, block_size=block_size,
                                            max_num_batched_tokens=budget,
                                            max_num_seqs=max(256, max(batch_sizes)), seed=seed))
    except EngineError as e:
        raise click.UsageError(f"cannot build the engine: {e} (raise --num-blocks?)") from e
    from services.instance.engine.core.scheduler import cdiv

    top_b, top_c = max(batch_sizes), max(context_lens)
    need = max(max(prefill_lens),
               top_b * cdiv(top_c + decode_tokens(top_b, top_c, steps, budget), block_size) * block_size)
    capacity = engine.num_total_blocks * block_size
    if need > capacity or max(prefill_lens) + 1 > engine.max_model_len:
        raise click.UsageError(f"the measurement needs {need} KV tokens and {max(prefill_lens) + 1} context; "
                               f"the engine has {capacity} and {engine.max_model_len}: lower the lengths or "
                               f"raise --num-blocks")
    vocab = getattr(getattr(engine, "model_config", None), "vocab_size", 32000)
    rng = np.random.default_rng(seed)
    measure_decode(engine, 1, 16, 2, vocab, rng)  # warm up the kernels
    pre = measure_prefill(engine, prefill_lens, vocab, rng)
    dec = []
    for c in context_lens:
        for b in batch_sizes:
            dec += measure_decode(engine, b, c, steps, vocab, rng, budget)
    engine.check_integrity()
    base, per_seq, per_kv = fit_step_model(dec)
    per_tok = fit_slope(pre)
    pred = np.array([base + per_seq * b + per_kv * kv for b, kv, _ in dec])
    meas = np.array([ms for _, _, ms in dec])
    rel_err = float(np.mean(np.abs(pred - meas) / meas))
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    prof = {
        "name": name or f"{model}-{device}-measured",
        "model": f"{model} ({dtype}) on {device}, measured by `ferry profile`",
        "block_size": block_size,
        "kv_capacity_tokens": capacity,
        "max_model_len": int(engine.max_model_len),
        "prefill_ms_per_token": per_tok,
        "decode_base_ms": base,
        "decode_ms_per_seq": per_seq,
        "decode_ms_per_kv_token": per_kv,
        "source": (f"Measured {when} on {platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, "
                   f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
                   f"{os.getloadavg()[0]:.2f}): prefill slope over {len(pre)} prompt lengths; decode step "
                   f"least squares over {len(dec)} steps (batch {batch_sizes} x context {context_lens}), "
                   f"mean relative error {rel_err:.1%}."),
        "measured": {"prefill": [{"tokens": n, "ms": ms} for n, ms in pre],
                     "decode": [{"batch": b, "kv_tokens": kv, "ms": ms} for b, kv, ms in dec],
                     "decode_fit_mean_relative_error": rel_err},
    }
    write_json(json_path, prof)
    click.echo(f"{'':10}{'batch':>7}{'kv tokens':>11}{'measured ms':>13}{'fitted ms':>11}")
    for (b, kv, ms), p in zip(dec[steps - 1::steps], pred[steps - 1::steps]):
        click.echo(f"{'decode':10}{b:>7}{kv:>11}{ms:>13.2f}{p:>11.2f}")
    for n, ms in pre:
        click.echo(f"{'prefill':10}{n:>7}{'':>11}{ms:>13.2f}{per_tok * n:>11.2f}")
    click.echo(f"decode_base_ms {base:.3f}, decode_ms_per_seq {per_seq:.4f}, decode_ms_per_kv_token {per_kv:.6f}, "
               f"prefill_ms_per_token {per_tok:.4f} (decode fit error {rel_err:.1%})")
    click.echo(f"wrote {json_path}; use it with --profile {json_path}")
