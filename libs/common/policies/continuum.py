"""continuum: TTL pinning of agent programs' KV between turns, after
Continuum (Li et al., "Continuum: Efficient and Robust Multi-Turn LLM Agent
Scheduling with KV Cache Time-to-Live", 2025), one of issue 53's baselines.

What it reproduces: when a turn of a program ends (the program named by the
client: prompt_cache_key / x-session-id), the instance keeps the program's
cached blocks pinned for a time-to-live: they cannot be evicted and count as
used, so the program's next turn finds its whole history where it left it,
at the price of memory that serves no one while the tool runs. The pin ends
at its TTL, when the next turn has taken the blocks, or when a newer turn
of the program ends (services/instance/engine/core/pins.py). Returning
turns are dispatched where their prefix is (llumnix-prefix's dispatch and
migration, unchanged: the pinned blocks are in the prefix index like any
cached block, and an instance's pinned blocks are not free to dispatch).

Where it differs from the paper: one fixed TTL (``TTL_S``, 30 s: twice the
agentic workload's mean tool latency, long enough for about 86% of its
exponential tool calls) instead of a TTL per tool type learned from the
observed tool durations; no program-level FCFS queue (turns are queued as
any request, by arrival and priority); no cap on pinned memory other than
the pool itself. In the simulator the policy sets the engines' TTL
(Policy.program_ttl_s); a live cluster's instances take ``--program-ttl-s``.
"""

from libs.common.policies.base import Policy
from libs.common.policies.freeness import llumnix_freeness
from libs.common.policies.llumnix_prefix import select

TTL_S = 30.0

POLICY = Policy("continuum", f"llumnix-prefix with Continuum's TTL pinning: a program's cached blocks are kept "
                f"pinned {TTL_S:g} s after each turn (instances' --program-ttl-s); migration; priorities",
                score=None, select=select, uses_prefix=True, migrates=True, uses_priorities=True,
                migration_freeness=llumnix_freeness, pairs_by_move_cost=True, program_ttl_s=TTL_S)
