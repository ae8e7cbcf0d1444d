"""What responses look like: a choice's logprobs in OpenAI's two shapes
(the legacy completions object of parallel lists, chat's list of token
entries with their bytes), vLLM's prompt_logprobs, and tool-call messages."""

from __future__ import annotations

from libs.common.types import Logprobs
from services.frontend.completions import Present
from services.frontend.tokenizer import Tokenizer


def token_str(tokenizer: Tokenizer, token_id: int, present: Present) -> str:
    return f"token_id:{token_id}" if present.tokens_as_ids else tokenizer.token_text(token_id)


def _top(tokenizer, lp: Logprobs, present: Present, k: int) -> list[tuple[str, float]]:
    return [(token_str(tokenizer, t, present), v) for t, v in lp.top[:k]]


def completion_logprobs(tokenizer: Tokenizer, present: Present, token_ids: list[int], logprobs: list,
                        offset: int = 0) -> dict:
    """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs
    (token -> logprob; None where a token has none: a prompt's first),
    text_offset (from ``offset``, the text before these tokens)."""
    k = present.logprobs or 0
    tokens, lps, tops, offsets = [], [], [], []
    for t, lp in zip(token_ids, logprobs):
        s = token_str(tokenizer, t, present)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        lps.append(None if lp is None else lp.logprob)
        tops.append(None if lp is None else dict(_top(tokenizer, lp, present, k)))
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def merge_completion_logprobs(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {key: a[key] + b[key] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def chat_logprobs(tokenizer: Tokenizer, present: Present, token_ids: list[int], logprobs: list) -> dict:
    """Chat's logprobs: one entry per token (token, logprob, bytes, top_logprobs)."""
    k = present.logprobs or 0

    def entry(t: int, v: float) -> dict:
        s = token_str(tokenizer, t, present)
        return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8", errors="replace"))}

    return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(tt, v) for tt, v in lp.top[:k]]}
                        for t, lp in zip(token_ids, logprobs)], "refusal": None}


def prompt_logprobs(tokenizer: Tokenizer, prompt_ids: list[int], plps: tuple | None) -> list | None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or
    {token id: {logprob, rank?, decoded_token}} for the token and the top ones."""
    if plps is None:
        return None
    out = []
    for t, lp in zip(prompt_ids, plps):
        if lp is None:
            out.append(None)
            continue
        d = {str(t): {"logprob": lp.logprob, "decoded_token": tokenizer.token_text(t)}}
        for rank, (tt, v) in enumerate(lp.top, start=1):
            d.setdefault(str(tt), {"logprob": v, "decoded_token": tokenizer.token_text(tt)})["rank"] = rank
        out.append(d)
    return out
