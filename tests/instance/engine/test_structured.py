"""Structured outputs on the native engine (xgrammar): for 20 JSON schemas
(nested objects, arrays, enums, required fields) x 10 seeds, every output
validates with jsonschema, and in the deterministic mode a request that
migrated mid-generation, was handed off after its first token (Splitwise's
point), preempted and recomputed, or resumed elsewhere by recompute gives
the tokens it gives alone: the grammar's state is rebuilt from the tokens
so far wherever the request runs."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

torch = pytest.importorskip("torch")

from libs.common.types import Grammar, GrammarKind, SamplingParams
from services.instance.engine import create_engine, vllm_kernels
from services.instance.engine.base import EngineConfig, EngineRequest
from tests.instance.engine.helpers import deterministic_or_skip, migrate

pytestmark = pytest.mark.model

STR, INT, BOOL = {"type": "string", "maxLength": 12}, {"type": "integer", "minimum": 0, "maximum": 9999}, {"type": "boolean"}


def obj(props: dict, required=None, **kw) -> dict:
    return {"type": "object", "properties": props, "required": list(required if required is not None else props),
            "additionalProperties": False, **kw}


def arr(items: dict, n: int = 3) -> dict:
    return {"type": "array", "items": items, "maxItems": n}


SCHEMAS = [
    obj({"name": STR}), obj({"age": INT}), obj({"ok": BOOL}), obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"name": STR, "age": INT}), obj({"tags": arr(STR)}), obj({"nums": arr(INT, 4)}),
    obj({"user": obj({"name": STR, "id": INT})}), obj({"point": obj({"x": INT, "y": INT}), "label": STR}),
    obj({"items": arr(obj({"sku": STR, "qty": INT}), 2)}), obj({"kind": {"enum": ["cat", "dog"]}, "legs": INT}),
    obj({"a": obj({"b": obj({"c": INT})})}), obj({"name": STR, "nick": STR}, required=["name"]),
    obj({"flags": arr(BOOL, 3), "count": INT}), arr(obj({"k": STR, "v": INT}), 2), arr({"enum": ["x", "y", "z"]}, 4),
    obj({"status": {"enum": ["open", "closed"]}, "owner": obj({"name": STR})}),
    obj({"matrix": arr(arr(INT, 2), 2)}), obj({"title": STR, "year": INT, "rated": BOOL}),
    obj({"address": obj({"city": STR, "zip": {"type": "string", "pattern": "[0-9]{5}"}})}),
]
SEEDS = range(10)
PROMPT = "Write a JSON value with short values:\n"  # the grammar says the rest


def _engine(num_blocks: int):
    return create_engine(EngineConfig(engine="native", model="smollm2", dtype="auto", block_size=32,
                                      num_blocks=num_blocks, deterministic=True, max_model_len=512,
                                      extra={"share_weights": True, "warmup": False}))


@pytest.fixture(scope="module")
def engines():
    if vllm_kernels.ops() is None:
        pytest.skip("the deterministic mode needs vLLM's CPU kernels (the vllm extra)")
    # 200 requests of 3-8 blocks, all on one engine at the end
    return deterministic_or_skip(lambda: (_engine(900), _engine(900), _engine(900)))


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from libs.common.models import ensure_model

    return AutoTokenizer.from_pretrained(ensure_model("smollm2"))


def _requests(tok) -> list[EngineRequest]:
    out = []
    for i, schema in enumerate(SCHEMAS):
        ids = tuple(tok(PROMPT)["input_ids"] + [100 + i])  # one prompt per schema
        g = Grammar(GrammarKind.JSON, json.dumps(schema), strict=True, compact=True)  # no whitespace runs
        for seed in SEEDS:
            out.append(EngineRequest(f"s{i}-{seed}", ids, SamplingParams(max_tokens=160, temperature=1.0, seed=seed,
                                                                        grammar=g)))
    return out


def _run(engine, reqs, other=None, events: dict | None = None) -> dict[str, list[int]]:
    """All requests on ``engine``; ``events``: request -> (what happens to it, at which output index)."""
    outs: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    at = dict(events or {})
    for r in reqs:
        engine.add_request(r)
    where: dict[str, object] = {r.request_id: engine for r in reqs}
    while engine.has_work() or (other is not None and other.has_work()):
        for e in {engine, other} - {None}:
            for o in e.step():
                if o.token_id is not None:
                    outs[o.request_id].append(o.token_id)
        for rid, (event, n) in list(at.items()):
            e = where[rid]
            if len(outs[rid]) < n or rid not in e.requests:
                continue
            del at[rid]
            if event in ("migrate", "handoff"):
                migrate(e, other, rid)
                where[rid] = other
            elif event == "preempt" and e.requests[rid] in e.scheduler.running:
                e.scheduler.preempt(e.requests[rid])
            elif event == "resume":
                e.abort_request(rid)
                r = next(x for x in reqs if x.request_id == rid)
                other.add_request(EngineRequest(rid, r.prompt_token_ids, r.sampling, resume_token_ids=tuple(outs[rid])))
                where[rid] = other
    for e in {engine, other} - {None}:
        e.check_integrity()
        assert e.num_free_blocks == e.num_total_blocks
    return outs


@pytest.fixture(scope="module")
def alone(engines, tok):
    return _run(engines[0], _requests(tok))


def test_every_output_validates(alone, tok):
    for i, schema in enumerate(SCHEMAS):
        for seed in SEEDS:
            ids = alone[f"s{i}-{seed}"]
            assert ids and ids[-1] in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")), \
                f"schema {i} seed {seed}: cut short: {tok.decode(ids)!r}"
            jsonschema.validate(json.loads(tok.decode(ids, skip_special_tokens=True)), schema)


@pytest.mark.parametrize("kinds", [("migrate", "handoff"), ("preempt", "resume")], ids=["moved", "recomputed"])
def test_tokens_are_those_alone_whatever_moved_the_request(engines, tok, alone, kinds):
    """Every request migrated at a random output index or handed off after
    its first token (the grammar's state moves with its tokens); or, one seed
    of every schema, preempted or resumed elsewhere (its matcher rebuilt from them)."""
    reqs = _requests(tok)
    if kinds[0] == "preempt":  # recompute is the same code for every schema: one seed each
        reqs = [r for r in reqs if r.request_id.endswith(("-3", "-4"))]
    rng = random.Random(str(kinds))
    events = {r.request_id: (kind, 1 if kind == "handoff" else rng.randrange(1, 8))
              for r, kind in zip(reqs, kinds * len(reqs))}
    got = _run(engines[1], reqs, engines[2], events)
    assert got == {r.request_id: alone[r.request_id] for r in reqs}


def test_the_bans_are_exactly_what_xgrammar_masks():
    """logits.grammar_bans (numpy's unpacking of the packed bitmask) bans what
    xgrammar's own apply masks, row by row, at a grammar's start and inside a
    string, for a vocabulary that is not a multiple of 32."""
    import xgrammar as xgr

    from services.instance.engine.native.logits import NEG_INF, grammar_bans

    vocab = 1000
    info = xgr.TokenizerInfo([f"t{i}" if i % 7 else f'"{i}' for i in range(vocab)], vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_regex(r'"[0-9]+t[0-9]"')
    fresh, inside = xgr.GrammarMatcher(compiled), xgr.GrammarMatcher(compiled)
    assert inside.accept_token(7)  # '"7': into the digits
    matchers = [fresh, inside]
    logits = torch.randn(2, vocab)
    want = logits.clone()
    bits = xgr.allocate_token_bitmask(2, vocab)
    for j, m in enumerate(matchers):
        m.fill_next_token_bitmask(bits, j)
    xgr.apply_token_bitmask_inplace(want, bits)
    banned = grammar_bans(matchers, vocab)
    assert banned.shape == (2, vocab) and banned.dtype == torch.bool
    assert torch.equal(logits.masked_fill(banned, NEG_INF), want)
    assert 0 < int((~banned[0]).sum()) < vocab and not torch.equal(banned[0], banned[1])
