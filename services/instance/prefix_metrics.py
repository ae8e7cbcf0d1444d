"""Prefix-cache metrics of an instance (exported on its --metrics-port), under
the names users know from vLLM: ``vllm:prefix_cache_queries`` and
``vllm:prefix_cache_hits`` (counters, in tokens), plus Ferry's gauges of the
cache's size and its evictions.

Read at scrape time from the engine's latest published load (a custom
collector): the engine keeps the counters, nothing is counted twice here.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily

from libs.common.types import PrefixCacheStats


class PrefixCacheCollector:
    def __init__(self) -> None:
        self.source: Callable[[], PrefixCacheStats] | None = None
        self.labels: dict[str, str] = {}

    def describe(self):
        return []  # metrics are known only when collected (no source: none)

    def collect(self):
        if self.source is None:
            return
        s = self.source()
        names, values = list(self.labels), list(self.labels.values())

        def counter(name: str, doc: str, v: float):
            m = CounterMetricFamily(name, doc, labels=names)
            m.add_metric(values, v)
            return m

        def gauge(name: str, doc: str, v: float):
            m = GaugeMetricFamily(name, doc, labels=names)
            m.add_metric(values, v)
            return m

        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens (a request's tokens at its "
                      "admission)", s.queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens (its cached prefix)", s.hits)
        yield counter("ferry_prefix_cache_evictions", "Cached KV blocks whose content was evicted", s.evictions)
        yield gauge("ferry_prefix_cache_blocks", "KV blocks named in the prefix cache (in use or free)",
                    s.cached_blocks)
        yield gauge("ferry_prefix_cache_evictable_blocks", "Cached KV blocks no request uses (counted as free)",
                    s.evictable_blocks)


COLLECTOR = PrefixCacheCollector()
_registered = False


def export(source: Callable[[], PrefixCacheStats], **labels: str) -> PrefixCacheCollector:
    """Export this process's instance's prefix-cache stats (one instance per
    process; a later call replaces the source)."""
    global _registered
    COLLECTOR.source, COLLECTOR.labels = source, dict(labels)
    if not _registered:
        REGISTRY.register(COLLECTOR)
        _registered = True
    return COLLECTOR
