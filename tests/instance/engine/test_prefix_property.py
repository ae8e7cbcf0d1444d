"""Random interleavings (hypothesis) of what can happen to a prefix-cached
engine: requests added with shared prefixes, steps, finishes, aborts,
preemptions, migrations out and in between two engines, evictions under
pressure, and the pool growing and shrinking back (KunServe's layer drop and
restore). After every rule: check_integrity() on both engines (hash table,
refcounts, eviction queue, every request's named blocks), the KV events
replay to exactly the cache, and every admission's hit is the longest cached
prefix (or shorter only by a block evicted in that very step). At the end
every request emitted exactly the fake model's tokens and no block leaked."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from libs.common.kv_events import BlockRemoved, apply
from libs.common.types import SamplingParams
from services.instance.engine import create_engine
from services.instance.engine.base import EngineConfig, EngineRequest
from services.instance.engine.core.request import RequestStatus
from services.instance.engine.fake import fake_generate

BS = 4
SEGMENTS = [[97 + (i * k + k) % 26 for i in range(n)] for k, n in ((3, 8), (5, 12), (7, 6), (11, 16))]


def engine(num_blocks: int):
    e = create_engine(EngineConfig(engine="fake", num_blocks=num_blocks, block_size=BS, token_delay_ms=0.0,
                                   watermark=0.0, max_num_batched_tokens=24, max_num_seqs=6))
    e.take_kv_events()  # recording on
    return e


class PrefixMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.engines = {"a": engine(28), "b": engine(20)}
        self.held = {k: {} for k in self.engines}  # the caches as the KV events tell them
        self.grown = {k: 0 for k in self.engines}
        self.prompts: dict[str, list[int]] = {}
        self.max_tokens: dict[str, int] = {}
        self.outputs: dict[str, list[int]] = {}
        self.where: dict[str, str] = {}  # live request -> engine
        self.hits = {k: 0 for k in self.engines}  # observed at admissions
        self.n = 0

    # --- helpers ---------------------------------------------------------------
    def _events(self, k: str) -> list:
        ev = self.engines[k].take_kv_events()
        apply(self.held[k], ev)
        return ev

    def _live(self, k: str, status=None) -> list[str]:
        e = self.engines[k]
        return sorted(r for r, req in e.requests.items() if status is None or req.status is status)

    # --- rules -----------------------------------------------------------------
    @initialize(first=st.lists(st.tuples(st.sampled_from("ab"), st.lists(st.integers(0, 3), min_size=1, max_size=3),
                                         st.integers(1, 9), st.integers(2, 14)), min_size=2, max_size=6))
    def some_requests(self, first):
        for args in first:
            self.add(*args)

    @rule(k=st.sampled_from("ab"), segs=st.lists(st.integers(0, 3), min_size=1, max_size=3),
          tail=st.integers(1, 9), max_tokens=st.integers(2, 14))
    def add(self, k, segs, tail, max_tokens):
        prompt = [t for s in segs for t in SEGMENTS[s]] + [97 + (self.n * 5 + i) % 26 for i in range(tail)]
        rid = f"r{self.n}"
        self.n += 1
        e = self.engines[k]
        if len(prompt) + max_tokens > (e.pool.capacity - e.pool.shrinking) * BS:
            return  # would never fit once the pool shrinks back
        e.add_request(EngineRequest(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens), 0, float(self.n)))
        self.prompts[rid], self.max_tokens[rid], self.where[rid] = prompt, max_tokens, k
        self.outputs[rid] = []

    @rule(k=st.sampled_from("ab"), n=st.integers(1, 4))
    def step(self, k, n):
        e = self.engines[k]
        for _ in range(n):
            waiting = {rid: e.requests[rid] for rid in self._live(k, RequestStatus.WAITING)}
            before = dict(self.held[k])
            for o in e.step():
                assert o.index == len(self.outputs[o.request_id])
                self.outputs[o.request_id].append(o.token_id)
                if o.finish_reason is not None:
                    self.where.pop(o.request_id)
            events = self._events(k)
            evicted = {h for ev in events if isinstance(ev, BlockRemoved) for h in ev.block_hashes}
            for rid, r in waiting.items():
                if r.status is RequestStatus.WAITING:
                    continue  # not admitted
                hit = r.prefix_hit_tokens  # (a request admitted and finished in one step too)
                self.hits[k] += hit
                hashes = r.full_block_hashes(BS, (r.num_tokens - 1) // BS)
                expect = 0
                while expect < len(hashes) and hashes[expect] in before:
                    expect += 1
                assert hit % BS == 0 and hit // BS <= expect, (rid, hit, expect)
                if hit // BS < expect:  # only an eviction in this step explains a shorter hit
                    assert hashes[hit // BS] in evicted, (rid, hit, expect)

    @precondition(lambda self: self.where)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.where)))
        assert self.engines[self.where.pop(rid)].abort_request(rid)
        self.prompts.pop(rid)

    @rule(k=st.sampled_from("ab"), data=st.data())
    def preempt(self, k, data):
        running = self._live(k, RequestStatus.RUNNING)
        if running:
            e = self.engines[k]
            e.scheduler.preempt(e.requests[data.draw(st.sampled_from(running))])

    @rule(k=st.sampled_from("ab"), data=st.data())
    def migrate(self, k, data):
        running = self._live(k, RequestStatus.RUNNING)
        if not running:
            return
        rid = data.draw(st.sampled_from(running))
        dk = "b" if k == "a" else "a"
        src, dst = self.engines[k], self.engines[dk]
        assert src.suspend_request(rid)
        blocks = src.all_blocks(rid)
        reserved = dst.reserve_blocks(len(blocks))
        if reserved is None:
            src.resume_request(rid)
            return
        dst.scatter_kv(reserved, src.gather_kv(blocks))
        dst.install_request(src.export_state(rid), reserved)
        src.drop_request(rid)
        self.where[rid] = dk
        self._events(dk)

    @rule(k=st.sampled_from("ab"), n=st.integers(1, 12))
    def evict(self, k, n):
        e = self.engines[k]
        got = e.reserve_blocks(n)  # pressure: cached blocks go when nothing plain is free
        if got is not None:
            e.release_blocks(got)

    @rule(k=st.sampled_from("ab"), n=st.integers(1, 6))
    def drop_layers(self, k, n):
        self.engines[k].grow_blocks(n)
        self.grown[k] += n

    @precondition(lambda self: any(self.grown.values()))
    @rule(k=st.sampled_from("ab"))
    def restore_layers(self, k):
        if self.grown[k]:
            self.engines[k].pool.shrink(self.grown[k])
            self.grown[k] = 0

    # --- after every rule ---------------------------------------------------------
    @invariant()
    def consistent(self):
        for k, e in self.engines.items():
            e.check_integrity()
            self._events(k)
            assert set(self.held[k]) == set(e.cached_hashes())
            pc = e.load().prefix_cache
            assert pc.hits + pc.preempted_hits == self.hits[k]

    def teardown(self):
        for k, e in self.engines.items():
            while e.has_work():
                self.step(k, 1)
            e.check_integrity()
            assert e.pool.num_free == e.pool.capacity, "a block leaked"
        for rid, prompt in self.prompts.items():
            assert self.outputs[rid] == fake_generate(prompt, self.max_tokens[rid]), rid


TestPrefixInterleavings = PrefixMachine.TestCase
TestPrefixInterleavings.settings = settings(max_examples=60, stateful_step_count=60, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
