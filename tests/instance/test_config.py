"""Instance options reach the engine they configure."""

from services.instance.config import InstanceConfig


def test_torch_threads_reaches_the_native_engine_config():
    assert InstanceConfig(engine="native", torch_threads=1).engine_config().extra == {
        "num_threads": 1, "kunserve_exchange_mb": 16.0, "kv_staging": True}
    assert "num_threads" not in InstanceConfig(engine="native").engine_config().extra


def test_kv_staging_can_be_turned_off_for_the_native_engine():
    assert InstanceConfig(engine="native", migration_kv_staging=False).engine_config().extra["kv_staging"] is False
    assert "kv_staging" not in InstanceConfig(engine="fake").engine_config().extra


def test_the_kunserve_exchange_budget_reaches_the_native_engine_only():
    assert InstanceConfig(engine="native", kunserve_exchange_mb=0).engine_config().extra["kunserve_exchange_mb"] == 0
    assert "kunserve_exchange_mb" not in InstanceConfig(engine="sim").engine_config().extra


def test_engine_options_are_passed_through():
    e = InstanceConfig(engine="sim", num_blocks=77, block_size=8, max_model_len=512, seed=3).engine_config()
    assert (e.engine, e.num_blocks, e.block_size, e.max_model_len, e.seed) == ("sim", 77, 8, 512, 3)


def test_unknown_instance_arguments_are_vllm_engine_arguments():
    from ferry.serve_cli import instance

    ctx = instance.make_context("instance", ["--engine", "vllm", "--model", "d", "--enforce-eager",
                                             "--gpu-memory-utilization", "0.8", "--port", "5"])
    assert ctx.params["engine_args"] == ("--enforce-eager", "--gpu-memory-utilization", "0.8")
    assert ctx.params["port"] == 5 and ctx.params["engine"] == "vllm"


def test_engine_block_size_default_and_vllm_args():
    """The native engine takes 32 where vLLM's CPU kernel attends over its
    paged cache (bf16 or fp32 on CPU with the vllm extra), else 16; the fake engine
    16 (vLLM's default depends on its platform: 32 on CPU, checked by
    tests/instance/engine/test_vllm.py, in a process of its own so that this
    one never imports vLLM itself)."""
    import torch

    from services.instance.engine import vllm_kernels
    from services.instance.engine.native.engine import resolve_dtype

    kernel = 32 if vllm_kernels.ops() is not None else 16
    assert resolve_dtype("auto", torch.device("cpu")) in (torch.bfloat16, torch.float32)
    assert InstanceConfig(engine="native").engine_config().block_size == kernel
    assert InstanceConfig(engine="native", dtype="bfloat16").engine_config().block_size == kernel
    assert InstanceConfig(engine="native", dtype="float32").engine_config().block_size == kernel
    assert InstanceConfig(engine="native", dtype="float16").engine_config().block_size == 16
    assert InstanceConfig(engine="fake").engine_config().block_size == 16
    assert InstanceConfig(engine="native", block_size=8).engine_config().block_size == 8
    cfg = InstanceConfig(engine="vllm", block_size=32, vllm_args="--enforce-eager").engine_config()
    assert cfg.extra == {"vllm_args": "--enforce-eager"} and cfg.block_size == 32


def test_prefill_first_reaches_the_core_engines_and_is_refused_for_vllm():
    """--prefill-first is the scheduling of Ferry's own engines; a vLLM
    instance refuses it at start rather than ignore it."""
    import pytest

    from services.instance.engine.base import EngineError
    from services.instance.engine.vllm.args import engine_argv

    from services.instance.engine import create_engine

    cfg = InstanceConfig(engine="fake", prefill_first=True, num_blocks=8).engine_config()
    assert create_engine(cfg).scheduler.prefill_first
    with pytest.raises(EngineError, match="prefill-first"):
        engine_argv(InstanceConfig(engine="vllm", prefill_first=True).engine_config(), "m")
    assert "--model" in engine_argv(InstanceConfig(engine="vllm").engine_config(), "m")
