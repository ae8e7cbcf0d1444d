"""vLLM's compiled CPU kernels are loaded only where a child process showed
they run (services/instance/engine/vllm_kernels.py). The probes are pointed
at a module that kills its own process with SIGILL, as a kernel build for an
instruction set the CPU lacks does: the test process lives on, the native
engine runs its torch path and says why in one log line, the vLLM engine and
`ferry up --engine vllm` refuse before loading anything. These tests do not
depend on the CPU they run on; the ones at the end run the real probe and
skip with its reason where vLLM cannot run here."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from services.instance.engine import vllm_kernels

SIGILL = "import tests.instance.engine.sigill_kernels\n"
AVX2 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c"


@pytest.fixture
def dying_kernels(tmp_path, monkeypatch):
    """Every vLLM probe's child dies of SIGILL; a fresh cache; vLLM "installed"."""
    monkeypatch.setenv("FERRY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(vllm_kernels, "_PROBE", SIGILL + vllm_kernels._PROBE)
    monkeypatch.setattr(vllm_kernels, "_PLATFORM_PROBE", SIGILL + vllm_kernels._PLATFORM_PROBE)
    monkeypatch.setattr(vllm_kernels, "installed_version", lambda: "0.0-test")
    vllm_kernels.ops.cache_clear()
    yield
    vllm_kernels.ops.cache_clear()


def test_the_build_follows_vllms_platform_choice(monkeypatch):
    monkeypatch.delenv(vllm_kernels.ENV_BUILD, raising=False)
    monkeypatch.setattr(vllm_kernels.cpu_features, "arch", lambda: "x86_64")
    fl = frozenset
    assert vllm_kernels.selected_build(fl(AVX2.split())) == "_C_AVX2"
    assert vllm_kernels.selected_build(fl("avx2 fma avx512f avx512bw avx512vl".split())) == "_C_AVX512"
    assert vllm_kernels.selected_build(fl("avx2 fma avx512f avx512bw avx512vl avx512_bf16".split())) == "_C"
    assert vllm_kernels.selected_build(fl("sse4_2 avx".split())) is None
    monkeypatch.setenv(vllm_kernels.ENV_BUILD, "_C_AVX2")
    assert vllm_kernels.selected_build(fl("avx512f avx512bw avx512vl avx512_bf16 avx2 fma".split())) == "_C_AVX2"
    assert vllm_kernels.selected_build(override=False) != "_C_AVX2" or vllm_kernels.cpu_features.level() == "AVX2"
    monkeypatch.setattr(vllm_kernels.cpu_features, "arch", lambda: "aarch64")
    monkeypatch.delenv(vllm_kernels.ENV_BUILD)
    assert vllm_kernels.selected_build() is None
    assert "x86-64" in vllm_kernels.probe().reason or "not installed" in vllm_kernels.probe().reason


def test_a_kernel_build_that_kills_its_process_leaves_the_torch_path(dying_kernels, monkeypatch, caplog):
    """The reproduction of the issue: the AVX-512 BF16 build (_C) on an AVX2 CPU."""
    monkeypatch.setenv("FERRY_CPU_FLAGS", AVX2)
    monkeypatch.setenv(vllm_kernels.ENV_BUILD, "_C")
    with caplog.at_level(logging.INFO, logger=vllm_kernels.log.name):
        assert vllm_kernels.ops() is None
        assert vllm_kernels.ops() is None  # decided once per process
    lines = [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]
    assert lines == ["vLLM's CPU kernels not used: vLLM's CPU kernels (_C) need AVX-512 BF16; this CPU has "
                     "AVX2: the probe died of SIGILL; the native engine runs its torch path"]
    from services.instance.engine.native import cpu_kernels

    assert cpu_kernels.load(9, 3, 64) is None
    assert vllm_kernels.describe()["runs_here"] is False


def test_the_native_engine_runs_its_torch_path_in_bf16(dying_kernels):
    torch = pytest.importorskip("torch")
    from libs.common.types import SamplingParams
    from services.instance.engine import create_engine
    from services.instance.engine.base import EngineConfig, EngineRequest
    from services.instance.engine.native.engine import default_block_size

    assert default_block_size("cpu", "bfloat16") == 16  # 32 only for the kernel's layout
    e = create_engine(EngineConfig(engine="native", model="tiny-llama", dtype="bfloat16", num_blocks=16, block_size=16,
                                   extra={"warmup": False}))
    assert e.dtype == torch.bfloat16 and e.executor.kernels is None and not e.kv_layout.k_transposed
    e.add_request(EngineRequest("r", tuple(range(5, 40)), SamplingParams(max_tokens=4, ignore_eos=True)))
    out = []
    while e.has_work():
        out += [o.token_id for o in e.step() if o.token_id is not None]
    assert len(out) == 4
    e.check_integrity()


def test_the_vllm_engine_refuses_before_starting_vllm(dying_kernels, monkeypatch):
    from services.instance.engine import create_engine
    from services.instance.engine.base import EngineConfig, EngineError
    from services.instance.engine.vllm import args as vargs

    def never(*a, **kw):
        raise AssertionError("vLLM was started")

    monkeypatch.setattr(vargs, "engine_args", never)
    with pytest.raises(EngineError, match=r"vLLM 0\.0-test cannot run on this machine: .*SIGILL"):
        create_engine(EngineConfig(engine="vllm", model="smollm2"))
    from services.instance.engine.vllm import available

    assert "cannot run" in available()


def test_ferry_up_refuses_the_vllm_engine_before_loading_anything(dying_kernels, monkeypatch):
    from ferry import up as up_mod

    def never(*a, **kw):
        raise AssertionError("a cluster was started")

    monkeypatch.setattr(up_mod, "LocalCluster", never)
    monkeypatch.setattr("libs.common.models.ensure_model", never)
    r = CliRunner().invoke(up_mod.up, ["--engine", "vllm"])
    assert r.exit_code == 1, r.output
    assert "cannot run on this machine" in r.output and "SIGILL" in r.output


# --- the real probe, on whatever CPU this is -------------------------------------------

def _real_probe():
    vllm_kernels.ops.cache_clear()
    result = vllm_kernels.probe()
    if not result.ok:
        pytest.skip(f"vLLM's CPU kernels do not run here: {vllm_kernels.why_not(result)}")
    return result


def test_the_real_probe_loads_the_build_for_this_cpu():
    result = _real_probe()
    assert result.report["build"] == vllm_kernels.selected_build()
    assert result.report["self_check_err"] < 0.05
    assert vllm_kernels.ops() is not None and vllm_kernels.loaded_build() == result.report["build"]


@pytest.mark.slow
def test_the_avx2_build_passes_the_kernel_tests_on_any_cpu_that_runs_it(tmp_path):
    """Every x86 CPU that runs vLLM runs its AVX2 build: the kernel tests
    (attention against the torch path, exact tokens in a running engine)
    pass with it too, in a process of its own (one build per process)."""
    if vllm_kernels.cpu_features.level() == "none" or vllm_kernels.installed_version() is None:
        pytest.skip("vLLM's AVX2 build does not run here")
    env = {**os.environ, vllm_kernels.ENV_BUILD: "_C_AVX2", "FERRY_CACHE_DIR": str(tmp_path)}
    code = ("from services.instance.engine import vllm_kernels as v; import sys; r = v.probe(); "
            "print('PROBE', r.ok, r.report.get('build'), v.why_not(r) if not r.ok else ''); sys.exit(0 if r.ok else 3)")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=False)
    if p.returncode == 3:
        pytest.skip(f"vLLM's AVX2 build does not run here: {p.stdout.strip()}")
    assert p.returncode == 0 and "PROBE True _C_AVX2" in p.stdout, p.stdout + p.stderr
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/instance/engine/test_cpu_kernels.py"], env=env, capture_output=True, text=True,
                       timeout=900, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert " passed" in p.stdout and "skipped" not in p.stdout.splitlines()[-1], p.stdout[-500:]
