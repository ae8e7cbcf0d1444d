"""`ferry bench overhead --ab-frontend-arg`: two fake clusters, one with the
extra frontend argument, sampled in turns; both get their added TTFT."""

import json

from click.testing import CliRunner

from ferry.bench.cli import bench


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
