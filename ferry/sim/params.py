"""The simulator's model parameters that the live services do not have: how
long the control plane's messages take, and what a migration's KV transfer
costs. Intervals and thresholds (status-report rate limit and heartbeat,
rescheduling interval, migration stages and limits, auto-scaling) are NOT
here: the simulator reads them from the live services' own configs
(InstanceConfig, SchedulerConfig), so the same flags set both.

Defaults were measured on the live cluster of this repository on this 2-core
machine (docs/results/LOG.md, "Simulator calibration"):
- `ferry sim calibrate` (16 sim instances of llama-7b-a10, M-M at 17/s,
  600 requests, llumnix): idle, a one-token request's frontend TTFT exceeds
  the profile's step by 4.2 ms (p50); under the load, Dispatch round trips
  take 2.1 ms and an instance's GetStatus 1.6 ms (p50). dispatch + generate +
  token = 2.2 ms of frontend work + the two round trips (6.0 ms in all);
- a report reaches the scheduler's view 2.5 ms after the instance wrote it
  (p50; a view polled every millisecond on a one-instance cluster);
- an engine-thread call returns to the event loop in 0.07 ms (p50 round
  trip of EngineRunner.call on an idle engine, 0.1 ms p90).
The KV transfer models the paper's testbed through the sim profile.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from services.instance.engine.sim import SimProfile


@dataclass(frozen=True)
class Delays:
    """One-way delays of the control plane, in seconds of model time."""

    # Frontend receives a request -> the scheduler's Dispatch picks an instance
    # (frontend work and half a Dispatch round trip).
    dispatch_s: float = 0.0033
    # The scheduler's pick -> the instance's Generate handler queues the request
    # (half a Dispatch and half an instance round trip).
    generate_s: float = 0.0019
    # An engine step ends -> its token reaches the frontend (TTFT, e2e end).
    token_s: float = 0.0008
    # An instance writes a status report -> the scheduler's view holds it
    # (instance -> meta store -> watch stream).
    report_s: float = 0.0025
    # One gRPC round trip between agents (pre-allocate, commit, abort, the
    # migrate-out order and its reply).
    rpc_s: float = 0.0016
    # A call run on the engine thread at a step boundary -> the agent's
    # event loop resumes (call_soon_threadsafe).
    hop_s: float = 0.0001
    # Auto-scaling: a launch -> the new instance registers and reports. Not
    # measured here: set it for the modelled system (weights loading).
    launch_s: float = 10.0

    def scaled(self, factor: float) -> Delays:
        """Every delay times ``factor`` (e.g. 1/K under --sim-slowdown K: the
        live delays are wall time and do not scale with the profile)."""
        return Delays(*(getattr(self, f) * factor for f in self.__dataclass_fields__))


@dataclass(frozen=True)
class TransferModel:
    """KV transfer of a migration stage: bytes / bandwidth + per-stage cost.

    From the sim profile: ``kv_bytes_per_token`` (what one token's KV weighs
    in the modelled model) and ``migration_bandwidth_gbps`` (the modelled
    link). A profile without them models the live sim engine, whose KV holds
    token ids (float32 K and V: 8 bytes per token) moved over loopback gRPC."""

    bytes_per_block: int
    bandwidth_bytes_per_s: float
    stage_overhead_s: float = 0.0

    @classmethod
    def from_profile(cls, profile: SimProfile, stage_overhead_s: float = 0.0) -> TransferModel:
        return cls(profile.kv_bytes_per_token * profile.block_size, profile.migration_bandwidth_gbps * 1e9 / 8,
                   stage_overhead_s)

    def seconds(self, blocks: int) -> float:
        if blocks <= 0:
            return 0.0
        return self.stage_overhead_s + blocks * self.bytes_per_block / self.bandwidth_bytes_per_s

    def with_(self, **kw) -> TransferModel:
        return replace(self, **kw)
