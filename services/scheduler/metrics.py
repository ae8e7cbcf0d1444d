"""The scheduler's metrics (exported on its --metrics-port): how long a
dispatch decision takes and how it ends, migrate-out orders and the
migrations they ran by outcome with their downtime (from the source's reply),
how late instances' status reports arrive, and, read at scrape time from the
scheduler's own view, each instance's load as dispatch sees it (freeness,
queue, KV use, migrations in flight, the age of its last report) and the
prefix index's size. Per-instance series carry ``instance_id`` (Prometheus
keeps ``instance`` for the scrape target). Registered by ``export`` only:
every process imports this module (the scheduler's options are everyone's
``ferry serve``), only the scheduler serves it."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import Counter, Histogram
from prometheus_client.core import REGISTRY, GaugeMetricFamily

DISPATCH_SECONDS = Histogram("ferry_scheduler_dispatch_seconds", "Time to decide one dispatch (in the scheduler)",
                             buckets=(2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.05, 0.1), registry=None)
DISPATCHES = Counter("ferry_scheduler_dispatches_total", "Dispatch decisions by outcome (placed, unavailable: "
                     "no live instance or no view yet, error)", ["outcome"], registry=None)
ORDERS = Counter("ferry_scheduler_migrate_out_orders_total", "Migrate-out orders sent, by how the call ended "
                 "(ok, failed)", ["outcome"], registry=None)
MIGRATIONS = Counter("ferry_scheduler_migrations_total", "Migrations the orders ran, by outcome (committed, "
                     "aborted), as their sources reported", ["outcome"], registry=None)
DOWNTIME = Histogram("ferry_scheduler_migration_downtime_seconds", "Downtime of committed migrations (suspend at "
                     "the source to the first step at the destination), as their sources reported",
                     buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 2.5), registry=None)
REPORT_LAG = Histogram("ferry_scheduler_report_lag_seconds", "From an instance's status report being made to the "
                       "scheduler's view having it (through the meta store)",
                       buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
                       registry=None)
# Programs (libs/common/programs.py), aggregated over programs: never labelled by program id.
PROGRAM_TURNS = Counter("ferry_scheduler_program_turns_total", "Dispatched turns of named programs (agent "
                        "sessions), by turn: first (the program's first seen here) or returning", ["turn"],
                        registry=None)
PROGRAM_PROMPT_TOKENS = Counter("ferry_scheduler_program_prompt_tokens_total", "Prompt tokens of named programs' "
                                "turns, by turn (first, returning) and source: cached (the chosen instance's held "
                                "prefix, as the prefix index had it at dispatch; prefix-blind policies look none "
                                "up) or computed", ["turn", "source"], registry=None)

CACHE_MOVE_ORDERS = Counter("ferry_scheduler_cache_move_orders_total", "Cache move orders sent (programs' kept "
                            "blocks, llumnix-move), by how the call ended (done, failed)", ["outcome"], registry=None)


def program_turn(turns: int, prompt_tokens: int, cached_tokens: int) -> None:
    """A program's turn dispatched (``turns``: its count so far, this one included)."""
    turn = "first" if turns == 1 else "returning"
    PROGRAM_TURNS.labels(turn).inc()
    PROGRAM_PROMPT_TOKENS.labels(turn, "cached").inc(cached_tokens)
    PROGRAM_PROMPT_TOKENS.labels(turn, "computed").inc(prompt_tokens - cached_tokens)


def order_done(result) -> None:
    """A migrate-out order's result (libs/common/types.OrderResult): its
    migrations by outcome, and their downtime."""
    ORDERS.labels("ok").inc()
    for r in result.results:
        MIGRATIONS.labels("committed" if r.committed else "aborted").inc()
        if r.committed and r.downtime_ms > 0:
            DOWNTIME.observe(r.downtime_ms / 1000)


