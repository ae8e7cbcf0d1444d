"""Shared test helpers: fake-engine expectations and cluster plumbing."""

from __future__ import annotations

import subprocess

import grpc
from prometheus_client.parser import text_string_to_metric_families

from ferry.bench import sse
from libs.pb import instance_pb2 as ipb
from libs.pb import instance_pb2_grpc as ipb_grpc
from services.instance.engine.fake import fake_generate


def expected_fake_tokens(prompt: list[int], n: int) -> list[int]:
    """What the fake engine must emit for ``prompt``."""
    return fake_generate(prompt, n)


def expected_fake_text(text: str, n: int) -> str:
    return bytes(fake_generate(list(text.encode()), n)).decode()


def metric(text: str, name: str, missing_ok: bool = False, **labels: str) -> float | None:
    """The sample ``name`` with exactly ``labels`` in a /metrics page;
    absent: AssertionError (None with ``missing_ok``)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    if missing_ok:
        return None
    raise AssertionError(f"{name} {labels or ''} not in /metrics")


def check_integrity(address: str) -> ipb.CheckIntegrityReply:
    with grpc.insecure_channel(address) as ch:
        return ipb_grpc.InstanceStub(ch).CheckIntegrity(ipb.CheckIntegrityRequest(), timeout=10)


def wait_idle_and_check(address: str, timeout_s: float = 10.0) -> ipb.CheckIntegrityReply:
    """Wait until the instance holds no request, then return its integrity report."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        r = check_integrity(address)
        if (r.num_requests == 0 and r.num_reservations == 0) or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def instance_status(address: str):
    with grpc.insecure_channel(address) as ch:
        return ipb_grpc.InstanceStub(ch).GetStatus(ipb.GetStatusRequest(), timeout=5)


def _requests_of(inst) -> list:
    """The requests a live instance child holds; none if it is gone or dies while asked (a test
    may kill it from another coroutine between ``alive()`` and the RPC)."""
    if not inst.alive():
        return []
    try:
        return list(instance_status(inst.address).requests)
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.UNAVAILABLE:
            raise
        try:  # a killed process closes its sockets a moment before it can be reaped
            inst.proc.wait(2)
        except subprocess.TimeoutExpired:
            raise e from None
        return []


def find_instance_of(cluster, request_id: str):
    """The instance child that currently holds ``request_id`` (or None)."""
    for inst in cluster.instances():
        if any(r.request_id == request_id for r in _requests_of(inst)):
            return inst
    return None


def running_request_ids(cluster) -> list[str]:
    """Every request the cluster's live instances hold."""
    return [r.request_id for inst in cluster.instances() for r in _requests_of(inst)]


async def migrate(cluster, request_id: str, dest=None) -> ipb.MigrateOutReply | None:
    """Order the instance holding ``request_id`` to migrate it to ``dest``
    (default: another live instance). None if the request is nowhere."""
    import asyncio

    src = None
    for _ in range(100):  # just after a commit it may be between two instances
        src = await asyncio.to_thread(find_instance_of, cluster, request_id)
        if src is not None:
            break
        await asyncio.sleep(0.02)
    if src is None:
        return None
    if dest is None:
        dest = next(i for i in cluster.instances() if i is not src and i.alive())
    async with grpc.aio.insecure_channel(src.address) as ch:
        for _ in range(100):  # the source may be busy with another migration (limit): retry
            try:
                return await ipb_grpc.InstanceStub(ch).MigrateOut(ipb.MigrateOutRequest(
                    request_id=request_id, dest_instance_id=dest.name, dest_address=dest.address), timeout=60)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                await asyncio.sleep(0.02)
        return None


async def stream_completion(http, body: dict, on_chunk=None) -> tuple[str, dict | None]:
    """POST a streaming completion; returns (text, the final `ferry` object).
    ``on_chunk(text_so_far, request_id)`` is a coroutine run after each chunk."""
    cb = None
    if on_chunk is not None:
        async def cb(c: sse.Completion) -> None:
            await on_chunk(c.text, c.request_id)
    c = await sse.stream_completion(http, body, cb)
    return c.text, c.final
