"""The load generator: replays a workload against a frontend's
/v1/completions with streaming, one httpx connection pool, one asyncio task per
request, and records each request's timeline.

CPU matters here (the client shares the machine with the cluster): token
chunks are recognised by a substring test and not JSON-parsed; only the final
chunks (finish_reason, usage, errors) are parsed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import time
from collections.abc import Callable

import httpx

from ferry.measure.metrics import RequestRecord
from ferry.measure.workload import Request, Workload, program_id, prompt_ids

_TOKEN_CHUNK = '"finish_reason": null'

# The key the benchmarks' clients present; clusters they start take it as a
# priority key (only those may ask for high priority). FERRY_BENCH_API_KEY:
# the key of a cluster started elsewhere (--url).
BENCH_API_KEY = os.environ.get("FERRY_BENCH_API_KEY", "ferry-bench-priority")


def raise_fd_limit() -> int:
    """Each in-flight stream holds a socket; lift the soft fd limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def request_body(req: Request, ids: list[int], model: str | None, stream: bool = True,
                 ferry_priority: bool = True, token_ids: bool = False) -> dict:
    """A completion request; ``ferry_priority=False`` leaves out Ferry's
    named priority (vLLM's server takes only integers there); ``token_ids``:
    ask for the completion's token ids (Ferry's ``ferry.token_ids``)."""
    body = {"prompt": ids, "max_tokens": req.output_len, "min_tokens": req.output_len, "ignore_eos": True,
            "temperature": 0.0, "stream": stream}
    if ferry_priority:
        body["priority"] = req.priority
        if req.session >= 0:  # a session's or an agent program's turn names its program
            body["prompt_cache_key"] = program_id(req)
    if token_ids:
        body["return_token_ids"] = True
    if stream:
        body["stream_options"] = {"include_usage": True}
    if model:
        body["model"] = model
    return body


def _final(rec: RequestRecord, obj: dict) -> None:
    if "error" in obj:
        err = obj["error"]
        rec.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        return
    if obj.get("usage"):
        rec.tokens = int(obj["usage"].get("completion_tokens", rec.tokens))
        details = obj["usage"].get("prompt_tokens_details")
        if details and details.get("cached_tokens") is not None:  # a server that says (the programs' recompute)
            rec.cached_tokens = int(details["cached_tokens"])
    for ch in obj.get("choices") or ():
        if ch.get("finish_reason"):
            rec.finish_reason = ch["finish_reason"]
    extras = obj.get("ferry")
    if extras:
        rec.preemptions = int(extras.get("preemptions") or 0)
        rec.preemption_loss_ms = float(extras.get("preemption_loss_ms") or 0.0)
        rec.migrations = int(extras.get("migrations") or 0)
        rec.resumes = int(extras.get("resumes") or 0)
        rec.instances = list(extras.get("instances") or [])
        rec.server_ttft_ms = extras.get("ttft_ms")
        if extras.get("token_ids") is not None:
            rec.output_ids = [int(t) for t in extras["token_ids"]]


async def _unary(client: httpx.AsyncClient, url: str, rec: RequestRecord, body: dict) -> None:
    """Non-streaming: half the CPU per token on both ends. TTFT is the
    frontend's (``ferry.ttft_ms``, from its arrival), the last token is the
    response time."""
    resp = await client.post(f"{url}/v1/completions", json=body)
    rec.finished_at = time.perf_counter()
    if resp.status_code != 200:
        rec.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
        return
    _final(rec, resp.json())
    if rec.server_ttft_ms is None:
        rec.error = "response without ferry.ttft_ms"
        return
    rec.first_token_at = rec.sent_at + rec.server_ttft_ms / 1000.0
    rec.last_token_at = rec.finished_at


def _gap(rec: RequestRecord, now: float) -> None:
    """A token at ``now``: keep the longest gap since the previous one, and when it ended."""
    gap = now - rec.last_token_at
    if rec.max_gap_s is None or gap > rec.max_gap_s:
        rec.max_gap_s, rec.max_gap_end = gap, time.time()


