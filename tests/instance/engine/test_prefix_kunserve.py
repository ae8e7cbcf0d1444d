"""Prefix caching with KunServe's pipelines (native engines, the tiny random
model): while layers run on a peer, which holds none of this engine's cached
KV, no cached prefix is reused and no block computed is named; the blocks
named before keep every layer's KV here and serve again once the layers are
back. Tokens are the full model's throughout."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from services.instance.engine.native.kunserve import LocalPeer
from tests.instance.engine.helpers import req, run, step_collect
from tests.instance.engine.test_pipeline import _engine

PROMPT = list(range(200, 260))  # 3 full blocks of 16 and a partial one
MODEL = "tiny-llama"


def once(engine, rid: str) -> tuple[list[int], int]:
    out: dict = {}
    engine.add_request(req(rid, PROMPT, max_tokens=12, min_tokens=12))
    step_collect(engine, out, 1)
    hit = engine.request_stats(rid)["prefix_hit_tokens"]
    return run(engine, out)[rid], hit


def test_a_pipeline_neither_reuses_nor_names_and_the_cache_serves_again_after():
    ref = _engine(MODEL, extra={"share_weights": True}, prefix_caching=False)
    want, _ = once(ref, "ref")
    a, b = _engine(MODEL), _engine(MODEL)
    assert once(a, "warm") == (want, 0)
    named = set(a.cached_hashes())
    assert len(named) == 4  # 60 prompt + 11 output tokens with KV: 4 full blocks
    layers = a.kv_layout.num_layers
    first, second = range(layers // 2), range(layers // 2, layers)
    a.drop_layers(second)
    b.drop_layers(first)
    a.set_pipeline(first, [(second, LocalPeer(b))])
    b.set_pipeline(second, [(first, LocalPeer(a))])
    assert once(a, "piped") == (want, 0)  # no reuse while the peer runs half the layers
    assert set(a.cached_hashes()) <= named  # nothing computed in the pipeline was named
    a.restore_layers(b.layer_states(second))
    a.set_pipeline(range(layers), [])
    got, hit = once(a, "after")
    assert got == want and hit == 48  # the blocks named before the pipeline serve again
    a.check_integrity()
