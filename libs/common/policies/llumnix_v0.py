"""llumnix-v0: the migration rules of Llumnix's first public release
(AlibabaPAI/llumnix, "Initial commit" 37d8e5e of 2024-07-06, on vLLM 0.4.2),
with its defaults (llumnix/arg_utils.py: load_metric "consumed_speed",
check_migrate_policy "prefill_constrained", migrate_out_threshold 3.0,
migrate_policy "LCFS", enable_prefill_migrate True). Each rule and where
the release has it:

- **The migration freeness** (llumnix/instance_info.py,
  MigrateLoadComputation, "consumed_speed" with prefill migration): the
  load is ``-(free blocks - watermark - the first waiting request's blocks)
  / (running + 1 if any request waits)``, and ``-inf`` with no request at
  all. Ferry counts the freeness, its negation: ``v0_freeness``. The
  watermark is vLLM's default, 1% of the blocks (vLLM 0.4.2 CacheConfig,
  ``watermark=0.01``; Ferry's engines keep the same, EngineConfig.watermark,
  but do not report it). No pending dispatches: the release counts none.
- **One threshold, -3, for sources and destinations**
  (global_scheduler/migration_scheduler.py, PrefillConstrained: sources have
  load > migrate_out_threshold = 3, destinations load < 3): freeness below
  -3 is a source, above -3 a destination.
- **Any instance with a preempted request waiting is a source**, and a
  destination has none (PrefillConstrained: ``num_killed_request > 0`` for
  sources, ``== 0`` for destinations; backends/vllm/scheduler.py
  ``_get_num_killed_request``: swapped requests and waiting ones that were
  preempted): Policy.preempted_sources, read from
  InstanceStatus.preempted_waiting.
- **Pairing without further constraints** (PrefillConstrained: "without any
  constrain in order to make prefill migrate happens as soon as possible"):
  the most loaded source with the least loaded destination, and so on; no
  queue or pending-dispatch condition on a destination
  (Policy.strict_destinations False).
- **One migration per pair** (llumlet/llumlet.py ``migrate_out``: one
  request, then the order returns): Policy.order_max_requests = 1.
- **The last running request moves first** (migrate_policy "LCFS":
  llumlet/local_migration_scheduler.py, backends/vllm/scheduler.py
  ``get_last_running_request``, the last of vLLM's running queue that is
  not prefilling): Policy.order_pick = "last_running"
  (libs/common/policies/migration.py).

Dispatch is llumnix_base's (freeness over all queued demand, no priorities;
the release had no priorities either). The release's dispatch counted no
pending dispatches: the scheduler's ``--no-dispatch-pending`` does the same
(a sensitivity flag, docs/results/sim/policies.md), as the instances'
``--prefill-first`` runs vLLM 0.4's scheduling. Not reproduced: it skipped a pair whose destination
was still migrating (Ferry leaves out busy sources and lets a destination
refuse); a destination with a queue refuses in Ferry (the instance's own
guard, libs/common/policies/migration.accepts_migration)."""

from __future__ import annotations

from libs.common.policies.base import InstanceView, Policy
from libs.common.policies.freeness import base_dispatch_key, base_dispatch_terms
from libs.common.policies.migration import LAST_RUNNING

THRESHOLD = -3.0  # the release's migrate_out_threshold (3.0) on the load, which is -freeness
WATERMARK = 0.01  # vLLM's block-manager watermark, a fraction of the blocks


def v0_freeness(v: InstanceView) -> float:
    """The release's migration load, negated: (free blocks - the watermark
    - the head of line's demand) / (running + 1 if a request waits); +inf
    with no request (load -inf), -inf while terminating."""
    s = v.status
    if s.terminating:
        return float("-inf")
    n = s.num_running + (1 if s.num_waiting else 0)
    if n == 0:
        return float("inf")
    watermark = int(WATERMARK * s.total_blocks)
    return (s.free_blocks - watermark - s.head_of_line_demand_blocks) / n


POLICY = Policy("llumnix-v0", "Llumnix's first release: freeness dispatch; migration at -3, LCFS, one per pair",
                score=base_dispatch_key, migrates=True, migration_freeness=v0_freeness,
                dispatch_terms=base_dispatch_terms,
                migrate_out_threshold=THRESHOLD, migrate_in_threshold=THRESHOLD,
                preempted_sources=True, strict_destinations=False,
                order_max_requests=1, order_pick=LAST_RUNNING)
