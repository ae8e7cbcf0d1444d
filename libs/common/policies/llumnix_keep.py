"""llumnix-keep: llumnix-prefix whose instances keep agent programs' KV
between turns by expected return (issue 53's "Keep"; this project's, not a
peer's).

What it does: when a turn of a program ends (the program named by the
client: prompt_cache_key / x-session-id), the instance keeps the program's
cached blocks for the program's expected return
(services/instance/engine/core/pins.py, ProgramKeep). Unlike Continuum's
pins (the ``continuum`` policy) the kept blocks hold no reference: they stay
evictable, so no request ever waits for them; they are evicted only once no
plain cached block is left, and then by worth, not recency: first the
blocks of the program whose recompute cost per second until its expected
return is lowest (its tail first). A program's expected return is learned
from its own gaps between turns on that instance (an EWMA; 15 s before its
first gap), and the retention lasts three expected gaps, after which its
blocks are plain LRU cache. At most ``BUDGET`` of an instance's KV pool is
kept; kept free blocks are reported as held (not free) to dispatch, so new
programs go to instances with room while the instance's own admission can
still take them. Clients cannot hint the return (no request field carries
one). Dispatch and migration are llumnix-prefix's, unchanged: a returning
turn goes where its prefix is. In the simulator the policy sets the
engines' budget (Policy.program_keep); a live cluster's instances take
``--program-keep``.
"""

from libs.common.policies.base import Policy
from libs.common.policies.freeness import llumnix_freeness
from libs.common.policies.llumnix_prefix import select

BUDGET = 0.75

POLICY = Policy("llumnix-keep", f"llumnix-prefix whose instances keep programs' cached blocks between turns by "
                f"expected return (evictable, evicted by recompute cost over time to return; at most "
                f"{BUDGET:g} of the pool; instances' --program-keep); migration; priorities",
                score=None, select=select, uses_prefix=True, migrates=True, uses_priorities=True,
                migration_freeness=llumnix_freeness, pairs_by_move_cost=True, program_keep=BUDGET)
