"""A simulated cluster's machine pools (Splitwise): how many instances of
which role run on which profile. ``ROLE:PROFILE:COUNT``, e.g.
``prefill:llama2-70b-h100:2,decode:llama2-70b-a100:3``. Without pools, a
cluster is ``--instances`` mixed instances of ``--profile`` (as before)."""

from __future__ import annotations

from dataclasses import dataclass

from libs.common.types import Role
from services.instance.engine.base import EngineError
from services.instance.engine.sim import SimProfile


class PoolError(ValueError):
    """A bad pool spec; the message says what is accepted."""


@dataclass(frozen=True)
class Pool:
    role: Role
    profile: str
    count: int

    @property
    def spec(self) -> str:
        return f"{self.role.value}:{self.profile}:{self.count}"


def parse_pool(spec: str) -> Pool:
    parts = spec.strip().split(":")
    if len(parts) != 3:
        raise PoolError(f"use ROLE:PROFILE:COUNT (e.g. prefill:llama2-70b-h100:2), got {spec!r}")
    role, profile, count = parts
    try:
        r = Role.parse(role)
        n = int(count)
    except ValueError as e:
        raise PoolError(f"{spec!r}: {e}") from None
    if n < 0:
        raise PoolError(f"{spec!r}: count must be >= 0")
    try:
        SimProfile.load(profile)
    except EngineError as e:
        raise PoolError(str(e)) from None
    return Pool(r, profile, n)


def parse_pools(specs: str | tuple[str, ...] | list[str]) -> tuple[Pool, ...]:
    """Pools from "a,b" or a sequence of specs; pools of 0 are left out."""
    if isinstance(specs, str):
        specs = [s for s in specs.split(",") if s.strip()]
    pools = tuple(p for p in (parse_pool(s) for s in specs) if p.count)
    if specs and not pools:
        raise PoolError("every pool is empty")
    return pools
