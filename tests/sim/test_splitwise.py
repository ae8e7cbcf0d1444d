"""Splitwise in the simulator: prefill and decode instances, the KV handoff in
both modes, the provisioning study's cost and power model, its workloads."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from ferry.measure import workload as wl
from ferry.sim.instance import TAP_LAYERS
from ferry.sim.params import Delays
from ferry.sim.pools import PoolError, parse_pools
from ferry.sim.provision import DESIGNS, Config, configs_within, profile, unloaded
from ferry.sim.run import SimOptions, simulate
from ferry.sim.splitwise_cli import splitwise
from libs.common.types import Role
from services.instance.engine.fake import VOCAB_HI, VOCAB_LO, fake_generate
from services.instance.engine.sim import PROFILE_DIR, SimProfile

SPLIT = ("prefill:{p}:1", "decode:{p}:1")


@pytest.fixture
def layered_profile(tmp_path):
    """llama-7b-a10 with its 32 layers, so per-layer handoffs overlap."""
    raw = json.loads((PROFILE_DIR / "llama-7b-a10.json").read_text())
    raw.update(name="llama-7b-a10-layers", num_layers=32)
    path = tmp_path / "layers.json"
    path.write_text(json.dumps(raw))
    return str(path)


def _opts(profile_path: str, **kw) -> SimOptions:
    base = {"arrivals": "poisson:6", "lengths": "S-S", "num_requests": 40, "seed": 3, "progress": False, "fake_tokens": True,
                "profile": profile_path, "per_layer_threshold": 100, "instance_args": ("--max-migrate-in", "64")}
    return SimOptions(**{**base, **kw})


def test_split_cluster_emits_the_colocated_tokens_and_hands_every_request_off(layered_profile):
    split = simulate(_opts(layered_profile, pools=tuple(s.format(p=layered_profile) for s in SPLIT)), "infaas++")
    mixed = simulate(_opts(layered_profile, instances=2), "infaas++")
    work = wl.build("poisson:6", "S-S", 40, 3, max_model_len=SimProfile.load(layered_profile).max_model_len)
    assert split["summary"]["completed"] == mixed["summary"]["completed"] == 40
    assert split["tokens"] == mixed["tokens"]
    for r in work.requests:  # the fake model's own tokens, not just the same wrong ones twice
        prompt = wl.prompt_ids(r, 3, VOCAB_LO, VOCAB_HI)
        assert split["tokens"][f"req-{r.index}"] == fake_generate(prompt, r.output_len)
    handed = [r for r in work.requests if r.output_len > 1]
    recs = split["handoffs"]
    # A per-layer handoff starts with its request: one whose prompt's token was its last one ends it.
    assert sorted(h["request_id"] for h in recs if not h["finished"]) == sorted(f"req-{r.index}" for r in handed)
    assert all(h["mode"] == "per_layer" for h in recs if h["finished"])
    assert {h["mode"] for h in recs} == {"serialized", "per_layer"}  # the threshold splits S-S prompts
    assert not any(h["in_place"] for h in recs)
    inst = split["sim"]["instances"]
    pre = [i for i in inst.values() if i["role"] == "prefill"]
    dec = [i for i in inst.values() if i["role"] == "decode"]
    assert len(pre) == len(dec) == 1
    assert pre[0]["decode_tokens"] == 0 and dec[0]["prefill_tokens"] == 0
    assert pre[0]["prefill_tokens"] == sum(r.prompt_len for r in work.requests)
    assert dec[0]["decode_tokens"] == sum(r.output_len - 1 for r in work.requests)
    assert split["sim"]["left_at_end"] == {"requests": 0, "used_blocks": 0, "reserved_blocks": 0,
                                           "handoffs_under_way": 0}
    assert split["sim"]["handoff"]["blocks"] == sum(h["blocks"] for h in recs) > 0


def test_a_refused_handoff_decodes_on_the_prefill_instance_and_leaks_nothing(layered_profile):
    # One handoff in at a time (handoffs have their own limit): concurrent ones are refused, and the live
    # rule applies: the request decodes where it prefilled, with the same tokens.
    opts = _opts(layered_profile, pools=tuple(s.format(p=layered_profile) for s in SPLIT), arrivals="poisson:40",
                 instance_args=("--max-handoff-in", "1"))
    run = simulate(opts, "infaas++")
    assert run["summary"]["completed"] == 40
    h = run["sim"]["handoff"]
    assert h["refusals"] > 0 and h["in_place"] >= h["refusals"]
    pre = next(i for i in run["sim"]["instances"].values() if i["role"] == "prefill")
    assert pre["decode_tokens"] > 0  # the refused ones decoded there
    work = wl.build("poisson:40", "S-S", 40, 3, max_model_len=SimProfile.load(layered_profile).max_model_len)
    for r in work.requests:
        assert run["tokens"][f"req-{r.index}"] == fake_generate(wl.prompt_ids(r, 3, VOCAB_LO, VOCAB_HI), r.output_len)
    assert run["sim"]["left_at_end"] == {"requests": 0, "used_blocks": 0, "reserved_blocks": 0,
                                         "handoffs_under_way": 0}


def _one_long_prompt(threshold: int, fake_tokens: bool = False) -> dict:
    opts = SimOptions(arrivals="poisson:1", lengths="fixed:3500:8", num_requests=1, seed=0, progress=False,
                      pools=("prefill:llama2-70b-h100:1", "decode:llama2-70b-a100:1"),
                      per_layer_threshold=threshold, fake_tokens=fake_tokens)
    return simulate(opts, "infaas++")


def test_per_layer_exposes_less_of_a_long_prompts_transfer_than_serialized():
    # The step-time executor hands each group of layers to the tap as it is computed (fake tokens have one layer).
    ser, lay = _one_long_prompt(0), _one_long_prompt(1)
    (hs,), (hl,) = ser["handoffs"], lay["handoffs"]
    assert (hs["mode"], hl["mode"]) == ("serialized", "per_layer")
    assert hs["transfer_s"] == hl["transfer_s"] > 0
    assert hs["exposed_s"] > hs["transfer_s"]  # the whole transfer plus the handshakes
    groups = min(TAP_LAYERS, profile("llama2-70b-h100").num_layers)
    assert hl["transfer_s"] / groups <= hl["exposed_s"] < hs["exposed_s"] - 0.9 * hs["transfer_s"]
    # TTFT is the prompt instance's; the handoff shows in the time to the second token.
    assert ser["summary"]["ttft_ms"]["p50"] == pytest.approx(lay["summary"]["ttft_ms"]["p50"])
    assert ser["requests"][0]["e2e_s"] > lay["requests"][0]["e2e_s"]
    assert _one_long_prompt(0, fake_tokens=True)["tokens"] == _one_long_prompt(1, fake_tokens=True)["tokens"]


def test_cost_and_power_come_from_the_profiles():
    a, h, cap = profile("llama2-70b-a100"), profile("llama2-70b-h100"), profile("llama2-70b-h100cap")
    assert h.machine_cost / a.machine_cost == pytest.approx(2.15)  # Splitwise's H100:A100 cost ratio
    assert h.machine_power_w / a.machine_power_w == pytest.approx(1.75)  # and max power
    assert cap.machine_cost == h.machine_cost and cap.machine_power_w < h.machine_power_w
    assert cap.prefill_ms_per_token > h.prefill_ms_per_token and cap.decode_base_ms == h.decode_base_ms
    ha = next(d for d in DESIGNS if d.name == "Splitwise-HA")
    c = Config(ha, 2, 3)
    assert c.cost == pytest.approx(2 * 2.15 + 3 * 1.0)
    assert c.power_w == pytest.approx(2 * h.machine_power_w + 3 * a.machine_power_w)
    assert c.pools() == ("prefill:llama2-70b-h100:2", "decode:llama2-70b-a100:3")


def test_configs_within_a_budget_fit_it_and_cannot_grow():
    budget = 4 * profile("llama2-70b-h100").machine_power_w
    for d in DESIGNS:
        cs = configs_within(d, budget, "power_w")
        assert cs, d.name
        for c in cs:
            assert c.power_w <= budget + 1e-6
            assert Config(d, c.prompt, c.token + 1).power_w > budget
    base = next(d for d in DESIGNS if d.name == "Baseline-A100")
    assert [c.token for c in configs_within(base, budget, "power_w")] == [7]  # 22.4 kW / 3.2 kW


def test_unloaded_latency_matches_a_lone_request_in_the_simulator():
    opts = SimOptions(arrivals="poisson:1", lengths="fixed:3000:50", num_requests=1, seed=0, progress=False,
                      profile="llama2-70b-a100", instances=1)
    rec = simulate(opts, "infaas++")["requests"][0]
    ttft, tbt, e2e = unloaded(profile("llama2-70b-a100"), 3000, 50, 2048, Delays())
    assert rec["ttft_s"] == pytest.approx(ttft, rel=0.01)
    assert rec["decode_s"] == pytest.approx(tbt, rel=0.02)
    assert rec["e2e_s"] == pytest.approx(e2e, rel=0.02)


def test_coding_workload_is_long_prompts_short_outputs_and_seeded():
    a = wl.build("poisson:5", "coding", 4000, 7)
    b = wl.build("poisson:5", "coding", 4000, 7)
    c = wl.build("poisson:5", "coding", 4000, 8)
    assert a == b and a != c
    p = np.array([r.prompt_len for r in a.requests])
    o = np.array([r.output_len for r in a.requests])
    assert 1400 <= np.median(p) <= 1600 and 11 <= np.median(o) <= 15
    assert p.min() >= 64 and p.max() <= 4000 and o.max() <= 512


def test_conv_workload_draws_rows_of_the_azure_trace():
    _, ctx, gen = wl.load_azure(str(wl.traces_dir() / wl.AZURE_CONV))
    rows = set(zip(ctx.tolist(), gen.tolist()))
    w = wl.build("poisson:5", "conv", 300, 1)
    assert all((r.prompt_len, r.output_len) in rows for r in w.requests)
    assert [r.prompt_len for r in w.requests] != [r.prompt_len for r in wl.build("poisson:5", "conv", 300, 2).requests]


def test_pool_specs():
    pools = parse_pools("prefill:llama2-70b-h100:2,decode:llama2-70b-a100:0,mixed:llama-7b-a10:1")
    assert [(p.role, p.count) for p in pools] == [(Role.PREFILL, 2), (Role.MIXED, 1)]
    for bad in ("prefill:llama2-70b-h100", "chef:llama2-70b-h100:1", "decode:no-such-profile:1"):
        with pytest.raises(PoolError):
            parse_pools(bad)


def test_the_study_writes_the_same_json_for_the_same_seeds(tmp_path):
    args = ["--workloads", "coding", "-n", "24", "--seeds", "0-1", "--budget-h100", "2", "--rate-precision", "1.6",
            "--target-rps", "6", "--designs", "Splitwise-HA", "--quiet"]
    outs = []
    for name in ("a.json", "b.json"):
        r = CliRunner().invoke(splitwise, [*args, "--json", str(tmp_path / name)])
        assert r.exit_code == 0, r.output
        outs.append((tmp_path / name).read_bytes())
    assert outs[0] == outs[1]
    res = json.loads(outs[0])
    w = res["workloads"]["coding"]
    assert set(w["iso_power"]) == {"Baseline-H100", "Splitwise-HA"}
    assert w["iso_power"]["Baseline-H100"]["vs_baseline_h100"]["median"] == 1.0
    assert res["machines"]["llama2-70b-h100"]["cost"] == 2.15


def test_a_pool_of_mixed_instances_is_the_plain_cluster():
    base = {"arrivals": "poisson:6", "lengths": "M-M", "num_requests": 60, "seed": 2, "progress": False}
    plain = simulate(SimOptions(**base, instances=2), "llumnix")
    pooled = simulate(SimOptions(**base, pools=("mixed:llama-7b-a10:2",)), "llumnix")
    assert pooled["requests"] == plain["requests"]
    assert pooled["sim"]["handoff"]["handoffs"] == 0
