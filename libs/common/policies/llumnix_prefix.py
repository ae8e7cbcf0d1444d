"""llumnix-prefix: Llumnix (the ``llumnix`` policy: freeness with
high-priority headroom, migration, priorities) whose dispatch knows each
instance's cached prefix of the request (DispatchRequest.hits).

What it computes per candidate instance, with ``hit`` = the blocks of the
prompt it holds (base.hit_blocks) and its block size ``bs``:

- demand: the prompt's blocks net of the hit, ``blocks_for(prompt) - hit``;
- freeness after placing it: ``fit_key`` over ``llumnix_dispatch_terms``
  (every queued request's demand in the usage, itself in the batch, reserved
  blocks and headroom as Algorithm 1) with that demand;
- prefill cost in tokens: the missed tokens ``prompt - hit * bs`` plus the
  instance's queued prefill tokens (freeness.queued_prefill_tokens: waiting
  demand net of hits plus unreported dispatches, in tokens, plus what
  running requests have left of prompts computed in chunks).

The key, larger is better: where the request fits and leaves freeness of at
least ``ROOMY`` (the default migrate-out threshold: the instance would not
become a migration source by taking it), ``(2, -prefill cost, freeness)``:
the least prefill work before its first token, then the freest. Where it
fits but leaves less, ``(1, freeness, -prefill cost)``; where it fits
nowhere ``(0, -shortfall, -prefill cost)``; terminating ``(-1, ...)``. Ties
go to the lowest id. So with no hit and no queue anywhere it is ``llumnix``'s
choice; a cached prefix wins unless the holder's queued prefill is longer
than the prefix saves, or it is short of memory. Memory balance beyond that
is left to migration: the same rescheduling loop, thresholds and freeness
as ``llumnix``, but each source is paired with the destination where the
request it would move first is cheapest to move (its blocks net of the
prefix held there, which the destination links instead of receiving;
``pairs_by_move_cost``), of equal costs the freest.
"""

from libs.common.policies.base import DispatchRequest, InstanceView, Policy, best_of, blocks_for, fit_key, hit_blocks
from libs.common.policies.freeness import llumnix_dispatch_terms, llumnix_freeness, queued_prefill_tokens

ROOMY = 10.0  # Policy.migrate_out_threshold's default


def fit_and_cost(v: InstanceView, req: DispatchRequest) -> tuple[int, float, int]:
    """(tier, freeness or shortfall, prefill cost) of placing ``req`` at ``v``:
    fit_key over llumnix_dispatch_terms with the demand net of the hit, and
    the missed plus queued prefill tokens; tier -1 where it is terminating."""
    t = llumnix_dispatch_terms(v)
    if t.terminating:
        return (-1, 0.0, 0)
    bs = max(1, v.status.block_size)
    hit = hit_blocks(v, req)
    tier, value = fit_key(t.total, t.usage + blocks_for(req.num_prompt_tokens, bs) - hit, t.batch)
    return tier, value, req.num_prompt_tokens - hit * bs + queued_prefill_tokens(v)


def prefix_key(v: InstanceView, req: DispatchRequest) -> tuple:
    tier, value, cost = fit_and_cost(v, req)
    if tier == -1:
        return (-1, 0.0, 0.0)
    if tier == 1 and value >= ROOMY:
        return (2, -cost, value)
    return (tier, value, -cost)


def select(cands: list[InstanceView], req: DispatchRequest) -> InstanceView:
    return best_of(cands, lambda v: prefix_key(v, req))


POLICY = Policy("llumnix-prefix", "llumnix whose dispatch counts each instance's cached prefix (demand net of "
                "the hit; least missed + queued prefill tokens where roomy); migration; priorities",
                score=None, select=select, uses_prefix=True, migrates=True, uses_priorities=True,
                migration_freeness=llumnix_freeness, pairs_by_move_cost=True)
