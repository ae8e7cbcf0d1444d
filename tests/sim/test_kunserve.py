"""KunServe in the simulator (ferry/sim/kunserve.py: the live KunServeLoop on
the SimLoop, simulated instance stubs): drops grow the members' KV pools and
restores give the memory back, nothing leaks, a group throttled again is
merged (the live loop's merges), tokens are those of an undisturbed run, the
static pipeline baseline, and the command."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ferry.sim.kunserve import KunServe, KunServeParams, layer_blocks
from ferry.sim.kunserve_cli import kunserve, violation_pct
from ferry.sim.run import SimOptions, simulate
from services.instance.engine.sim import PROFILE_DIR, SimProfile

OWN_BLOCKS = 1000  # the small profile's pool: 16,000 tokens of 16


@pytest.fixture
def small_profile(tmp_path):
    """qwen2.5-14b-a800 with a small KV pool and parameter memory (9 blocks a
    layer, 432 for the 48 layers), so a burst of a few hundred requests
    throttles four instances."""
    raw = json.loads((PROFILE_DIR / "qwen2.5-14b-a800.json").read_text())
    raw.update(name="small-kunserve", kv_capacity_tokens=16_000, param_bytes=1_500_000_000, max_model_len=4096)
    path = tmp_path / "small.json"
    path.write_text(json.dumps(raw))
    return str(path)


def _opts(profile: str, **kw) -> SimOptions:
    base = {"arrivals": "phases:4@20,40@5", "lengths": "fixed:128:512", "num_requests": 400, "instances": 4,
            "profile": profile, "progress": False, "scheduler_args": ("--no-migration",),
            "instance_args": ("--max-num-seqs=1024",)}
    return SimOptions(**{**base, **kw})


def _run(opts: SimOptions, params: KunServeParams | None = None):
    """simulate() with KunServe, probing every member's pool once a second."""
    seen = {"cluster": None, "probes": []}

    def extend(cluster):
        seen["cluster"] = cluster
        ks = KunServe(cluster, params or KunServeParams())

        def probe():
            seen["probes"].append({iid: (i.engine.pool.capacity, iid in ks.loop.groups)
                                   for iid, i in cluster.instances.items()})
            if cluster.recorder.done < len(cluster.work.requests):
                cluster.k.after(1.0, probe)

        cluster.k.after(1.0, probe)
        return ks

    run = simulate(opts, "llumnix", extend=extend)
    return run, seen


def test_layer_blocks_rounds_down_and_needs_the_parameter_memory():
    p = SimProfile.load("qwen2.5-14b-a800")
    # 28 GB / 48 layers / (16 tokens x 192 KiB) = 185.4 blocks a layer
    assert layer_blocks(p) == 185
    with pytest.raises(ValueError, match="param_bytes"):
        layer_blocks(SimProfile.load("llama-7b-a10"))


def _balanced(ext) -> None:
    """Every member that dropped layers took them back, entered the pipeline
    once a formation and once a merge, and left it once; no stub call failed."""
    assert ext["errors"] == [] and ext["lent_blocks_at_end"] == 0
    per: dict[str, dict] = {}
    for e in ext["member_log"]:
        m = per.setdefault(e["member"], {"drop": 0, "restore": 0, "enter": 0, "leave": 0})
        m[e["event"]] += e.get("blocks", 1)
    merged = {i: sum(i in e["members"] for e in ext["log"] if e["event"] == "merge") for i in per}
    assert per and all(m["drop"] == m["restore"] > 0 and m["enter"] == 1 + merged[i] and m["leave"] == 1
                       for i, m in per.items())


