"""`ferry bench engine`'s phase split: prefill and decode per step, the same
definition on both sides."""

from __future__ import annotations

import pytest

from ferry.bench.engine import _phases, decode_step_ms


def test_decode_step_is_the_run_after_prefill_per_output_step():
    # 128 output tokens: the first comes with the prefill, 127 decode steps follow
    assert decode_step_ms(4.0, 0.19, 128) == pytest.approx(1000 * 3.81 / 127)
    assert decode_step_ms(4.0, None, 128) is None  # no request got its first token
    assert decode_step_ms(4.0, 0.19, 1) is None  # no decode step at all


def test_phases_are_medians_over_rounds():
    runs = [{"seconds": 4.0, "prefill_s": 0.2}, {"seconds": 5.0, "prefill_s": 0.3},
            {"seconds": 4.5, "prefill_s": 0.25}]
    ph = _phases(runs, 11)
    assert ph == {"prefill_s": 0.25, "decode_step_ms": round(1000 * 4.25 / 10, 2)}
    assert _phases([{"seconds": 1.0}], 11) == {"prefill_s": None, "decode_step_ms": None}
