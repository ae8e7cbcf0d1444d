"""`ferry bench overhead`: the rate steps and the split of the added time;
with --ab-frontend-arg, two fake clusters sampled in turns; the frontend
path's connections (kept, or new per request)."""

import asyncio
import json

import aiohttp
from aiohttp import web
from click.testing import CliRunner

from ferry.bench.cli import bench
from ferry.bench.overhead import _frontend_ttft
from libs.common import rpc


def test_ab_compares_the_dispatch_stream_with_unary_dispatch(tmp_path):
    out = tmp_path / "ab.json"
    result = CliRunner().invoke(bench, ["overhead", "--instances", "1", "--samples", "16",
                                        "--ab-frontend-arg=--no-dispatch-stream", "--json", str(out)])
    assert result.exit_code == 0, result.output
    ab = json.loads(out.read_text())["ab"]
    assert set(ab) == {"default", "--no-dispatch-stream"}
    for r in ab.values():
        assert 0 < r["direct_ttft_ms_p50"] < r["frontend_ttft_ms_p50"]
        assert abs(r["added_ttft_ms_p50"] - (r["frontend_ttft_ms_p50"] - r["direct_ttft_ms_p50"])) < 1e-9
        assert r["frontend_new_conn_ttft_ms_p50"] > r["direct_ttft_ms_p50"]
    assert "--no-dispatch-stream" in result.output


def test_the_rate_steps_and_the_split_of_the_added_time(tmp_path):
    out = tmp_path / "run.json"
    result = CliRunner().invoke(bench, ["overhead", "--instances", "1", "--samples", "16", "--rates", "20",
                                        "--step-s", "0.5", "--json", str(out)])
    assert result.exit_code == 0, result.output
    res = json.loads(out.read_text())
    assert res["config"]["cluster_token"] is True
    assert res["max_rps"] == 20 and res["rate_steps"][0]["error_rate"] == 0
    # The frontend's own histogram saw exactly the measured requests (not the
    # warm-up, not the rate step), each inside its client-side time.
    assert res["frontend_inside_count"] == 16
    split = res["split_ms_mean"]
    assert 0 < split["frontend_inside"] < split["frontend"]
    assert abs(split["frontend_inside"] + split["http_edge"] - split["frontend"]) < 1e-6
    assert "mean http_edge" in result.output
    assert res["added_new_conn_ttft_ms_p50"] == res["frontend_new_conn_ttft_ms_p50"] - res["direct_ttft_ms_p50"]
    assert rpc.current().token == ""  # the bench's token does not outlive the command


async def test_the_frontend_path_reads_whole_streams_and_keeps_its_connection():
    """Kept: every request on one connection (the direct path keeps its gRPC
    channel); force_close: a new connection each."""
    peers = []

    async def sse(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername"))
        r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        for text in ("a", "b"):
            await r.write(f'data: {{"choices": [{{"text": "{text}"}}]}}\r\n\r\n'.encode())
            await asyncio.sleep(0.02)  # a stream still going at its first token
        await r.write(b"data: [DONE]\r\n\r\n")
        await r.write_eof()
        return r

    app = web.Application()
    app.router.add_post("/v1/completions", sse)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        async with aiohttp.ClientSession(base_url=url) as kept:
            ttft = await _frontend_ttft(kept, 4)
        assert len(ttft) == 4 and all(t > 0 for t in ttft) and len(set(peers)) == 1
        peers.clear()
        async with aiohttp.ClientSession(base_url=url, connector=aiohttp.TCPConnector(force_close=True)) as new:
            await _frontend_ttft(new, 4)
        assert len(set(peers)) == 4
    finally:
        await runner.cleanup()


def test_tracing_mode_compares_tracing_off_twice_and_on_and_counts_the_spans(tmp_path):
    out = tmp_path / "tracing.json"
    result = CliRunner().invoke(bench, ["overhead", "--instances", "1", "--samples", "16", "--tracing",
                                        "--json", str(out)])
    assert result.exit_code == 0, result.output
    res = json.loads(out.read_text())
    assert list(res["clusters"]) == ["off", "on (100% sampled)", "off, again"] and res["sample_ratio"] == 1.0
    # Every traced request exported its spans (the warm-up's too); the untraced clusters none.
    assert res["spans_exported"] >= 16 * 5
    assert all(v > 0 for v in res["off_path_ns_per_call"].values())
    # The tracing work timed in process, tracing on; off again afterwards (this process serves other tests).
    assert set(res["on_path_us_per_request"]) == {"frontend_before_first_token", "instance_before_first_token",
                                                  "frontend_after_response", "otlp_encode_per_span"}
    assert all(v > 0 for v in res["on_path_us_per_request"].values())
    from libs.common import tracing

    assert not tracing.enabled()
    assert "tracing on - off, TTFT p50" in result.output
