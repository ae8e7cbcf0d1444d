"""Pipelined execution across instances (KunServe, paper 002 §4): an instance
that dropped some layers serves its requests with a peer that holds them.

Each request stays with its owner, the instance it was dispatched to: the
owner schedules it (continuous batching, preemption, sampling, its RNG),
embeds its tokens and samples its next token. For each step the owner runs
the layers it holds and hands the step's hidden states to the peer that holds
the next range of layers, which runs them over the KV it keeps for those
layers and hands the hidden states back. A *guest* is the peer's record of
such a request: blocks from the peer's own pool, for the layers the peer
runs. Guests are released when the request finishes, is preempted (its
recompute starts over) or leaves the owner.

The contract between them (``LayerPeer``):

- ``forward_layers(layers, chunks, hidden, attend)``: ``hidden`` is ``[T, hidden]``,
  the rows of ``chunks`` in order (``num_new`` rows each, positions ``start``
  onwards); the peer returns the same rows after ``layers``. A chunk with
  ``kv_at_owner`` has its KV of these layers still at the owner (the live
  exchange below): the peer computes its queries, keys and values and calls
  ``attend(layer, q, k, v)`` (model.Attend) for those rows, in chunk order;
  the owner runs that attention over its own cache and returns the output.
- ``release(request_ids)``: forget those guests (free their blocks).
- ``fetch_kv(layers, request_id, num_tokens, layer_bytes)``: a guest's KV of
  those layers (whole blocks, layer-major; ``layer_bytes`` a layer, for a
  transport that sends it in pieces), for its owner taking it back when the
  pipeline ends (``NativeEngine.leave_pipeline``).
- ``push_kv(layers, request_id, num_tokens, data)``: the inverse, when the
  owner enters a pipeline with requests running (``enter_pipeline``).

The live KV exchange (paper §4.3): an owner that enters a pipeline with
requests running does not stop them while their KV of the peer's layers moves.
Their chunks go with ``kv_at_owner`` (remote attention) until the owner has
pushed that request's KV, a few requests between each two steps
(``NativeEngine.step``); the push travels on the same ordered stream as the
steps, so the peer has it before the first step that attends there.

``LocalPeer`` calls another engine in this process (tests, benchmarks); a
gRPC peer is the same contract between instance agents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from services.instance.engine.native.model import Attend


@dataclass(frozen=True)
class GuestChunk:
    """One request's part of a pipelined step, as its owner scheduled it."""

    request_id: str
    start: int  # tokens with KV before this step
    num_new: int  # tokens whose KV this step computes
    kv_at_owner: bool = False  # its KV of the peer's layers is still at the owner: remote attention


class LayerPeer(Protocol):
    def forward_layers(self, layers: range, chunks: list[GuestChunk], hidden: torch.Tensor,
                       attend: Attend | None = None) -> torch.Tensor: ...

    def release(self, request_ids: list[str]) -> None: ...

    def fetch_kv(self, layers: range, request_id: str, num_tokens: int,
                 layer_bytes: int = 0) -> bytes | memoryview: ...

    def push_kv(self, layers: range, request_id: str, num_tokens: int, data: bytes | memoryview) -> None: ...


class LocalPeer:
    """A peer engine in this process. ``calls`` counts the forwards it ran."""

    def __init__(self, engine):
        self.engine = engine
        self.calls = 0

    def forward_layers(self, layers: range, chunks: list[GuestChunk], hidden: torch.Tensor,
                       attend: Attend | None = None) -> torch.Tensor:
        self.calls += 1
        return self.engine.forward_guest(layers, chunks, hidden, attend)

    def release(self, request_ids: list[str]) -> None:
        self.engine.release_guests(request_ids)

    def fetch_kv(self, layers: range, request_id: str, num_tokens: int, layer_bytes: int = 0) -> memoryview:
        return self.engine.guest_kv(request_id, layers, num_tokens)

    def push_kv(self, layers: range, request_id: str, num_tokens: int, data: bytes | memoryview) -> None:
        self.engine.adopt_guest_kv(request_id, layers, num_tokens, data)


def plan_segments(num_layers: int, own: range, peers: list[tuple[range, LayerPeer]]):
    """[(layers, peer or None for this instance)] in layer order, covering
    0..num_layers-1 exactly once; ValueError otherwise."""
    segs = sorted([(own, None)] + list(peers), key=lambda s: s[0].start)
    at = 0
    for layers, _ in segs:
        if layers.step != 1 or len(layers) == 0:
            raise ValueError(f"a layer range must be contiguous and non-empty, got {layers}")
        if layers.start != at:
            raise ValueError(f"layers {at}..{layers.start - 1} have no holder" if layers.start > at
                             else f"layer {layers.start} has two holders")
        at = layers.stop
    if at != num_layers:
        raise ValueError(f"layers {at}..{num_layers - 1} have no holder" if at < num_layers
                         else f"{at} layers for a {num_layers}-layer model")
    return segs