def test_a_burst_drops_layers_then_restores_them_and_nothing_leaks(small_profile):
    run, seen = _run(_opts(small_profile))
    s, ext = run["summary"], run["sim"]["extension"]
    assert s["completed"] == s["requests"] == 400 and s["failed"] == 0
    assert ext["drops"] >= 1 and ext["groups_formed"] >= 2 and ext["freed_blocks"] > 0
    # The live loop formed the groups (merging those throttled again) and restored every one
    # once the burst passed.
    assert ext["restores"] == ext["groups_formed"] - ext["merges"] and ext["groups_at_end"] == 0
    assert [e["event"] for e in ext["log"]].count("drop") == ext["groups_formed"]
    _balanced(ext)
    cluster = seen["cluster"]
    left = cluster.settle()
    assert left == {"requests": 0, "used_blocks": 0, "reserved_blocks": 0, "handoffs_under_way": 0}
    assert all(i.engine.pool.capacity == OWN_BLOCKS and i.executor.stretch is None
               for i in cluster.instances.values())
    # While grouped, a member's pool held its own blocks and the lent ones: a
    # pair, each member drops 24 of the 48 layers, 9 blocks each; a group of
    # four, 36 (its own alone once it is restored and its buddies still restoring).
    lent = {cap for probe in seen["probes"] for cap, grouped in probe.values() if grouped}
    pair, four = OWN_BLOCKS + 24 * 9, OWN_BLOCKS + 36 * 9
    assert pair in lent and lent <= {OWN_BLOCKS, pair, four} and (four in lent) == (ext["merges"] > 0)
    # Outside a group, its own (or the lent ones already, while the group forms).
    alone = [cap for probe in seen["probes"] for cap, grouped in probe.values() if not grouped]
    assert set(alone) <= {OWN_BLOCKS, pair} and alone.count(OWN_BLOCKS) > 0.9 * len(alone)


def test_a_group_throttled_again_is_merged_into_a_group_of_four(small_profile):
    # A longer, heavier burst: the pairs fill up again, and the live loop merges
    # them (Algorithm 1 goes on merging): each member keeps 12 of the 48 layers
    # and lends 36 layers' blocks; the group of four is restored as merged.
    opts = _opts(small_profile, arrivals="phases:4@20,60@10", num_requests=600, fake_tokens=True)
    run, seen = _run(opts)
    ext = run["sim"]["extension"]
    assert run["summary"]["completed"] == 600
    assert run["tokens"] == simulate(opts, "llumnix")["tokens"]  # every request's, through drops and merges
    drops = [e for e in ext["log"] if e["event"] == "drop"]
    merges = [e for e in ext["log"] if e["event"] == "merge"]
    assert drops and all(len(e["members"]) == 2 and e["freed_blocks"] == 2 * 24 * 9 for e in drops)
    assert merges and ext["merges"] == len(merges)
    for e in merges:  # two formed groups become one, one replica's parameters more
        assert sorted(e["members"]) == sorted(e["groups"][0] + e["groups"][1]) and len(e["members"]) == 4
        assert e["freed_blocks"] == 48 * 9
    assert max(cap for probe in seen["probes"] for cap, _ in probe.values()) == OWN_BLOCKS + 36 * 9
    restored = [e["members"] for e in ext["log"] if e["event"] == "restore"]
    assert sorted(map(sorted, restored)) == sorted(sorted(e["members"]) for e in merges)
    _balanced(ext)
    assert ext["groups_at_end"] == 0 and ext["lent_blocks_at_end"] == 0
    assert seen["cluster"].settle()["used_blocks"] == 0
    assert all(i.engine.pool.capacity == OWN_BLOCKS for i in seen["cluster"].instances.values())


def test_merging_admits_what_the_pairs_preempted_for(small_profile):
    # The same burst with merges off (a cap of two members): the pairs preempt more.
    opts = _opts(small_profile, arrivals="phases:4@20,60@10", num_requests=600)
    merged, _ = _run(opts)
    pairs, _ = _run(opts, KunServeParams(max_group_size=2))
    assert pairs["sim"]["extension"]["merges"] == 0 and merged["sim"]["extension"]["merges"] >= 1
    assert merged["summary"]["preemptions"] < pairs["summary"]["preemptions"]


def test_the_drop_admits_the_queue_a_replica_would_preempt_for(small_profile):
    base = simulate(_opts(small_profile), "llumnix")["summary"]
    run, _ = _run(_opts(small_profile))
    assert run["summary"]["preemptions"] < base["preemptions"]


