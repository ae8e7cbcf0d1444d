"""High-priority headroom from a step-time profile (Llumnix §4.4.1): the
memory that keeps a high-priority request decoding at its ideal speed, that
is, without interference from the requests batched with it.

With a step time of ``base + per_seq * batch + per_kv_token * kv_tokens``
(services/instance/engine/sim.py), a high-priority request alone on an
instance decodes at ``ideal = base + per_seq`` per token. Other requests
holding K tokens of KV in sequences of about ``seq_tokens`` tokens add
``K * (per_seq / seq_tokens + per_kv_token)``. "Ideal speed" allows
``slowdown`` of ``ideal`` (10%: a step time the profile cannot tell from a
lone request's within its own error), so the others may hold at most
``K* = slowdown * ideal / (per_seq / seq_tokens + per_kv_token)`` tokens and
the headroom is the rest of the instance's KV blocks. Algorithm 1 shares it
among the instance's high-priority requests; load balancing then moves
normal requests away until the others' usage is back under K*."""

from __future__ import annotations

import math

SLOWDOWN = 0.10  # the step-time increase still counted as the ideal speed
SEQ_TOKENS = 512  # typical tokens of a co-running sequence (prompt + output so far)


def ideal_speed_headroom(num_blocks: int, block_size: int, decode_base_ms: float, decode_ms_per_seq: float,
                         decode_ms_per_kv_token: float, slowdown: float = SLOWDOWN,
                         seq_tokens: int = SEQ_TOKENS) -> int:
    ideal = decode_base_ms + decode_ms_per_seq
    per_token = decode_ms_per_seq / max(1, seq_tokens) + decode_ms_per_kv_token
    if per_token <= 0:
        return 0  # the others cost nothing: no headroom needed
    others_blocks = math.floor(slowdown * ideal / per_token / max(1, block_size))
    return max(0, num_blocks - others_blocks)


def profile_headroom(profile, num_blocks: int | None = None) -> int:
    """ideal_speed_headroom for a SimProfile-like object (block_size,
    num_blocks, decode_base_ms, decode_ms_per_seq, decode_ms_per_kv_token);
    0 for None (an engine without a step-time profile)."""
    if profile is None:
        return 0
    return ideal_speed_headroom(num_blocks or profile.num_blocks, profile.block_size, profile.decode_base_ms,
                                profile.decode_ms_per_seq, profile.decode_ms_per_kv_token)
