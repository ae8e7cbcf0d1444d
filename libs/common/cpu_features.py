"""What this CPU can run: its instruction-set flags, read once from
``/proc/cpuinfo`` (Linux) and summarized into the levels that decide which
native kernels may load here (vLLM's CPU wheel ships one build per level:
AVX2, AVX-512, AVX-512 with BF16).

The machines Ferry runs on differ: two of the same kind may have AVX-512 or
only AVX2. Benchmarks record ``describe()`` so that a number says what it ran
on, and ``ferry up`` prints ``summary()`` when it starts.

``FERRY_CPU_FLAGS`` (space-separated flags) replaces what ``/proc/cpuinfo``
says, for tests of the decisions made from the flags; it changes what Ferry
believes, not what the CPU runs.
"""

from __future__ import annotations

import functools
import os
import pathlib
import platform

# The flags that decide which kernel builds may run, in the order shown.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "avx_vnni")
LEVELS = ("none", "AVX2", "AVX-512", "AVX-512 BF16", "AMX")


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first CPU; ('', {}) where unreadable."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return "", frozenset()
    model, flags = "", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
        if model and flags:
            break
    return model, flags


def flags() -> frozenset[str]:
    override = os.environ.get("FERRY_CPU_FLAGS")
    if override is not None:
        return frozenset(override.split())
    return _cpuinfo()[1]


def arch() -> str:
    return platform.machine()


def level(fl: frozenset[str] | None = None) -> str:
    """The highest x86 vector level these flags reach (one of LEVELS)."""
    fl = flags() if fl is None else fl
    if {"amx_tile", "amx_bf16", "avx512_bf16"} <= fl:
        return "AMX"
    if {"avx512f", "avx512bw", "avx512vl"} <= fl:
        return "AVX-512 BF16" if "avx512_bf16" in fl else "AVX-512"
    if {"avx2", "fma"} <= fl:
        return "AVX2"
    return "none"


def at_least(needed: str, fl: frozenset[str] | None = None) -> bool:
    return LEVELS.index(level(fl)) >= LEVELS.index(needed)


def has_bf16(fl: frozenset[str] | None = None) -> bool:
    """Native bf16 arithmetic (AVX-512 BF16 or AMX): where bf16 GEMMs beat fp32."""
    fl = flags() if fl is None else fl
    return "avx512_bf16" in fl or "amx_bf16" in fl


def summary() -> str:
    """One line: architecture, model, vector level and the deciding flags."""
    model = _cpuinfo()[0] or "unknown model"
    fl = flags()
    shown = " ".join(f for f in ISA_FLAGS if f in fl) or "-"
    return f"{arch()} {model}: {level(fl)} ({shown})"


def describe() -> dict:
    """The CPU as a benchmark's JSON records it (the engines' own views added by their callers)."""
    fl = flags()
    out = {"arch": arch(), "model": _cpuinfo()[0], "level": level(fl),
           "flags": [f for f in ISA_FLAGS if f in fl], "cores": os.cpu_count()}
    if "FERRY_CPU_FLAGS" in os.environ:
        out["flags_overridden"] = True
    return out
