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


# Caps that make this CPU run a lower kind's code paths (levels below its own):
# torch's dispatch (ATEN_CPU_CAPABILITY), oneDNN (ONEDNN_MAX_CPU_ISA), MKL
# (MKL_ENABLE_INSTRUCTIONS), vLLM's kernel build (FERRY_VLLM_CPU_BUILD) and
# Ferry's own decisions (FERRY_CPU_FLAGS without the flags above the cap). They
# must be in the environment before torch is imported (a child process).
# name -> (the level it emulates, ATen, oneDNN, MKL, vLLM build, flag prefixes dropped)
CAPS = {
    "avx2": ("AVX2", "avx2", "AVX2", "AVX2", "_C_AVX2", ("avx512", "amx")),
    "avx512": ("AVX-512", "avx512", "AVX512_CORE", "AVX512", "_C_AVX512", ("avx512_bf16", "avx512_fp16", "amx")),
    "avx512_bf16": ("AVX-512 BF16", "avx512", "AVX512_CORE_BF16", "AVX512", "_C", ("avx512_fp16", "amx")),
}


def cap_env(name: str, fl: frozenset[str] | None = None) -> dict[str, str]:
    """The environment that runs this CPU as the kind ``name`` (CAPS)."""
    try:
        _, aten, onednn, mkl, build, dropped = CAPS[name]
    except KeyError:
        raise ValueError(f"unknown ISA cap {name!r}; supported: {', '.join(CAPS)}") from None
    fl = flags() if fl is None else fl
    kept = " ".join(sorted(f for f in fl if not f.startswith(dropped)))
    return {"ATEN_CPU_CAPABILITY": aten, "ONEDNN_MAX_CPU_ISA": onednn, "MKL_ENABLE_INSTRUCTIONS": mkl,
            "FERRY_VLLM_CPU_BUILD": build, "FERRY_CPU_FLAGS": kept}


def caps_below(fl: frozenset[str] | None = None) -> list[str]:
    """The caps whose level is below this CPU's: the other kinds it can run."""
    here = LEVELS.index(level(fl))
    return [name for name, c in CAPS.items() if LEVELS.index(c[0]) < here]


def describe() -> dict:
    """The CPU as a benchmark's JSON records it (the engines' own views added by their callers)."""
    fl = flags()
    out = {"arch": arch(), "model": _cpuinfo()[0], "level": level(fl),
           "flags": [f for f in ISA_FLAGS if f in fl], "cores": os.cpu_count()}
    if "FERRY_CPU_FLAGS" in os.environ:
        out["flags_overridden"] = True
    return out
