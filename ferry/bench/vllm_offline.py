"""vLLM's offline ``LLM.generate`` throughput, served to ``ferry bench
engine`` by a subprocess under the interpreter vLLM is installed in, so that
vLLM's imports, its thread binding and its worker processes stay out of the
process that measures Ferry, and so that the two can take turns: the bench
runs Ferry and vLLM alternately on the same prompts, seconds apart, which
makes their ratio hold on a machine whose load changes by the minute.

Stand-alone on purpose: it imports vLLM and the standard library only, never
Ferry (whose dependencies need not be in vLLM's environment).

Protocol, one JSON object per line. First line on stdin::

    {"model_dir": str, "dtype": "bfloat16", "max_model_len": int, "kv_cache_gb": float}

answered by ``{"ready": true, "vllm_version": str}``; then each line
``{"prompts": [[token ids], ...], "output_len": int}`` is answered by
``{"tok_s": float, "tokens": int, "seconds": float}`` (one timed greedy
``generate`` of the batch, prefill included, after an untimed 4-token
warm-up of the same batch), until stdin closes. vLLM's own logging goes to
stderr.
"""

from __future__ import annotations

import json
import sys
import time


def _reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # vLLM's CPU backend reserves --gpu-memory-utilization of RAM (0.92 by
    # default, refused on a shared machine): the KV space is given in bytes.
    llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], seed=0,
              kv_cache_memory_bytes=int(spec.get("kv_cache_gb", 1.0) * 2**30))
    _reply({"ready": True, "vllm_version": vllm.__version__})
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        n = int(req["output_len"])
        prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        greedy = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
        t0 = time.perf_counter()
        res = llm.generate(prompts, greedy, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        tokens = sum(len(r.outputs[0].token_ids) for r in res)
        _reply({"tok_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed})


if __name__ == "__main__":  # vLLM's workers are spawned and re-import this module
    main()
