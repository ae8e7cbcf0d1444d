"""The shared core through the fake and sim engines (no model): determinism,
batching, preemption, chunked prefill, resume, aborts, migration hooks."""

from __future__ import annotations

import json

import pytest

from libs.common.types import Priority
from services.instance.engine.base import EngineError
from services.instance.engine.fake import fake_next_token
from tests.instance.engine.helpers import migrate, req, run, run_alone, step_collect

PROMPTS = {f"p{n}": [97 + (i * 7 + n) % 26 for i in range(n)] for n in (1, 5, 16, 17, 40)}


@pytest.fixture(params=["fake", "sim"])
def kind(request, tmp_path):
    """Engine kwargs; sim gets a fast profile so tests stay quick."""
    if request.param == "fake":
        return {"engine": "fake"}
    prof = tmp_path / "fast.json"
    prof.write_text(json.dumps({"name": "fast", "block_size": 16, "kv_capacity_tokens": 16 * 64,
                                "prefill_ms_per_token": 0.001, "decode_base_ms": 0.1, "decode_ms_per_seq": 0.01}))
    return {"engine": "sim", "profile": str(prof)}


def expected(prompt: list[int], n: int) -> list[int]:
    """The fake model's definition, applied to the true context."""
    ctx, out = list(prompt), []
    for _ in range(n):
        out.append(fake_next_token(ctx))
        ctx.append(out[-1])
    return out


def test_tokens_follow_the_model_through_the_kv_cache(make_engine, kind):
    e = make_engine(**kind, num_blocks=64)
    for rid, p in PROMPTS.items():
        e.add_request(req(rid, p, max_tokens=20))
    outs = run(e)
    for rid, p in PROMPTS.items():
        assert outs[rid] == expected(p, 20)


def test_batch_equals_alone_and_chunked_prefill(make_engine, kind):
    alone = {rid: run_alone(make_engine(**kind, num_blocks=64), req(rid, p, max_tokens=12))
             for rid, p in PROMPTS.items()}
    e = make_engine(**kind, num_blocks=64, max_num_batched_tokens=7)  # prompts of 16..40 span steps
    for rid, p in PROMPTS.items():
        e.add_request(req(rid, p, max_tokens=12))
    assert run(e) == alone


def test_the_load_reports_what_running_prompts_have_left_to_compute(make_engine, kind):
    e = make_engine(**kind, num_blocks=64, max_num_batched_tokens=7)
    e.add_request(req("long", PROMPTS["p40"], max_tokens=3))
    left = []
    while e.has_work():
        e.step()
        left.append(e.load().running_prefill_tokens)
    # 40 prompt tokens, 7 a step: 33, 26, ... 5 left; then decoding adds none.
    assert left[:6] == [33, 26, 19, 12, 5, 0] and set(left[6:]) == {0}


def test_preemption_recomputes_the_same_tokens(make_engine, kind):
    e = make_engine(**kind, num_blocks=6, watermark=0.0)  # 96 tokens of KV for 4 requests of 17+30
    for i in range(4):
        e.add_request(req(f"r{i}", PROMPTS["p17"][i:] + [97 + i], max_tokens=30, arrival=float(i + 1)))
    finals = {}
    outs = {}
    while e.has_work():
        for o in e.step():
            outs.setdefault(o.request_id, []).append(o.token_id)
            if o.finish_reason:
                finals[o.request_id] = o
    assert e.load().num_preemptions > 0
    for i in range(4):
        assert outs[f"r{i}"] == expected(PROMPTS["p17"][i:] + [97 + i], 30)
    # the latest arrival is the first victim; its counters travel on its last token
    last = finals["r3"].stats
    assert last["num_preemptions"] >= 1 and last["preemption_loss_ms"] > 0
    assert finals["r0"].stats["num_preemptions"] == 0 and finals["r0"].stats["preemption_loss_ms"] == 0


def test_high_priority_is_admitted_first(make_engine, kind):
    e = make_engine(**kind, num_blocks=64, max_num_seqs=1)
    e.add_request(req("normal", PROMPTS["p5"], max_tokens=3, arrival=1.0))
    e.add_request(req("high", PROMPTS["p5"], max_tokens=3, priority=Priority.HIGH, arrival=2.0))
    first = e.step()
    assert [o.request_id for o in first] == ["high"]
    outs = run(e, {"high": [first[0].token_id]})
    assert outs["normal"] == outs["high"]


def test_resume_tokens_extend_the_context(make_engine, kind):
    e = make_engine(**kind, num_blocks=64)
    full = run_alone(e, req("a", PROMPTS["p16"], max_tokens=10))
    e.add_request(req("a", PROMPTS["p16"], max_tokens=10, resume=full[:4]))
    outs = {}
    first = e.step()
    assert first[0].index == 4
    outs["a"] = [first[0].token_id]
    step_collect(e, outs, 20)
    assert outs["a"] == full[4:]


