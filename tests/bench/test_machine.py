"""Every benchmark's JSON says what it ran on (ferry/machine.py)."""

from __future__ import annotations

import json

from ferry import machine


def test_write_json_adds_the_machine(tmp_path, monkeypatch):
    from services.instance.engine import vllm_kernels

    monkeypatch.setenv("FERRY_CPU_FLAGS", "avx avx2 fma f16c")
    view = {"installed": True, "version": "0.0", "build": "_C_AVX2", "needs": "AVX2", "runs_here": True}
    monkeypatch.setattr(vllm_kernels, "describe", lambda: view)  # its own tests run the probe
    path = tmp_path / "out" / "r.json"
    machine.write_json(str(path), {"tok_s": 1.5})
    d = json.loads(path.read_text())
    assert d["tok_s"] == 1.5
    m = d["machine"]
    assert m["cpu"]["level"] == "AVX2" and m["cpu"]["flags"] == ["avx2", "fma", "f16c"]
    assert m["cpu"]["flags_overridden"] is True
    assert m["torch"]["capability"] and m["torch"]["version"]
    assert m["vllm"] == view
    assert machine.line(m).startswith("CPU ") and "AVX2" in machine.line(m) and "_C_AVX2" in machine.line(m)
