"""`ferry profile`: the step-time fit, and the command end to end on a tiny
random-weight model, whose profile a sim engine then runs with."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ferry.bench.profile_cli import fit_slope, fit_step_model, profile
from services.instance.engine.sim import SimProfile


def test_fit_recovers_a_linear_step_model():
    pts = [(b, kv, 20.0 + 0.5 * b + 0.01 * kv) for b in (1, 4, 16) for kv in (64 * b, 512 * b, 1000 * b)]
    assert fit_step_model(pts) == pytest.approx((20.0, 0.5, 0.01), rel=1e-6)


def test_fit_drops_a_coefficient_the_data_drive_negative():
    # Step time falls with batch here (noise): that coefficient is dropped, not reported negative.
    pts = [(1, 100, 30.0), (4, 400, 29.0), (16, 1600, 28.0)]
    base, per_seq, per_kv = fit_step_model(pts)
    assert min(base, per_seq, per_kv) >= 0
    assert base == pytest.approx(29.0, abs=1.0)


def test_prefill_slope():
    assert fit_slope([(64, 10.0), (256, 34.0), (1024, 130.0)]) == pytest.approx(0.125)


def test_profile_command_writes_a_profile_the_sim_runs(tmp_path, make_sim_engine):
    out = tmp_path / "tiny.json"
    r = CliRunner().invoke(profile, ["--json", str(out), "--model", "tiny-llama", "--num-blocks", "64",
                                     "--prefill-lens", "16,48", "--batch-sizes", "1,3", "--context-lens", "8,24",
                                     "--steps", "2"])
    assert r.exit_code == 0, r.output + repr(r.exception)
    raw = json.loads(out.read_text())
    assert len(raw["measured"]["decode"]) == 2 * 2 * 2 and len(raw["measured"]["prefill"]) == 2
    assert "Measured" in raw["source"]
    prof = SimProfile.load(str(out))
    assert prof.kv_capacity_tokens == 64 * 16 and prof.block_size == 16
    assert prof.decode_base_ms + prof.decode_ms_per_seq + prof.decode_ms_per_kv_token > 0
    assert make_sim_engine(str(out)) == 5  # the sim generates with it


def test_profile_refuses_lengths_that_do_not_fit(tmp_path):
    r = CliRunner().invoke(profile, ["--json", str(tmp_path / "x.json"), "--model", "tiny-llama",
                                     "--num-blocks", "4", "--prefill-lens", "500"])
    assert r.exit_code != 0 and "raise --num-blocks" in r.output


@pytest.fixture
def make_sim_engine():
    from libs.common.types import SamplingParams
    from services.instance.engine import create_engine
    from services.instance.engine.base import EngineConfig, EngineRequest

    def run(path: str) -> int:
        e = create_engine(EngineConfig(engine="sim", profile=path))
        e.add_request(EngineRequest("r", (1, 2, 3), SamplingParams(max_tokens=5, ignore_eos=True)))
        n = 0
        while e.has_work():
            n += len(e.step())
        e.check_integrity()
        return n

    return run


def test_decode_points_time_the_whole_batch(tmp_path):
    # Prefill is chunked: the first requests decode while the last prefill.
    # Every timed step must still run the whole batch, at its full context.
    out = tmp_path / "tiny.json"
    # 16 x 400 tokens take four 2048-token prefill steps.
    r = CliRunner().invoke(profile, ["--json", str(out), "--model", "tiny-llama", "--num-blocks", "512",
                                     "--prefill-lens", "16,32", "--batch-sizes", "16", "--context-lens", "400",
                                     "--steps", "3"])
    assert r.exit_code == 0, r.output + repr(r.exception)
    for p in json.loads(out.read_text())["measured"]["decode"]:
        assert p["batch"] == 16 and p["kv_tokens"] >= 16 * 400, p