def test_stop_tokens_min_tokens_and_bad_requests(make_engine, kind):
    e = make_engine(**kind, num_blocks=64, max_model_len=64)
    ref = expected(PROMPTS["p5"], 10)
    stop = ref[3]
    e.add_request(req("s", PROMPTS["p5"], max_tokens=10, stop_token_ids=(stop,)))
    assert run(e)["s"] == ref[: ref.index(stop) + 1]
    e.add_request(req("m", PROMPTS["p5"], max_tokens=10, stop_token_ids=(stop,), min_tokens=ref.index(stop) + 2))
    got = run(e)["m"]
    assert len(got) > ref.index(stop) + 1 and got == ref[: len(got)]
    with pytest.raises(EngineError):
        e.add_request(req("long", [97] * 64))
    with pytest.raises(EngineError):
        e.add_request(req("empty", []))


def test_abort_anywhere_frees_blocks(make_engine, kind):
    e = make_engine(**kind, num_blocks=8, max_num_seqs=1)
    e.add_request(req("run", PROMPTS["p40"], max_tokens=50))
    e.add_request(req("wait", PROMPTS["p5"], max_tokens=5))
    e.step()
    assert e.request_phase("run")[0] == "running" and e.request_phase("wait")[0] == "waiting"
    assert e.num_free_blocks < 8
    assert e.abort_request("wait") and e.abort_request("run") and not e.abort_request("run")
    e.add_request(req("sus", PROMPTS["p5"], max_tokens=5))
    e.step()
    assert e.suspend_request("sus") and not e.has_work()
    e.check_integrity()
    assert e.abort_request("sus")
    blocks = e.reserve_blocks(3)
    assert blocks is not None and e.reserve_blocks(8) is None  # refusal is a result
    e.release_blocks(blocks)


def test_suspend_resume_keeps_tokens(make_engine, kind):
    e = make_engine(**kind, num_blocks=64)
    ref = expected(PROMPTS["p17"], 15)
    e.add_request(req("a", PROMPTS["p17"], max_tokens=15))
    outs = {}
    step_collect(e, outs, 4)
    assert e.suspend_request("a") and not e.suspend_request("a")
    step_collect(e, outs, 3)  # nothing happens while suspended
    assert len(outs["a"]) == 4
    e.resume_request("a")
    assert run(e, outs)["a"] == ref


@pytest.mark.parametrize("prompt", ["p1", "p17", "p40"])
def test_migration_continues_with_identical_tokens(make_engine, kind, prompt):
    src = make_engine(**kind, num_blocks=64)
    dst = make_engine(**kind, num_blocks=64)
    ref = expected(PROMPTS[prompt], 40)
    src.add_request(req("a", PROMPTS[prompt], max_tokens=40))
    src.add_request(req("other", PROMPTS["p5"], max_tokens=40))  # keeps running on the source
    outs = {}
    step_collect(src, outs, 20)
    state_index = migrate(src, dst, "a")
    assert state_index == len(outs["a"])
    got = run(dst, {"a": list(outs["a"])})["a"]  # indices continue where the source stopped
    run(src, outs)
    assert got == ref and outs["other"] == expected(PROMPTS["p5"], 40)


def test_corrupted_kv_transfer_changes_tokens(make_engine, kind):
    """The check above can fail: a migration that scrambles one block's KV
    must give different tokens on the fake model."""
    src = make_engine(**kind, num_blocks=64)
    dst = make_engine(**kind, num_blocks=64)
    ref = expected(PROMPTS["p40"], 20)
    src.add_request(req("a", PROMPTS["p40"], max_tokens=20))
    outs = {}
    step_collect(src, outs, 2)
    src.suspend_request("a")
    blocks = src.all_blocks("a")
    data = bytearray(src.gather_kv(blocks))
    data[4:8] = bytes(4)  # position 1's key -> 0.0
    mine = dst.reserve_blocks(len(blocks))
    dst.scatter_kv(mine, data)
    dst.install_request(src.export_state("a"), mine)
    src.drop_request("a")
    assert run(dst, outs)["a"] != ref


def test_gather_from_another_thread_while_stepping(make_engine, kind):
    """Full blocks are never rewritten: a copy taken on another thread while
    the engine steps equals one taken while it is idle."""
    import threading

    e = make_engine(**kind, num_blocks=64)
    e.add_request(req("a", PROMPTS["p40"], max_tokens=30))
    e.add_request(req("b", PROMPTS["p17"], max_tokens=30))
    e.step()
    full = e.full_blocks("a")
    before = bytes(e.gather_kv(full))
    copies, stop = [], threading.Event()

    def copier():
        while not stop.is_set():
            copies.append(bytes(e.gather_kv(full)))

    t = threading.Thread(target=copier)
    t.start()
    outs = {}
    step_collect(e, outs, 10)
    stop.set()
    t.join()
    assert copies and all(c == before for c in copies)
    e.abort_request("a")
    e.abort_request("b")


def test_an_engine_without_migration_hooks_says_it_cannot_migrate():
    """MigrationHooks is an interface an engine implements besides Engine:
    the core engines do; one that does not reports why it cannot migrate."""
    from services.instance.engine.base import Engine, MigrationHooks

    class Plain(Engine):
        name = "plain"

    Plain.__abstractmethods__ = frozenset()  # the serving methods are not what this checks
    assert Plain().no_migration == "the plain engine has no migration hooks"
    from services.instance.engine import create_engine
    from services.instance.engine.base import EngineConfig

    fake = create_engine(EngineConfig(engine="fake", num_blocks=8, block_size=16))
    assert isinstance(fake, MigrationHooks) and fake.no_migration == ""
