"""The model cache: processes that start together on an empty cache convert
the default model once, and none of them sees a half-written directory."""

from __future__ import annotations

import threading
import time

from libs.common import models


def test_concurrent_first_use_converts_once_and_everyone_gets_a_complete_model(monkeypatch, tmp_path):
    monkeypatch.setenv("FERRY_CACHE_DIR", str(tmp_path))
    active, calls, overlaps = [0], [], []

    def convert(target):  # stands in for the 20 s GGUF conversion
        active[0] += 1
        overlaps.append(active[0])
        calls.append(target)
        time.sleep(0.2)
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        (target / ".complete").write_text("x")
        active[0] -= 1

    monkeypatch.setattr(models, "_convert_smollm2", convert)
    results, errors = [], []

    def use():
        try:
            results.append(models.ensure_model("smollm2"))
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    threads = [threading.Thread(target=use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(calls) == 1 and overlaps == [1]
    assert all(r == tmp_path / "models" / "smollm2" and (r / ".complete").exists() for r in results)
    assert len(results) == 4
