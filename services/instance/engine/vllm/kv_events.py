"""vLLM's KV events in Ferry's terms: vLLM's own prefix cache publishes
BlockStored / BlockRemoved / AllBlocksCleared through its KV-event publisher
(``kv_events_config``, vLLM's ``EventPublisher`` interface); this publisher
takes them in process and renames every block by Ferry's hash
(libs/common/prefix_hash.py, recomputed from the stored event's token ids
and its parent's Ferry hash), so that the cluster's prefix index speaks one
hash whatever the engine.

vLLM's events are not a set's changes one for one: it keeps duplicate blocks
under one hash (a removal may leave the hash cached) and re-announces blocks a
request hits. So an event only says which hashes to look at; whether one is
held is read from vLLM's block pool, and Ferry's events say exactly when a
hash came and went. Extra hash keys (LoRA, multimodal, cache salt) are not
Ferry's: such blocks are named by their tokens alone.
"""

from __future__ import annotations

from libs.common.kv_events import AllCleared, BlockRemoved, BlockStored, KvEvent
from libs.common.prefix_hash import ROOT, hash_block


def publisher_class():
    """The publisher type, a subclass of vLLM's EventPublisher (imported late:
    vLLM is an optional extra)."""
    from vllm.distributed.kv_events import EventPublisher

    class FerryKvEventPublisher(EventPublisher):
        def __init__(self, data_parallel_rank: int = 0, **_):
            super().__init__(data_parallel_rank)
            self.pending: list = []
            self.recording = False  # from the first take (Engine.take_kv_events): nothing kept for nobody

        def publish(self, events) -> None:
            if self.recording:
                self.pending.extend(events.events)

        def shutdown(self) -> None:
            self.pending.clear()

    return FerryKvEventPublisher


class KvEventTranslator:
    """vLLM's hashes -> Ferry's, for the blocks vLLM's cache holds."""

    def __init__(self, pool, block_size: int):
        self.pool = pool  # vLLM's BlockPool (its hash map is read)
        self.block_size = block_size
        self.ferry_of: dict[bytes, int] = {}  # vLLM hash -> Ferry hash, of held blocks
        self.count: dict[int, int] = {}  # Ferry hash -> vLLM hashes naming it
        self.evictions = 0

    def held(self, vhash, group: int) -> bool:
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        if not isinstance(vhash, bytes):  # int hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES): the event says
            return True
        return self.pool.cached_block_hash_to_block.get_one_block(
            make_block_hash_with_group_id(vhash, group)) is not None

    def translate(self, events: list) -> list[KvEvent]:
        """vLLM events (one step's, in order) -> Ferry events."""
        from vllm.distributed.kv_events import AllBlocksCleared
        from vllm.distributed.kv_events import BlockRemoved as VRemoved
        from vllm.distributed.kv_events import BlockStored as VStored

        out: list[KvEvent] = []
        for ev in events:
            if isinstance(ev, VStored):
                self._stored(ev, out)
            elif isinstance(ev, VRemoved):
                gone = []
                for vh in ev.block_hashes:
                    if vh in self.ferry_of and not self.held(vh, ev.group_idx or 0):
                        fh = self._drop(vh)
                        if fh is not None:
                            gone.append(fh)
                if gone:
                    self.evictions += len(gone)
                    out.append(BlockRemoved(tuple(gone)))
            elif isinstance(ev, AllBlocksCleared):
                self.evictions += len(self.count)
                self.ferry_of.clear()
                self.count.clear()
                out.append(AllCleared())
        return out

    def _stored(self, ev, out: list[KvEvent]) -> None:
        bs = ev.block_size or self.block_size
        if ev.parent_block_hash is None:
            prev = None
        elif ev.parent_block_hash in self.ferry_of:
            prev = self.ferry_of[ev.parent_block_hash]
        else:
            return  # a chain whose head left meanwhile: nothing to name it by
        run: list[int] = []
        run_parent = None
        for i, vh in enumerate(ev.block_hashes):
            fh = hash_block(ROOT if prev is None else prev, ev.token_ids[i * bs:(i + 1) * bs])
            if vh not in self.ferry_of and self.held(vh, ev.group_idx or 0):
                self.ferry_of[vh] = fh
                self.count[fh] = self.count.get(fh, 0) + 1
                if self.count[fh] == 1:  # (two vLLM hashes name one Ferry block only with extra keys)
                    if not run:
                        run_parent = prev
                    run.append(fh)
            elif run:
                out.append(BlockStored(tuple(run), run_parent))
                run = []
            prev = fh
        if run:
            out.append(BlockStored(tuple(run), run_parent))

    def _drop(self, vh) -> int | None:
        """vLLM no longer holds ``vh``: its Ferry hash if nothing else names it."""
        fh = self.ferry_of.pop(vh)
        self.count[fh] -= 1
        if self.count[fh]:
            return None
        del self.count[fh]
        return fh

    def hashes(self) -> list[int]:
        return list(self.count)
