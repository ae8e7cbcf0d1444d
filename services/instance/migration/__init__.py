"""Live migration of running requests (DESIGN §6)."""

from services.instance.migration.manager import MigrationManager

__all__ = ["MigrationManager"]
