"""What the benchmarks share beside the cluster (ferry/cluster.py) and the
load clients (client.py, sse.py, retrying.py): a started cluster for the
length of a block, the options every bench takes alike, the report (a
table, the JSON with the machine it ran on: ferry/machine.write_json), the
scheduler's and an instance's view (its running requests), a migration
order, the leak check after a run, random prompts of token ids, medians. Percentiles come from
ferry/measure/metrics.py. A bench imports these, never another bench's
private helpers (tests/test_layers.py)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable

import click
import grpc

from ferry.cluster import ClusterSpec, LocalCluster
from ferry.machine import write_json
from libs.common import rpc
from libs.pb import common_pb2 as cpb
from libs.pb import instance_pb2 as ipb
from libs.pb import instance_pb2_grpc as ipb_grpc
from libs.pb import scheduler_pb2 as spb
from libs.pb import scheduler_pb2_grpc as spb_grpc

# --- the cluster under test ---------------------------------------------------------


def log_dir_for(log_dir: str | None, bench: str) -> str:
    """``log_dir``, or a new temporary folder named after the bench (kept: its logs outlive the run)."""
    return log_dir or tempfile.mkdtemp(prefix=f"ferry-{bench}-")


@contextlib.contextmanager
def started(*specs: ClusterSpec, timeout_s: float = 120.0):
    """LocalClusters of ``specs``, started one after another (all of them
    running together) and stopped however the block ends; yields one
    cluster, or a list of them for several specs."""
    clusters = [LocalCluster(s) for s in specs]
    try:
        for c in clusters:
            c.start(timeout_s=timeout_s)
        yield clusters[0] if len(clusters) == 1 else clusters
    finally:
        for c in clusters:
            c.stop()


@contextlib.asynccontextmanager
async def running(spec: ClusterSpec, timeout_s: float = 120.0):
    """``started`` for a coroutine: starting and stopping run in a thread, the event loop goes on."""
    cluster = LocalCluster(spec)
    await asyncio.to_thread(cluster.start, timeout_s)
    try:
        yield cluster
    finally:
        await asyncio.to_thread(cluster.stop)


# --- the options every bench takes alike ----------------------------------------------


JSON_DECLS = ["--json", "json_path"]


def _json_attrs(default: str | None = None, help: str = "write results here") -> dict:  # noqa: A002 - click's
    return {"type": click.Path(dir_okay=False), "default": default, "show_default": default is not None, "help": help}


def json_option(default: str | None = None, help: str = "write results here"):  # noqa: A002
    """``--json PATH`` (``json_path``): where ``report`` writes the results."""
    return click.option(*JSON_DECLS, **_json_attrs(default, help))


def bench_command(name: str | None = None, show: Callable[[dict], object] | None = None,
                  failed: Callable[[dict], object] | None = None, json_default: str | None = None):
    """A bench's command: the decorated function takes its options and
    returns its results, which ``report`` shows (``show``) and writes to
    ``--json``; the command exits 1 where ``failed(results)`` (the bench's
    pass criteria)."""
    def wrap(f):
        @functools.wraps(f)
        def run(json_path, **options):
            res = f(**options)
            report(res, json_path, show)
            if failed is not None and failed(res):
                raise SystemExit(1)
        cmd = click.command(name)(run)
        cmd.params.append(click.Option(JSON_DECLS, **_json_attrs(json_default)))  # last, as the benches list it
        return cmd
    return wrap


def seed_option(help: str | None = None):  # noqa: A002
    return click.option("--seed", type=int, default=0, show_default=True, help=help)


def log_dir_option(help: str | None = "children's logs"):  # noqa: A002
    return click.option("--log-dir", type=click.Path(file_okay=False), default=None, help=help)


def instance_arg_option():
    return click.option("--instance-arg", "instance_args", multiple=True,
                        help="extra `ferry serve instance` argument")


# --- the report -------------------------------------------------------------------------


def report(res: dict, json_path: str | None, show: Callable[[dict], object] | None = None) -> None:
    """A bench's results: ``show(res)`` prints its table, then the JSON goes
    to ``json_path`` (when given) with the machine it ran on, and a line says so."""
    if show is not None:
        show(res)
    if json_path:
        write_json(json_path, res)
        click.echo(f"wrote {json_path}")


def fmt(v: float | None, digits: int = 1) -> str:
    """A table's number (thousands separated), ``-`` for none."""
    return "-" if v is None else f"{v:,.{digits}f}"


def cells(values: Iterable, width: int = 11, digits: int = 2) -> str:
    """A table's row (or header) of right-aligned cells: floats with ``digits`` decimals, the rest as text."""
    return "".join(f"{v:>{width}.{digits}f}" if isinstance(v, float) else f"{v!s:>{width}}" for v in values)


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None; None when there are none."""
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def median_of(rows: Iterable[dict], key: str) -> float | None:
    """``median`` of the rows' ``key`` values."""
    return median(r[key] for r in rows)


