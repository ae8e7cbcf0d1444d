"""vLLM as an instance engine (optional: ``pip install -e '.[vllm]'``).

- ``engine.py`` — ``VllmEngine``: vLLM's in-process LLMEngine behind Engine.
- ``args.py`` — EngineConfig + vLLM CLI flags -> EngineArgs; per-incarnation SamplingParams.
- ``connector.py`` — Ferry's out-of-tree KV connector (hold, reserve, load blocks).
- ``kv_views.py`` — vLLM's KV tensors as K/V blocks; the fused transfer buffer.
- ``integrity.py`` — block bookkeeping check.

Nothing here imports vLLM at module import time except connector.py, which
vLLM itself imports from its kv_connector_module_path.
"""


def available() -> str | None:
    """None if vLLM is installed and runs on this machine (its platform's
    kernels load here: ``vllm_kernels.require_vllm``), else why not."""
    from services.instance.engine import vllm_kernels

    try:
        vllm_kernels.require_vllm()
    except RuntimeError as e:
        return str(e)
    return None
