"""What the benchmarks share beside the cluster (ferry/cluster.py), the load
client (client.py, sse.py) and the report (ferry/machine.write_json,
ferry/measure/metrics.py): the scheduler's view, the leak check after a
run, random prompts of token ids. A bench imports these, never another
bench's private helpers (tests/test_layers.py)."""

from __future__ import annotations

import asyncio
import time

import grpc

from ferry.cluster import LocalCluster
from libs.pb import instance_pb2 as ipb
from libs.pb import instance_pb2_grpc as ipb_grpc
from libs.pb import scheduler_pb2 as spb
from libs.pb import scheduler_pb2_grpc as spb_grpc
from libs.common import rpc


async def scheduler_view(address: str, timeout: float = 1.0) -> spb.ClusterViewReply:
    async with rpc.channel(address) as ch:
        return await spb_grpc.SchedulerStub(ch).GetClusterView(spb.ClusterViewRequest(), timeout=timeout)


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


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 32000), (batch, length), generator=g).tolist()
