"""The native engine on the real default model (SmolLM2-135M, fp32) against
Hugging Face transformers on the same converted weights; a request alone, in a
batch, prefilled in chunks, preempted and recomputed: in the deterministic mode
bit for bit the same tokens and logprobs, in the default mode the same up to a
bounded divergence (helpers.assert_bounded_divergence: the matmul kernels block
by the step's rows)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from libs.common.models import ensure_model
from tests.instance.engine.helpers import (
    LOGPROB_NOISE,
    assert_bounded_divergence,
    collect,
    exact,
    migrate,
    req,
    run,
    run_alone,
    step_collect,
)

pytestmark = pytest.mark.model

TEXTS = [
    "Paris is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
    ("Write a haiku about the sea, then explain which words carry the rhythm and why the season word "
     "matters in classical Japanese poetry. Be brief and concrete, and give one example."),
    " ".join(f"Item {i}: a list entry that makes the prompt long enough to span many KV blocks." for i in range(12)),
]
N = 64
GREEDY = dict(max_tokens=N, min_tokens=N)  # min_tokens masks EOS, like HF's min_new_tokens


@pytest.fixture(scope="module")
def model_dir():
    return ensure_model("smollm2")


@pytest.fixture(scope="module")
def prompts(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    chat = tok.apply_chat_template([{"role": "user", "content": "Name a fruit."}], add_generation_prompt=True)
    chat = chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat
    ids = [tok(t)["input_ids"] for t in TEXTS] + [list(chat)]
    assert len({len(p) for p in ids}) == len(ids)  # all different lengths
    return ids


@pytest.fixture(scope="module")
def hf_greedy(model_dir, prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = hf.generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False, attention_mask=torch.ones_like(ids))
        out.append(gen[0, len(p):].tolist())
    return out


# The default mode, and the deterministic mode (blocks of 32: vLLM's kernel over the paged cache).
MODES = {"default": {}, "deterministic": {"deterministic": True, "block_size": 32}}


def batch_run(prompts, mode: str = "default", **extra):
    """All prompts in one batch on a fresh engine (checked here; the module
    scope outlives make_engine): each request's outputs, with logprobs."""
    from services.instance.engine import create_engine
    from services.instance.engine.base import EngineConfig

    e = create_engine(EngineConfig(engine="native", num_blocks=128, **MODES[mode],
                                   extra={"share_weights": True, "warmup": False, **extra}))
    for i, p in enumerate(prompts):
        e.add_request(req(str(i), p, logprobs=5, **GREEDY))
    outs = collect(e)
    e.check_integrity()
    assert e.num_free_blocks == e.num_total_blocks
    return [outs[str(i)] for i in range(len(prompts))]


def tokens(outs) -> list[int]:
    return [o.token_id for o in outs]


@pytest.fixture(scope="module", params=list(MODES))
def mode(request):
    if request.param == "deterministic":
        from services.instance.engine import vllm_kernels

        if vllm_kernels.ops() is None:
            pytest.skip("the deterministic mode needs vLLM's CPU kernels (the vllm extra)")
    return request.param


@pytest.fixture(scope="module")
def batch_out(prompts, mode):
    return batch_run(prompts, mode)


def agree(ref: list, got: list, mode: str, greedy: bool = True) -> None:
    """What each mode promises of two runs of one request (module docstring)."""
    if mode == "deterministic":
        assert exact(got) == exact(ref)
    else:
        assert_bounded_divergence(ref, got, LOGPROB_NOISE["float32"], greedy)


def test_greedy_matches_transformers(batch_out, hf_greedy, mode):
    """fp32 as it runs by default: with vLLM's kernels where they run here
    (attention, RMSNorm, oneDNN projections for steps of several rows); and
    in the deterministic mode."""
    for got, ref in zip(batch_out, hf_greedy):
        assert tokens(got) == ref


def test_the_torch_path_matches_transformers(prompts, hf_greedy):
    """fp32 without vLLM's kernels (F.linear, torch attention): the path every CPU has."""
    for got, ref in zip(batch_run(prompts, vllm_kernels=False), hf_greedy):
        assert tokens(got) == ref


