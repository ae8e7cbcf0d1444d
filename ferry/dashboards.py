"""``ferry dashboards``: Ferry's Grafana dashboards (cluster, instances,
migration, prefix cache, control plane), built with Grafana's Foundation
SDK and written as JSON into deploy/grafana/dashboards/ (``--check``: fail
when the committed files are not what this builds). Every panel's query reads
the metrics of the processes' /metrics under the jobs `ferry up`'s file_sd
targets name (ferry/targets.py); tests/deploy/test_prometheus_live.py runs
each one against a real Prometheus scraping a loaded cluster, and
``ferry dashboards --render`` plots each panel from the same queries."""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

import click

OUT = pathlib.Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "dashboards"
RATE = "$__rate_interval"
INST = 'instance_id=~"$instance_id"'


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    description: str = ""
    stat: bool = False  # a single number, not a time series


@dataclass(frozen=True)
class Board:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]
    per_instance: bool = False  # has the $instance_id variable


def _q(expr: str, legend: str = "") -> Query:
    return Query(expr, legend)


def _quantiles(metric: str, by: str = "", selector: str = "", qs=(0.5, 0.99)) -> tuple[Query, ...]:
    group = f"le, {by}" if by else "le"
    label = f"{{{{{by}}}}} " if by else ""
    return tuple(_q(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
                    f"{label}p{int(q * 100)}") for q in qs)


def _rate(metric: str, by: str = "", selector: str = "") -> str:
    agg = f"sum by ({by})" if by else "sum"
    return f"{agg} (rate({metric}{{{selector}}}[{RATE}]))"


FRONTEND = 'job="ferry-frontend"'

