"""Scheduler unreachable: the frontend dispatches by itself and loses no
request; normal dispatch resumes when the scheduler returns."""

import asyncio
import json

import httpx

from tests.conftest import start_fake_cluster
from tests.helpers import expected_fake_text, metric


async def _stream(http, prompt, n):
    text = ""
    async with http.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": n, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["text"]
    return text


async def test_scheduler_killed_mid_run_loses_no_request(tmp_path_factory):
    cluster = start_fake_cluster(tmp_path_factory, "bypass", instances=2,
                                 instance_args=["--token-delay-ms", "5"])
    try:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
            async def wave(tag, count, n=40):
                prompts = [f"{tag} {i}" for i in range(count)]
                texts = await asyncio.gather(*(_stream(http, p, n) for p in prompts))
                return [t == expected_fake_text(p, n) for p, t in zip(prompts, texts)]

            first = asyncio.create_task(wave("before", 20))
            await asyncio.sleep(0.1)
            cluster.kill("scheduler")  # mid-run
            during = await wave("during", 20)
            assert all(await first) and all(during)
            m = (await http.get("/metrics")).text
            assert metric(m, "ferry_dispatch_bypass") == 1
            assert metric(m, "ferry_bypass_dispatches_total") >= 20
            # Both instances served in bypass (least loaded, not one instance for all).
            assert metric(m, "ferry_instance_requests_total", instance="instance-0") > 0
            assert metric(m, "ferry_instance_requests_total", instance="instance-1") > 0

            cluster.restart("scheduler")
            await asyncio.sleep(1.2)  # past the bypass retry interval
            assert all(await wave("after", 4))
            m = (await http.get("/metrics")).text
            assert metric(m, "ferry_dispatch_bypass") == 0
    finally:
        cluster.stop()
