"""The migration protocol's messages as plain dataclasses (docs/design.md §6). The
state machines speak these; protobuf stays at the gRPC edge (grpc_peer.py,
and the servicer in manager.py)."""

from __future__ import annotations

from dataclasses import dataclass

from services.instance.engine.base import KvLayout
from services.instance.engine.shared_kv import KvShare


class MigrationAborted(Exception):
    """A migration cannot go on; the source aborts it (the request stays)."""


class PeerError(MigrationAborted):
    """The destination could not be reached or failed a call."""


@dataclass(frozen=True)
class MigrationConfig:
    max_stages: int = 4
    last_stage_max_blocks: int = 2
    chunk_bytes: int = 4 << 20
    max_migrate_out: int = 1
    max_migrate_in: int = 2
    deadline_ms: int = 3000
    rpc_timeout_s: float = 10.0
    # Most migrations out of this instance to one destination at once.
    max_migrate_out_per_dest: int = 2
    # Pre-copy stages (the request still decodes here) copy in smaller chunks
    # and spend at most this fraction of wall time copying (gather + send),
    # so that the source's decode steps barely slow down; the last stage (the
    # request suspended) runs at full speed.
    copy_duty: float = 0.25
    precopy_chunk_bytes: int = 1 << 20
    # Splitwise handoffs into this instance at once (counted apart from
    # max_migrate_in: a burst of prompts finishing together hands off together).
    max_handoff_in: int = 16
    # Prompts at least this long are planned as per-layer handoffs
    # (phases.handoff_mode); 0: every handoff is serialized.
    handoff_per_layer_threshold: int = 0
    # After the last stage's pre-allocation the destination starts no step
    # for up to this long, unless the commit (or an abort) comes first: the
    # request then joins the very next step instead of waiting for the end of
    # one that began meanwhile (up to a whole step of downtime). The cost: a
    # pause of at most this long in the destination's other requests, once
    # per migration in. 0: off.
    join_hold_ms: float = 20.0
    # Before the suspend, tell the destination when the commit should come
    # (this engine's next step boundary plus the recent suspend -> commit
    # acknowledgement), so that it holds the boundary before that time
    # instead of starting a step the request would wait for (at most half a
    # step either way: EngineRunner.expect). Needs join_hold_ms > 0 there.
    join_notice: bool = True
    # Same-host transfer through the source's shared KV cache (engine/shared_kv.py):
    # the source offers it at the first pre-allocation, the destination maps it
    # if it can, and the stages then send block ids, not bytes.
    shared_kv: bool = True
    # Prefix-aware migration: the first pre-allocation asks the destination to
    # link the request's first blocks that its prefix cache holds already
    # (the longest held prefix of the block hashes); only the rest is sent.
    link_cached: bool = True
    # When the destination mapped the source's shared cache, the last stage
    # (its block ids) rides on the commit: after the suspend one round trip
    # instead of three (the last pre-allocation, its transfer, the commit).
    fuse_last_stage: bool = True


@dataclass(frozen=True)
class PreAllocate:
    migration_id: str
    request_id: str
    stage: int
    num_blocks: int
    layout: KvLayout
    deadline_ms: int
    source_instance_id: str
    spare_blocks: int = 0
    handoff: bool = False  # a prefill->decode handoff, not a load-balancing migration
    last: bool = False  # the last stage: the request is suspended at the source
    kv_share: KvShare | None = None  # the source's shared KV cache, offered (shared_kv.py)
    # The prefix-cache hashes of the request's full blocks (first stage): the
    # destination says which it holds (Admission.held).
    block_hashes: tuple[int, ...] = ()
    # With block_hashes: the destination links the longest prefix of them its
    # cache holds (Admission.linked) and this stage's num_blocks counts from
    # the request's first block, the linked ones included: it reserves the rest.
    link: bool = False
    # A cache move (cache_move.py): this program's kept blocks, no request
    # attached; ``block_hashes`` are theirs and ``link`` applies as above.
    program_id: str = ""


@dataclass(frozen=True)
class Admission:
    """The destination's answer to a pre-allocation."""

    accepted: bool
    reason: str = ""
    # It mapped the source's shared KV cache (PreAllocate.kv_share): chunks
    # may name source blocks (KvChunk.src_blocks) instead of carrying bytes.
    kv_shared: bool = False
    # Those of PreAllocate.block_hashes its prefix cache holds now.
    held: tuple[int, ...] = ()
    # PreAllocate.link: the request's first blocks linked from its cache (not sent).
    linked: int = 0


@dataclass(frozen=True)
class KvChunk:
    """Part of one stage's fused KV buffer, ``offset`` bytes into it. With
    ``layer`` set (per-layer transfer), part of that one layer's buffer
    ``[stage blocks, 2, block_size, kv_heads, head_dim]`` instead; empty data
    only renews the reservation. With ``src_blocks`` (the destination mapped
    the source's shared cache), no data: the blocks of the source's cache that
    hold these bytes of the stage, for the destination to copy itself. A
    stage takes one kind of chunk."""

    migration_id: str
    stage: int
    offset: int
    data: bytes | memoryview
    num_blocks: int = 0  # blocks in the whole stage
    total_bytes: int = 0
    layer: int | None = None
    src_blocks: tuple[int, ...] = ()


@dataclass(frozen=True)
class LastStage:
    """The last stage carried by the commit (MigrationConfig.fuse_last_stage):
    source blocks of its shared KV cache, in order, for the destination to
    copy into its reservation before it installs the request."""

    stage: int
    src_blocks: tuple[int, ...]
