"""dynamo-kv: Dynamo's KV router, as its public docs describe it: per
worker, ``cost = prefill_load_scale * potential prefill blocks + potential
decode blocks``, the lowest wins (router temperature 0: deterministic).

Here, per instance, in blocks of its size:
``prefill_load_scale * max(active prefill + prompt blocks - overlap, 0)
+ decode blocks`` with

- active prefill: freeness.queued_prefill_tokens / block size (waiting
  demand net of hits plus unreported dispatches, plus what running requests
  have left of prompts computed in chunks);
- prompt blocks: ``blocks_for(prompt tokens)``; overlap: the instance's
  longest cached prefix of the prompt (from the KV-event index, as Dynamo's
  KvIndexer);
- decode blocks: blocks in use or reserved plus unreported dispatches'
  demand, plus the request's own new blocks (prompt blocks - overlap): the
  "potential active blocks" of Dynamo's docs;
- ``prefill_load_scale`` = 1.0 (Dynamo's default overlap score weight).

Differs: Dynamo tracks active blocks and prefill tokens in the router per
request it routed; here they come from the instances' status reports plus
pending dispatches. A running request whose prompt is still being computed
in chunks is not counted as active prefill. Ties: the lowest id. No
migration, every request at normal priority."""

from libs.common.policies.base import DispatchRequest, InstanceView, Policy, best_of, blocks_for
from libs.common.policies.freeness import queued_prefill_tokens

PREFILL_LOAD_SCALE = 1.0


def cost(v: InstanceView, req: DispatchRequest) -> float:
    s = v.status
    bs = max(1, s.block_size)
    prompt_blocks = blocks_for(req.num_prompt_tokens, bs)
    overlap = min(req.hits.get(v.instance_id, 0), prompt_blocks)
    prefill = max(queued_prefill_tokens(v) / bs + prompt_blocks - overlap, 0.0)
    decode = s.total_blocks - s.free_blocks + v.pending_blocks + prompt_blocks - overlap
    return PREFILL_LOAD_SCALE * prefill + decode


def select(cands: list[InstanceView], req: DispatchRequest) -> InstanceView:
    return best_of(cands, lambda v: (-cost(v, req),))


POLICY = Policy("dynamo-kv", "Dynamo KV router: least prefill blocks (net of the cached overlap) + active blocks; "
                "no migration", score=None, select=select, uses_prefix=True)