def int_list(text: str, allow_empty: bool = False) -> list[int]:
    """Comma-separated positive integers (a click option's value)."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected comma-separated integers") from None
    if (not vals and not allow_empty) or (vals and min(vals) < 1):
        raise click.BadParameter(f"{text!r}: expected positive integers")
    return vals


class Background:
    """``n`` requests decoding on one instance, each re-issued when it ends
    (a bench's ``_slot(i)``); the arrival times of slot 0's tokens
    (``times``; None between two of its requests: the gap across a prefill
    is no step) time the instance's decode steps."""

    def __init__(self, n: int):
        self.n = n
        self.times: list[float | None] = []
        self.tasks: list[asyncio.Task] = []

    async def _slot(self, i: int) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._slot(i)) for i in range(self.n)]

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def step_ms(self, t0: float, t1: float, inside: bool = True) -> float | None:
        """The median step (ms) of the gaps ending inside [t0, t1] (outside it: ``inside=False``)."""
        return median((b - a) * 1000 for a, b in zip(self.times, self.times[1:])
                      if a is not None and b is not None and (t0 <= b <= t1) == inside)


# --- what the services say ----------------------------------------------------------------


async def scheduler_view(address: str, timeout: float = 1.0) -> spb.ClusterViewReply:
    async with rpc.channel(address) as ch:
        return await spb_grpc.SchedulerStub(ch).GetClusterView(spb.ClusterViewRequest(), timeout=timeout)


async def instance_status(address: str, timeout: float = 1.0) -> ipb.InstanceStatus:
    async with rpc.channel(address) as ch:
        return await ipb_grpc.InstanceStub(ch).GetStatus(ipb.GetStatusRequest(), timeout=timeout)


async def running_ids(inst, timeout: float | None = 1.0) -> list[str]:
    """The requests decoding on instance ``inst`` (a cluster child); none where it does not answer."""
    try:
        st = await instance_status(inst.address, timeout)
    except grpc.RpcError:
        return []
    return [r.request_id for r in st.requests if r.state == cpb.RequestLoad.RUNNING]


async def migrate_out(src, rid: str, dst, timeout: float, blocking: bool = False) -> ipb.MigrateOutReply:
    """Order the migration of request ``rid`` from instance ``src`` to ``dst`` (cluster children)."""
    async with rpc.channel(src.address) as ch:
        return await ipb_grpc.InstanceStub(ch).MigrateOut(ipb.MigrateOutRequest(
            request_id=rid, dest_instance_id=dst.name, dest_address=dst.address, blocking=blocking), timeout=timeout)


async def first_token_s(stub: ipb_grpc.InstanceStub, rid: str, prompt_ids: list[int], max_tokens: int,
                        ignore_eos: bool = False) -> float:
    """Seconds from calling an instance's Generate directly (gRPC) to its first token; the call is then cancelled."""
    t0 = time.perf_counter()
    call = stub.Generate(ipb.GenerateRequest(request_id=rid, prompt_token_ids=prompt_ids, sampling=cpb.SamplingParams(
        max_tokens=max_tokens, ignore_eos=ignore_eos)))
    async for ev in call:
        if ev.token_ids:
            break
    took = time.perf_counter() - t0
    call.cancel()
    return took


async def leaks(cluster: LocalCluster, timeout_s: float = 15.0) -> tuple[int, list[str], list[str]]:
    """After idle: total - free blocks summed over every live instance (the
    static ones and those the scheduler launched)."""
    addresses = {i.name: i.address for i in cluster.instances() if i.alive()}
    try:
        for rec in (await scheduler_view(cluster.scheduler, 2.0)).instances:
            addresses.setdefault(rec.info.instance_id, rec.info.address)
    except grpc.RpcError:
        pass
    leaked, errors = 0, []
    for name, address in sorted(addresses.items()):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                async with rpc.channel(address) as ch:
                    r = await ipb_grpc.InstanceStub(ch).CheckIntegrity(ipb.CheckIntegrityRequest(), timeout=5)
            except grpc.RpcError as e:
                errors.append(f"{name}: unreachable ({e.code().name})")
                break
            if (r.num_requests == 0 and r.num_reservations == 0) or time.monotonic() > deadline:
                leaked += r.total_blocks - r.free_blocks
                if not r.ok:
                    errors.append(f"{name}: {r.error}")
                break
            await asyncio.sleep(0.1)
    return leaked, errors, sorted(addresses)


def expected_fake_text(text: str, n: int) -> str:
    """The fake engine's output for a text prompt (greedy, no EOS: it never emits 0)."""
    from services.instance.engine.fake import fake_generate

    return bytes(fake_generate(list(text.encode()), n)).decode()


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 32000), (batch, length), generator=g).tolist()
