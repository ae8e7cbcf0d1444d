"""Rolling restarts lose nothing (issue 39): SIGTERM on an instance hands
its running requests to another instance by live migration before it exits
(no recompute, the streams follow); SIGTERM on a frontend refuses new
requests (503, /health 503) and lets its streams finish, then exits."""

import asyncio
import signal

import httpx

from tests.conftest import start_fake_cluster
from tests.helpers import expected_fake_text, stream_completion, wait_idle_and_check


async def test_sigterm_drains_an_instance_by_live_migration(tmp_path_factory):
    c = start_fake_cluster(tmp_path_factory, "drain", instances=2, dispatch="round_robin",
                           instance_args=["--token-delay-ms", "10", "--num-blocks", "1024"])
    try:
        prompts = [f"drained {i} " * 3 for i in range(6)]
        async with httpx.AsyncClient(base_url=c.url, timeout=60) as http:
            tasks = [asyncio.create_task(stream_completion(http, {"prompt": p, "max_tokens": 150})) for p in prompts]
            await asyncio.sleep(0.5)
            c.child("instance-0").proc.send_signal(signal.SIGTERM)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert [t for t, _ in results] == [expected_fake_text(p, 150) for p in prompts]
        finals = [f for _, f in results]
        assert all(f["resumes"] == 0 for f in finals), finals  # nothing recomputed
        moved = [f for f in finals if f["instances"][0] == "instance-0"]
        assert moved and all(f["migrations"] >= 1 and f["instances"][-1] == "instance-1" for f in moved), finals
        gone = c.child("instance-0")
        await asyncio.to_thread(gone.proc.wait, 20)
        assert gone.proc.returncode == 0
        rep = await asyncio.to_thread(wait_idle_and_check, c.child("instance-1").address)
        assert rep.ok and rep.free_blocks == rep.total_blocks, rep
    finally:
        c.stop()


async def test_sigterm_on_a_frontend_finishes_its_streams_and_refuses_new_requests(tmp_path_factory):
    c = start_fake_cluster(tmp_path_factory, "frontend-drain", instances=1,
                           instance_args=["--token-delay-ms", "10"], frontend_args=["--shutdown-grace-s", "30"])
    try:
        async with httpx.AsyncClient(base_url=c.url, timeout=60) as http:
            long = asyncio.create_task(stream_completion(http, {"prompt": "long one", "max_tokens": 200}))
            await asyncio.sleep(0.5)  # streaming (200 tokens take 2 s)
            frontend = c.child("frontend")
            frontend.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            health = await http.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "draining"
            refused = await http.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "service_unavailable_error"
            text, final = await long
        assert text == expected_fake_text("long one", 200) and final is not None  # not cut
        await asyncio.to_thread(frontend.proc.wait, 20)
        assert frontend.proc.returncode == 0
    finally:
        c.stop()
