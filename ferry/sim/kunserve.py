"""KunServe on the simulated cluster (issue 20; paper 002, §4): under memory
throttling, instances drop parameter layers into buddy groups that serve as
a pipeline, and restore them when the pressure ends.

The controller is the scheduler's live one: ``KunServeLoop``
(services/scheduler/kunserve.py, its tick, forecast, planning, forming and
restoring over the Instance RPCs), running on the cluster's SimLoop
(ferry/sim/aio.py) with the SimScheduler as its view (``views()``,
``address()``), the kernel's clock, and for each instance a ``SimPipeline``,
the InstanceClient (libs/common/instance_client.py) of a simulated instance
(ferry/sim/control.py ``SimClient``) with the simulator's execution model of
the instance side of KunServe (services/instance/kunserve.py ``PipelineHost``):

- **drop_layers** (§4.1, §4.3): the member's KV pool grows by the dropped
  layers' parameter memory at its next step boundary (``grow_blocks``
  through the instance's engine runner, ``SimRunner``). ``prepare`` does
  nothing; ``hold`` is not modelled (the member steps on until it enters).
- **set_pipeline, entering** (§4.2): the member's steps run as a pipeline
  stage. Its micro-batches pass through all k stages; ideally a group of k
  serves the union of its members' batches with the same compute, so a
  step takes what its own batch takes, plus k-1 activation hops (``hop_ms``);
  what a real pipeline loses (bubbles, smaller kernels, communication) is
  ``pipeline_overhead`` (default 0.2: the throughput the paper measured a
  static pipeline to lose against replication, 12.6-21.8%, §5.1). While
  (k-1)/k of the running requests' KV moves to the peers (the largest
  member's share over the profile's link), steps run ``1 +
  remote_attention_overhead`` times slower (remote attention).
- **restore_layers** (§4.2): the pool shrinks back by those layers' blocks
  (blocks in use are retired as they are freed: the call waits until they
  are), then the parameters come back over ``reload_gbps``.
- **set_pipeline, leaving** (own = every layer, no peers): the remote share of
  the KV comes back over ``reload_gbps``, then the member steps alone again.

Each call also pays half a round trip each way (``Delays.rpc_s``).

The static pipeline baseline (the paper's "Llumnix (pipeline)",
``static_group_size``): the same loop's ``form()`` makes groups of that size
before the first request; its tick loop is never started, so nothing
restores them (and nothing else forms).

A group throttled again merges with another as the live loop decides
(``KunServeLoop.merge_throttled``, Algorithm 1 going on merging): each member
drops more layers (its pool grows again) and sets the merged group's stages;
that ``set_pipeline`` is charged as an entry, (k-1)/k of each member's KV
over the link with remote attention meanwhile (the KV that really moves in a
merge is less: what leaves a member's old range). What the live loop does
not do, the simulator does not either: members are restored one after the
other, each taking its layers, then its KV back, while the loop's next tick
waits.

Simplifications, each on the side of the pipeline's cost:
- A member's requests are charged to its own pool: the group's memory is not
  pooled across members (in KunServe each request's KV is spread over the
  stages). The dispatcher balances new requests over members by freeness.
- The pool shrinks by a count of blocks, whichever ids come free: in a real
  engine, the live restore moves KV off the memory the parameters return
  to; its transfer is charged to the restore time.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass

from ferry.sim.control import SimClient
from ferry.sim.instance import SimInstance
from libs.common.policies.kunserve import buddy_group
from libs.common.types import LayerChange
from services.scheduler.kunserve import KunServeConfig, KunServeLoop


@dataclass(frozen=True)
class KunServeParams:
    # The live loop's (KunServeConfig)
    interval_s: float = 0.1  # the monitor's period (the scheduler's rescheduling interval)
    window_s: float = 1.0  # samples the forecast fits
    horizon_s: float = 1.0  # §4.3: drop when throttling is predicted within one second
    restore_margin: float = 0.2  # restore once each member's requirement fits (1 - this) of its own memory
    min_group_s: float = 5.0  # and the group is at least this old (no drop/restore flapping)
    max_group_size: int | None = None
    # The simulated instances' (SimPipeline)
    hop_ms: float = 0.05  # activations of a micro-batch from one stage to the next
    pipeline_overhead: float = 0.2  # step time x (1 + this) in a group (paper §5.1: 12.6-21.8% less throughput)
    remote_attention_overhead: float = 0.5  # step time x (1 + this) while the KV exchange is under way
    reload_gbps: float = 200.0  # parameters and the remote KV back: host memory or a peer over RDMA
    static_group_size: int = 0  # > 1: the static pipeline baseline (groups from the start, never restored)

    def validate(self) -> None:
        for name in ("interval_s", "window_s", "horizon_s", "reload_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if min(self.hop_ms, self.remote_attention_overhead, self.pipeline_overhead) < 0 or not 0 <= self.restore_margin < 1:
            raise ValueError(f"invalid KunServe parameters {self}")
        if self.static_group_size == 1 or self.static_group_size < 0:
            raise ValueError(f"static_group_size must be 0 (off) or at least 2, got {self.static_group_size}")

    def config(self, num_layers: int, layer_blocks: int) -> KunServeConfig:
        """The live loop's configuration."""
        return KunServeConfig(num_layers, layer_blocks, interval_s=self.interval_s, window_s=self.window_s,
                              horizon_s=self.horizon_s, restore_margin=self.restore_margin,
                              min_group_s=self.min_group_s, max_group_size=self.max_group_size)