BOARDS = (
    Board("ferry-cluster", "Ferry / Cluster", "Requests as clients see them (the frontends), and the cluster's size",
          (
              Panel("Requests by status", (_q(_rate("ferry_requests_total", "status", FRONTEND), "{{status}}"),),
                    "reqps"),
              Panel("Time to first token", _quantiles("ferry_time_to_first_token_seconds", selector=FRONTEND), "s",
                    "From the request's arrival at the frontend to its first token (dispatch, queue, prefill)"),
              Panel("Inter-token latency", _quantiles("ferry_inter_token_latency_seconds", selector=FRONTEND), "s",
                    "Between two tokens of a request, as the frontend delivers them (migrations' downtime included)"),
              Panel("End-to-end latency", _quantiles("ferry_request_latency_seconds", selector=FRONTEND), "s"),
              Panel("Tokens delivered", (_q(_rate("ferry_generated_tokens_total", selector=FRONTEND), "tokens/s"),),
                    "short"),
              Panel("Requests in flight", (_q(f"sum(ferry_requests_in_flight{{{FRONTEND}}})", "in flight"),),
                    "short"),
              Panel("Server errors (5xx share)", (_q(
                  f'(sum(rate(ferry_requests_total{{{FRONTEND}, status=~"5.."}}[{RATE}])) or vector(0)) '
                  f"/ sum(rate(ferry_requests_total{{{FRONTEND}}}[{RATE}]))", "5xx"),), "percentunit"),
              Panel("Migrations followed and resumes", (
                  _q(_rate("ferry_migrations_followed_total", selector=FRONTEND), "followed moves/s"),
                  _q(_rate("ferry_resumes_total", selector=FRONTEND), "resumes/s")), "short",
                    "Streams re-attached after a live migration; requests resumed elsewhere by recompute"),
              Panel("Instances", (_q("ferry_scheduler_instances", "{{state}}"),), "short",
                    "Instances in the scheduler's view, by state", stat=True),
          )),
    Board("ferry-instances", "Ferry / Instances", "Each instance's load, under vLLM's metric names",
          (
              Panel("Running requests", (_q(f"vllm:num_requests_running{{{INST}}}", "{{instance_id}}"),), "short"),
              Panel("Waiting requests", (_q(f"vllm:num_requests_waiting{{{INST}}}", "{{instance_id}}"),), "short"),
              Panel("KV cache usage", (_q(f"vllm:kv_cache_usage_perc{{{INST}}}", "{{instance_id}}"),), "percentunit"),
              Panel("Freeness (the scheduler's view)",
                    (_q(f"ferry_scheduler_instance_freeness{{{INST}}}", "{{instance_id}}"),), "short",
                    "Free KV blocks per running request (Llumnix): dispatch picks the highest; below the "
                    "migrate-out threshold an instance is a migration source"),
              Panel("Time to first token (p99)", _quantiles("vllm:time_to_first_token_seconds", "instance_id", INST,
                                                            qs=(0.99,)), "s",
                    "From the request's arrival at the instance"),
              Panel("Time per output token (p50)", _quantiles("vllm:request_time_per_output_token_seconds",
                                                              "instance_id", INST, qs=(0.5,)), "s"),
              Panel("Queue time (p99)", _quantiles("vllm:request_queue_time_seconds", "instance_id", INST,
                                                   qs=(0.99,)), "s"),
              Panel("Generated tokens", (_q(_rate("vllm:generation_tokens_total", "instance_id", INST),
                                            "{{instance_id}}"),), "short"),
              Panel("Preemptions", (_q(_rate("vllm:num_preemptions_total", "instance_id", INST), "{{instance_id}}"),),
                    "short"),
          ), per_instance=True),
    Board("ferry-migration", "Ferry / Live migration", "Migrations between instances: outcomes, downtime, bytes",
          (
              Panel("Migrations by outcome", (_q(_rate("ferry_migrations_total", "outcome", 'side="source"'),
                                                 "{{outcome}}"),), "short", "At the sources"),
              Panel("Migrate-out orders", (_q(_rate("ferry_scheduler_migrate_out_orders_total", "outcome"),
                                              "{{outcome}}"),), "short",
                    "Orders the scheduler's rescheduling loop sent, by how the call ended"),
              Panel("Downtime", _quantiles("ferry_migration_downtime_seconds"), "s",
                    "From the suspend at the source to the request's first step at the destination"),
              Panel("Downtime (the scheduler's orders)", _quantiles("ferry_scheduler_migration_downtime_seconds"),
                    "s"),
              Panel("Duration", _quantiles("ferry_migration_duration_seconds"), "s", "From select to done or abort"),
              Panel("KV bytes sent", (_q(_rate("ferry_migration_bytes_total"), "bytes/s"),), "Bps"),
              Panel("Copy stages per migration", (_q(
                  f"sum(rate(ferry_migration_stages_sum[{RATE}])) / sum(rate(ferry_migration_stages_count[{RATE}]))",
                  "mean"),), "short"),
              Panel("Migrations in flight", (_q("sum by (instance_id) (ferry_migrations_in_flight_out)",
                                                "{{instance_id}} out"),), "short"),
          )),
    Board("ferry-prefix-cache", "Ferry / Prefix cache", "Each instance's prefix cache and the cluster's index",
          (
              Panel("Hit rate", (_q(f"sum by (instance_id) (rate(vllm:prefix_cache_hits_total{{{INST}}}[{RATE}])) / "
                                    f"sum by (instance_id) (rate(vllm:prefix_cache_queries_total{{{INST}}}[{RATE}]))",
                                    "{{instance_id}}"),), "percentunit", "Tokens found cached / tokens asked"),
              Panel("Cached blocks", (_q(f"ferry_prefix_cache_blocks{{{INST}}}", "{{instance_id}}"),
                                      _q(f"ferry_prefix_cache_evictable_blocks{{{INST}}}", "{{instance_id}} evictable")),
                    "short"),
              Panel("Evictions", (_q(_rate("ferry_prefix_cache_evictions_total", "instance_id", INST),
                                     "{{instance_id}}"),), "short", "Cached blocks whose content was evicted"),
              Panel("Cluster prefix index", (_q("ferry_scheduler_prefix_index_entries", "entries"),), "short",
                    "(instance, block hash) pairs the scheduler's index holds"),
              Panel("Instances followed by the index", (_q("ferry_scheduler_prefix_index_instances", "synced"),),
                    "short", stat=True),
          ), per_instance=True),
    Board("ferry-control-plane", "Ferry / Control plane", "Scheduler, meta store and the processes themselves",
          (
              Panel("Dispatch decision time", _quantiles("ferry_scheduler_dispatch_seconds"), "s"),
              Panel("Dispatches by outcome", (_q(_rate("ferry_scheduler_dispatches_total", "outcome"), "{{outcome}}"),),
                    "reqps"),
              Panel("Status report lag", _quantiles("ferry_scheduler_report_lag_seconds"), "s",
                    "From an instance's report being made to the scheduler's view having it"),
              Panel("Age of the latest report", (_q("max by (instance_id) (ferry_scheduler_instance_report_age_seconds)",
                                                    "{{instance_id}}"),), "s"),
              Panel("Meta store", (_q("ferry_meta_store_instances", "instances registered"),
                                   _q("ferry_meta_store_watchers", "watch streams")), "short"),
              Panel("Frontend bypass", (_q("max(ferry_dispatch_bypass)", "bypassing"),), "short",
                    "1 while a frontend cannot reach the scheduler and dispatches by itself"),
              Panel("Processes up", (_q('up{job=~"ferry-.*"}', "{{ferry_name}}"),), "short"),
              Panel("CPU per process", (_q(f'rate(process_cpu_seconds_total{{job=~"ferry-.*"}}[{RATE}])',
                                           "{{ferry_name}}"),), "percentunit"),
          )),
)


