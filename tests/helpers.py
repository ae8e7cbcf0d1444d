"""Shared test helpers: fake-engine expectations and cluster plumbing."""

from __future__ import annotations

import grpc

from ferry.pb import instance_pb2 as ipb
from ferry.pb import instance_pb2_grpc as ipb_grpc
from services.instance.engine.fake import fake_next_token


def expected_fake_tokens(prompt: list[int], n: int) -> list[int]:
    """What the fake engine must emit for ``prompt`` (its model, run here)."""
    ctx = list(prompt)
    out = []
    for _ in range(n):
        t = fake_next_token(ctx)
        out.append(t)
        ctx.append(t)
    return out


def expected_fake_text(text: str, n: int) -> str:
    return bytes(expected_fake_tokens(list(text.encode()), n)).decode()


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
