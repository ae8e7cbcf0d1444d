"""The native engine's CPU fast paths give the tokens of the plain paths:
decodes reading the dense copy of their context (decode_cache.py) vs
gathering blocks, under churn (requests leaving at different steps,
preemption, the copy not fitting its budget); oneDNN-packed bf16 projections
vs F.linear; greedy by ``max`` vs ``argmax`` on ties."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from services.instance.engine.native.linear import packing_supported
from tests.instance.engine.helpers import req, run

pytestmark = pytest.mark.model

PROMPTS = [list(range(100 + 7 * i, 100 + 7 * i + n)) for i, n in enumerate([5, 40, 17, 90, 33, 64])]


def _run_all(engine, max_tokens=(24, 8, 30, 12, 20, 16)) -> dict:
    # different lengths: requests leave the batch at different steps (slots compact)
    for i, (p, n) in enumerate(zip(PROMPTS, max_tokens)):
        engine.add_request(req(str(i), p, max_tokens=n, min_tokens=n))
    return run(engine)


def _plain(make_engine, **kw):
    return make_engine("native", extra={"share_weights": True, "warmup": False, "decode_cache_gb": 0}, **kw)


def _fast(make_engine, gb=None, **kw):
    extra = {"share_weights": True, "warmup": False}
    if gb is not None:
        extra["decode_cache_gb"] = gb
    return make_engine("native", extra=extra, **kw)


def test_dense_decode_gives_the_gather_paths_tokens(make_engine):
    plain = _plain(make_engine, num_blocks=64)
    assert plain.executor.decode_cache is None
    fast = _fast(make_engine, num_blocks=64)
    assert fast.executor.decode_cache is not None
    assert _run_all(fast) == _run_all(plain)
    assert fast.executor.decode_cache.buf is not None  # the dense path ran


def test_dense_decode_under_preemption_and_a_small_budget(make_engine):
    ref = _run_all(_plain(make_engine, num_blocks=64))
    # 9 blocks (144 tokens of KV) for ~350 needed: the scheduler preempts and recomputes
    tight = _fast(make_engine, num_blocks=9, watermark=0.0)
    assert _run_all(tight) == ref
    assert tight.load().num_preemptions > 0
    # a budget of ~2 slots x 128 positions: steps with more decodes gather instead
    small = _fast(make_engine, gb=2 * 128 * 30 * 2 * 3 * 64 * 4 / 2**30, num_blocks=64)
    assert _run_all(small) == ref


@pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.bfloat16),
                    reason="no oneDNN bf16 on this CPU")
def test_packed_bf16_projections_give_the_plain_tokens(make_engine):
    fast = _fast(make_engine, num_blocks=64, dtype="bfloat16")
    model = fast.executor.model
    assert model.lm_head_packed is not None
    got = _run_all(fast)
    packed = [(m, m.packed) for m in model.modules() if hasattr(m, "packed")]
    lm = model.lm_head_packed
    try:
        for m, _ in packed:
            m.packed = None
        model.lm_head_packed = None
        assert _run_all(fast) == got
    finally:  # the model is shared with other tests
        for m, p in packed:
            m.packed = p
        model.lm_head_packed = lm


def test_greedy_max_picks_the_first_of_ties():
    from services.instance.engine.native.sampler import sample

    logits = torch.zeros(3, 50)
    logits[0, [7, 3, 9]] = 2.0
    logits[1, [40, 41]] = 1.0
    logits[2] = 5.0

    from libs.common.types import SamplingParams
    from services.instance.engine.core.request import Request

    reqs = [Request(f"r{i}", [1], SamplingParams(max_tokens=4, temperature=0.0)) for i in range(3)]
    assert sample(logits, reqs, frozenset()) == [3, 40, 0]


def test_fp32_projections_split_by_rows():
    """fp32 with vLLM's matmul handler (linear.RowSplit): one row through
    F.linear (its bits), several through oneDNN (within fp32 rounding)."""
    from services.instance.engine import vllm_kernels
    from services.instance.engine.native import linear

    if vllm_kernels.ops() is None or not linear._vllm_ok(torch.float32):
        pytest.skip("vLLM's matmul handler does not run here")
    g = torch.Generator().manual_seed(4)
    w = torch.randn(300, 96, generator=g) * 0.1
    packed = linear.pack_weight(w)
    assert isinstance(packed, linear.RowSplit)
    one, many = torch.randn(1, 96, generator=g), torch.randn(7, 96, generator=g)
    assert torch.equal(packed(one), torch.nn.functional.linear(one, w))
    assert torch.allclose(packed(many), torch.nn.functional.linear(many, w), rtol=1e-5, atol=1e-6)
    assert linear.pack_weight(w, vllm=False) is None  # the torch path: plain F.linear
