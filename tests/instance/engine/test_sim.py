"""The sim engine's step time follows its profile."""

from __future__ import annotations

import json
import time

import pytest

from services.instance.engine.base import EngineError
from services.instance.engine.sim import PROFILE_DIR
from tests.instance.engine.helpers import req


def test_shipped_profile_has_the_paper_capacity_and_a_source(make_engine):
    raw = json.loads((PROFILE_DIR / "llama-7b-a10.json").read_text())
    e = make_engine("sim")
    assert e.block_size == 16 == raw["block_size"]
    assert e.num_total_blocks * e.block_size == 13616 == raw["kv_capacity_tokens"]
    assert len(raw["source"]) > 100


def test_unknown_profile_lists_known_ones(make_engine):
    with pytest.raises(EngineError, match="llama-7b-a10"):
        make_engine("sim", profile="nope")


def test_step_time_follows_the_profile(make_engine, tmp_path):
    p = {"name": "t", "block_size": 16, "kv_capacity_tokens": 16 * 256, "prefill_ms_per_token": 0.2,
         "decode_base_ms": 20.0, "decode_ms_per_seq": 2.0, "decode_ms_per_kv_token": 0.01}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(p))
    e = make_engine("sim", profile=str(path))
    batch, plen = 6, 100
    for i in range(batch):
        e.add_request(req(f"r{i}", [97 + i] * plen, max_tokens=3))
    t0 = time.perf_counter()
    e.step()  # prefill: every request's 100 prompt tokens
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    e.step()  # decode: 6 sequences attending to 101 tokens each
    decode_s = time.perf_counter() - t0
    want_prefill = p["decode_base_ms"] + p["decode_ms_per_seq"] * batch + p["prefill_ms_per_token"] * batch * plen
    want_decode = (p["decode_base_ms"] + p["decode_ms_per_seq"] * batch
                   + p["decode_ms_per_kv_token"] * batch * (plen + 1))
    assert want_prefill / 1000 <= prefill_s < want_prefill / 1000 + 0.03
    assert want_decode / 1000 <= decode_s < want_decode / 1000 + 0.03
    for i in range(batch):
        assert e.abort_request(f"r{i}")
