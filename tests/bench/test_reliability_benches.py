"""CI-sized runs of the reliability benchmarks' invariants (the full-sized
runs are `ferry bench storm` and `ferry bench rolling-restart`; their
timings are reported there, never asserted here)."""

from ferry.bench.rolling import run_rolling
from ferry.bench.storm import run_storm


async def test_a_small_storm_kills_nothing_leaks_nothing_and_every_request_ends(tmp_path):
    res = await run_storm("fake", 2, streams=300, leavers=60, slow=10, max_tokens=8, max_s=120,
                          frontend_args=["--client-timeout-s", "2", "--max-in-flight", "100"], instance_args=[],
                          log_dir=str(tmp_path), seed=1)
    assert res["dead_processes"] == [] and res["leaked_blocks"] == 0 and res["integrity_errors"] == []
    assert res["unended"] == 0
    c = res["counts"]
    assert c.get("answered", 0) + c.get("refused", 0) == 300, c  # each stream answered or told to come back
    assert c.get("refused", 0) > 0, c  # the in-flight bound of 100 was met
    assert not [k for k in c if k.startswith("error")], c
    assert res["slowloris_closed"] == 10 and res["after_storm_probe"] == "answered"


async def test_a_small_rolling_restart_loses_cuts_and_recomputes_nothing(tmp_path):
    res = await run_rolling("fake", 2, concurrency=4, baseline_s=1.0, settle_s=0.5, seed=1, log_dir=str(tmp_path))
    assert [r["exit_code"] for r in res["restarts"]] == [0] * 5
    assert res["answered"] > 0 and res["lost"] == 0 and res["cut"] == 0 and res["text_mismatches"] == 0, res
    assert res["recomputed_tokens"] == 0 and res["resumes"] == 0, res
    assert res["leaked_blocks"] == 0


async def test_a_chaos_fault_the_cluster_never_recovers_from_ends_the_run_with_its_name():
    # A restarted process that fails at its start: the run must stop with the
    # fault's name, not wait for its recovery forever (the CI's 90 minutes).
    from types import SimpleNamespace

    import pytest

    from ferry.bench.chaos import Chaos

    done = []
    cluster = SimpleNamespace(spec=SimpleNamespace(log_dir="/logs/here"), kill=done.append, restart=done.append)
    chaos = Chaos(cluster, 2, seed=0, down_s=0.0, recover_timeout_s=0.3)

    async def never(http):
        return False

    chaos.healthy = never
    with pytest.raises(RuntimeError, match="fault scheduler on scheduler: not recovered in 0.3 s .logs: /logs/here"):
        await chaos.inject("scheduler", http=None)
    assert done == ["scheduler", "scheduler"] and chaos.faults == []
