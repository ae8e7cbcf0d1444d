"""llumnix-move: llumnix-keep whose rescheduler moves programs' kept blocks
instead of letting admission evict them (issue 53, "move instead of
evict"). This project's design; none of the peers can do it (they pin idle
KV where it is, as Continuum, or drop it and recompute).

Everything of llumnix-keep (keep by expected return, program dispatch,
migration) and, every rescheduling round, cache moves
(libs/common/policies/cache_moves.py): an instance whose queue and pending
dispatches would take the plain free blocks it has left (less a floor) moves
programs' kept blocks, the programs worth least first (those its keep would
evict first), to the instance with the most room, on the migration
protocol with no request attached (services/instance/migration/
cache_move.py: pre-allocate, the blocks, commit; the destination links what
it holds already). The blocks join the destination's cache, kept for the
program; at the source they become plain cache, the first evicted there
(freeing them at once made returning turns recompute more: docs/results/sim/
agentic.md). The prefix index takes the destination's events, and the
program's next turn goes to an instance holding its history (llumnix-keep's
home rule). Not here: a host-memory tier as a second destination."""

from dataclasses import replace

from libs.common.policies import llumnix_keep

POLICY = replace(llumnix_keep.POLICY, name="llumnix-move",
                 summary="llumnix-keep, and programs' kept blocks move to an instance with room (a cache move, no "
                         "request attached) before admission would evict them; the next turn follows them",
                 moves_kept=True)
