"""The scheduler's dispatch index: a policy whose score is a fit key over
per-instance terms (``Policy.dispatch_terms``: llumnix, llumnix_base) scores
every instance at once over arrays, and only the rows of instances that
changed since the last dispatch are recomputed in Python.

Dispatcher.choose over a list of views costs O(N) Python calls per
placement (and the list itself another O(N)); at 1,000 instances and 500
dispatches a second that alone is more than a core (ferry bench
control-plane). Here a placement costs O(changed rows) Python + O(N) numpy.

NOTE: the same choice as ``Dispatcher.choose`` over the same views: the same
terms (the policy's function), the same arithmetic in the same order on
float64, the same candidates (schedulable and not excluded, else any not
excluded), ties to the lowest id (tests/common/test_dispatch_index.py checks
it on random clusters)."""

from __future__ import annotations

import bisect

import numpy as np

from libs.common.policies.base import DispatchRequest, InstanceView, Policy
from libs.common.types import Role


class DispatchIndex:
    def __init__(self, policy: Policy):
        if policy.dispatch_terms is None:
            raise ValueError(f"policy {policy.name} has no dispatch terms")
        self.terms = policy.dispatch_terms
        self.ids: list[str] = []  # sorted: the lowest id is the first index
        self._pos: dict[str, int] = {}
        self._rows = 0
        self._cap = 0
        self._alloc(64)
        self.split = 0  # rows whose instance is not mixed (Splitwise: the index does not place those)

    def _alloc(self, cap: int) -> None:
        def grow(a, dtype):
            b = np.zeros(cap, dtype=dtype)
            if a is not None:
                b[:self._rows] = a[:self._rows]
            return b
        old = self._cap > 0
        self.terminating = grow(self.terminating if old else None, bool)
        self.schedulable = grow(self.schedulable if old else None, bool)
        self.total = grow(self.total if old else None, np.float64)
        self.usage = grow(self.usage if old else None, np.float64)
        self.batch = grow(self.batch if old else None, np.float64)
        self.block_size = grow(self.block_size if old else None, np.int64)
        self.mixed = grow(self.mixed if old else None, bool)
        self._cap = cap

    def __len__(self) -> int:
        return self._rows

    # --- rows -----------------------------------------------------------------------
    def update(self, instance_id: str, view: InstanceView | None) -> None:
        """The instance's row from its view (None: it is gone)."""
        if view is None:
            self._remove(instance_id)
            return
        i = self._pos.get(instance_id)
        if i is None:
            i = self._insert(instance_id)
        t = self.terms(view)
        was_mixed = self.mixed[i]
        self.terminating[i] = t.terminating
        self.schedulable[i] = view.schedulable
        self.total[i] = t.total
        self.usage[i] = t.usage
        self.batch[i] = max(1, t.batch)
        self.block_size[i] = max(1, view.status.block_size)
        self.mixed[i] = view.status.role is Role.MIXED
        self.split += int(was_mixed) - int(self.mixed[i])

    def _insert(self, instance_id: str) -> int:
        if self._rows == self._cap:
            self._alloc(self._cap * 2)
        i = bisect.bisect_left(self.ids, instance_id)
        n = self._rows
        for a in self._arrays():
            a[i + 1:n + 1] = a[i:n].copy()
        self.ids.insert(i, instance_id)
        self._rows += 1
        self.mixed[i] = True  # counted as mixed until its row is set
        self._pos = {iid: k for k, iid in enumerate(self.ids)}
        return i

    def _remove(self, instance_id: str) -> None:
        i = self._pos.get(instance_id)
        if i is None:
            return
        self.split -= int(not self.mixed[i])
        n = self._rows
        for a in self._arrays():
            a[i:n - 1] = a[i + 1:n].copy()
        del self.ids[i]
        self._rows -= 1
        self._pos = {iid: k for k, iid in enumerate(self.ids)}

    def _arrays(self):
        return (self.terminating, self.schedulable, self.total, self.usage, self.batch, self.block_size,
                self.mixed)

    # --- the choice -------------------------------------------------------------------
    def choose(self, req: DispatchRequest) -> str | None:
        n = self._rows
        if n == 0:
            return None
        allowed = np.ones(n, dtype=bool)
        for iid in req.exclude:
            i = self._pos.get(iid)
            if i is not None:
                allowed[i] = False
        cand = allowed & self.schedulable[:n]
        if not cand.any():  # every instance terminating or excluded: better anywhere than nowhere
            cand = allowed
            if not cand.any():
                return None
        bs = self.block_size[:n]
        demand = -(-req.num_prompt_tokens // bs)
        room = self.total[:n] - (self.usage[:n] + demand)
        fits = room >= 0
        tier = np.where(self.terminating[:n], -1, fits.astype(np.int64))
        value = np.where(self.terminating[:n], 0.0, np.where(fits, room / self.batch[:n], room))
        # The fit_key order: tier first, then value; of equals the lowest id.
        tier = np.where(cand, tier, -2)
        best_tier = tier.max()
        value = np.where(tier == best_tier, value, -np.inf)
        best = int(np.argmax(value))
        if value[best] == -np.inf:  # every value -inf in the best tier: the first of that tier
            best = int(np.argmax(tier == best_tier))
        return self.ids[best]
