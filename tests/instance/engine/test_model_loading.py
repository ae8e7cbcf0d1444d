"""Loaders: a local Hugging Face Llama directory (llama3 RoPE scaling, untied
embeddings, GQA) matches transformers; named shapes build random models;
model names resolve with clear errors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from libs.common.models import ModelNotFound, ensure_model, model_max_len
from services.instance.engine.base import EngineError
from tests.instance.engine.helpers import req, run


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                      eos_token_id=299, bos_token_id=1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # bigger weights than the init so argmax ties are unlikely
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else None
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path, model


def test_local_llama3_dir_matches_transformers(make_engine, tiny_hf_dir):
    path, hf = tiny_hf_dir
    prompts = [[5, 17, 42, 7, 99, 3] * 20, [11, 12, 13]]  # 120 tokens: past the 64-token original context
    e = make_engine("native", model=str(path), num_blocks=64)
    for i, p in enumerate(prompts):
        e.add_request(req(str(i), p, max_tokens=20, min_tokens=20))
    outs = run(e)
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        ref = hf.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                          attention_mask=torch.ones_like(ids))[0, len(p):].tolist()
        assert outs[str(i)] == ref


def test_named_shape_builds_random_weights(make_engine):
    e = make_engine("native", model="tiny-llama", num_blocks=16)
    assert e.kv_layout.num_layers == 2 and e.kv_layout.num_kv_heads == 2 and e.kv_layout.head_dim == 16
    e.add_request(req("a", [1, 2, 3], max_tokens=5, ignore_eos=True))
    assert len(run(e)["a"]) == 5


def test_kv_capacity_from_a_memory_budget(make_engine):
    e = make_engine("native", model="tiny-llama", kv_cache_gb=0.001)
    assert e.num_total_blocks == int(2**30 * 0.001 // e.kv_layout.bytes_per_block)


def test_model_names_resolve_with_clear_errors(tiny_hf_dir, make_engine):
    path, _ = tiny_hf_dir
    assert ensure_model(str(path)) == path
    assert model_max_len(path) == 512
    with pytest.raises(ModelNotFound, match="smollm2"):
        ensure_model("no-such-model")
    with pytest.raises(EngineError, match="llama-3.2-1b"):
        make_engine("native", model="no-such-model")


@pytest.mark.gpu
def test_random_llama_on_cuda(make_engine):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    e = make_engine("native", model="llama-3.2-1b", device="cuda", dtype="bfloat16", num_blocks=64)
    e.add_request(req("a", list(range(1, 200)), max_tokens=8, ignore_eos=True))
    assert len(run(e)["a"]) == 8
