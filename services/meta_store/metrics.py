"""The meta store's metrics (exported on its --metrics-port): instances
registered, watch streams open, instances expired by the TTL, status reports
taken."""

from __future__ import annotations

from prometheus_client import Counter
from prometheus_client.core import REGISTRY, GaugeMetricFamily

# Registered by export() only (every `ferry serve` process imports the meta store's options).
EXPIRED = Counter("ferry_meta_store_expired_total", "Instances removed because they stopped reporting (TTL)",
                  registry=None)


class RegistryCollector:
    def __init__(self, registry):
        self.registry = registry

    def describe(self):
        return []

    def collect(self):
        yield GaugeMetricFamily("ferry_meta_store_instances", "Instances registered",
                                value=len(self.registry.list()))
        yield GaugeMetricFamily("ferry_meta_store_watchers", "Watch streams open (schedulers, frontends)",
                                value=self.registry.watchers)


def export(registry) -> None:
    REGISTRY.register(EXPIRED)
    REGISTRY.register(RegistryCollector(registry))
