"""PNG plots of one or several benchmark runs: TTFT CDF, latency bars,
freeness timeline. Every function takes ``runs``: {label: run dict} where a run
dict is what serving writes (``summary``, ``requests``, ``samples``)."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

METRICS = (("ttft_ms", "TTFT"), ("decode_ms", "decode / token"), ("e2e_ms", "end-to-end"))


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ttfts(run: dict) -> np.ndarray:
    scale = run.get("time_scale", 1.0) or 1.0
    return np.sort([r["ttft_s"] * 1000.0 / scale for r in run["requests"] if r["ttft_s"] is not None
                    and r["error"] is None])


def ttft_cdf(runs: dict[str, dict], path: str) -> str:
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, run in runs.items():
        x = _ttfts(run)
        if len(x):
            ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title("TTFT CDF")
    return _save(fig, path)


def latency_bars(runs: dict[str, dict], path: str) -> str:
    labels = list(runs)
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.8))
    width = 0.8 / max(1, len(labels))
    for ax, (key, title) in zip(axes, METRICS):
        for i, label in enumerate(labels):
            s = runs[label]["summary"][key]
            vals = [s["mean"] or 0.0, s["p99"] or 0.0]
            ax.bar(np.arange(2) + i * width, vals, width, label=label)
        ax.set_xticks(np.arange(2) + width * (len(labels) - 1) / 2, ["mean", "p99"])
        ax.set_title(f"{title} (ms)")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    return _save(fig, path)


def freeness_timeline(runs: dict[str, dict], path: str) -> str | None:
    """One panel per run: every instance's freeness over time, and the
    cluster's waiting requests on a second axis."""
    runs = {k: v for k, v in runs.items() if v.get("samples")}
    if not runs:
        return None
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 2.8 * len(runs)), squeeze=False, sharex=True)
    for ax, (label, run) in zip(axes[:, 0], runs.items()):
        samples = run["samples"]
        t0 = samples[0]["t"]
        ids = sorted({iid for s in samples for iid in s["instances"]})
        for iid in ids:
            pts = [(s["t"] - t0, s["instances"][iid]["freeness"]) for s in samples if iid in s["instances"]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=0.7)
        ax.set_ylabel("freeness")
        ax.set_title(f"{label}: freeness per instance ({len(ids)}), waiting requests (dashed)", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax2 = ax.twinx()
        ax2.plot([s["t"] - t0 for s in samples],
                 [sum(i["num_waiting"] for i in s["instances"].values()) for s in samples], "k--", lw=0.8)
        ax2.set_ylabel("waiting")
    axes[-1, 0].set_xlabel("time (s, wall)")
    return _save(fig, path)


def hit_rate_timeline(runs: dict[str, dict], path: str, window: int = 10) -> str | None:
    """The cluster's prefix-cache hit rate over time per policy (hits /
    lookups over the last ``window`` samples), from the samples' cumulative
    ``prefix_hits`` and ``prefix_queries`` (the simulator's)."""
    series = {label: run["samples"] for label, run in runs.items()
              if run.get("samples") and "prefix_queries" in run["samples"][0]}
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, samples in series.items():
        t = np.array([s["t"] for s in samples])
        q = np.array([s["prefix_queries"] for s in samples], dtype=float)
        h = np.array([s["prefix_hits"] for s in samples], dtype=float)
        dq, dh = q[window:] - q[:-window], h[window:] - h[:-window]
        # no lookups in the window (no arrivals): a gap in the line, not a jump across it
        rate = np.divide(dh, dq, out=np.full_like(dh, np.nan), where=dq > 0)
        ax.plot(t[window:], rate, label=label)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("hit rate (blocks)")
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"prefix-cache hit rate over the last {window} samples")
    return _save(fig, path)


def migration_blocks(runs: dict[str, dict], path: str) -> str | None:
    """KV blocks moved by committed migrations per policy: sent, and linked
    at the destination from its prefix cache instead (what a prefix-blind
    migration of the same requests would have sent on top)."""
    rows = [(label, run["sim"]["migration_blocks_sent"], run["sim"]["migration_blocks_linked"])
            for label, run in runs.items() if "migration_blocks_sent" in run.get("sim", {})]
    if not rows or not any(s + k for _, s, k in rows):
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(rows))
    sent = np.array([s for _, s, _ in rows])
    linked = np.array([k for _, _, k in rows])
    ax.bar(x, sent, label="sent")
    ax.bar(x, linked, bottom=sent, label="linked (not sent)")
    ax.set_xticks(x, [r[0] for r in rows], rotation=20, fontsize=8)
    ax.set_ylabel("KV blocks of committed migrations")
    ax.legend()
    ax.set_title("blocks migrated per policy")
    return _save(fig, path)


def write_all(runs: dict[str, dict], folder: str) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    out = [ttft_cdf(runs, os.path.join(folder, "ttft_cdf.png")),
           latency_bars(runs, os.path.join(folder, "latency.png")),
           freeness_timeline(runs, os.path.join(folder, "freeness.png")),
           hit_rate_timeline(runs, os.path.join(folder, "hit_rate.png")),
           migration_blocks(runs, os.path.join(folder, "migration_blocks.png"))]
    return [p for p in out if p]
