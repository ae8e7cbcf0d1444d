"""Freeness of an instance as the policies count it (Llumnix Algorithm 1 and
its baselines), from a reported status plus pending dispatches. Blocks
reserved for incoming migrations are in use: ``total - free_blocks`` counts
them, and so does the reported virtual usage (services/instance/status.py)."""

from __future__ import annotations

from libs.common.policies.base import FitTerms, InstanceView, fit_terms_key


def llumnix_freeness(v: InstanceView) -> float:
    """Reported freeness (Algorithm 1: physical usage, priority headroom, the
    head-of-line demand, reserved blocks) less pending dispatches. The
    rescheduling loop's view."""
    s = v.status
    usage = s.total_blocks - s.freeness * max(1, s.num_running) + v.pending_blocks
    return (s.total_blocks - usage) / max(1, s.num_running + v.pending_requests)


def base_freeness(v: InstanceView) -> float:
    """Freeness without priority headroom (llumnix_base): blocks in use or
    reserved plus the head-of-line demand, as Algorithm 1 counts them."""
    s = v.status
    if s.terminating:
        return float("-inf")
    usage = s.total_blocks - s.free_blocks + s.head_of_line_demand_blocks + v.pending_blocks
    return (s.total_blocks - usage) / max(1, s.num_running + v.pending_requests)


def llumnix_dispatch_terms(v: InstanceView) -> FitTerms:
    """What llumnix_dispatch_key needs of an instance, whatever the new
    request: every queued request counts (its demand in the usage, itself
    in the batch), not only the head of line. Migration needs only the head
    of line (what blocks admission now); dispatch must also see how long a
    queue the new request would join."""
    s = v.status
    usage = (s.total_blocks - s.freeness * max(1, s.num_running) - s.head_of_line_demand_blocks
             + s.waiting_demand_blocks + v.pending_blocks)
    return FitTerms(s.terminating, s.total_blocks, usage, s.num_running + s.num_waiting + v.pending_requests + 1)


def llumnix_dispatch_key(v: InstanceView, demand_blocks: int) -> tuple:
    """Where to place a new request of ``demand_blocks`` (fit_key over
    llumnix_dispatch_terms, the new request in the usage and the batch)."""
    return fit_terms_key(llumnix_dispatch_terms(v), demand_blocks)


def base_dispatch_terms(v: InstanceView) -> FitTerms:
    """llumnix_dispatch_terms without priority headroom (llumnix_base)."""
    s = v.status
    usage = s.total_blocks - s.free_blocks + s.waiting_demand_blocks + v.pending_blocks
    return FitTerms(s.terminating, s.total_blocks, usage, s.num_running + s.num_waiting + v.pending_requests + 1)


def base_dispatch_key(v: InstanceView, demand_blocks: int) -> tuple:
    """llumnix_dispatch_key without priority headroom (llumnix_base)."""
    return fit_terms_key(base_dispatch_terms(v), demand_blocks)


def memory_load(v: InstanceView) -> float:
    """INFaaS++ load: memory in use (or reserved) including queued demand, as a fraction."""
    s = v.status
    return (s.total_blocks - s.free_blocks + s.waiting_demand_blocks + v.pending_blocks) / max(1, s.total_blocks)


def queued_prefill_tokens(v: InstanceView) -> int:
    """Prompt tokens an instance has yet to compute before a new request's:
    its waiting requests' demand (reported net of their cached prefixes) and
    the dispatches not yet in a report, in tokens (blocks x block size), and
    what its running requests have left of prompts computed in chunks."""
    s = v.status
    return (s.waiting_demand_blocks + v.pending_blocks) * max(1, s.block_size) + s.running_prefill_tokens


def active_requests(v: InstanceView) -> int:
    """Requests an instance serves or queues, dispatches not yet reported included."""
    s = v.status
    return s.num_running + s.num_waiting + v.pending_requests
