"""Structured outputs for the native engine, with xgrammar (the grammar
library vLLM and SGLang use): a request's Grammar (libs/common/types.py) is
compiled once per engine and spec (xgrammar's compiler caches it: 11 ms cold
for a small JSON schema on SmolLM2's 49,152 tokens, 0.1 ms again), and each
request gets its own matcher, which masks what may come next
(logits.grammar_bans) and accepts each sampled token.

A matcher is a function of the grammar and the tokens accepted so far, so a
request that migrated, was handed off, preempted or resumed gets a new one
fed its output tokens (``matcher``): the same state, whatever ran before."""

from __future__ import annotations

import json
import threading

from libs.common.types import Grammar, GrammarKind
from services.instance.engine.base import EngineError


def choice_regex(choices: list[str]) -> str:
    """One of these strings exactly (vLLM's guided_choice)."""
    import re

    return "(" + "|".join(re.escape(c) for c in choices) + ")"


class Grammars:
    """The engine's compiler (built on first use: xgrammar reads the
    tokenizer's vocabulary, 0.3 s for SmolLM2) and its matchers."""

    def __init__(self, tokenizer_dir, vocab_size: int, eos_token_ids: frozenset[int]):
        self._dir = tokenizer_dir
        self._vocab = vocab_size
        self._eos = sorted(eos_token_ids)
        self._compiler = None
        self._lock = threading.Lock()

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import AutoTokenizer

                if self._dir is None:
                    raise EngineError("structured outputs need the model's tokenizer (a random-weight shape has none)")
                tok = AutoTokenizer.from_pretrained(self._dir)
                info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self._vocab, stop_token_ids=self._eos)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, g: Grammar):
        c = self._get_compiler()
        try:
            if g.kind is GrammarKind.JSON:
                return c.compile_json_schema(g.spec, strict_mode=g.strict, any_whitespace=not g.compact)
            if g.kind is GrammarKind.JSON_OBJECT:
                return c.compile_json_schema('{"type": "object"}', strict_mode=False, any_whitespace=not g.compact)
            if g.kind is GrammarKind.REGEX:
                return c.compile_regex(g.spec)
            if g.kind is GrammarKind.CHOICE:
                return c.compile_regex(choice_regex(json.loads(g.spec)))
            if g.kind is GrammarKind.GRAMMAR:
                return c.compile_grammar(g.spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise EngineError(f"invalid {g.kind.value} grammar: {e}") from None
        raise EngineError(f"unknown grammar kind {g.kind!r}")

    def matcher(self, g: Grammar, output_token_ids: list[int]):
        """A matcher that has accepted ``output_token_ids`` (EngineError if the grammar refuses them)."""
        import xgrammar as xgr

        m = xgr.GrammarMatcher(self.compile(g))
        for i, t in enumerate(output_token_ids):
            if not m.accept_token(t):
                raise EngineError(f"the output so far leaves its grammar at token {i} ({t})")
        return m