def test_batch_equals_alone(make_engine, prompts, batch_out, mode):
    e = make_engine("native", num_blocks=64, **MODES[mode])
    for i in (0, 3):  # the shortest and the longest prompt
        e.add_request(req(str(i), prompts[i], max_tokens=24, min_tokens=24, logprobs=5))
        agree(batch_out[i][:24], collect(e)[str(i)], mode)


def test_chunked_prefill_gives_the_same_tokens(make_engine, prompts, batch_out, mode):
    e = make_engine("native", num_blocks=64, max_num_batched_tokens=24, **MODES[mode])
    for i in (1, 3):  # 3 is > 24 tokens: prefilled over several steps beside the decode of 1
        e.add_request(req(str(i), prompts[i], max_tokens=16, min_tokens=16, logprobs=5))
    outs = collect(e)
    for i in (1, 3):
        agree(batch_out[i][:16], outs[str(i)], mode)


def test_preemption_recomputes_the_same_tokens(make_engine, prompts, batch_out, mode):
    # KV for fewer tokens than the requests end with (blocks of 16: 112 for ~150; of 32: 4
    # blocks for 5, request 1 growing into its second block while 2 holds two)
    blocks, picks = {"default": (7, (0, 2, 4)), "deterministic": (4, (0, 1, 2))}[mode]
    e = make_engine("native", num_blocks=blocks, watermark=0.0, **MODES[mode])
    for k, i in enumerate(picks):
        e.add_request(req(str(i), prompts[i], max_tokens=24, min_tokens=24, arrival=float(k + 1), logprobs=5))
    outs = collect(e)
    assert e.load().num_preemptions > 0
    for i in picks:
        agree(batch_out[i][:24], outs[str(i)], mode)


SAMPLED = dict(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50)


def test_seeded_sampling_is_reproducible_and_seeds_differ(make_engine, prompts, mode):
    e = make_engine("native", num_blocks=64, **MODES[mode])
    e.add_request(req("a", prompts[2], seed=1, logprobs=5, **SAMPLED))
    a = collect(e)["a"]
    e.add_request(req("b", prompts[2], seed=1, logprobs=5, **SAMPLED))  # same seed inside a batch
    e.add_request(req("c", prompts[2], seed=2, **SAMPLED))
    e.add_request(req("d", prompts[0], max_tokens=16))
    outs = collect(e)
    agree(a, outs["b"], mode, greedy=False)
    assert tokens(outs["c"]) != tokens(a)


@pytest.mark.parametrize("sampling", [dict(max_tokens=24, min_tokens=24), dict(SAMPLED, max_tokens=24, seed=7)],
                         ids=["greedy", "seeded"])
def test_migration_continues_with_identical_tokens(make_engine, prompts, sampling):
    src = make_engine("native", num_blocks=64)
    dst = make_engine("native", num_blocks=64)
    ref = run_alone(src, req("a", prompts[3], **sampling))
    src.add_request(req("a", prompts[3], **sampling))
    src.add_request(req("b", prompts[1], max_tokens=20))
    outs = {}
    step_collect(src, outs, 9)
    index = migrate(src, dst, "a")
    assert index == len(outs["a"]) > 0
    assert run(dst, {"a": list(outs["a"])})["a"] == ref
    run(src, outs)


def test_gather_scatter_roundtrip_is_exact(make_engine, prompts):
    e = make_engine("native", num_blocks=32)
    e.add_request(req("a", prompts[3], max_tokens=2))
    e.step()
    blocks = e.full_blocks("a")
    data = bytes(e.gather_kv(blocks))
    assert len(data) == len(blocks) * e.kv_layout.bytes_per_block
    mine = e.reserve_blocks(len(blocks))
    e.scatter_kv(mine, data)
    assert bytes(e.gather_kv(mine)) == data
    assert torch.count_nonzero(torch.frombuffer(bytearray(data), dtype=torch.uint8)) > 0
    e.release_blocks(mine)
    assert e.abort_request("a")
