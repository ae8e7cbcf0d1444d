"""Sampling over a batch of logits: greedy rows in one argmax; temperature /
top-k / top-p rows filtered together, then drawn per request with the
request's own torch.Generator (its state migrates with the request)."""

from __future__ import annotations

import torch

from libs.common.types import GREEDY_TEMPERATURE, Logprobs
from services.instance.engine.base import RequestFailed
from services.instance.engine.core.executor import Sampled
from services.instance.engine.native import logits as logits_mod
from services.instance.engine.core.request import Request


def new_generator(seed: int) -> torch.Generator:
    # CPU generator on every device: sampling draws on CPU so that the state
    # is portable between CPU and CUDA instances.
    return torch.Generator(device="cpu").manual_seed(seed)


def generator_state(g: torch.Generator) -> bytes:
    return g.get_state().numpy().tobytes()


def set_generator_state(g: torch.Generator, state: bytes) -> None:
    g.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))


def skip_draws(g: torch.Generator, n: int, vocab: int) -> None:
    """Advance ``g`` past the draws of ``n`` sampled tokens: ``sample`` draws
    one multinomial over the whole vocabulary per token, which takes the same
    amount of the generator's stream whatever the probabilities (checked by
    tests/instance/engine/test_sampler.py), so n draws from any distribution
    leave it where the n real ones did."""
    if n:
        uniform = torch.full((vocab,), 1.0 / vocab)
        for _ in range(n):
            torch.multinomial(uniform, 1, generator=g)


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k (0 = off) and top-p exclude, row-wise."""
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(min=1, max=vocab)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # keep the smallest prefix whose mass reaches top_p (always the first token)
    before = probs.cumsum(dim=-1) - probs
    drop |= before >= top_p.unsqueeze(1)
    drop[:, 0] = False  # NOTE: a top_p that rounds to 0 in float32 still keeps the best token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)


def raw_logprobs(logits: torch.Tensor, reqs: list[Request]) -> dict[int, torch.Tensor]:
    """Row -> the log-softmax of the model's logits, for the requests that asked
    for logprobs (vLLM's raw logprobs: before temperature, top-k/p, penalties)."""
    rows = [i for i, r in enumerate(reqs) if r.sampling.logprobs is not None]
    if not rows:
        return {}
    lp = logits[rows].float().log_softmax(dim=-1)
    return {i: lp[j] for j, i in enumerate(rows)}


def with_logprobs(token: int, lp: torch.Tensor, k: int) -> Sampled:
    top = ()
    if k:
        values, ids = lp.topk(min(k, lp.shape[-1]))
        top = tuple(zip(ids.tolist(), values.tolist()))
    return Sampled(token, Logprobs(float(lp[token]), top))


def sample(logits: torch.Tensor, reqs: list[Request], eos_token_ids: frozenset[int]) -> list[int | Sampled]:
    """logits: fp32 [B, vocab], one row per request. Order (vLLM's V1
    sampler): raw logprobs; masks, biases and penalties (logits.py); greedy
    argmax, or temperature, min_p, top-k, top-p and the request's own draw;
    each grammar accepts its token."""
    lps = raw_logprobs(logits, reqs)  # NOTE: before the masks below change the logits
    logits = logits.float()
    logits_mod.ban_stop_tokens(logits, reqs, eos_token_ids)
    logits_mod.process(logits, reqs)
    # One pass gives the greedy tokens and the finiteness check: max's indices
    # = argmax's (first of ties; 3x faster on CPU), max propagates NaN like amax.
    best = logits.max(dim=-1)
    # NOTE: before any draw, so that no request's generator moves in a step
    # that fails (the engine runs it again without the failed rows).
    bad = (~torch.isfinite(best.values)).nonzero().flatten().tolist()
    if bad:
        raise RequestFailed("no token can follow: the model produced non-finite logits (NaN or infinity), or its "
                            "masks (grammar, allowed_token_ids, bad_words, min_tokens) left none",
                            [reqs[i].request_id for i in bad], code="internal")
    out = best.indices.cpu()
    rows = [i for i, r in enumerate(reqs) if not r.sampling.greedy]
    if rows:
        sub = logits[rows]
        # NOTE: greedy below GREEDY_TEMPERATURE, so the division stays finite
        # for any finite logits; the clamp guards callers that bypass `greedy`.
        temp = torch.tensor([reqs[i].sampling.temperature for i in rows], device=sub.device,
                            dtype=torch.float32).clamp(min=GREEDY_TEMPERATURE)
        top_k = torch.tensor([reqs[i].sampling.top_k for i in rows], device=sub.device)
        top_p = torch.tensor([reqs[i].sampling.top_p for i in rows], device=sub.device, dtype=torch.float32)
        scaled = sub / temp.unsqueeze(1)
        min_p = [reqs[i].sampling.min_p for i in rows]
        if any(min_p):
            drop = logits_mod.min_p_mask(scaled.softmax(dim=-1), torch.tensor(min_p, device=sub.device))
            scaled = scaled.masked_fill(drop, float("-inf"))
        probs = _filter(scaled, top_k, top_p).softmax(dim=-1).cpu()
        # Still before any draw: a row that cannot be drawn from (huge logits
        # over a small temperature) fails alone, as non-finite logits do.
        bad = (~torch.isfinite(probs).all(dim=-1) | ~(probs.sum(dim=-1) > 0)).nonzero().flatten().tolist()
        if bad:
            raise RequestFailed("sampling produced no valid distribution for this request (logits too large "
                                "for its temperature)", [reqs[rows[j]].request_id for j in bad], code="internal")
        for j, i in enumerate(rows):
            out[i] = torch.multinomial(probs[j], 1, generator=reqs[i].generator).item()
    tokens = out.tolist()
    for i, r in enumerate(reqs):
        if r.grammar_matcher is not None:
            r.grammar_matcher.accept_token(tokens[i])
            r.grammar_done = r.grammar_matcher.is_terminated()
    for i, lp in lps.items():
        tokens[i] = with_logprobs(tokens[i], lp, reqs[i].sampling.logprobs)
    return tokens


def samples(chunk) -> bool:
    """The chunk's request draws a token this step (a prompt-only request,
    max_tokens 0, ends with its prompt instead)."""
    return chunk.samples and chunk.request.sampling.max_tokens > 0


def prompt_logprob_positions(chunk) -> range:
    """The positions among the chunk's rows whose next token is a prompt token
    its request wants the logprob of (SamplingParams.prompt_logprobs)."""
    r = chunk.request
    if r.sampling.prompt_logprobs is None or r.prompt_logprobs_sent:
        return range(0)
    return range(chunk.start, min(chunk.end, r.num_prompt_tokens - 1))


def keep_prompt_logprobs(chunks, logits: torch.Tensor) -> None:
    """The prompt rows' logits (in ``_inputs``' order) as each request's
    prompt logprobs, by the position of the token they predict."""
    lp = logits.float().log_softmax(dim=-1)
    row = 0
    for c in chunks:
        r = c.request
        for j in prompt_logprob_positions(c):
            r.prompt_logprobs[j + 1] = with_logprobs(r.prompt_token_ids[j + 1], lp[row],
                                                     r.sampling.prompt_logprobs).logprobs
            row += 1
