"""Migration metrics of an instance (exported on its --metrics-port).
NOTE: written only through MigrationCounters (the manager owns one)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from libs.common.types import Outcome

MIGRATIONS = Counter("ferry_migrations_total", "Migrations by side and outcome", ["side", "outcome"])
STAGES = Histogram("ferry_migration_stages", "Copy stages per migration (last included)",
                   buckets=(1, 2, 3, 4, 5, 6, 8, 12))
BLOCKS = Counter("ferry_migration_blocks_total", "KV blocks sent by migrations")
BYTES = Counter("ferry_migration_bytes_total", "KV bytes sent by migrations")
LINKED = Counter("ferry_migration_linked_blocks_total",
                 "KV blocks the destination linked from its prefix cache instead of receiving them")
DURATION = Histogram("ferry_migration_duration_seconds", "Migration duration (select to done/abort)",
                     buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
DOWNTIME = Histogram("ferry_migration_downtime_seconds", "Suspend to the first step on the destination",
                     buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1))
COMMIT_ACK = Histogram("ferry_migration_commit_ack_seconds", "Suspend to commit acknowledged",
                       buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1))
HANDOFFS = Counter("ferry_handoffs_total", "Splitwise prefill->decode handoffs (source side) by outcome",
                   ["outcome"])
HANDOFF_DOWNTIME = Histogram("ferry_handoff_downtime_seconds",
                             "Handoff: export at the prefill instance to the first step on the decode instance",
                             buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1))

CACHE_MOVES = Counter("ferry_cache_moves_total",
                      "Cache moves of programs' kept blocks (no request attached) by side and outcome",
                      ["side", "outcome"])
CACHE_MOVE_BLOCKS = Counter("ferry_cache_move_blocks_total", "KV blocks of programs' kept blocks moved out")


class MigrationCounters:
    """Counts of this instance's migrations, and the Prometheus export."""

    def __init__(self):
        self.committed_out = 0
        self.aborted_out = 0
        self.committed_in = 0
        self.handed_off = 0
        self.handoffs_aborted = 0
        # Of committed migrations and handoffs out: blocks sent, and blocks the
        # destination linked from its prefix cache instead.
        self.blocks_sent = 0
        self.blocks_linked = 0
        self.bytes_sent = 0
        # Cache moves (a program's kept blocks, no request): out committed / aborted, blocks moved out, in.
        self.cache_moved_out = 0
        self.cache_moves_aborted = 0
        self.cache_blocks_out = 0
        self.cache_moved_in = 0

    def cache_move_done(self, out: Outcome) -> None:
        """Counted apart from migrations: no request moved, no downtime."""
        if out.committed:
            self.cache_moved_out += 1
            self.cache_blocks_out += out.blocks + out.linked_blocks
            CACHE_MOVE_BLOCKS.inc(out.blocks + out.linked_blocks)
        else:
            self.cache_moves_aborted += 1
        CACHE_MOVES.labels("source", "committed" if out.committed else "aborted").inc()

    def cache_move_in(self) -> None:
        self.cache_moved_in += 1
        CACHE_MOVES.labels("destination", "committed").inc()

    def _sent(self, out: Outcome) -> None:
        BLOCKS.inc(out.blocks)
        BYTES.inc(out.bytes)
        LINKED.inc(out.linked_blocks)
        if out.committed:
            self.blocks_sent += out.blocks
            self.blocks_linked += out.linked_blocks
            self.bytes_sent += out.bytes

    def handoff_done(self, out: Outcome) -> None:
        """A handoff is not a load-balancing migration: counted apart."""
        if out.committed:
            self.handed_off += 1
        else:
            self.handoffs_aborted += 1
        HANDOFFS.labels("committed" if out.committed else "aborted").inc()
        self._sent(out)
        if out.committed and out.downtime_ms:
            HANDOFF_DOWNTIME.observe(out.downtime_ms / 1000)

    def source_done(self, out: Outcome) -> None:
        if out.committed:
            self.committed_out += 1
        else:
            self.aborted_out += 1
        MIGRATIONS.labels("source", "committed" if out.committed else "aborted").inc()
        STAGES.observe(out.stages)
        self._sent(out)
        DURATION.observe(out.duration_ms / 1000)
        if out.committed:
            COMMIT_ACK.observe(out.commit_ack_ms / 1000)
            if out.downtime_ms:
                DOWNTIME.observe(out.downtime_ms / 1000)

    def destination_committed(self) -> None:
        self.committed_in += 1
        MIGRATIONS.labels("destination", "committed").inc()
