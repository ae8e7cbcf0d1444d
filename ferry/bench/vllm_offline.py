"""vLLM's offline ``LLM.generate`` throughput, served to ``ferry bench
engine`` by a subprocess under the interpreter vLLM is installed in, so that
vLLM's imports, its thread binding and its worker processes stay out of the
process that measures Ferry, and so that the two can take turns: the bench
runs Ferry and vLLM alternately on the same prompts, seconds apart, which
makes their ratio hold on a machine whose load changes by the minute.

Stand-alone on purpose: it imports vLLM and the standard library only, never
Ferry (whose dependencies need not be in vLLM's environment).

Protocol, one JSON object per line. First line on stdin::

    {"model_dir": str, "dtype": "bfloat16", "max_model_len": int, "kv_cache_gb": float,
     "max_num_batched_tokens": int (optional: vLLM's default, 4096 on CPU for LLM)}

answered by ``{"ready": true, "vllm_version": str}``; then each line
``{"prompts": [[token ids], ...], "output_len": int}`` is answered by
``{"tok_s": float, "tokens": int, "seconds": float, "cpu_s": float|null}``
(``cpu_s``: CPU time of this process and its descendants, vLLM's engine
core and worker, during the call; Linux /proc) of one timed greedy
``generate`` of the batch, prefill included, after an untimed 4-token
warm-up of the same batch), until stdin closes. vLLM's own logging goes to
stderr.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time


def _cap_isa() -> None:
    """``FERRY_BENCH_ISA=avx2`` (``ferry bench engine --cap-isa avx2``): vLLM's
    platform chooses as on a CPU without AVX-512 (its _C_AVX2 build, its
    portable attention path). Module level: vLLM's spawned processes re-import
    this module."""
    if os.environ.get("FERRY_BENCH_ISA") == "avx2":
        import torch

        for name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported"):
            setattr(torch.cpu, name, lambda: False)


_cap_isa()


def _reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _tree_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) used so far by pid and its descendants."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        total, todo = 0.0, [pid]
        while todo:
            p = todo.pop()
            try:
                fields = pathlib.Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
                for t in pathlib.Path(f"/proc/{p}/task").iterdir():
                    todo += [int(c) for c in (t / "children").read_text().split()]
            except OSError:
                continue  # exited meanwhile
        return total
    except (OSError, ValueError):
        return None


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # vLLM's CPU backend reserves --gpu-memory-utilization of RAM (0.92 by
    # default, refused on a shared machine): the KV space is given in bytes.
    extra = {"max_num_batched_tokens": int(spec["max_num_batched_tokens"])} if spec.get("max_num_batched_tokens") \
        else {}
    llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], seed=0,
              kv_cache_memory_bytes=int(spec.get("kv_cache_gb", 1.0) * 2**30), **extra)
    _reply({"ready": True, "vllm_version": vllm.__version__})
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        n = int(req["output_len"])
        prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        greedy = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
        c0, t0 = _tree_cpu_s(os.getpid()), time.perf_counter()
        res = llm.generate(prompts, greedy, use_tqdm=False)
        elapsed, c1 = time.perf_counter() - t0, _tree_cpu_s(os.getpid())
        tokens = sum(len(r.outputs[0].token_ids) for r in res)
        _reply({"tok_s": tokens / elapsed, "tokens": tokens, "seconds": elapsed,
                "cpu_s": None if c0 is None or c1 is None else c1 - c0})


if __name__ == "__main__":  # vLLM's workers are spawned and re-import this module
    main()
