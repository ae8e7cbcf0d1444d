"""KV transfer between a CUDA cache and host bytes off the compute stream.

Live migration copies a request's KV blocks while the engine keeps stepping
(the pre-copy stages), on another thread (``asyncio.to_thread`` at the source
and the destination). The plain path, ``index_select(...).cpu()``, runs on
the calling thread's current stream, which is the default stream the engine
computes on: the gather queues behind the step in flight, and the copy to
pageable host memory is synchronous and slow (an extra bounce buffer in the
driver). Here instead:

- every copy runs on a side stream of its own (one per engine), so it
  overlaps the engine's kernels; the device-to-host and host-to-device
  copies go through the GPU's copy engines;
- the blocks are gathered on the device into one contiguous buffer (the
  fused transfer layout, ``[n, layers, 2, block, kv_heads, head_dim]``) and
  moved in one copy to page-locked (pinned) host memory. The pinned buffers
  come from torch's host caching allocator, so a chunk's staging buffer is
  reused by a later chunk once its bytes have gone (the caller drops the
  memoryview), instead of registering new memory each time;
- ordering: the engine records an event on its stream after every step
  (``step_done``); a copy first waits on it, so it never reads a block a
  step still writes (a prefill chunk's step does not synchronize with the
  host: only sampling does) nor writes blocks the last step may still read.
  A scatter returns once its copy is complete, so the request installed
  after it (on the engine thread) reads the new blocks.

Several threads may gather or scatter at once: the copies queue on the one
side stream in the order they are issued, and each call waits on its own
event only.
"""

from __future__ import annotations

import numpy as np
import torch


class CudaKvStaging:
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._step_done: torch.cuda.Event | None = None

    def step_done(self) -> None:
        """Engine thread, after a step's kernels were queued: later copies wait for them."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self._step_done = ev

    def _wait_for_steps(self) -> None:
        ev = self._step_done
        if ev is not None:
            self.stream.wait_event(ev)

    def _index(self, rows: list[int] | torch.Tensor) -> torch.Tensor:
        """Row indices (host) on the device, copied on the side stream (pinned: asynchronous)."""
        if not isinstance(rows, torch.Tensor):
            rows = torch.tensor(rows, dtype=torch.long)
        return rows.pin_memory().to(self.device, non_blocking=True)

    def gather(self, source: torch.Tensor, rows: list[int] | torch.Tensor, now: bool = False) -> memoryview:
        """The rows ``rows`` of ``source`` (dim 0), in that order, as host
        bytes (a pinned buffer that lives as long as the memoryview).
        ``now``: on the engine thread mid-step, after what it queued so far
        (a layer's KV for a per-layer handoff), not only after the last step."""
        after = None
        if now:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self._wait_for_steps()
            if after is not None:
                self.stream.wait_event(after)
            packed = source.index_select(0, self._index(rows))
            host = torch.empty(packed.numel() * packed.element_size(), dtype=torch.uint8, pin_memory=True)
            host.copy_(packed.view(-1).view(torch.uint8), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()
        return memoryview(host.numpy()).cast("B")

    def scatter(self, target: torch.Tensor, rows: list[int] | torch.Tensor, data: bytes | memoryview) -> None:
        """Write host bytes ``data`` (``len(rows)`` rows of ``target``'s
        shape past dim 0) into those rows; returns once they are written."""
        raw = np.frombuffer(data, dtype=np.uint8)
        host = torch.empty(raw.size, dtype=torch.uint8, pin_memory=True)
        host.numpy()[:] = raw  # one memcpy into page-locked memory: the upload is then asynchronous
        n = len(rows)
        with torch.cuda.stream(self.stream):
            self._wait_for_steps()
            dev = host.to(self.device, non_blocking=True).view(target.dtype).view((n,) + tuple(target.shape[1:]))
            target.index_copy_(0, self._index(rows), dev)
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()