def layer_blocks(profile) -> int:
    """One layer's parameter memory in whole KV blocks (rounded down: a
    drop never lends more than it frees)."""
    if profile.param_bytes <= 0 or profile.num_layers <= 0:
        raise ValueError(f"profile {profile.name!r} has no param_bytes/num_layers: KunServe needs both")
    per_block = profile.kv_bytes_per_token * profile.block_size
    return int(profile.param_bytes / profile.num_layers // per_block)


class SimPipeline(SimClient):
    """One simulated instance's client, its KunServe calls run by the
    execution model of the module doc on the SimInstance."""

    def __init__(self, ks: "KunServe", inst: SimInstance):
        super().__init__(ks.c, inst.instance_id)
        self.ks, self.inst = ks, inst
        self.runner = inst.runner  # the agent's (SimInstance.serve)
        self.size = 1  # the group's members, this one included (1: alone)
        self.stages: tuple[range, list] | None = None  # (own, peers) set last, None alone
        self.exchange_until = 0.0

    def _event(self, event: str, **kw) -> None:
        self.ks.member_log.append({"t": self.ks.k.now - self.ks.c.t0, "member": self.inst.instance_id,
                                   "event": event, **kw})

    async def _call(self, name: str, fn, *args):
        try:
            await self._hop()
            reply = await fn(*args)
            await self._hop()
            return reply
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the live loop logs and goes on: the run reports it
            self.ks.errors.append(f"{self.inst.instance_id} {name}: {e!r}")
            raise

    async def drop_layers(self, layers: range, hold: bool = False, prepare: bool = False) -> LayerChange:
        return await self._call("drop_layers", self._drop, layers, prepare)

    async def set_pipeline(self, own: range, peers=(), pause_exchange: bool = False, hold: bool = False) -> int:
        return await self._call("set_pipeline", self._set_pipeline, own, list(peers))

    async def restore_layers(self, layers: range, from_address: str) -> LayerChange:
        return await self._call("restore_layers", self._restore, layers)

    # --- the model --------------------------------------------------------------------------
    def _blocks(self, layers: range) -> int:
        return len(layers) * self.ks.layer_blocks

    async def _drop(self, layers: range, prepare: bool) -> LayerChange:
        pool = self.inst.engine.pool
        if prepare:
            return LayerChange(0, pool.capacity)
        n = self._blocks(layers)
        total = await self.runner.call(self.inst.engine.grow_blocks, n)
        self.ks.lent += n
        self._event("drop", blocks=n)
        return LayerChange(n, total)

    async def _set_pipeline(self, own: range, peers: list[tuple[range, str]]) -> int:
        moved = len(self.inst.engine.requests)
        if peers and self.stages == (own, peers):
            return 0  # the stages it runs (a merge's last round ends the hold): nothing moves
        self.stages = (own, peers) if peers else None
        if peers:
            members = [self.inst] + [self.ks.c.instances[address] for _, address in peers]
            exchange_s = self.ks.exchange_s(members)
            self._event("enter", size=len(members), exchange_s=exchange_s)
            await self.runner.call(self._enter, len(members), exchange_s)
            return moved
        if own != range(self.ks.num_layers):
            raise ValueError(f"set_pipeline alone with layers {own.start}-{own.stop} of {self.ks.num_layers}")
        k = self.size
        back_s = self.inst.engine.pool.num_used * (k - 1) / k * self.ks.bytes_per_block / self.ks.reload_bytes_per_s
        await asyncio.sleep(back_s)  # the remote KV back, while the member steps on in the pipeline
        await self.runner.call(self._leave)
        self._event("leave", kv_back_s=back_s)
        return moved if k > 1 else 0

    def _enter(self, size: int, exchange_s: float) -> None:
        """Between steps: the member's steps run as a pipeline stage."""
        self.size, self.exchange_until = size, self.ks.k.now + exchange_s
        self.inst.executor.stretch = self._stretch
        self.inst.poke()

    def _leave(self) -> None:
        self.size = 1
        self.inst.executor.stretch = None
        self.inst.poke()

    def _stretch(self, ms: float) -> float:
        """A member's step as a pipeline stage: its own batch's time, the
        pipeline's overhead, the activation hops; slower while the KV
        exchange runs (remote attention)."""
        p = self.ks.p
        out = ms * (1.0 + p.pipeline_overhead) + (self.size - 1) * p.hop_ms
        if self.ks.k.now < self.exchange_until:
            out *= 1.0 + p.remote_attention_overhead
        return out

    async def _restore(self, layers: range) -> LayerChange:
        n = self._blocks(layers)
        pool = self.inst.engine.pool
        await self.runner.call(pool.shrink, n)
        while pool.shrinking:  # blocks in use are retired as their requests free them
            await asyncio.sleep(self.ks.p.interval_s)
        reload_s = n * self.ks.bytes_per_block / self.ks.reload_bytes_per_s
        await asyncio.sleep(reload_s)
        self.ks.lent -= n
        self._event("restore", blocks=n, reload_s=reload_s)
        return LayerChange(n, pool.capacity)


class KunServe:
    """The live KunServeLoop on one simulated cluster (see the module doc)."""

    def __init__(self, cluster, params: KunServeParams):
        params.validate()
        self.c = cluster
        self.k = cluster.k
        self.p = params
        self.profile = cluster.profile
        self.layer_blocks = layer_blocks(self.profile)
        self.num_layers = self.profile.num_layers
        self.bytes_per_block = self.profile.kv_bytes_per_token * self.profile.block_size
        self.reload_bytes_per_s = params.reload_gbps * 1e9 / 8
        self.pipelines: dict[str, SimPipeline] = {}
        self.member_log: list[dict] = []  # what the members did, one by one
        self.errors: list[str] = []  # KunServe calls that failed (none on a sound run)
        self.lent = 0  # blocks lent by dropped layers now
        self.static = bool(params.static_group_size)
        with cluster.loop.running():
            self.loop = KunServeLoop(cluster.scheduler, params.config(self.num_layers, self.layer_blocks),
                                     clients=self, clock=lambda: self.k.now)
            if self.static:
                cluster.loop.create_task(self._static_groups())
            else:
                self.loop.start()

    def __call__(self, instance_id: str, address: str) -> SimPipeline:
        """The loop's instance clients (libs/common/instance_client.InstanceClients)."""
        if instance_id not in self.pipelines:
            self.pipelines[instance_id] = SimPipeline(self, self.c.instances[instance_id])
        return self.pipelines[instance_id]

    def forget(self, instance_id: str) -> None:
        self.pipelines.pop(instance_id, None)

    async def _static_groups(self) -> None:
        """Groups of ``static_group_size`` in instance order, formed by the
        live loop's ``form`` and never restored (its tick loop never runs)."""
        ids = sorted(self.c.instances)
        k = self.p.static_group_size
        for i in range(0, len(ids) - k + 1, k):
            members = ids[i:i + k]
            await self.loop.form(buddy_group(members, self.num_layers, self.layer_blocks),
                                 {m: self.c.instances[m].engine.pool.capacity for m in members})

    # --- the execution model's costs -------------------------------------------------------------
    def exchange_s(self, members: list[SimInstance]) -> float:
        """(k-1)/k of each member's KV goes to the members now holding those
        layers; every member sends and receives at once over its own link."""
        k = len(members)
        link = self.c.migration.transfer.bandwidth_bytes_per_s
        return max(inst.engine.pool.num_used * self.bytes_per_block * (k - 1) / k / link for inst in members)

    # --- results -------------------------------------------------------------------------------
    def summary(self) -> dict:
        """From the live loop's log (its wall-clock timings left out: the same
        options give the same summary) and the members'."""
        t0 = self.c.t0
        log = [{"t": e["t"] - t0, "event": e["event"], "members": e["members"],
                **{k: e[k] for k in ("groups", "freed_blocks") if k in e}} for e in self.loop.log]
        drops = [e for e in log if e["event"] == "drop"]
        merges = [e for e in log if e["event"] == "merge"]
        restores = [e for e in log if e["event"] == "restore"]
        formed: dict[str, float] = {}
        pipelined = 0.0
        for e in log:
            key = "+".join(e["members"])
            if e["event"] == "restore":
                pipelined += len(e["members"]) * (e["t"] - formed.pop(key))
                continue
            for old in e.get("groups", ()):  # a merge ends the two groups it joins
                pipelined += len(old) * (e["t"] - formed.pop("+".join(old)))
            formed[key] = e["t"]
        now = self.k.now - t0
        pipelined += sum(len(key.split("+")) * (now - t) for key, t in formed.items())
        return {"layer_blocks": self.layer_blocks, "param_blocks": self.layer_blocks * self.num_layers,
                # ticks that formed groups (the static baseline's are formed before any tick)
                "drops": 0 if self.static else len({e["t"] for e in drops}),
                "groups_formed": len(drops), "merges": len(merges), "restores": len(restores),
                "freed_blocks": sum(e["freed_blocks"] for e in drops + merges), "lent_blocks_at_end": self.lent,
                "groups_at_end": len(self.loop._live_groups()), "pipelined_instance_s": pipelined,
                "errors": self.errors, "params": asdict(self.p), "log": log, "member_log": self.member_log}
