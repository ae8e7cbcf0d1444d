"""`ferry bench serving`: the non-streaming path end to end, and the sim
slowdown's profile and control-loop scaling."""

from __future__ import annotations

import json

from click.testing import CliRunner

from ferry.bench.cli import bench
from ferry.bench.serving import scaled_profile, slowed_intervals
from services.instance.engine.sim import SimProfile


def test_serving_no_stream_fake(tmp_path):
    out = tmp_path / "run.json"
    result = CliRunner().invoke(bench, [
        "serving", "--engine", "fake", "--instances", "2", "--token-delay-ms", "2", "-n", "10",
        "--arrivals", "gamma:50:2", "--lengths", "fixed:8:6", "--no-stream", "--no-progress", "--json", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    run = json.loads(out.read_text())
    assert run["summary"]["completed"] == 10
    assert all(r["tokens"] == 6 and r["server_ttft_ms"] > 0 and r["ttft_s"] > 0 for r in run["requests"])


def test_scaled_profile_keeps_the_format(tmp_path):
    base = SimProfile.load("llama-7b-a10")
    slow = SimProfile.load(scaled_profile("llama-7b-a10", 4, str(tmp_path / "p")))
    assert slow.decode_base_ms == base.decode_base_ms * 4
    assert slow.prefill_ms_per_token == base.prefill_ms_per_token * 4
    assert slow.step_ms(8, 100, 1000) == base.step_ms(8, 100, 1000) * 4
    assert (slow.kv_capacity_tokens, slow.block_size, slow.max_model_len) == (
        base.kv_capacity_tokens, base.block_size, base.max_model_len)


def test_slowed_intervals():
    assert slowed_intervals(1) == ([], [])
    assert slowed_intervals(0.5) == ([], [])  # compression keeps the wall-time intervals
    from services.instance.config import InstanceConfig

    inst, sched = slowed_intervals(5)
    report = InstanceConfig.__dataclass_fields__["report_interval_s"].default
    assert inst == ["--report-interval-s", f"{report * 5:g}"] and sched == ["--migrate-interval-s", "0.5"]


def test_serving_on_a_split_cluster_fake(tmp_path):
    """--prefill/--decode start a Splitwise cluster; every request completes."""
    out = tmp_path / "split.json"
    result = CliRunner().invoke(bench, [
        "serving", "--engine", "fake", "--instances", "2", "--prefill", "1", "--decode", "1", "--token-delay-ms", "2",
        "-n", "10", "--arrivals", "gamma:50:2", "--lengths", "fixed:40:6", "--no-progress", "--json", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    run = json.loads(out.read_text())
    assert (run["options"]["prefill"], run["options"]["decode"]) == (1, 1)
    assert run["summary"]["completed"] == 10
    assert all(r["tokens"] == 6 for r in run["requests"])


def test_serving_refuses_a_split_that_cannot_serve():
    result = CliRunner().invoke(bench, ["serving", "--engine", "fake", "--instances", "1", "--prefill", "1",
                                        "-n", "1", "--no-progress"])
    assert result.exit_code != 0
    assert "need a decode or mixed instance" in (result.output + repr(result.exception))