def _datasource():
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    return DataSourceRef(type_val="prometheus", uid="${datasource}")


def build(board: Board):
    """The dashboard's Foundation SDK builder."""
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.builders import prometheus, stat, timeseries
    from grafana_foundation_sdk.models.dashboard import VariableRefresh

    d = (db.Dashboard(board.title).uid(board.uid).description(board.description).tags(["ferry"])
         .refresh("10s").time("now-30m", "now").timezone("browser")
         .with_variable(db.DatasourceVariable("datasource").label("Data source").type("prometheus")))
    if board.per_instance:
        d = d.with_variable(db.QueryVariable("instance_id").label("Instance").datasource(_datasource())
                            .query("label_values(vllm:num_requests_running, instance_id)")
                            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).multi(True).include_all(True)
                            .all_value(".*"))
    for p in board.panels:
        panel = (stat.Panel() if p.stat else timeseries.Panel()).title(p.title).unit(p.unit).datasource(
            _datasource()).height(8).span(8 if p.stat else 12)
        if p.description:
            panel = panel.description(p.description)
        for i, q in enumerate(p.queries):
            panel = panel.with_target(prometheus.Dataquery().expr(q.expr).legend_format(q.legend or "__auto")
                                      .ref_id(chr(ord("A") + i)))
        d = d.with_panel(panel)
    return d


def _without_nulls(v):
    if isinstance(v, dict):
        return {k: _without_nulls(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_without_nulls(x) for x in v]
    return v


def to_json(board: Board) -> str:
    """The dashboard as Grafana imports it (fields the SDK leaves unset, null, left out)."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder

    built = json.loads(JSONEncoder(sort_keys=True).encode(build(board).build()))
    return json.dumps(_without_nulls(built), indent=2, sort_keys=True) + "\n"


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of a dashboard's JSON."""
    return [(p["title"], t["expr"]) for p in dashboard.get("panels", []) for t in p.get("targets", [])]


@click.command("dashboards")
@click.option("--out", type=click.Path(file_okay=False, path_type=pathlib.Path), default=OUT, show_default=True)
@click.option("--check", is_flag=True, help="fail when the files in --out are not what this builds")
@click.option("--render", "render_dir", type=click.Path(file_okay=False, path_type=pathlib.Path),
              help="instead: plot every dashboard's panels (PNG, matplotlib) from --prometheus into this folder")
@click.option("--prometheus", default="http://127.0.0.1:9090", show_default=True, help="with --render")
@click.option("--minutes", type=float, default=5.0, show_default=True, help="with --render: the last this many")
def dashboards(out: pathlib.Path, check: bool, render_dir: pathlib.Path | None, prometheus: str,
               minutes: float) -> None:
    """Write Ferry's Grafana dashboards as JSON (deploy/grafana/dashboards)."""
    if render_dir is not None:
        import time

        from ferry.dashboard_render import render_all

        end = time.time()
        for path in render_all(prometheus, end - minutes * 60, end, render_dir):
            click.echo(f"wrote {path}")
        return
    stale = []
    for board in BOARDS:
        path = out / f"{board.uid}.json"
        text = to_json(board)
        if check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path.name)
            continue
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        click.echo(f"wrote {path} ({len(board.panels)} panels)")
    if stale:
        raise click.ClickException(f"stale dashboards (run `ferry dashboards`): {', '.join(stale)}")
