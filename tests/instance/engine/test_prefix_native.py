"""Prefix caching on the native engine (SmolLM2-135M, fp32 and the bf16 fast
path), greedy and seeded, at hit lengths 0, one block, many blocks and the
whole prompt but its last token: in the deterministic mode the tokens and
logprobs with the cache on are bit for bit those with it off; in the default
mode a cached prefix's KV was computed in another step shape, so they agree up
to a bounded divergence (helpers.assert_bounded_divergence; on CPUs with AMX,
bf16 tokens do part at near-ties). A migrated request whose blocks were shared
keeps its tokens."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from tests.instance.engine.helpers import (
    LOGPROB_NOISE,
    assert_bounded_divergence,
    collect,
    deterministic_or_skip,
    exact,
    migrate,
    req,
    run,
    step_collect,
)

pytestmark = pytest.mark.model

BS = 16
TEXT = ("You are a careful assistant. Answer every question in two sentences, cite no sources, and end with "
        "a short summary line. The user asks about the history of tea in England and how it changed trade. ") * 5
N = 16


@pytest.fixture(scope="module")
def base():
    from libs.common.models import ensure_model
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(ensure_model("smollm2"))(TEXT)["input_ids"]
    assert len(ids) > 4 * 32 + 1
    return ids


def cases(ids, bs):
    """(the second prompt, its hit) after a first prompt of 4 full blocks and one token."""
    base = ids[: 4 * bs + 1]
    tail = [1000 + i * 37 for i in range(9)]
    return base, {"none": ([2000 + i for i in range(40)], 0), "one_block": (base[:bs] + tail, bs),
                  "many_blocks": (base[: 4 * bs] + tail, 4 * bs), "all_but_last": (list(base), 4 * bs)}


@pytest.mark.parametrize("name", ["none", "one_block", "many_blocks", "all_but_last"])
@pytest.mark.parametrize("sampling", [{}, {"seed": 11, "temperature": 0.9, "top_p": 0.95}], ids=["greedy", "seeded"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_tokens_equal_the_cache_off(make_engine, base, name, sampling, dtype, deterministic):
    # bf16 on CPU, and the deterministic mode: vLLM's kernel over the paged cache, blocks of 32
    bs = BS if dtype == "float32" and not deterministic else 32
    if deterministic:
        from services.instance.engine import vllm_kernels

        if vllm_kernels.ops() is None:
            pytest.skip("the deterministic mode needs vLLM's CPU kernels (the vllm extra)")
    first, c = cases(base, bs)
    prompt, hit = c[name]
    outs = {}
    for caching in (True, False):
        e = deterministic_or_skip(lambda caching=caching: make_engine(
            "native", num_blocks=64, block_size=bs, dtype=dtype, prefix_caching=caching, deterministic=deterministic))
        e.add_request(req("first", first, max_tokens=4, min_tokens=4, **sampling))
        run(e)
        e.add_request(req("second", prompt, max_tokens=N, min_tokens=N, logprobs=5, **sampling))
        o: dict = {}
        for out in e.step():  # its first step: admitted at its longest cached prefix
            o.setdefault(out.request_id, []).append(out)
        assert e.request_stats("second")["prefix_hit_tokens"] == (hit if caching else 0)
        outs[caching] = collect(e, o)["second"]
    if deterministic:
        assert exact(outs[True]) == exact(outs[False])
    else:
        assert_bounded_divergence(outs[False], outs[True], LOGPROB_NOISE[dtype], greedy=not sampling)


def test_migration_of_a_request_sharing_its_prefix(make_engine, base):
    src, dst = make_engine("native", num_blocks=64), make_engine("native", num_blocks=64)
    ref = make_engine("native", num_blocks=64, prefix_caching=False)
    a, b = base[:48] + [3000, 3001], base[:48] + [4000, 4001, 4002]
    want = {}
    for rid, p in (("a", a), ("b", b)):
        ref.add_request(req(rid, p, max_tokens=24, min_tokens=24, seed=5, temperature=0.8))
    want = run(ref)
    outs: dict = {}
    src.add_request(req("a", a, max_tokens=24, min_tokens=24, seed=5, temperature=0.8))
    step_collect(src, outs, 2)
    src.add_request(req("b", b, max_tokens=24, min_tokens=24, seed=5, temperature=0.8))
    step_collect(src, outs, 3)
    assert src.load().shared_blocks == 3
    migrate(src, dst, "b")
    run(src, outs)
    run(dst, outs)
    assert outs == want


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_a_returning_turn_with_kept_blocks_gives_the_tokens_of_the_cache_off(make_engine, base, deterministic):
    """Keep (core/pins.py ProgramKeep): a program's turn ends, pressure that
    plain LRU would serve from that turn's blocks (freed first) takes
    another request's cached blocks instead, and the program's next turn
    starts at its kept history, with the tokens (and, in the deterministic
    mode, the logprobs) it has with the prefix cache off."""
    bs = 32 if deterministic else BS
    if deterministic:
        from services.instance.engine import vllm_kernels

        if vllm_kernels.ops() is None:
            pytest.skip("the deterministic mode needs vLLM's CPU kernels (the vllm extra)")
    first = base[: 4 * bs + 1]
    other = [3000 + i for i in range(4 * bs)]
    pressure = [5000 + i for i in range(20 * bs - 2)]  # every plain free block and other's 4, on 24
    tail = [1000 + i * 37 for i in range(9)]
    outs, hits = {}, {}
    for keep in (0.5, None):  # None: the prefix cache off
        e = deterministic_or_skip(lambda keep=keep: make_engine(
            "native", num_blocks=24, block_size=bs, prefix_caching=keep is not None, program_keep=keep or 0.0,
            deterministic=deterministic))
        t1 = req("t1", first, max_tokens=4, min_tokens=4)
        e.add_request(dataclasses.replace(t1, program_id="p"))
        out1 = run(e)["t1"]
        if keep:
            assert len(e.pins.blocks_of("p")) == 4
            second = first + out1 + tail
        e.add_request(req("other", other, max_tokens=4, min_tokens=4))
        run(e)
        e.add_request(req("pressure", pressure, max_tokens=1))
        run(e)
        e.add_request(dataclasses.replace(req("t2", second, max_tokens=N, min_tokens=N, logprobs=5), program_id="p"))
        o: dict = {}
        for out in e.step():
            o.setdefault(out.request_id, []).append(out)
        hits[keep] = e.request_stats("t2")["prefix_hit_tokens"]
        outs[keep] = collect(e, o)["t2"]
    assert hits == {0.5: 4 * bs, None: 0}  # the kept history survived the pressure
    if deterministic:
        assert exact(outs[0.5]) == exact(outs[None])
    else:
        assert_bounded_divergence(outs[None], outs[0.5], LOGPROB_NOISE["float32"])


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_a_returning_turn_on_moved_blocks_gives_the_tokens_of_the_cache_off(make_engine, base, deterministic):
    """A cache move (engine half: export_program, the KV gathered and
    scattered into another engine's reserved blocks, import_program): the
    program's next turn on the second engine starts at its whole history,
    moved, with the tokens (and, in the deterministic mode, the logprobs) it
    has on an engine with the prefix cache off; both pools stay exact."""
    bs = 32 if deterministic else BS
    if deterministic:
        from services.instance.engine import vllm_kernels

        if vllm_kernels.ops() is None:
            pytest.skip("the deterministic mode needs vLLM's CPU kernels (the vllm extra)")
    first = base[: 4 * bs + 1]
    tail = [1000 + i * 37 for i in range(9)]

    def engine(keep: float | None):
        return deterministic_or_skip(lambda: make_engine(
            "native", num_blocks=24, block_size=bs, prefix_caching=keep is not None, program_keep=keep or 0.0,
            deterministic=deterministic))

    a, b, off = engine(0.5), engine(0.5), engine(None)
    a.add_request(dataclasses.replace(req("t1", first, max_tokens=4, min_tokens=4), program_id="p"))
    out1 = run(a)["t1"]
    second = first + out1 + tail
    kv = a.export_program("p")
    assert kv is not None and len(kv.block_ids) == 4
    blocks = b.reserve_blocks(4)
    b.scatter_kv(blocks, a.gather_kv(list(kv.block_ids)))
    b.import_program(kv, blocks)
    a.end_export("p", moved=True)
    a.check_integrity()
    outs = {}
    for name, e in (("moved", b), ("off", off)):
        e.add_request(dataclasses.replace(req("t2", second, max_tokens=N, min_tokens=N, logprobs=5), program_id="p"))
        o: dict = {}
        for out in e.step():
            o.setdefault(out.request_id, []).append(out)
        if name == "moved":
            assert e.request_stats("t2")["prefix_hit_tokens"] == 4 * bs  # the moved history, not recomputed
        outs[name] = collect(e, o)["t2"]
        e.check_integrity()
    if deterministic:
        assert exact(outs["moved"]) == exact(outs["off"])
    else:
        assert_bounded_divergence(outs["off"], outs["moved"], LOGPROB_NOISE["float32"])
