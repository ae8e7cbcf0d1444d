"""``--cap-isa avx2``: run a benchmark as on a CPU without AVX-512, on this one.

Every library that picks kernels by instruction set is capped at AVX2 before
it loads: torch's dispatch (``ATEN_CPU_CAPABILITY``), oneDNN
(``ONEDNN_MAX_CPU_ISA``), MKL (``MKL_ENABLE_INSTRUCTIONS``), vLLM's kernel
build (``FERRY_VLLM_CPU_BUILD=_C_AVX2`` for the native engine; vLLM's own
platform in its bench process, vllm_offline.py) and Ferry's own decisions
(``FERRY_CPU_FLAGS``: no AVX-512 or AMX flags, so ``dtype=auto`` picks fp32).
It emulates the instruction set, not the machine: an AVX2 server's memory
bandwidth, caches and clocks differ, so its numbers compare code paths with
each other on this machine, not with a real AVX2 CPU. The process re-executes
itself with the caps set (they must precede torch's first import).
"""

from __future__ import annotations

import os
import sys

from libs.common import cpu_features

MARK = "FERRY_BENCH_ISA"


def caps(isa: str) -> dict[str, str]:
    if isa != "avx2":
        raise ValueError(f"unknown ISA cap {isa!r}; supported: avx2")
    return {MARK: isa, **cpu_features.cap_env(isa)}


def reexec_capped(isa: str | None) -> dict[str, str] | None:
    """With ``isa``: the caps in force (re-executing this command with them
    first if they are not yet); None without."""
    if not isa:
        return None
    env = caps(isa)
    if os.environ.get(MARK) != isa:
        if "torch" in sys.modules:
            raise RuntimeError("--cap-isa must take effect before torch is imported")
        os.environ.update(env)
        os.execv(sys.executable, [sys.executable, *sys.argv])
    return {k: os.environ[k] for k in env}
