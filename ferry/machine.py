"""What a measurement ran on: the CPU's instruction sets, and torch's and
vLLM's view of them. Every benchmark's JSON carries ``describe()`` (through
``write_json``), and ``ferry up`` prints ``line()`` when it starts."""

from __future__ import annotations

import json
import os

from libs.common import cpu_features


def torch_view() -> dict:
    """torch's dispatch level on this CPU and whether oneDNN has bf16 kernels here."""
    import torch

    try:
        bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        bf16 = False
    return {"version": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability(),
            "onednn_bf16": bf16, "threads": torch.get_num_threads()}


# Run in a child with ONEDNN_VERBOSE=1: oneDNN's ISA in effect and the kernel it
# picks for bf16 matmuls of 1, 16 and 256 rows (AMX shows as ..._amx).
_ONEDNN_PROBE = """
import json, os, sys, tempfile
import torch
fd, path = tempfile.mkstemp()
saved = os.dup(1)
os.dup2(fd, 1)
try:
    for m in (1, 16, 256):
        try:
            torch.mm(torch.randn(m, 256).bfloat16(), torch.randn(256, 256).bfloat16())
        except RuntimeError:
            pass
finally:
    sys.stdout.flush()
    os.dup2(saved, 1)
lines = open(path).read().splitlines()
isa = next((ln.split("isa:", 1)[1] for ln in lines if ",isa:" in ln), "")
mm = sorted({ln.split(",")[6] for ln in lines if ",exec,cpu,matmul," in ln})
print(json.dumps({"isa": isa, "bf16_matmul": mm}))
"""


def onednn_view() -> dict:
    """oneDNN's instruction set here (capped by ONEDNN_MAX_CPU_ISA, if set) and
    whether its bf16 matmuls use AMX: the kernels that decide bf16 rounding
    (docs/determinism.md). Probed once per CPU and cap, in a child."""
    import torch

    from libs.common import native_probe

    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "")
    r = native_probe.probe("onednn-isa", _ONEDNN_PROBE, {"torch": torch.__version__, "cap": cap}, timeout_s=120,
                           env={"ONEDNN_VERBOSE": "1"})
    kernels = r.report.get("bf16_matmul", []) if r.ok else []
    return {"max_cpu_isa": cap or None, "isa": r.report.get("isa", "") if r.ok else None,
            "bf16_matmul": kernels, "amx": any("amx" in k for k in kernels),
            **({} if r.ok else {"probe_failed": r.reason})}


def describe() -> dict:
    from services.instance.engine import vllm_kernels

    return {"cpu": cpu_features.describe(), "torch": torch_view(), "onednn": onednn_view(),
            "vllm": vllm_kernels.describe()}


def line(d: dict | None = None) -> str:
    """One line of ``describe()``: the CPU, torch's level, and which vLLM build runs here."""
    d = d or describe()
    v = d["vllm"]
    if not v.get("installed"):
        vllm = "not installed"
    elif v.get("runs_here"):
        vllm = f"{v['version']} build {v['build']} ({v['needs']}) runs here"
    else:
        vllm = f"{v['version']} cannot run here: {v.get('why_not')}"
    dnn = d.get("onednn") or {}
    if dnn.get("bf16_matmul"):
        amx = "AMX" if dnn.get("amx") else "no AMX"
        onednn = f"oneDNN bf16 matmul {', '.join(dnn['bf16_matmul'])} ({amx})"
    else:
        onednn = "oneDNN: no bf16 matmul"
    if dnn.get("max_cpu_isa"):
        onednn += f", ONEDNN_MAX_CPU_ISA={dnn['max_cpu_isa']}"
    return f"CPU {cpu_features.summary()}; torch {d['torch']['capability']}; {onednn}; vLLM kernels {vllm}"


def write_json(path: str, obj: dict, indent: int = 1) -> None:
    """A benchmark's result, with the machine it ran on (``machine``) added.
    Nothing that changes from run to run (the simulator's results are the
    same bytes for the same command): when and at which commit a result was
    made is its file's git history (ferry/results.py reads it)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({**obj, "machine": describe()}, f, indent=indent, default=str)
        f.write("\n")
