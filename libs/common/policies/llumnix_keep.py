"""llumnix-keep: llumnix-prefix whose instances keep agent programs' KV
between turns by expected return (issue 53's "Keep"), and whose dispatch
sends a program's returning turn to the instance holding its KV unless that
instance is overloaded (issue 53's "Schedule programs", its first rule).
This project's design, not a peer's: it reproduces the session affinity of
the peers' program routers (vLLM's router, llm-d: a program's turns go where
its KV is) but leaves a home by a counted cost, not a timeout or a load
score, and it keeps KV without pinning it (Continuum pins, below).

Keep: when a turn of a program ends (the program named by the client:
prompt_cache_key / x-session-id), the instance keeps the program's cached
blocks for the program's expected return
(services/instance/engine/core/pins.py, ProgramKeep). Unlike Continuum's
pins (the ``continuum`` policy) the kept blocks hold no reference: they stay
evictable, so no request ever waits for them; they are evicted only once no
plain cached block is left, and then by worth, not recency: first the
blocks of the program whose recompute cost per second until its expected
return is lowest (its tail first). A program's expected return is learned
from its own gaps between turns on that instance (an EWMA; 15 s before its
first gap), and the retention lasts three expected gaps, after which its
blocks are plain LRU cache. At most ``BUDGET`` of an instance's KV pool is
kept; kept free blocks are reported as held (InstanceStatus.free_blocks
withholds them, which a program's first turn is placed by, below), while
the instance's own admission can still take them. Clients cannot hint the
return (no request field carries one). In the simulator the policy sets
the engines' budget (Policy.program_keep); a live cluster's instances take
``--program-keep``.

Program dispatch (``select``). A program's first turn
(DispatchRequest.program_turn 0: the scheduler's program ledger has seen
none of it) goes where it fits with the most free blocks per request
after placing it (``fit_key`` over ``base_dispatch_terms``: the reported
free blocks, which withhold kept ones, less every queued and pending
demand; its own demand net of its hit; of equals the least prefill cost),
not to where the shared system prompt saves the most prefill: the program
will keep its history where it starts, so it starts where the least memory
is held, and programs spread over the cluster instead of piling onto the
instances that first cached the system prompt. (Llumnix's freeness, which
llumnix-prefix's key reads, counts cached blocks, kept or not, as free: it
cannot see where programs' KV is held.)

A returning turn: llumnix-prefix's choice (``prefix_key``: among instances
left at least ``ROOMY`` freeness, the least prefill cost) sends it away from
its KV whenever the instance holding it is short of ``ROOMY``, as the few
instances llumnix-prefix packs programs onto often are. Here a turn of a named program
(DispatchRequest.program_id) has a home: the candidate holding the longest
prefix of its prompt (DispatchRequest.hits, the exact prefix index: where
its blocks are now, kept or plain cached; not the program ledger's last
instance, which may since have evicted them), of equal hits the lowest id.
Where the home holds more of the prompt than llumnix-prefix's choice does:

- the home is overloaded where the turn does not fit there with every queued
  request counted (``fit_key`` over ``llumnix_dispatch_terms``, the turn's
  demand net of its hit: freeness after placing below
  ``HOME_MIN_FREENESS`` = 0 blocks per request, instead of ``ROOMY``). An
  overloaded home is not chosen: the turn would wait there for memory that
  running requests have yet to release, a wait these counts cannot bound
  (no decode rates in a status), so llumnix-prefix's choice stands.
- otherwise the counted cost decides, in prompt tokens computed on that
  instance before the turn's first token (the prefill work it waits for
  plus its own): at the home, ``queued_prefill_tokens(home)`` (the waiting
  it would see there) plus its missed tokens ``prompt - hit_home x bs``; at
  llumnix-prefix's choice, ``queued_prefill_tokens(alt)`` plus ``prompt -
  hit_alt x bs`` (the history it would recompute there). The home wins ties.
  A token of waiting and a token of recompute weigh the same: both are
  prefill steps of the same model (the engines' prefill cost is linear in
  tokens to first order), as migration pairing counts blocks sent.

Where the home holds no more than llumnix-prefix's choice, where the
ledger did not count the program's turns (program_turn -1: the frontend's
bypass, whose returning turns take the rule above), and for requests of no
program, the choice is llumnix-prefix's unchanged. Migration is
llumnix-prefix's (pairs_by_move_cost): a turn placed at a tight home may be
moved later, to where its blocks are cheapest to send. Moving kept KV to a
roomier instance instead of evicting it (issue 53's "move instead of evict")
is llumnix-move (llumnix_move.py). Not here yet: program-level admission,
fairness.
"""

