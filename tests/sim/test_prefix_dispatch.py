"""The simulator runs the prefix-aware policies with the hits the live
scheduler would pass (ferry/sim/scheduler.py ``prefix_hits``: each
instance's longest cached prefix, read from its engine), and they raise the
cluster's hit rate over prefix-blind llumnix on a multi-turn workload."""

import dataclasses
import types

from ferry.sim.run import Cluster, SimOptions, simulate
from ferry.measure import prefixes
from libs.common.prefix_hash import block_hashes

OPTS = SimOptions(instances=4, prefix="sessions:3", arrivals="poisson:2", num_requests=36, progress=False)


def hit_rate(policy: str) -> float:
    return simulate(OPTS, policy)["summary"]["prefix_cache"]["hit_rate"]


def test_prefix_policies_hit_more_than_llumnix_on_sessions():
    blind = hit_rate("llumnix")
    for policy in ("llumnix-prefix", "llmd-prefix", "dynamo-kv", "sglang-cache-aware"):
        assert hit_rate(policy) > blind + 0.2, policy


def test_the_hits_are_the_engines_longest_cached_prefix():
    work = prefixes.build(OPTS.arrivals, OPTS.lengths, OPTS.num_requests, OPTS.prefix, OPTS.seed, 1.0, 0.0, 4096)
    c = Cluster(OPTS, "llumnix-prefix", work)
    c.run()
    prompt = list(c.prompts[0]) + c.answers[0]  # the first turn and its answer: cached where it ran
    got = c.scheduler.prefix_hits(prompt)
    hashes = block_hashes(prompt, 16)
    assert got["prefix_blocks"] == len(hashes)
    for iid, inst in c.instances.items():
        assert got["hits"].get(iid, 0) == len(inst.engine.pool.lookup(hashes))
    assert max(got["hits"].values()) >= len(c.prompts[0]) // 16


def test_simulated_migrations_link_the_prefix_their_destination_holds():
    """Shared system prompts, overloaded: migrations move requests whose
    system prompt the destination holds, and send only the rest (the live
    protocol's linking on the simulated engines); no link is left when the
    run ends, and every engine's bookkeeping is consistent. Without linking
    (--no-migration-link-cached) every block is sent."""
    opts = SimOptions(instances=4, prefix="system:2:1024", arrivals="poisson:6", num_requests=400, progress=False)
    for policy in ("llumnix", "llumnix-prefix"):
        held = {}

        def keep(cluster):
            held["cluster"] = cluster
            return types.SimpleNamespace(summary=dict)

        out = simulate(opts, policy, extend=keep)
        c = held["cluster"]
        done = [o for o in c.scheduler.outcomes if o.committed]
        assert done and sum(o.linked_blocks for o in done) > sum(o.blocks for o in done) / 2, policy
        assert out["summary"]["migration_blocks"] == {"sent": sum(o.blocks for o in done),
                                                      "linked": sum(o.linked_blocks for o in done)}
        for inst in c.instances.values():
            assert inst.engine.pool.num_linked == 0
            inst.engine.check_integrity()
    off = simulate(dataclasses.replace(opts, instance_args=("--no-migration-link-cached",)), "llumnix")
    assert off["summary"]["migration_blocks"]["linked"] == 0 and off["summary"]["migration_blocks"]["sent"] > 0
