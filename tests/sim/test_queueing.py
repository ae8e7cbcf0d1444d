"""The queueing probe (ferry/sim/queueing.py): it reads and never changes a
run, it charges each waiting request to the right cause, and the breakdown
removes only fragmented waits."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from ferry.sim.queueing import QueueProbe, breakdown
from ferry.sim.queueing_cli import queueing
from ferry.sim.run import SimOptions, simulate
from libs.common.types import SamplingParams
from services.instance.engine.core.block_pool import BlockPool
from services.instance.engine.core.request import Request
from services.instance.engine.core.scheduler import Scheduler

BS = 16


def _instance(free_blocks: int, waiting_tokens: list[int], first_arrival: float, watermark: int = 0):
    """A stand-in instance: a real pool with ``free_blocks`` free and a real
    scheduler whose queue holds requests of these context lengths."""
    pool = BlockPool(free_blocks + 100, watermark_blocks=watermark)
    pool.allocate(100)  # in use by running requests
    sched = Scheduler(pool, BS, max_num_seqs=64, max_num_batched_tokens=2048)
    for i, n in enumerate(waiting_tokens):
        t = first_arrival + i
        sched.add_waiting(Request(f"r{first_arrival:g}-{i}", list(range(n)), SamplingParams(), arrival_time=t, seq=i))
    return SimpleNamespace(engine=SimpleNamespace(pool=pool, scheduler=sched))


def _probe(instances: list) -> QueueProbe:
    probe = QueueProbe.__new__(QueueProbe)  # classify() reads only the instances
    probe.c = SimpleNamespace(instances={f"i{n}": inst for n, inst in enumerate(instances)})
    return probe


def test_local_fragmented_and_short_are_told_apart():
    # A: 10 free blocks, a queue of 4 blocks (fits) then 20 blocks (does not) then 1 block (behind the head).
    a = _instance(10, [4 * BS, 20 * BS, BS], first_arrival=100)
    # B: 30 free blocks and nothing waiting: pooled memory has 6 (left on A) + 30 = 36 blocks.
    b = _instance(30, [], first_arrival=0)
    # C: 0 free, waits for 16 blocks (arrived first: served first in the pooled walk) and 5 blocks.
    c = _instance(0, [16 * BS, 5 * BS], first_arrival=1)
    cause = _probe([a, b, c]).classify()
    assert cause["r100-0"] == 0  # fits its own instance
    assert cause["r1-0"] == 1  # 16 of the 36 pooled blocks
    assert cause["r1-1"] == 1  # 5 more: 15 left
    assert cause["r100-1"] == 2  # 20 > 15: the cluster has not the memory
    assert cause["r100-2"] == 1  # 1 block, behind A's head: fragmentation, not shortage
    assert len(cause) == 5


def test_the_watermark_is_not_free_for_admission():
    cause = _probe([_instance(10, [8 * BS], first_arrival=0, watermark=4)]).classify()
    assert cause["r0-0"] == 2


def _opts(**kw) -> SimOptions:
    base = {"arrivals": "poisson:12", "lengths": "M-M", "num_requests": 300, "instances": 4, "progress": False,
            "seed": 3}
    return SimOptions(**{**base, **kw})


def test_the_probe_changes_nothing_in_the_run():
    plain = simulate(_opts(), "round_robin")
    probed = simulate(_opts(), "round_robin", extend=lambda c: QueueProbe(c, 0.01))
    assert probed["summary"] == plain["summary"]
    assert probed["requests"] == plain["requests"]
    charged = probed["sim"]["extension"]["wait_s"]
    assert charged  # this load queues: the probe saw waiting requests
    pre = probed["sim"]["extension"]["preemptions"]
    assert pre["short"] + pre["not_short"] == probed["summary"]["preemptions"] > 0  # every preemption, once
    # Nobody is charged more than its time to first token.
    ttft = {f"req-{r['index']}": r["ttft_s"] for r in probed["requests"]}
    assert all(sum(v) <= ttft[rid] + 0.011 for rid, v in charged.items())


def test_breakdown_removes_only_fragmented_waits():
    reqs = [{"index": i, "error": None, "ttft_s": 1.0} for i in range(99)]
    reqs.append({"index": 99, "error": None, "ttft_s": 20.0})
    summary = {"short_time_s": 3.0, "fragmented_time_s": 5.0,
               "wait_s": {"req-99": [1.0, 12.0, 5.0], "req-0": [0.5, 0.0, 0.0]}}
    out = breakdown(summary, reqs)
    assert out["share_tail"] == pytest.approx({"local": 1 / 18, "fragmented": 12 / 18, "short": 5 / 18})
    assert out["tail_requests"] == 1
    # The P99 of 99 ones and one 20 interpolates; without the 12 s the outlier is 8 s.
    import numpy as np

    assert out["ttft_p99_ms"] == pytest.approx(np.percentile([1.0] * 99 + [20.0], 99) * 1000)
    assert out["ttft_p99_without_fragmented_ms"] == pytest.approx(np.percentile([1.0] * 99 + [8.0], 99) * 1000)


def test_the_command_writes_the_same_json_twice(tmp_path):
    args = ["--instances", "3", "--lengths", "M-M", "--arrivals", "poisson:5", "-n", "150", "--seeds", "0-1",
            "--policies", "infaas++,llumnix_base"]
    outs = []
    for name in ("a.json", "b.json"):
        res = CliRunner().invoke(queueing, args + ["--json", str(tmp_path / name)])
        assert res.exit_code == 0, res.output
        outs.append((tmp_path / name).read_text())
    assert outs[0] == outs[1]
    data = json.loads(outs[0])
    assert set(data["per_seed"]) == {"infaas++", "llumnix_base"}
    assert len(data["ratios"]["llumnix_base"]["bound"]["per_seed"]) == 2
    assert "fragmented waits removed" in res.output


def test_the_command_refuses_a_baseline_it_does_not_run():
    res = CliRunner().invoke(queueing, ["--policies", "llumnix", "--baseline", "infaas++"])
    assert res.exit_code != 0
    assert "--baseline" in res.output
