"""The scheduler of ``ferry bench control-plane``: the real SchedulerService
in its own process, as ``ferry serve scheduler`` runs it, with its cluster
view's per-record update hook timed: report lag is the time from a status's
timestamp (its sender's clock, this host) to the view taking it in.

SIGUSR1 starts the measurement window (drops earlier samples); SIGUSR2
writes the window's percentiles to ``--stats-file``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

import click

from ferry.measure.metrics import percentile
from libs.common.config import click_options


def _stats(lags: list[float]) -> dict:
    if not lags:
        return {"n": 0}
    qs = {"p50": 50, "p90": 90, "p99": 99, "p999": 99.9, "max": 100}
    return {"n": len(lags), **{k: round(percentile(lags, q), 2) for k, q in qs.items()}}


def main() -> None:
    from ferry.serve_cli import _setup, _started
    from libs.common.server import run, serve
    from services.scheduler.service import SchedulerConfig, SchedulerService

    @click.command()
    @click.option("--stats-file", required=True)
    @click_options(SchedulerConfig)
    def cmd(stats_file, **options) -> None:
        cfg = _setup(SchedulerConfig, options, "scheduler")
        svc = SchedulerService(cfg)
        lags: list[float] = []
        recording = [False]
        settle = svc.view._settle

        def timed_settle(rec):
            settle(rec)
            if recording[0] and rec.status is not None and rec.status.timestamp:
                lags.append((time.time() - rec.status.timestamp) * 1000)
        svc.view._settle = timed_settle
        # The placement itself (index refresh and choice, or the policy over
        # the view): what the scheduler adds to a dispatch besides gRPC.
        places: list[float] = []
        place = svc.place

        def timed_place(req):
            t0 = time.perf_counter()
            try:
                return place(req)
            finally:
                if recording[0]:
                    places.append((time.perf_counter() - t0) * 1000)
        svc.place = timed_place

        def start_window():
            lags.clear()
            places.clear()
            recording[0] = True

        def write_stats():
            recording[0] = False
            tmp = stats_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump({**_stats(lags), "place_ms": _stats(places)}, f)
            os.replace(tmp, stats_file)

        async def ready(address):
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGUSR1, start_window)
            loop.add_signal_handler(signal.SIGUSR2, write_stats)
            _started(cfg)(address)

        sys.exit(run(serve(svc, cfg.host, cfg.port, ready=ready)))

    cmd()
