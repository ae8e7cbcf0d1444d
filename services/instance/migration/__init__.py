"""Live migration of running requests (docs/design.md §6)."""

from services.instance.migration.host import MigrationHost
from services.instance.migration.manager import MigrationManager
from services.instance.migration.messages import MigrationConfig

__all__ = ["MigrationConfig", "MigrationHost", "MigrationManager"]