class ReportLag:
    """A view listener: each new status report's lag, once (a dispatch also
    touches an instance; its report is not new then)."""

    def __init__(self, view, clock: Callable[[], float] = time.time):
        self.view = view
        self.clock = clock
        self._seen: dict[str, int] = {}

    def __call__(self, instance_id: str) -> None:
        rec = self.view.records.get(instance_id)
        if rec is None or rec.status is None:
            self._seen.pop(instance_id, None)
            return
        s = rec.status
        if self._seen.get(instance_id) != s.seq:
            self._seen[instance_id] = s.seq
            if s.timestamp > 0:
                REPORT_LAG.observe(max(0.0, self.clock() - s.timestamp))


class ViewCollector:
    """The scheduler's view at scrape time."""

    def __init__(self, svc, clock: Callable[[], float] = time.time):
        self.svc = svc
        self.clock = clock

    def describe(self):
        return []

    def collect(self):
        svc, now = self.svc, self.clock()
        if svc is None:
            return
        per = {name: GaugeMetricFamily(f"ferry_scheduler_instance_{name}", doc, labels=["instance_id"])
               for name, doc in (
                   ("freeness", "Freeness (free KV blocks per running request, Llumnix) as dispatch sees it"),
                   ("running", "Running requests, as last reported"),
                   ("waiting", "Waiting requests, as last reported"),
                   ("kv_usage", "Used KV blocks / all (a fraction), as last reported"),
                   ("migrating_in", "Migrations into the instance under way, as last reported"),
                   ("migrating_out", "Migrations out of the instance under way, as last reported"),
                   ("report_age_seconds", "Time since the instance's last status report was made"),
               )}
        states = {"serving": 0, "terminating": 0, "unschedulable": 0, "unreported": 0}
        for iid, rec in list(svc.view.records.items()):
            s = rec.status
            if s is None:
                states["unreported"] += 1
                continue
            states["terminating" if s.terminating else "unschedulable" if s.unschedulable else "serving"] += 1
            for name, v in (("freeness", s.freeness), ("running", s.num_running), ("waiting", s.num_waiting),
                            ("kv_usage", (s.total_blocks - s.free_blocks) / max(1, s.total_blocks)),
                            ("migrating_in", s.migrating_in), ("migrating_out", s.migrating_out),
                            ("report_age_seconds", max(0.0, now - s.timestamp) if s.timestamp else 0.0)):
                per[name].add_metric([iid], v)
        yield from per.values()
        g = GaugeMetricFamily("ferry_scheduler_instances", "Instances in the scheduler's view, by state",
                              labels=["state"])
        for state, n in states.items():
            g.add_metric([state], n)
        yield g
        r = svc.rescheduler
        yield GaugeMetricFamily("ferry_scheduler_migrate_out_orders_in_flight",
                                "Migrate-out orders under way (one per source at most)",
                                value=len(r.busy) if r is not None else 0)
        yield GaugeMetricFamily("ferry_scheduler_leader", "1 while this scheduler runs the rescheduling, scaling "
                                "and KunServe loops", value=1 if svc.leadership is not None and svc.leadership.is_leader else 0)
        kv = svc.kv_index
        yield GaugeMetricFamily("ferry_scheduler_prefix_index_entries", "(instance, block hash) pairs in the "
                                "cluster's prefix index", value=kv.index.num_entries if kv is not None else 0)
        yield GaugeMetricFamily("ferry_scheduler_prefix_index_instances", "Instances whose KV events the prefix "
                                "index follows (synced)", value=len(kv.synced) if kv is not None else 0)


_VIEW = ViewCollector(None)


def export(svc) -> None:
    """Serve ``svc``'s metrics from this process's registry (one scheduler per
    process: a later call replaces the view read)."""
    if _VIEW.svc is None:
        for m in (DISPATCH_SECONDS, DISPATCHES, ORDERS, MIGRATIONS, DOWNTIME, REPORT_LAG, PROGRAM_TURNS,
                  PROGRAM_PROMPT_TOKENS, CACHE_MOVE_ORDERS, _VIEW):
            REGISTRY.register(m)
    _VIEW.svc = svc
    svc.view.listeners.append(ReportLag(svc.view))
