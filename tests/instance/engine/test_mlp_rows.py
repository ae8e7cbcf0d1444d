"""The native MLP over a large step (a prefill chunk) runs in row blocks where
its projections are prepacked: the same bits as one call over every row."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.instance.engine.native import model
from services.instance.engine.native.linear import packing_supported

pytestmark = pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.bfloat16),
                                reason="no oneDNN bf16 packing on this CPU")


def test_a_large_step_runs_its_mlp_in_row_blocks_with_the_same_bits(monkeypatch):
    torch.manual_seed(0)
    mlp = model.MLP(SimpleNamespace(hidden_size=64, intermediate_size=160)).to(torch.bfloat16).eval()
    for m in (mlp.gate_up_proj, mlp.down_proj):
        m.pack()
    calls = []
    rows = mlp._rows
    monkeypatch.setattr(mlp, "_rows", lambda x: calls.append(x.shape[0]) or rows(x))
    split = model.MLP_SPLIT_ABOVE
    x = torch.randn(split + 300, 64).to(torch.bfloat16)
    with torch.inference_mode():
        out = mlp(x)
        assert calls == [model.MLP_ROWS] * (len(calls) - 1) + [(len(x) - 1) % model.MLP_ROWS + 1]
        assert len(calls) == -(-len(x) // model.MLP_ROWS)
        calls.clear()
        whole = mlp(x[:split])  # not above the threshold: one call
        assert calls == [split]
        monkeypatch.setattr(model, "MLP_SPLIT_ABOVE", 10**9)
        one = mlp(x)
    assert torch.equal(out, one)
    assert torch.equal(whole, one[:split])