def test_tokens_are_those_of_an_undisturbed_run(small_profile):
    opts = _opts(small_profile, fake_tokens=True, num_requests=200)
    plain = simulate(opts, "llumnix")
    run, _ = _run(opts)
    assert run["sim"]["extension"]["drops"] >= 1
    assert run["tokens"] == plain["tokens"]
    assert all(len(t) == 512 for t in run["tokens"].values())


def test_the_same_options_give_the_same_run(small_profile):
    a, _ = _run(_opts(small_profile, num_requests=150))
    b, _ = _run(_opts(small_profile, num_requests=150))
    a.pop("_wall_s")
    b.pop("_wall_s")
    assert a == b


def test_static_pipeline_groups_from_the_start_never_restore_and_run_slower(small_profile):
    opts = _opts(small_profile, arrivals="poisson:2", num_requests=60)
    plain = simulate(opts, "llumnix")["summary"]
    run, seen = _run(opts, KunServeParams(static_group_size=2))
    ext = run["sim"]["extension"]
    assert ext["groups_formed"] == 2 and ext["restores"] == 0 and ext["groups_at_end"] == 2
    assert ext["drops"] == 0 and ext["errors"] == []  # formed by the live loop's form(), no tick
    assert [sorted(e["members"]) for e in ext["log"]] == [["inst-000", "inst-001"], ["inst-002", "inst-003"]]
    assert all(grouped for probe in seen["probes"] for _, grouped in probe.values())
    # Each step pays the pipeline's overhead and a hop: light load, so the TBT
    # ratio is about 1 + pipeline_overhead.
    ratio = run["summary"]["decode_ms"]["p50"] / plain["decode_ms"]["p50"]
    assert 1.15 < ratio < 1.3


def test_invalid_parameters_are_refused():
    for bad in ({"static_group_size": 1}, {"restore_margin": 1.0}, {"interval_s": 0}, {"pipeline_overhead": -1}):
        with pytest.raises(ValueError):
            KunServeParams(**bad).validate()


def test_violation_pct_counts_a_request_that_misses_either_slo():
    slo = {"ttft_ms": 100.0, "tbt_ms": 10.0}
    reqs = [{"error": None, "ttft_s": 0.05, "decode_s": 0.005}, {"error": None, "ttft_s": 0.2, "decode_s": 0.005},
            {"error": None, "ttft_s": 0.05, "decode_s": 0.02}, {"error": None, "ttft_s": 0.05, "decode_s": None},
            {"error": "boom", "ttft_s": None, "decode_s": None}]
    assert violation_pct(reqs, slo) == pytest.approx(50.0)


def test_the_command_compares_the_modes_and_writes_the_same_bytes(small_profile, tmp_path):
    args = ["--instances", "4", "--profile", small_profile, "--arrivals", "phases:4@20,40@5", "--lengths",
            "fixed:128:512", "-n", "150", "--seeds", "0,1", "--instance-arg=--max-num-seqs=1024"]
    outs = []
    for name in ("a.json", "b.json"):
        res = CliRunner().invoke(kunserve, [*args, "--json", str(tmp_path / name)])
        assert res.exit_code == 0, res.output + repr(res.exception)
        outs.append((tmp_path / name).read_bytes())
    assert outs[0] == outs[1]
    data = json.loads(outs[0])
    assert list(data["per_seed"]) == ["replication", "migration", "pipeline", "kunserve"]
    assert all(len(v) == 2 for v in data["per_seed"].values()) and len(data["slo"]) == 2
    assert set(data["ratios"]) == {"replication", "migration", "pipeline"}
    r = data["ratios"]["replication"]["p99_ttft_over_kunserve"]["per_seed"]
    assert r == pytest.approx([a["ttft_ms"]["p99"] / b["ttft_ms"]["p99"]
                               for a, b in zip(data["per_seed"]["replication"], data["per_seed"]["kunserve"])])
    assert "P99 TTFT / KunServe's" in res.output
    bad = CliRunner().invoke(kunserve, [*args, "--modes", "kunserve,vllm"])
    assert bad.exit_code != 0 and "unknown modes" in bad.output
