"""sglang-cache-aware: SGLang router's cache-aware policy, as its public docs
describe it. Load = an instance's requests (running, waiting and unreported
dispatches). If the busiest candidate's load exceeds the idlest's both by
more than ``BALANCE_ABS`` (64) and by more than ``BALANCE_REL`` (1.5) times,
the least loaded; else the instance with the longest cached prefix, if it
covers more than ``CACHE_THRESHOLD`` (0.3) of the prompt's tokens; else the
least loaded. (The defaults are the router's documented ones.)

Differs: SGLang's router matches the prompt's text against its own
approximate radix tree of what it routed (per worker, evicted by its own
LRU); here the match is the exact block-level prefix index fed by the
instances' KV events, in whole blocks. Below the threshold, SGLang sends to
the worker with the smallest tree (most cache room); here the least loaded,
as the issue specifies. Ties: the lower load, then the lowest id. No
migration, every request at normal priority."""

from libs.common.policies.base import DispatchRequest, InstanceView, Policy, best_of, hit_blocks
from libs.common.policies.freeness import active_requests

CACHE_THRESHOLD = 0.3
BALANCE_ABS = 64
BALANCE_REL = 1.5


def imbalanced(loads: list[int]) -> bool:
    hi, lo = max(loads), min(loads)
    return hi - lo > BALANCE_ABS and hi > BALANCE_REL * lo


def match_rate(v: InstanceView, req: DispatchRequest) -> float:
    return hit_blocks(v, req) * max(1, v.status.block_size) / max(1, req.num_prompt_tokens)


def select(cands: list[InstanceView], req: DispatchRequest) -> InstanceView:
    least = best_of(cands, lambda v: (-active_requests(v),))
    if imbalanced([active_requests(v) for v in cands]):
        return least
    best = best_of(cands, lambda v: (match_rate(v, req), -active_requests(v)))
    return best if match_rate(best, req) > CACHE_THRESHOLD else least


POLICY = Policy("sglang-cache-aware", "SGLang router: least loaded when imbalanced, else the best prefix match "
                "above 0.3 of the prompt, else the least loaded; no migration",
                score=None, select=select, uses_prefix=True)
