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


def describe() -> dict:
    from services.instance.engine import vllm_kernels

    return {"cpu": cpu_features.describe(), "torch": torch_view(), "vllm": vllm_kernels.describe()}


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
    return f"CPU {cpu_features.summary()}; torch {d['torch']['capability']}; vLLM kernels {vllm}"


def write_json(path: str, obj: dict, indent: int = 1) -> None:
    """A benchmark's result, with the machine it ran on (``machine``) added."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({**obj, "machine": describe()}, f, indent=indent, default=str)
        f.write("\n")
