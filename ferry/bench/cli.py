"""``ferry bench …``: benchmarks are commands that print a table and write JSON."""

from __future__ import annotations

import click

from ferry.cli import LazyGroup


@click.group(
    cls=LazyGroup,
    lazy={
        # --- benchmarks: keep one line per command, sorted ---
        "autoscale": "ferry.bench.autoscale:autoscale",
        "chaos": "ferry.bench.chaos:chaos",
        "compare": "ferry.bench.compare:compare",
        "control-plane": "ferry.bench.control_plane:control_plane",
        "engine": "ferry.bench.engine:engine",
        "failover": "ferry.bench.failover:failover",
        "features": "ferry.bench.features:features",
        "handoff": "ferry.bench.handoff:handoff",
        "handoff-modes": "ferry.bench.handoff_modes:handoff_modes",
        "migration": "ferry.bench.migration:migration",
        "migration-local": "ferry.bench.migration_local:migration_local",
        "overhead": "ferry.bench.overhead:overhead",
        "rolling-restart": "ferry.bench.rolling:rolling_restart",
        "prefix": "ferry.bench.prefix:prefix",
        "serving": "ferry.bench.serving:serving",
        "storm": "ferry.bench.storm:storm",
        "vllm": "ferry.bench.vllm_serve:vllm_bench",
    },
)
def bench() -> None:
    """Benchmarks (each prints a table and writes JSON with --json)."""
