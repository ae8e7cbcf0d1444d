"""The prefix-cache metrics under vLLM's names, read from the latest stats."""

from __future__ import annotations

from prometheus_client import generate_latest

from libs.common.types import PrefixCacheStats
from services.instance import prefix_metrics


def test_counters_carry_vllms_names_and_the_latest_values():
    stats = {"now": PrefixCacheStats(True, 3, 300, 128, 2, 10, 4)}
    prefix_metrics.export(lambda: stats["now"], instance="i-1")
    text = generate_latest().decode()
    assert 'vllm:prefix_cache_queries_total{instance="i-1"} 300.0' in text
    assert 'vllm:prefix_cache_hits_total{instance="i-1"} 128.0' in text
    assert 'ferry_prefix_cache_blocks{instance="i-1"} 10.0' in text
    stats["now"] = PrefixCacheStats(True, 4, 400, 200, 2, 11, 5)
    assert 'vllm:prefix_cache_hits_total{instance="i-1"} 200.0' in generate_latest().decode()
