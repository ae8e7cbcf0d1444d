"""`ferry bench overhead --ab-frontend-arg`: two fake clusters, one with the
extra frontend argument, sampled in turns; both get their added TTFT."""

import json

from click.testing import CliRunner

from ferry.bench.cli import bench
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
    assert rpc.current().token == ""  # the bench's token does not outlive the command
