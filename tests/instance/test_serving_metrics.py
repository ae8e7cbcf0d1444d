"""The instance's metrics under vLLM's names: state read from the latest load,
per-request histograms from the outputs of the steps (times carried by a
migration), exactly once per request."""

from __future__ import annotations

from prometheus_client import generate_latest

from libs.common.types import (
    FinishReason,
    PrefixCacheStats,
    Priority,
    RequestLoad,
    RequestPhase,
    RequestState,
    SamplingParams,
    TokenOutput,
)
from services.instance.engine.base import EngineLoad
from services.instance.serving_metrics import ServingMetrics
from tests.helpers import metric

L = {"model_name": "m", "engine": "0"}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _load(*reqs: tuple[str, RequestPhase], free: int = 30) -> EngineLoad:
    return EngineLoad(100, free, 16, tuple(RequestLoad(r, Priority.NORMAL, s, 1, 1) for r, s in reqs),
                      num_preemptions=2, prefix_cache=PrefixCacheStats(True, 3, 300, 128, 2, 10, 4))


def _hist(name: str, iid: str) -> tuple[float, float]:
    text = generate_latest().decode()
    labels = {**L, "instance_id": iid}
    return (metric(text, f"{name}_count", **labels), metric(text, f"{name}_sum", **labels))


def test_state_is_read_at_scrape_time_under_vllms_names():
    m = ServingMetrics("m", "i-state")
    now = {"load": _load(("a", RequestPhase.RUNNING), ("b", RequestPhase.WAITING), ("c", RequestPhase.WAITING))}
    m.export(lambda: now["load"], lambda: (1, 2))
    text = generate_latest().decode()
    labels = {**L, "instance_id": "i-state"}
    assert metric(text, "vllm:num_requests_running", **labels) == 1
    assert metric(text, "vllm:num_requests_waiting", **labels) == 2
    assert metric(text, "vllm:kv_cache_usage_perc", **labels) == 0.7
    assert metric(text, "vllm:num_preemptions_total", **labels) == 2
    assert metric(text, "vllm:prefix_cache_queries_total", **labels) == 300
    assert metric(text, "vllm:prefix_cache_hits_total", **labels) == 128
    assert metric(text, "ferry_prefix_cache_blocks", **labels) == 10
    assert metric(text, "ferry_migrations_in_flight_out", **labels) == 2
    now["load"] = _load(free=100)
    text = generate_latest().decode()
    assert metric(text, "vllm:kv_cache_usage_perc", **labels) == 0
    assert metric(text, "vllm:num_requests_running", **labels) == 0


def test_a_request_is_observed_once_from_arrival_to_its_finish_across_a_migration():
    clock = Clock()
    src, dst = ServingMetrics("m", "i-src", clock), ServingMetrics("m", "i-dst", clock)
    src.arrived("r", prompt_tokens=8, resumed_tokens=0)
    clock.t += 0.5
    src.on_step([], _load(("r", RequestPhase.RUNNING)))  # left the queue after 0.5 s
    clock.t += 0.25
    src.on_step([TokenOutput("r", 0, 7)], None)  # first token 0.75 s after arrival
    clock.t += 0.1
    src.on_step([TokenOutput("r", 1, 7)], None)
    src.left("r")  # moved on
    state = RequestState("r", [1] * 8, [7, 7], SamplingParams(), arrival_time=1000.0, first_token_time=1000.75)
    dst.committed_in(state)
    clock.t += 0.3
    dst.on_step([TokenOutput("r", 2, 7)], None)
    clock.t += 0.1
    dst.on_step([TokenOutput("r", 3, 7, FinishReason.LENGTH)], None)
    assert _hist("vllm:request_queue_time_seconds", "i-src") == (1, 0.5)
    assert _hist("vllm:time_to_first_token_seconds", "i-src") == (1, 0.75)
    assert _hist("vllm:time_to_first_token_seconds", "i-dst")[0] == 0  # produced elsewhere
    assert _hist("vllm:e2e_request_latency_seconds", "i-src")[0] == 0  # it did not finish there
    count, total = _hist("vllm:e2e_request_latency_seconds", "i-dst")
    assert count == 1 and abs(total - 1.25) < 1e-9  # from its arrival at the source
    count, total = _hist("vllm:request_time_per_output_token_seconds", "i-dst")
    assert count == 1 and abs(total - 0.5 / 3) < 1e-9  # three tokens after the first, in 0.5 s
    text = generate_latest().decode()
    assert metric(text, "vllm:request_success_total", **L, instance_id="i-dst", finished_reason="length") == 1
    assert metric(text, "vllm:generation_tokens_total", **L, instance_id="i-src") == 2
    assert metric(text, "vllm:prompt_tokens_total", **L, instance_id="i-src") == 8


def test_a_resumed_request_counts_its_recomputed_tokens_and_no_second_first_token():
    clock = Clock()
    m = ServingMetrics("m", "i-resumed", clock)
    m.arrived("r", prompt_tokens=8, resumed_tokens=4)
    clock.t += 0.2
    m.on_step([TokenOutput("r", 4, 7, FinishReason.STOP)], None)
    assert _hist("vllm:time_to_first_token_seconds", "i-resumed")[0] == 0
    assert _hist("vllm:e2e_request_latency_seconds", "i-resumed")[0] == 1
    text = generate_latest().decode()
    assert metric(text, "vllm:prompt_tokens_total", **L, instance_id="i-resumed") == 12
