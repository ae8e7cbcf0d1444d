"""What changes a row of logits before the draw, as vLLM's V1 sampler does it
(for the requests that ask for any of it; the others never come here):

1. masks: allowed_token_ids, bad_words (a sequence's last token, once the
   output ends with the rest of it), min_tokens' stop tokens, the grammar's
   next-token mask (grammar.py);
2. logit_bias, added;
3. penalties over the tokens so far: repetition (prompt and output: a
   positive logit divided by it, a negative one multiplied), then frequency
   (times each output token's count) and presence (once per output token),
   subtracted.

Everything here is a function of the request's sampling parameters and its
tokens so far, so a migration, a handoff or a resume carries it with the
tokens and nothing else (the grammar's matcher is rebuilt from them).
``min_p`` comes after the temperature, with top-k and top-p (sampler.py)."""

from __future__ import annotations

import torch

from services.instance.engine.core.request import Request

NEG_INF = float("-inf")


def ban_stop_tokens(logits: torch.Tensor, reqs: list[Request], eos_token_ids: frozenset[int]) -> None:
    """min_tokens: stop tokens are not allowed yet (rare, cheap)."""
    for i, r in enumerate(reqs):
        sp = r.sampling
        if sp.min_tokens and len(r.output_token_ids) < sp.min_tokens:
            banned = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_token_ids))
            if banned:
                logits[i, list(banned)] = NEG_INF


def process(logits: torch.Tensor, reqs: list[Request]) -> None:
    """Masks, biases and penalties of the rows whose request asks for any (in place)."""
    rows = [i for i, r in enumerate(reqs) if r.sampling.processes_logits]
    if not rows:
        return
    grammar_rows = [i for i in rows if reqs[i].grammar_matcher is not None]
    if grammar_rows:
        banned = grammar_bans([reqs[i].grammar_matcher for i in grammar_rows], logits.shape[-1]).to(logits.device)
        if len(grammar_rows) == logits.shape[0]:  # every row: in place, no gather and scatter of the rows
            logits.masked_fill_(banned, NEG_INF)
        else:
            logits[grammar_rows] = logits[grammar_rows].masked_fill(banned, NEG_INF)
    for i in rows:
        r, sp, row = reqs[i], reqs[i].sampling, logits[i]
        if sp.allowed_token_ids:
            keep = torch.zeros_like(row, dtype=torch.bool)
            keep[list(sp.allowed_token_ids)] = True
            row.masked_fill_(~keep, NEG_INF)
        out = r.output_token_ids
        for word in sp.bad_words:
            n = len(word) - 1
            if n == 0 or (len(out) >= n and tuple(out[len(out) - n:]) == word[:-1]):
                row[word[-1]] = NEG_INF
        if sp.logit_bias:
            ids = torch.tensor([t for t, _ in sp.logit_bias], device=row.device)
            row.index_add_(0, ids, torch.tensor([b for _, b in sp.logit_bias], device=row.device, dtype=row.dtype))
        if sp.repetition_penalty != 1.0 or sp.frequency_penalty or sp.presence_penalty:
            _penalize(row, r, logits.shape[-1])


def _penalize(row: torch.Tensor, r: Request, vocab: int) -> None:
    sp = r.sampling
    out = torch.tensor(r.output_token_ids, dtype=torch.long)
    counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.device, row.dtype)
    if sp.repetition_penalty != 1.0:
        seen = counts > 0
        seen[torch.tensor(r.prompt_token_ids, dtype=torch.long, device=row.device)] = True
        rp = sp.repetition_penalty
        row.copy_(torch.where(seen, torch.where(row > 0, row / rp, row * rp), row))
    if sp.frequency_penalty:
        row.sub_(counts * sp.frequency_penalty)
    if sp.presence_penalty:
        row.sub_((counts > 0).to(row.dtype) * sp.presence_penalty)


def min_p_mask(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """True where a token's probability is below min_p x the row's most likely one."""
    return probs < min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values


def grammar_bans(matchers, vocab: int) -> torch.Tensor:
    """[rows, vocab] bool: True where a row's grammar matcher does not allow
    the token next. Its packed bitmask (bit k of word w: token 32w + k) is
    inverted and unpacked by numpy, little-endian, and viewed as bool: 0.19 ms
    for 32 rows of SmolLM2's vocabulary, where torch's shifts took 2 ms and
    xgrammar's CPU apply 0.27 ms a row."""
    import numpy as np
    import xgrammar as xgr

    words = (vocab + 31) // 32
    bits = xgr.allocate_token_bitmask(len(matchers), words * 32)
    for j, m in enumerate(matchers):
        m.fill_next_token_bitmask(bits, j)
    unpacked = np.unpackbits(np.invert(bits.numpy()).view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return torch.from_numpy(unpacked).view(torch.bool)
