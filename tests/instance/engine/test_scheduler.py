"""Scheduler policy on bare requests: queue order, admission, token budget,
preemption order (exact block ids)."""

from libs.common.types import Priority, SamplingParams
from services.instance.engine.core.block_pool import BlockPool
from services.instance.engine.core.request import Request, RequestStatus
from services.instance.engine.core.scheduler import Scheduler

SP = SamplingParams(max_tokens=8)


def make(num_blocks=8, block_size=4, max_seqs=8, budget=64, watermark=0):
    pool = BlockPool(num_blocks, watermark_blocks=watermark)
    return pool, Scheduler(pool, block_size, max_seqs, budget)


def r(rid, n, prio=Priority.NORMAL, arrival=1.0, seq=0):
    return Request(rid, list(range(1, n + 1)), SP, prio, arrival, seq=seq)


def finish_step(out):
    """What the engine does after a step: advance counters, append a token."""
    for c in out.chunks:
        c.request.num_computed_tokens = c.end
        if c.samples:
            c.request.output_token_ids.append(7)


def test_waiting_queue_is_priority_then_arrival():
    _, s = make()
    for q in [r("n2", 1, arrival=2.0), r("h3", 1, Priority.HIGH, 3.0), r("n1", 1, arrival=1.0),
              r("h1", 1, Priority.HIGH, 1.5), r("n1b", 1, arrival=1.0, seq=5)]:
        s.add_waiting(q)
    assert [q.request_id for q in s.waiting] == ["h1", "h3", "n1", "n1b", "n2"]
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["h1", "h3", "n1", "n1b", "n2"]


def test_admission_allocates_prompt_blocks_in_free_list_order():
    pool, s = make(num_blocks=8, block_size=4)
    a, b = r("a", 9, arrival=1), r("b", 4, arrival=2)
    s.add_waiting(a)
    s.add_waiting(b)
    out = s.schedule()
    assert a.block_ids == [0, 1, 2] and b.block_ids == [3]
    assert [(c.request.request_id, c.start, c.num_new, c.samples) for c in out.chunks] == [
        ("a", 0, 9, True), ("b", 0, 4, True)]
    assert pool.num_free == 4


def test_head_of_line_waits_for_blocks_above_the_watermark():
    pool, s = make(num_blocks=4, block_size=4, watermark=1)
    s.add_waiting(r("big", 13, arrival=1))  # 4 blocks > 4 - watermark
    s.add_waiting(r("small", 1, arrival=2))
    out = s.schedule()
    assert out.chunks == [] and pool.num_free == 4  # FCFS: small does not skip ahead


def test_token_budget_chunks_a_long_prompt():
    _, s = make(num_blocks=16, block_size=4, budget=5)
    a = r("a", 12)
    s.add_waiting(a)
    spans = []
    for _ in range(4):
        out = s.schedule()
        spans += [(c.start, c.num_new, c.samples) for c in out.chunks]
        finish_step(out)
    assert spans == [(0, 5, False), (5, 5, False), (10, 2, True), (12, 1, True)]


def test_max_num_seqs():
    _, s = make(max_seqs=2)
    for i in range(3):
        s.add_waiting(r(f"r{i}", 2, arrival=i + 1))
    assert [c.request.request_id for c in s.schedule().chunks] == ["r0", "r1"]
    assert [q.request_id for q in s.waiting] == ["r2"]


def test_preemption_takes_lowest_priority_then_latest_arrival():
    pool, s = make(num_blocks=4, block_size=2)
    reqs = [r("h_old", 2, Priority.HIGH, 1.0), r("n_old", 2, Priority.NORMAL, 2.0),
            r("h_new", 2, Priority.HIGH, 3.0), r("n_new", 2, Priority.NORMAL, 4.0)]
    for q in reqs:
        s.add_waiting(q)
    out = s.schedule()  # all four admitted, 1 block each, pool full
    # admitted in queue order: h_old, h_new, n_old, n_new
    assert [q.block_ids for q in reqs] == [[0], [2], [1], [3]] and pool.num_free == 0
    finish_step(out)  # each now has 3 tokens: the next step needs a second block each
    out = s.schedule()
    # h_old needs a block: the victim is the latest normal (n_new); its block 3 goes to
    # h_old. h_new needs one: the victim is now n_old; its block 2 goes to h_new.
    assert [q.request_id for q in out.preempted] == ["n_new", "n_old"]
    assert reqs[0].block_ids == [0, 3] and reqs[2].block_ids == [1, 2]
    assert [q.request_id for q in s.waiting] == ["n_old", "n_new"]
    assert all(q.status is RequestStatus.WAITING and q.num_computed_tokens == 0 for q in reqs[1::2])
    assert [c.request.request_id for c in out.chunks] == ["h_old", "h_new"]
    assert reqs[1].num_preemptions == 1 and s.num_preemptions == 2


def _prefill_first(num_blocks=32, block_size=4, budget=16):
    pool = BlockPool(num_blocks)
    return pool, Scheduler(pool, block_size, 8, budget, prefill_first=True)


def test_prefill_first_runs_whole_prompts_alone_then_decodes():
    _, s = _prefill_first(budget=16)
    s.add_waiting(r("a", 6, arrival=1))
    out = s.schedule()
    assert [(c.request.request_id, c.start, c.num_new) for c in out.chunks] == [("a", 0, 6)]
    finish_step(out)
    s.add_waiting(r("b", 7, arrival=2))
    s.add_waiting(r("c", 10, arrival=3))  # 7 + 10 > 16: c waits for the next prefill step
    out = s.schedule()  # a step of prompts: "a" does not decode in it
    assert [(c.request.request_id, c.start, c.num_new) for c in out.chunks] == [("b", 0, 7)]
    finish_step(out)
    out = s.schedule()
    assert [(c.request.request_id, c.num_new) for c in out.chunks] == [("c", 10)]
    finish_step(out)
    out = s.schedule()  # nobody waits: every running request decodes
    assert sorted((c.request.request_id, c.num_new) for c in out.chunks) == [("a", 1), ("b", 1), ("c", 1)]


def test_prefill_first_decodes_while_the_head_does_not_fit_and_chunks_a_prompt_over_the_budget():
    pool, s = _prefill_first(num_blocks=6, block_size=4, budget=8)
    s.add_waiting(r("a", 8, arrival=1))
    finish_step(s.schedule())
    s.add_waiting(r("big", 20, arrival=2))  # 5 blocks: only 4 are free
    out = s.schedule()
    assert [(c.request.request_id, c.num_new) for c in out.chunks] == [("a", 1)]
    _, s = _prefill_first(num_blocks=16, block_size=4, budget=8)
    s.add_waiting(r("long", 20, arrival=1))  # longer than the budget: in chunks, as without the mode
    out = s.schedule()
    assert [(c.request.request_id, c.start, c.num_new) for c in out.chunks] == [("long", 0, 8)]


def test_a_chunk_cap_splits_a_prompt_under_the_budget():
    # the native engine's deterministic mode caps a request's prompt tokens per step (batch_invariant.ATTENTION_CHUNK)
    _, s = make(num_blocks=16, block_size=4, budget=64)
    s.max_chunk_tokens = 8
    s.add_waiting(r("a", 20, arrival=1))
    s.add_waiting(r("b", 5, arrival=2))
    out = s.schedule()
    assert [(c.request.request_id, c.start, c.num_new) for c in out.chunks] == [("a", 0, 8), ("b", 0, 5)]
