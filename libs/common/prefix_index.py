"""The cluster-wide prefix index: which instance holds which block hash,
kept exact from each instance's KV events (libs/common/kv_events.py). Pure:
the live scheduler feeds it from the instances' event streams
(libs/common/kv_index.py); a simulator can feed it from its engines.

Each instance's entries come from a snapshot, then from its batches in
order; a batch that does not follow the last one applied is refused (the
feeder resyncs from a new snapshot), so the index never silently drifts.
Bounded by the cluster's blocks: an instance holds at most its pool.
"""

from __future__ import annotations

from libs.common.kv_events import AllCleared, BlockRemoved, BlockStored, KvEventBatch, KvSnapshot
from libs.common.prefix_hash import BlockHash

_GONE = object()


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[BlockHash, set[str]] = {}
        self._held: dict[str, dict[BlockHash, BlockHash | None]] = {}
        self._seq: dict[str, int] = {}

    # --- feeding -----------------------------------------------------------------
    def reset(self, snapshot: KvSnapshot) -> None:
        """An instance's whole cache, at its batch ``snapshot.seq``."""
        iid = snapshot.instance_id
        self.remove(iid)
        self._held[iid] = dict(snapshot.blocks)
        self._seq[iid] = snapshot.seq
        for h in snapshot.blocks:
            self._holders.setdefault(h, set()).add(iid)

    def apply(self, batch: KvEventBatch) -> bool:
        """Apply the instance's next batch; False (nothing applied) when it is
        not the next one, or the instance has no snapshot here: resync."""
        iid = batch.instance_id
        if self._seq.get(iid) is None or batch.seq != self._seq[iid] + 1:
            return False
        held = self._held[iid]
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                parent = ev.parent
                for h in ev.block_hashes:
                    held[h] = parent
                    parent = h
                    self._holders.setdefault(h, set()).add(iid)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    if held.pop(h, _GONE) is not _GONE:
                        self._drop(h, iid)
            elif isinstance(ev, AllCleared):
                for h in held:
                    self._drop(h, iid)
                held.clear()
            else:
                raise TypeError(f"not a KV event: {ev!r}")
        self._seq[iid] = batch.seq
        return True

    def remove(self, instance_id: str) -> None:
        """Forget an instance (gone, or its stream broke: nothing stale stays)."""
        for h in self._held.pop(instance_id, {}):
            self._drop(h, instance_id)
        self._seq.pop(instance_id, None)

    def _drop(self, h: BlockHash, iid: str) -> None:
        s = self._holders.get(h)
        if s is not None:
            s.discard(iid)
            if not s:
                del self._holders[h]

    # --- queries -------------------------------------------------------------------
    def instances(self) -> list[str]:
        return sorted(self._held)

    def seq_of(self, instance_id: str) -> int | None:
        return self._seq.get(instance_id)

    def hashes_of(self, instance_id: str) -> set[BlockHash]:
        return set(self._held.get(instance_id, ()))

    def holders(self, h: BlockHash) -> frozenset[str]:
        return frozenset(self._holders.get(h, ()))

    @property
    def num_entries(self) -> int:
        """(instance, hash) pairs."""
        return sum(len(v) for v in self._held.values())

    def match(self, hashes: list[BlockHash]) -> dict[str, int]:
        """For every instance holding a prefix of ``hashes``: how many of its
        first blocks it holds (a chain hit stops at the first miss)."""
        out: dict[str, int] = {}
        live: set[str] | None = None
        for i, h in enumerate(hashes):
            have = self._holders.get(h)
            live = set(have or ()) if live is None else live & (have or set())
            if not live:
                break
            for iid in live:
                out[iid] = i + 1
        return out
