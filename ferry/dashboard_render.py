"""``ferry dashboards --render``: each dashboard's panels plotted with
matplotlib from the same PromQL its panels hold, queried from a Prometheus
over a time range: the dashboards' screenshots where no Grafana runs (Grafana
is not packaged for Debian; docs/observability.md shows these)."""

from __future__ import annotations

import math
import pathlib
import re
import time

import httpx

from ferry.dashboards import BOARDS, Board

_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def _query_range(url: str, expr: str, start: float, end: float, step_s: float) -> list[dict]:
    r = httpx.get(f"{url}/api/v1/query_range", params={"query": expr, "start": start, "end": end,
                                                        "step": f"{step_s:g}s"}, timeout=30)
    body = r.json()
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body.get('error', body)}")
    return body["data"]["result"]


def _legend(fmt: str, labels: dict) -> str:
    if not fmt or fmt == "__auto":
        return ",".join(f"{k}={v}" for k, v in labels.items() if k != "__name__") or "value"
    return _LEGEND.sub(lambda m: labels.get(m.group(1), ""), fmt)


def render_board(board: Board, url: str, start: float, end: float, out: pathlib.Path,
                 rate_interval: str = "30s", step_s: float = 2.0) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 3
    rows = math.ceil(len(board.panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.2 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, board.panels):
        for q in panel.queries:
            expr = q.expr.replace("$__rate_interval", rate_interval).replace("$instance_id", ".*")
            for series in _query_range(url, expr, start, end, step_s):
                xs = [float(t) - start for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                ax.plot(xs, ys, label=_legend(q.legend, series["metric"]), linewidth=1.4)
        ax.set_title(panel.title, fontsize=10, loc="left")
        ax.set_xlabel("s", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if panel.unit == "percentunit":
            ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        elif panel.unit == "s":
            ax.set_ylabel("s", fontsize=8)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
    for ax in list(axes.flat)[len(board.panels):]:
        ax.axis("off")
    fig.suptitle(f"{board.title}  (panels from deploy/grafana/dashboards/{board.uid}.json, "
                 f"queried from Prometheus; {time.strftime('%Y-%m-%d %H:%M', time.localtime(end))})", fontsize=11)
    fig.tight_layout()
    path = out / f"{board.uid}.png"
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def render_all(url: str, start: float, end: float, out: pathlib.Path) -> list[pathlib.Path]:
    return [render_board(b, url, start, end, out) for b in BOARDS]
