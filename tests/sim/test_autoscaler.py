"""Auto-scaling in the simulator: the live autoscaler's decide() launches
instances under load and drains the launched ones once the load is gone;
cost counts every instance from its launch to its stop."""

from ferry.sim.params import Delays
from ferry.sim.run import SimOptions, simulate

AUTO = ("--autoscale", "--scale-out-below", "30", "--scale-in-above", "100", "--scale-window-s", "2",
        "--scale-cooldown-s", "2", "--min-instances", "1", "--max-instances", "6")


def test_scale_out_under_load_then_in_and_cost_counts_launches():
    opts = SimOptions(arrivals="poisson:6", lengths="M-M", num_requests=300, seed=2, instances=1,
                      scheduler_args=AUTO, delays=Delays(launch_s=1.0), progress=False)
    run = simulate(opts, "llumnix")
    s, sim = run["summary"], run["sim"]
    assert s["completed"] == 300
    actions = [e["action"] for e in sim["scale_events"]]
    assert actions.count("scale_out") >= 2 and "scale_in" in actions
    assert actions.index("scale_in") > actions.index("scale_out")
    # Between one instance all along and six all along.
    duration = s["duration_s"]
    assert duration < sim["instance_seconds"] < 6 * duration
    fixed = simulate(SimOptions(**{**opts.__dict__, "scheduler_args": (), "instances": 1}), "llumnix")
    assert fixed["sim"]["instance_seconds"] < sim["instance_seconds"]
    assert run["summary"]["ttft_ms"]["p99"] < fixed["summary"]["ttft_ms"]["p99"]  # the launches paid off


def test_a_scale_out_sized_by_the_shortfall_launches_several_at_once():
    base = SimOptions(arrivals="poisson:6", lengths="M-M", num_requests=300, seed=2, instances=1,
                      scheduler_args=AUTO, delays=Delays(launch_s=1.0), progress=False)
    many = simulate(SimOptions(**{**base.__dict__, "scheduler_args": AUTO + ("--scale-out-max-launch", "4")}),
                    "llumnix")
    assert many["summary"]["completed"] == 300
    outs = [e for e in many["sim"]["scale_events"] if e["action"] == "scale_out"]
    assert max(e["count"] for e in outs) > 1 and all(1 <= e["count"] <= 4 for e in outs)
    one = simulate(base, "llumnix")
    assert all(e["count"] == 1 for e in one["sim"]["scale_events"] if e["action"] == "scale_out")