async def _stream(client: httpx.AsyncClient, url: str, rec: RequestRecord, body: dict) -> None:
    chunks = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            rec.error = f"HTTP {resp.status_code}: {text[:300]}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            now = time.perf_counter()
            data = line[5:].strip()
            if _TOKEN_CHUNK in data and '"text": ""' not in data:
                chunks += 1
                if rec.first_token_at is None:
                    rec.first_token_at = now
                else:
                    _gap(rec, now)
                rec.last_token_at = now
                continue
            if data == "[DONE]":
                break
            obj = json.loads(data)
            for ch in obj.get("choices") or ():
                if ch.get("text"):
                    chunks += 1
                    if rec.last_token_at is not None:
                        _gap(rec, now)
                    rec.first_token_at = rec.first_token_at or now
                    rec.last_token_at = now
            _final(rec, obj)
    rec.finished_at = time.perf_counter()
    if rec.error is None and rec.finish_reason is None:
        rec.error = "stream ended without a finish_reason"
    if rec.tokens == 0:
        rec.tokens = chunks  # no usage chunk: count the text chunks


async def send_one(client: httpx.AsyncClient, url: str, rec: RequestRecord, body: dict) -> RequestRecord:
    rec.sent_at = time.perf_counter()
    try:
        await (_stream if body.get("stream") else _unary)(client, url, rec, body)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    return rec


async def replay(url: str, workload: Workload, token_range: tuple[int, int], model: str | None = None,
                 on_done: Callable[[RequestRecord], None] | None = None,
                 max_connections: int = 8192, stream: bool = True, shards: int = 32,
                 ferry_priority: bool = True) -> list[RequestRecord]:
    """Send every request at its arrival time (relative to now); return the
    records in workload order once all have finished.

    Requests are spread over ``shards`` clients, each with its own pool: an
    httpx pool scans all its connections on every request and response. With
    about a thousand requests in flight (M-M at 17/s compressed 2x), one pool
    cost the client 33 CPU-s in a run, 32 pools 11 CPU-s, on the same cores
    as the cluster."""
    raise_fd_limit()
    # Pooled connections expire before a server's keep-alive timeout (uvicorn's
    # default is 5 s): a POST sent on a connection the server is closing fails
    # with a ReadError and is not retried.
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                          keepalive_expiry=2.0)
    timeout = httpx.Timeout(connect=60.0, read=None, write=60.0, pool=None)
    records = [RequestRecord(r.index, r.priority, r.prompt_len, r.output_len, r.arrival_s) for r in workload.requests]
    lo, hi = token_range
    # Prefix workloads: keep the tokens (the hit-rate bound; a session's next turn)
    token_ids = workload.prefix != "none" and ferry_priority
    turns: dict[int, list[int]] = {}
    for i, req in enumerate(workload.requests):
        if req.session >= 0:
            turns.setdefault(req.session, []).append(i)

    async def run(client: httpx.AsyncClient, rec: RequestRecord, body: dict) -> None:
        await send_one(client, url, rec, body)
        if on_done:
            on_done(rec)

    async def session(client: httpx.AsyncClient, rec: RequestRecord, body: dict, rest: list[int]) -> None:
        """A conversation: each next turn, once the answer is in and the user
        thought, sends everything so far (prompt and answer) and its message."""
        await run(client, rec, body)
        context = body["prompt"]
        for i in rest:
            if not rec.ok or rec.output_ids is None:
                nxt = records[i]
                nxt.error = "session ended: an earlier turn failed"
                if on_done:
                    on_done(nxt)
                continue
            context = context + rec.output_ids
            req, rec = workload.requests[i], records[i]
            await asyncio.sleep(req.think_s)
            rec.scheduled_at = time.perf_counter()
            body = request_body(req, context + prompt_ids(req, workload.seed, lo, hi), model, stream,
                                ferry_priority, token_ids=True)
            rec.prompt_ids = context = body["prompt"]
            await run(client, rec, body)

    async with contextlib.AsyncExitStack() as stack:
        headers = {"Authorization": f"Bearer {BENCH_API_KEY}"}  # may ask for high priority (Ferry; others ignore it)
        clients = [await stack.enter_async_context(httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers))
                   for _ in range(max(1, shards))]
        start = time.perf_counter()
        tasks = []
        for i, (req, rec) in enumerate(zip(workload.requests, records)):
            if req.session >= 0 and req.turn > 0:
                continue  # sent by its session's first turn
            body = request_body(req, prompt_ids(req, workload.seed, lo, hi), model, stream,
                                ferry_priority, token_ids)  # built before the wait
            if token_ids:
                rec.prompt_ids = body["prompt"]
            rec.scheduled_at = start + req.arrival_s
            delay = rec.scheduled_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            c = clients[i % len(clients)]
            if req.session >= 0:
                tasks.append(asyncio.create_task(session(c, rec, body, turns[req.session][1:])))
            else:
                tasks.append(asyncio.create_task(run(c, rec, body)))
        await asyncio.gather(*tasks)
    return records
