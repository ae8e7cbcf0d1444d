"""``ferry top``: a running cluster live in the terminal, as its scheduler
sees it (``GetClusterView``, once a second): per instance its role and
state, running and waiting requests, KV use, freeness, migrations in and out,
preemptions and the age of its last report; the cluster's totals and the
rate of migrate-out orders. It finds a `ferry up` cluster by its HTTP port
(the cluster file ferry/targets.py writes) or takes the scheduler's address
and token file. Drawn with rich; ``--once`` prints one frame, ``--svg`` saves
one as an SVG screenshot."""

from __future__ import annotations

import pathlib
import time
from dataclasses import dataclass

import click
import grpc
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from libs.common import convert, rpc
from libs.common.types import InstanceRecord
from libs.pb import scheduler_pb2 as spb
from libs.pb import scheduler_pb2_grpc as spb_grpc


@dataclass(frozen=True)
class Frame:
    """One look at the cluster."""

    at: float  # wall clock (time.time())
    policy: str
    migrations_ordered: int
    records: tuple[InstanceRecord, ...]


def fetch(address: str, credentials: rpc.Credentials, timeout_s: float = 2.0) -> Frame:
    with rpc.sync_channel(address, credentials) as ch:
        r = spb_grpc.SchedulerStub(ch).GetClusterView(spb.ClusterViewRequest(), timeout=timeout_s)
    return Frame(time.time(), r.dispatch_policy, r.migrations_ordered,
                 tuple(sorted((convert.record_from_pb(x) for x in r.instances), key=lambda rec: rec.info.instance_id)))


def _bar(fraction: float, width: int = 10) -> Text:
    fraction = min(1.0, max(0.0, fraction))
    full = round(fraction * width)
    style = "red" if fraction > 0.95 else "yellow" if fraction > 0.8 else "green"
    return Text("█" * full + "·" * (width - full), style=style) + Text(f" {fraction * 100:5.1f}%")


def render(frame: Frame, previous: Frame | None = None, title: str = ""):
    """The frame as a rich renderable (pure: tests render it to text)."""
    table = Table(expand=False, header_style="bold", box=box.SIMPLE_HEAD)
    for name, justify in (("instance", "left"), ("role", "left"), ("state", "left"), ("run", "right"),
                          ("wait", "right"), ("KV used", "left"), ("freeness", "right"), ("mig in", "right"),
                          ("mig out", "right"), ("preempt", "right"), ("report", "right")):
        table.add_column(name, justify=justify)
    running = waiting = m_in = m_out = 0
    used = total = 0
    for rec in frame.records:
        s = rec.status
        if s is None:
            table.add_row(rec.info.instance_id, "", Text("no report yet", style="dim"), *[""] * 8)
            continue
        state = ("terminating", "yellow") if s.terminating else ("unschedulable", "red") if s.unschedulable \
            else ("serving", "green")
        age = max(0.0, frame.at - s.timestamp) if s.timestamp else 0.0
        kv = (s.total_blocks - s.free_blocks) / max(1, s.total_blocks)
        table.add_row(rec.info.instance_id, s.role.value, Text(state[0], style=state[1]), str(s.num_running),
                      str(s.num_waiting), _bar(kv), f"{s.freeness:.1f}", str(s.migrating_in), str(s.migrating_out),
                      str(s.num_preemptions), Text(f"{age:.1f}s", style="red" if age > 2 else ""))
        running, waiting = running + s.num_running, waiting + s.num_waiting
        m_in, m_out = m_in + s.migrating_in, m_out + s.migrating_out
        used, total = used + s.total_blocks - s.free_blocks, total + s.total_blocks
    rate = ""
    if previous is not None and frame.at > previous.at:
        rate = f" ({(frame.migrations_ordered - previous.migrations_ordered) / (frame.at - previous.at):.1f}/s)"
    head = Text.assemble((title or "ferry top", "bold"), f"   policy {frame.policy}   instances {len(frame.records)}"
                         f"   running {running}   waiting {waiting}   KV {used}/{total} blocks"
                         f"   migrating {m_out}   orders {frame.migrations_ordered}{rate}   "
                         + time.strftime("%H:%M:%S", time.localtime(frame.at)))
    return Group(head, table)


def _target(port: int, scheduler: str, token_file: str) -> tuple[str, rpc.Credentials, str]:
    if scheduler:
        return scheduler, rpc.load_credentials(token_file=token_file), scheduler
    from ferry import targets

    try:
        info = targets.read_cluster_file(port)
    except FileNotFoundError:
        raise click.ClickException(f"no `ferry up` on port {port} (no {targets.state_dir(port)}/cluster.json); "
                                   "give --port, or --scheduler and --cluster-token-file") from None
    return info["scheduler"], rpc.load_credentials(token_file=info["token_file"]), info["url"]


@click.command("top")
@click.option("--port", type=int, default=8000, show_default=True, help="the HTTP port of a `ferry up` cluster")
@click.option("--scheduler", default="", help="or a scheduler's address (host:port)")
@click.option("--cluster-token-file", default="", help="with --scheduler: the cluster token's file")
@click.option("--interval", type=click.FloatRange(0.1), default=1.0, show_default=True, help="seconds per frame")
@click.option("--once", is_flag=True, help="print one frame and exit")
@click.option("--svg", type=click.Path(dir_okay=False, path_type=pathlib.Path),
              help="save one frame as an SVG screenshot (after --interval, for the migration rate) and exit")
def top(port, scheduler, cluster_token_file, interval, once, svg) -> None:
    """A running cluster live: instances, load, queue, KV use, migrations."""
    address, creds, title = _target(port, scheduler, cluster_token_file)

    def look() -> Frame:
        try:
            return fetch(address, creds)
        except grpc.RpcError as e:
            raise click.ClickException(f"scheduler {address}: {e.code().name}: {e.details()}") from None

    if once or svg:
        first = look()
        previous = None
        if svg:
            time.sleep(interval)
            previous, first = first, look()
        console = Console(record=bool(svg), width=130)
        console.print(render(first, previous, f"ferry top {title}"))
        if svg:
            console.save_svg(str(svg), title="ferry top")
        return
    previous = look()
    with Live(render(previous, None, f"ferry top {title}"), refresh_per_second=4, screen=False) as live:
        try:
            while True:
                time.sleep(interval)
                frame = look()
                live.update(render(frame, previous, f"ferry top {title}"))
                previous = frame
        except KeyboardInterrupt:
            pass
