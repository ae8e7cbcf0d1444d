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
    """None if vLLM can be imported here, else why not."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (pip install -e '.[vllm]')"
    return None
