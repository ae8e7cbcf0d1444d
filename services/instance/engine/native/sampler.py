"""Sampling over a batch of logits: greedy rows in one argmax; temperature /
top-k / top-p rows filtered together, then drawn per request with the
request's own torch.Generator (its state migrates with the request)."""

from __future__ import annotations

import torch

from libs.common.types import GREEDY_TEMPERATURE, Logprobs
from services.instance.engine.base import RequestFailed
from services.instance.engine.core.executor import Sampled
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
    """logits: fp32 [B, vocab], one row per request."""
    lps = raw_logprobs(logits, reqs)  # NOTE: before the masks below change the logits
    logits = logits.float()
    for i, r in enumerate(reqs):  # min_tokens: stop tokens are not allowed yet (rare, cheap)
        sp = r.sampling
        if sp.min_tokens and len(r.output_token_ids) < sp.min_tokens:
            banned = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_token_ids))
            if banned:
                logits[i, list(banned)] = float("-inf")
    # One pass gives the greedy tokens and the finiteness check: max's indices
    # = argmax's (first of ties; 3x faster on CPU), max propagates NaN like amax.
    best = logits.max(dim=-1)
    # NOTE: before any draw, so that no request's generator moves in a step
    # that fails (the engine runs it again without the failed rows).
    bad = (~torch.isfinite(best.values)).nonzero().flatten().tolist()
    if bad:
        raise RequestFailed("the model produced non-finite logits (NaN or infinity) for this request",
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
        probs = _filter(sub / temp.unsqueeze(1), top_k, top_p).softmax(dim=-1).cpu()
        # Still before any draw: a row that cannot be drawn from (huge logits
        # over a small temperature) fails alone, as non-finite logits do.
        bad = (~torch.isfinite(probs).all(dim=-1) | ~(probs.sum(dim=-1) > 0)).nonzero().flatten().tolist()
        if bad:
            raise RequestFailed("sampling produced no valid distribution for this request (logits too large "
                                "for its temperature)", [reqs[rows[j]].request_id for j in bad], code="internal")
        for j, i in enumerate(rows):
            out[i] = torch.multinomial(probs[j], 1, generator=reqs[i].generator).item()
    tokens = out.tolist()
    for i, lp in lps.items():
        tokens[i] = with_logprobs(tokens[i], lp, reqs[i].sampling.logprobs)
    return tokens