from libs.common.policies import llumnix_prefix
from libs.common.policies.base import (DispatchRequest, InstanceView, Policy, best_of, blocks_for, fit_terms_key,
                                       hit_blocks)
from libs.common.policies.freeness import base_dispatch_terms, llumnix_freeness

BUDGET = 0.75
HOME_MIN_FREENESS = 0.0  # freeness after placing below this at the home: overloaded


def home(cands: list[InstanceView], req: DispatchRequest) -> tuple[InstanceView | None, int]:
    """The candidate holding the longest prefix of ``req``'s prompt and that
    hit in blocks (hit_blocks); (None, 0) where none holds any or the request
    names no program."""
    if not req.program_id:
        return None, 0
    best, best_hit = None, 0
    for v in cands:
        h = hit_blocks(v, req)
        if h > best_hit or (h == best_hit and best is not None and h > 0 and v.instance_id < best.instance_id):
            best, best_hit = v, h
    return best, best_hit


def overloaded(v: InstanceView, req: DispatchRequest) -> bool:
    """The turn does not fit at ``v`` with every queued request counted:
    freeness after placing its demand net of its hit below HOME_MIN_FREENESS
    (or ``v`` is terminating)."""
    tier, value, _ = llumnix_prefix.fit_and_cost(v, req)
    return tier < 1 or value < HOME_MIN_FREENESS


def prefill_cost(v: InstanceView, req: DispatchRequest) -> int:
    """Prompt tokens ``v`` computes before the turn's first token: what it has
    queued and the turn's own missed tokens (llumnix_prefix.prefix_key's cost)."""
    return llumnix_prefix.fit_and_cost(v, req)[2]


def first_turn_key(v: InstanceView, req: DispatchRequest) -> tuple:
    """A program's first turn: where it fits, the most free blocks per request
    after placing it (base_dispatch_terms: the reported free blocks, which
    withhold kept ones, less queued and pending demand), its demand net of
    its hit; of equals the least prefill cost. Larger is better."""
    demand = blocks_for(req.num_prompt_tokens, max(1, v.status.block_size)) - hit_blocks(v, req)
    return (*fit_terms_key(base_dispatch_terms(v), demand), -llumnix_prefix.fit_and_cost(v, req)[2])


def select(cands: list[InstanceView], req: DispatchRequest) -> InstanceView:
    if req.program_id and req.program_turn == 0:
        return best_of(cands, lambda v: first_turn_key(v, req))
    alt = llumnix_prefix.select(cands, req)
    h, hit = home(cands, req)
    if h is None or h.instance_id == alt.instance_id or hit <= hit_blocks(alt, req) or overloaded(h, req):
        return alt
    return h if prefill_cost(h, req) <= prefill_cost(alt, req) else alt


POLICY = Policy("llumnix-keep", f"llumnix-prefix whose instances keep programs' cached blocks between turns by "
                f"expected return (evictable, evicted by recompute cost over time to return; at most "
                f"{BUDGET:g} of the pool; instances' --program-keep); a program's first turn goes to the "
                f"freest instance, a returning one where its KV is unless it does not fit there or prefills sooner "
                f"elsewhere; migration; priorities",
                score=None, select=select, uses_prefix=True, migrates=True, uses_priorities=True,
                migration_freeness=llumnix_freeness, pairs_by_move_cost=True, program_keep=BUDGET)
