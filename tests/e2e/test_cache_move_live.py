"""A cache move between real instance processes over gRPC (issue 53, move
instead of evict), fake engines (which compute from the KV they read back)
behind the real frontend, scheduler and meta store: a program's first turn
ends kept at its instance; a MigrateOut order with cache_blocks moves the
kept blocks to the other instance (no request attached), where they are kept
while the source holds its copy as plain cache; the scheduler's prefix index
takes the destination's KV events, and llumnix-keep sends the program's next
turn to an instance holding its whole history (either: of equal hits, the
lower id); that turn's tokens are exact and its history is served from
cache; no block leaks."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest

from libs.pb import instance_pb2 as ipb
from libs.pb import instance_pb2_grpc as ipb_grpc
from tests.conftest import start_fake_cluster
from tests.helpers import expected_fake_text, wait_idle_and_check

ARGS = ["--token-delay-ms", "2", "--num-blocks", "256", "--program-keep", "0.5"]
HISTORY = "You are a coding agent. The repository has three modules and a failing test. " * 4  # 320 tokens


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_fake_cluster(tmp_path_factory, "cache-move", instances=2, instance_args=ARGS, dispatch="llumnix-keep")
    yield c
    c.stop()


async def status(address: str) -> ipb.InstanceStatus:
    async with grpc.aio.insecure_channel(address) as ch:
        return await ipb_grpc.InstanceStub(ch).GetStatus(ipb.GetStatusRequest(), timeout=5)


async def until(what: str, ok, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (got := await ok()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)
    return got


async def test_a_programs_kept_blocks_move_and_its_next_turn_follows_them_exactly(cluster):
    by_name = {i.name: i for i in cluster.instances()}
    headers = {"x-session-id": "agent-7"}
    async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
        r = await http.post("/v1/completions", json={"prompt": HISTORY, "max_tokens": 12}, headers=headers)
        assert r.status_code == 200, r.text
        first = r.json()
        answer = first["choices"][0]["text"]
        assert answer == expected_fake_text(HISTORY, 12)
        src = by_name[first["ferry"]["instances"][0]]
        dst = next(i for i in cluster.instances() if i is not src)
        kept = (await until("the turn's blocks kept", lambda: _kept(src.address))).kept_blocks
        assert kept == len(HISTORY) // 16  # its full blocks (the answer's partial block is not named)
        async with grpc.aio.insecure_channel(src.address) as ch:
            reply = await ipb_grpc.InstanceStub(ch).MigrateOut(ipb.MigrateOutRequest(
                dest_instance_id=dst.name, dest_address=dst.address, cache_blocks=kept), timeout=30)
        assert (reply.started, reply.committed) == (1, 1), reply
        assert reply.results[0].request_id.startswith("program:") and reply.results[0].blocks == kept
        assert (await status(src.address)).kept_blocks == 0  # plain cache there now
        assert (await status(dst.address)).kept_blocks == kept
        before = {i.name: (await status(i.address)).prefix_cache.hits for i in cluster.instances()}
        await asyncio.sleep(1.0)  # the scheduler's index takes the destination's KV events
        turn = HISTORY + answer + " Now run the tests again."
        r = await http.post("/v1/completions", json={"prompt": turn, "max_tokens": 12}, headers=headers)
        assert r.status_code == 200, r.text
        second = r.json()
        assert second["choices"][0]["text"] == expected_fake_text(turn, 12)
        ran = by_name[second["ferry"]["instances"][0]]
        hits = (await status(ran.address)).prefix_cache.hits - before[ran.name]
        assert hits >= kept * 16  # its whole history, not recomputed
    for inst in cluster.instances():
        check = wait_idle_and_check(inst.address, timeout_s=8)
        assert check.ok, check.error
        assert check.num_requests == 0 and check.num_reservations == 0


async def _kept(address: str):
    s = await status(address)
    return s if s.kept_blocks > 0 else None


async def _first_turn_on_instance_0(c, http) -> tuple[str, str, dict]:
    """A program's first turn that llumnix-keep placed on instance-0 (its tie-break: the lowest id)."""
    for k in range(6):
        headers = {"x-session-id": f"agent-chaos-{k}"}
        r = await http.post("/v1/completions", json={"prompt": HISTORY, "max_tokens": 12}, headers=headers)
        assert r.status_code == 200, r.text
        if r.json()["ferry"]["instances"] == ["instance-0"]:
            return headers["x-session-id"], r.json()["choices"][0]["text"], headers
    pytest.fail("no first turn landed on instance-0")


@pytest.mark.parametrize("killed", ["destination", "source"])
async def test_an_instance_killed_mid_move_leaks_nothing_and_the_blocks_stay_somewhere(tmp_path_factory, killed):
    """Chaos: the destination (or the source) process dies while the blocks
    are on their way (failpoint *.crash_mid_transfer: os._exit). Destination
    killed: the source keeps the program's blocks, aborts, stays exact, and
    the program's next turn is served from them. Source killed: the
    destination's reservation is freed by its deadline, every block back."""
    fp = {"destination": {1: ["--failpoints", "dest.crash_mid_transfer"]},
          "source": {0: ["--failpoints", "source.crash_mid_transfer"]}}[killed]
    c = start_fake_cluster(tmp_path_factory, f"cache-move-{killed}", instances=2, instance_args=ARGS,
                           dispatch="llumnix-keep", per_instance_args=fp)
    try:
        src, dst = c.child("instance-0"), c.child("instance-1")
        async with httpx.AsyncClient(base_url=c.url, timeout=60) as http:
            _, answer, headers = await _first_turn_on_instance_0(c, http)
            kept = (await until("the turn's blocks kept", lambda: _kept(src.address))).kept_blocks
            async with grpc.aio.insecure_channel(src.address) as ch:
                call = ipb_grpc.InstanceStub(ch).MigrateOut(ipb.MigrateOutRequest(
                    dest_instance_id=dst.name, dest_address=dst.address, cache_blocks=kept), timeout=30)
                if killed == "destination":
                    reply = await call
                    assert (reply.started, reply.committed, reply.aborted) == (1, 0, 1), reply
                else:
                    with pytest.raises(grpc.aio.AioRpcError):
                        await call
            dead, alive = (dst, src) if killed == "destination" else (src, dst)
            await until("the killed process gone", lambda: _dead(dead))
            if killed == "destination":
                assert (await status(src.address)).kept_blocks == kept  # still kept where it was
                turn = HISTORY + answer + " Next step."
                before = (await status(src.address)).prefix_cache.hits
                r = await http.post("/v1/completions", json={"prompt": turn, "max_tokens": 12}, headers=headers)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == expected_fake_text(turn, 12)
                assert (await status(src.address)).prefix_cache.hits - before >= kept * 16
        check = wait_idle_and_check(alive.address, timeout_s=10)
        assert check.ok, check.error
        assert (check.num_requests, check.num_reservations) == (0, 0), check
        assert check.free_blocks == check.total_blocks  # kept blocks are free ones: nothing else holds any
    finally:
        c.stop()


async def _dead(child) -> bool:
    return not child.alive()
