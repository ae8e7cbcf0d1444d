"""Where a simulated request's queueing went: a read-only probe on the cluster.

Every ``interval_s`` of model time the probe looks at every engine's waiting
queue and charges the interval to each waiting request under one of three
causes:

- ``local``: its own instance has the free blocks for it (walking that queue
  in order, each request taking its whole context's blocks above the
  watermark). It waits for something else: the step boundary, the token
  budget, ``max_num_seqs``, a preemption earlier in the step.
- ``fragmented``: its instance is short, but the blocks free on the other
  instances (beyond what their own queues take) would hold it. A perfect
  de-fragmenter (migration that moves memory anywhere at no cost) could
  have admitted it now.
- ``short``: the cluster as a whole has not the free blocks for it: until
  running requests finish, no placement and no migration makes room.

It also counts preemptions by whether some request was ``short`` at the
tick that saw them: a preemption while the cluster is short of memory is one
no migration could have avoided by moving memory around.

The pooled walk lets a later, smaller request take what an earlier, larger
one cannot, so ``fragmented`` is an upper bound on what de-fragmentation
could remove and ``short`` a lower bound on what it could not.

The probe only reads, so a run's results are the same with and without it
(tests/sim/test_queueing.py). ``summary()`` gives per-request charges;
:func:`breakdown` turns them, with the run's records, into the tail's shares
and the P99 TTFT left if every ``fragmented`` wait were removed.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from services.instance.engine.core.scheduler import cdiv

CAUSES = ("local", "fragmented", "short")


class QueueProbe:
    """Charges waiting time to causes (module doc); wired by ``simulate(extend=...)``."""

    def __init__(self, cluster, interval_s: float = 0.02):
        self.c = cluster
        self.k = cluster.k
        self.interval_s = interval_s
        self.wait: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
        self.short_time_s = 0.0  # time with at least one ``short`` request
        self.fragmented_time_s = 0.0  # time with at least one ``fragmented`` request
        # Preemptions counted at the tick after them, by whether a request was short then.
        self.preemptions = {"short": 0, "not_short": 0}
        self._preemptions_seen = 0
        self.k.at(self.k.now + interval_s, self._tick)

    def classify(self) -> dict[str, int]:
        """request id -> cause index (CAUSES) for every waiting request now."""
        cause: dict[str, int] = {}
        spare: list[int] = []
        rest = []  # (sort key, request id, demand) of requests their instance cannot hold
        for inst in self.c.instances.values():
            eng = inst.engine
            pool, sched = eng.pool, eng.scheduler
            room = max(0, pool.num_free - pool.watermark_blocks)
            blocked = False  # FCFS within an instance: nothing behind a head that does not fit is admitted
            for req in sched.waiting:
                need = max(0, cdiv(req.num_tokens, sched.block_size) - len(req.block_ids))
                if not blocked and need <= room:
                    room -= need
                    cause[req.request_id] = 0
                else:
                    blocked = True
                    rest.append((req.sort_key, req.request_id, need))
            spare.append(room)  # what is left here, a pooled memory could give to any queue
        pooled = sum(spare)
        for _, rid, need in sorted(rest):
            if need <= pooled:
                pooled -= need
                cause[rid] = 1
            else:
                cause[rid] = 2
        return cause

    def _tick(self) -> None:
        dt = self.interval_s
        cause = self.classify()
        seen = set()
        for rid, i in cause.items():
            self.wait[rid][i] += dt
            seen.add(i)
        if 2 in seen:
            self.short_time_s += dt
        if 1 in seen:
            self.fragmented_time_s += dt
        total = sum(i.engine.scheduler.num_preemptions for i in self.c.instances.values())
        if total > self._preemptions_seen:
            self.preemptions["short" if 2 in seen else "not_short"] += total - self._preemptions_seen
            self._preemptions_seen = total
        if self.c.recorder.done < len(self.c.work.requests):
            self.k.after(dt, self._tick)

    def summary(self) -> dict:
        return {"interval_s": self.interval_s, "short_time_s": self.short_time_s,
                "fragmented_time_s": self.fragmented_time_s, "preemptions": dict(self.preemptions),
                "wait_s": {rid: list(v) for rid, v in sorted(self.wait.items())}}


def breakdown(summary: dict, requests: list[dict], tail_pct: float = 99.0) -> dict:
    """From a probe's summary and the run's request records: the shares of
    each cause in all queueing and in the tail's (requests at or above the
    ``tail_pct`` TTFT), and ``ttft_p99_without_fragmented_ms``: the P99 TTFT
    if every ``fragmented`` wait were gone and nothing else changed (an
    optimistic bound for a perfect de-fragmenter)."""
    ok = [r for r in requests if r["error"] is None and r["ttft_s"] is not None]
    wait = summary["wait_s"]
    charges = np.array([wait.get(f"req-{r['index']}", [0.0, 0.0, 0.0]) for r in ok], dtype=float).reshape(-1, 3)
    ttft = np.array([r["ttft_s"] for r in ok], dtype=float)
    if not len(ttft):
        return {}
    cut = np.percentile(ttft, tail_pct)
    tail = ttft >= cut

    def shares(rows: np.ndarray) -> dict:
        total = rows.sum()
        return {c: (float(rows[:, i].sum() / total) if total > 0 else None) for i, c in enumerate(CAUSES)}

    without = np.maximum(ttft - charges[:, 1], 0.0)
    return {"queueing_s_mean": float(charges.sum(axis=1).mean()),
            "share_all": shares(charges), "share_tail": shares(charges[tail]),
            "tail_requests": int(tail.sum()),
            "tail_wait_s_mean": {c: float(charges[tail, i].mean()) for i, c in enumerate(CAUSES)},
            "ttft_p99_ms": float(np.percentile(ttft, 99) * 1000),
            "ttft_p99_without_fragmented_ms": float(np.percentile(without, 99) * 1000),
            "short_time_s": summary["short_time_s"], "fragmented_time_s": summary["fragmented_time_s"],
            "preemptions": summary.get("preemptions", {}),
            "preemptions_while_short": _share(summary.get("preemptions", {}))}


def _share(p: dict) -> float | None:
    n = p.get("short", 0) + p.get("not_short", 0)
    return p.get("short", 0) / n if n else None
