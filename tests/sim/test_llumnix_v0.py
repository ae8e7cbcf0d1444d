"""llumnix-v0 in the simulator (which runs the live pairing and the live
instances' migrate-out orders): it runs, migrates, and each order moves one
request at most (Llumnix's first release: one migration per pair)."""

from ferry.sim.run import SimOptions, simulate

OPTS = SimOptions(arrivals="poisson:9", lengths="M-M", num_requests=600, seed=0, instances=4, progress=False)


def test_llumnix_v0_runs_and_migrates_one_request_per_order():
    box = {}

    class Keep:
        def __init__(self, cluster):
            box["cluster"] = cluster
            box["preempted"] = 0
            deliver = cluster.scheduler.deliver

            def counting(status):  # the engines report their preempted requests waiting
                box["preempted"] = max(box["preempted"], status.preempted_waiting)
                deliver(status)

            cluster.scheduler.deliver = counting

        def summary(self):
            return {}

    r = simulate(OPTS, "llumnix-v0", extend=Keep)
    s, sim = r["summary"], r["sim"]
    assert s["completed"] == OPTS.num_requests and s["failed"] == 0
    assert sim["migrations_committed"] > 0 and s["migrated_requests"] > 0
    sched = box["cluster"].scheduler
    assert sched.config.out_threshold == sched.config.in_threshold == -3.0
    # one migration per order: never more migrations than orders
    assert 0 < len(sched.outcomes) <= s["migrations_ordered"]
    assert s["preemptions"] > 0 and box["preempted"] > 0
    # the current presets run several per order and pair far less eagerly
    base = simulate(OPTS, "llumnix_base")
    assert base["summary"]["migrations_ordered"] < s["migrations_ordered"]
