"""Issue 55's sensitivity flags in the simulator, on the live code they set:
dispatch without pending accounting (the scheduler's --no-dispatch-pending,
as Llumnix's first release dispatched) and vLLM 0.4's prefill-first
scheduling (the instances' --prefill-first)."""

from collections import Counter

from ferry.sim.run import SimOptions, simulate


def _run(**kw) -> dict:
    return simulate(SimOptions(instances=2, lengths="fixed:64:16", num_requests=12, seed=0, progress=False,
                               **kw), "llumnix-v0")


def _first_instances(run: dict) -> Counter:
    return Counter(r["instances"][0] for r in run["requests"])


def test_without_pending_accounting_a_burst_goes_where_the_last_reports_point():
    # 12 requests within a few milliseconds: no report comes between them
    counted = _first_instances(_run(arrivals="poisson:5000"))
    uncounted = _first_instances(_run(arrivals="poisson:5000", scheduler_args=("--no-dispatch-pending",)))
    assert max(counted.values()) <= 7  # each placement counted until reported: the burst is spread
    assert max(uncounted.values()) >= 10  # the same reports, the same choice, again and again


def test_prefill_first_stops_decodes_while_prompts_arrive():
    args = ("--max-num-batched-tokens=4096",)
    chunked = _run(arrivals="poisson:20", instance_args=args)["summary"]
    first = _run(arrivals="poisson:20", instance_args=(*args, "--prefill-first"))["summary"]
    assert chunked["completed"] == first["completed"] == 12
    # a prompt's step holds the decodes beside it back a whole step (chunked: they run in it)
    assert first["decode_ms"]["p99"] > chunked["decode_ms"]["p99"]
