"""The policy registry: every scheduling policy is one module here defining
``POLICY`` (a Policy) and one line in ``_MODULES``. The scheduler, the
frontend's bypass, ``ferry up``, the benchmarks and the simulator read the
names and the Policy objects from here and nowhere else."""

from __future__ import annotations

from libs.common.policies import infaas, llumnix, llumnix_base, round_robin
from libs.common.policies.base import (
    Dispatcher,
    DispatchRequest,
    InstanceView,
    Policy,
    blocks_for,
    fit_key,
)

_MODULES = (round_robin, infaas, llumnix_base, llumnix)  # the order tables and CLIs list them in
POLICIES: dict[str, Policy] = {m.POLICY.name: m.POLICY for m in _MODULES}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


def get(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown dispatch policy {name!r}; supported: {', '.join(POLICY_NAMES)}") from None


__all__ = ["POLICIES", "POLICY_NAMES", "DispatchRequest", "Dispatcher", "InstanceView", "Policy", "blocks_for",
           "fit_key", "get"]
