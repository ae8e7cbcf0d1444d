"""The policy registry: every scheduling policy is one module here defining
``POLICY`` (a Policy) and one line in ``_MODULES``. The scheduler, the
frontend's bypass, ``ferry up``, the benchmarks and the simulator read the
names and the Policy objects from here and nowhere else."""

from __future__ import annotations

from libs.common.policies import (continuum, dynamo_kv, infaas, llmd_prefix, llumnix, llumnix_base, llumnix_keep,
                                  llumnix_move, llumnix_prefix, llumnix_v0, round_robin, sglang_cache_aware)
from libs.common.policies.base import (
    Dispatcher,
    DispatchRequest,
    InstanceView,
    Policy,
    blocks_for,
    demand_blocks,
    fit_key,
    hit_blocks,
)

# The order tables and CLIs list them in; the prefix-aware ones (Policy.uses_prefix) last.
_MODULES = (round_robin, infaas, llumnix_base, llumnix, llumnix_v0, llumnix_prefix, llmd_prefix, dynamo_kv,
            sglang_cache_aware, continuum, llumnix_keep, llumnix_move)
POLICIES: dict[str, Policy] = {m.POLICY.name: m.POLICY for m in _MODULES}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


def get(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown dispatch policy {name!r}; supported: {', '.join(POLICY_NAMES)}") from None


__all__ = ["POLICIES", "POLICY_NAMES", "DispatchRequest", "Dispatcher", "InstanceView", "Policy", "blocks_for",
           "demand_blocks", "fit_key", "get", "hit_blocks"]
