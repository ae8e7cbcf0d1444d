"""Ferry's out-of-tree vLLM KV connector: what live migration needs from an
unmodified vLLM, through the extension point vLLM made for moving KV
(``KVConnectorBase_V1``, loaded with ``--kv-transfer-config
'{"kv_connector": "FerryMigrationConnector", "kv_connector_module_path":
"services.instance.engine.vllm.connector", "kv_role": "kv_both"}'``).

vLLM builds one instance per role. The scheduler-side one
- sees every request arrive (``on_new_request``) and holds the scheduler's
  own ``KVCacheManager`` (``bind_kv_cache_manager``), so it can say which
  blocks a request owns and how many of its tokens have KV;
- keeps a suspended request's blocks: the engine aborts the request and
  ``request_finished`` answers "free later" for it; the blocks go back when
  the worker reports the request as finished sending (after a commit, or
  after they were copied into the request's resumed incarnation);
- reserves blocks for an incoming migration straight from vLLM's block pool;
- answers ``get_num_new_matched_tokens`` for a request installed with KV
  (its computed tokens are "external"), and at ``update_state_after_alloc``
  plans the copy from the staging blocks into the blocks vLLM gave it.
The worker-side one holds the KV tensors (``register_kv_caches``), copies
planned blocks in ``start_load_kv`` before the forward that reads them, and
gathers/scatters blocks for the transfer (kv_views.KvViews).

The engine (engine.py) finds both instances through ``REGISTRY`` under the
``engine_id`` of its kv_transfer_config: vLLM runs in the agent's process
(in-process engine core, uni-process executor), so they are plain objects.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from services.instance.engine.vllm.kv_views import KvViews, UnsupportedLayout

# engine_id -> {"scheduler": connector, "worker": connector}
REGISTRY: dict[str, dict[str, FerryMigrationConnector]] = {}
LOAD_KEY = "ferry_load"  # key in a request's kv_transfer_params naming its pending load


@dataclass
class StepMeta(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    copies: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (src, dst) block ids
    release: list[str] = field(default_factory=list)  # held requests whose blocks may go


@dataclass
class PendingLoad:
    """KV waiting in staging blocks for a request added with these tokens."""

    src_blocks: list[int]  # staging block ids, in order, cdiv(num_computed, block_size) of them
    num_computed_tokens: int
    reserved: list[Any] = field(default_factory=list)  # KVCacheBlocks taken from the pool (destination)
    held_id: str | None = None  # or: a suspended incarnation whose held blocks are the staging


class FerryMigrationConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.engine_id = vllm_config.kv_transfer_config.engine_id
        self.block_size = vllm_config.cache_config.block_size
        self.lock = threading.Lock()
        # scheduler side
        self.live: dict[str, Any] = {}  # internal id -> vLLM Request (scheduler's object)
        self.hold_ids: set[str] = set()  # abort these with their blocks kept
        self.held: dict[str, list[int]] = {}  # internal id -> blocks kept after its abort
        self.pending: dict[str, PendingLoad] = {}  # load key -> load
        self.reserved: dict[int, Any] = {}  # block id -> KVCacheBlock held for an incoming migration
        self._copies: list[tuple[list[int], list[int]]] = []
        self._release: list[str] = []
        # Staging blocks go back to the pool one schedule after the step that
        # copied them (an empty step's connector output never reaches
        # update_connector_output, so freeing cannot wait for it).
        self._retiring: list[Any] = []  # copied by the step being scheduled
        self._copied: list[Any] = []  # copied by the step that just ran
        # worker side
        self.views: KvViews | None = None
        self.layout_error = ""
        REGISTRY.setdefault(self.engine_id, {})["scheduler" if role == KVConnectorRole.SCHEDULER
                                                else "worker"] = self

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # nothing is handed off at a request's natural end

    # ==== worker side ===================================================================
    def register_kv_caches(self, kv_caches: dict) -> None:
        spec = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec
        try:
            self.views = KvViews(kv_caches, _backend_name(self._vllm_config, kv_caches), spec.num_kv_heads,
                                 spec.head_size, spec.block_size)
        except UnsupportedLayout as e:
            self.layout_error = str(e)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, StepMeta) or not meta.copies:
            return
        for src, dst in meta.copies:
            self.views.copy(src, dst)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]):
        meta = self._connector_metadata
        if isinstance(meta, StepMeta) and meta.release:
            return set(meta.release), None
        return None, None

    # ==== scheduler side ================================================================
    def on_new_request(self, request) -> None:
        self.live[request.request_id] = request

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        load = self._load_of(request)
        if load is None:
            return 0, False
        return max(0, load.num_computed_tokens - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        key = (request.kv_transfer_params or {}).get(LOAD_KEY)
        load = self.pending.pop(key, None) if key else None
        if load is None:
            return
        if num_external_tokens:
            dst = blocks.get_block_ids()[0]
            first = (load.num_computed_tokens - num_external_tokens) // self.block_size  # local prefix hit
            n = -(-load.num_computed_tokens // self.block_size)
            self._copies.append((load.src_blocks[first:n], list(dst[first:n])))
        self._retire(load)

    def build_connector_meta(self, scheduler_output) -> StepMeta:
        if self._copied:  # the step that copied them has run
            self._kv_cache_manager.block_pool.free_blocks(self._copied)
        self._copied, self._retiring = self._retiring, []
        meta = StepMeta(self._copies, self._release)
        self._copies, self._release = [], []
        return meta

    def update_connector_output(self, connector_output) -> None:
        for rid in connector_output.finished_sending or ():
            self.held.pop(rid, None)

    def request_finished(self, request, block_ids: list[int]):
        rid = request.request_id
        self.live.pop(rid, None)
        key = (request.kv_transfer_params or {}).get(LOAD_KEY)
        if key and key in self.pending:  # ended before its load ran: drop the staging
            self._retire(self.pending.pop(key))
        if rid in self.hold_ids:
            self.hold_ids.discard(rid)
            self.held[rid] = list(block_ids)
            return True, None
        return False, None

    def has_pending_push_work(self) -> bool:
        return bool(self._copies or self._release or self._retiring or self._copied)

    # ==== called by the engine (engine thread, between steps) ===========================
    def block_ids(self, request_id: str) -> list[int]:
        if request_id in self.held:
            return list(self.held[request_id])
        return list(self._kv_cache_manager.get_block_ids(request_id)[0])

    def reserve(self, n: int, keep_free: int) -> list[int] | None:
        pool = self._kv_cache_manager.block_pool
        if pool.get_num_free_blocks() - n < keep_free:
            return None
        blocks = pool.get_new_blocks(n)
        for b in blocks:
            self.reserved[b.block_id] = b
        return [b.block_id for b in blocks]

    def release_reserved(self, block_ids: list[int]) -> None:
        blocks = [self.reserved.pop(b) for b in block_ids if b in self.reserved]
        if blocks:
            self._kv_cache_manager.block_pool.free_blocks(blocks)

    def expect_load(self, key: str, load: PendingLoad) -> None:
        """The request added with kv_transfer_params {LOAD_KEY: key} has its
        first ``num_computed_tokens`` tokens' KV in ``load.src_blocks``."""
        if load.reserved:
            for b in load.reserved:
                self.reserved.pop(b.block_id, None)
        self.pending[key] = load

    def release_held(self, request_id: str) -> None:
        """Give the blocks of a suspended (aborted, held) request back to vLLM at the next step."""
        if request_id in self.held and request_id not in self._release:
            self._release.append(request_id)

    def _load_of(self, request) -> PendingLoad | None:
        key = (request.kv_transfer_params or {}).get(LOAD_KEY)
        return self.pending.get(key) if key else None

    def _retire(self, load: PendingLoad) -> None:
        """After the step that copies (or skips) a load, its staging goes."""
        if load.reserved:
            self._retiring.extend(load.reserved)
        if load.held_id:
            self.release_held(load.held_id)


def _backend_name(vllm_config, kv_caches: dict) -> str:
    """The attention backend of the first KV layer, as vLLM names it."""
    ctx = vllm_config.compilation_config.static_forward_context
    for name in kv_caches:
        layer = ctx.get(name)
        backend = getattr(layer, "attn_backend", None) if layer is not None else None
        if backend is None and layer is not None and hasattr(layer, "get_attn_backend"):
            backend = layer.get_attn_backend()
        if backend is not None:
            return backend.get_name()
    return "unknown"
