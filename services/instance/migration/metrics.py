"""Per-migration metrics of an instance (exported on its --metrics-port)."""

from prometheus_client import Counter, Histogram

MIGRATIONS = Counter("ferry_migrations_total", "Migrations by side and outcome", ["side", "outcome"])
STAGES = Histogram("ferry_migration_stages", "Copy stages per migration (last included)",
                   buckets=(1, 2, 3, 4, 5, 6, 8, 12))
BLOCKS = Counter("ferry_migration_blocks_total", "KV blocks sent by migrations")
BYTES = Counter("ferry_migration_bytes_total", "KV bytes sent by migrations")
DURATION = Histogram("ferry_migration_duration_seconds", "Migration duration (select to done/abort)",
                     buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
DOWNTIME = Histogram("ferry_migration_downtime_seconds", "Suspend to commit acknowledged",
                     buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1))
