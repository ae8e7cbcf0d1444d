"""llmd-prefix: llm-d's inference scheduler with its precise prefix-cache
scorer configuration, as its public docs describe it: three scorers, each
in [0, 1], summed with weights prefix 2 : KV utilization 1 : queue 1, the
highest total wins.

- prefix: the fraction of the prompt's full blocks the instance holds (its
  longest cached prefix / the prompt's hashed blocks), from the KV-event
  index (llm-d's precise scorer also follows the engines' KV events);
- KV utilization: ``1 - used / total`` blocks, used = in use or reserved
  plus unreported dispatches' demand;
- queue: ``(max q - q) / (max q - min q)`` over the candidates, q = waiting
  requests plus unreported dispatches; 1 everywhere when all are equal.

Differs: llm-d breaks ties at random, here the lowest id wins; its KV
utilization and queue come from scraped engine metrics, here from the
instances' status reports (the same figures the other policies see). No
migration, every request at normal priority."""

from libs.common.policies.base import DispatchRequest, InstanceView, Policy, best_of

PREFIX_WEIGHT, KV_WEIGHT, QUEUE_WEIGHT = 2.0, 1.0, 1.0


def queue_depth(v: InstanceView) -> int:
    return v.status.num_waiting + v.pending_requests


def kv_utilization(v: InstanceView) -> float:
    s = v.status
    return min(1.0, max(0.0, (s.total_blocks - s.free_blocks + v.pending_blocks) / max(1, s.total_blocks)))


def prefix_fraction(v: InstanceView, req: DispatchRequest) -> float:
    if req.prefix_blocks <= 0:
        return 0.0
    return min(req.hits.get(v.instance_id, 0), req.prefix_blocks) / req.prefix_blocks


def scores(cands: list[InstanceView], req: DispatchRequest) -> dict[str, float]:
    qs = {v.instance_id: queue_depth(v) for v in cands}
    lo, hi = min(qs.values()), max(qs.values())
    out = {}
    for v in cands:
        queue = 1.0 if hi == lo else (hi - qs[v.instance_id]) / (hi - lo)
        out[v.instance_id] = (PREFIX_WEIGHT * prefix_fraction(v, req) + KV_WEIGHT * (1.0 - kv_utilization(v))
                              + QUEUE_WEIGHT * queue)
    return out


def select(cands: list[InstanceView], req: DispatchRequest) -> InstanceView:
    s = scores(cands, req)
    return best_of(cands, lambda v: (s[v.instance_id],))


POLICY = Policy("llmd-prefix", "llm-d: 2 x prefix-match fraction + 1 x free KV + 1 x queue score; no migration",
                score=None, select=select, uses_prefix=True)
