"""An instance's serving metrics (exported on its --metrics-port) under the
names autoscalers and gateways already read from vLLM, with vLLM's labels
(``model_name``, ``engine``) and Ferry's ``instance_id``:

- state, read at scrape time from the engine's latest published load (a
  custom collector; the engine keeps the counters, nothing is counted twice):
  ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (a fraction, as vLLM's), ``vllm:num_preemptions``,
  the prefix cache's ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``
  (in tokens) and Ferry's cache size, evictions, KV blocks and migrations in
  flight;
- per request, observed as its tokens come out of this instance's steps:
  ``vllm:time_to_first_token_seconds`` (on the instance that produced the
  first token), ``vllm:request_time_per_output_token_seconds`` and
  ``vllm:e2e_request_latency_seconds`` (on the instance where it finished,
  from its arrival wherever that was: a migration carries the times),
  ``vllm:request_queue_time_seconds``, ``vllm:prompt_tokens`` /
  ``vllm:generation_tokens`` and ``vllm:request_success`` by finish reason.

The agent tells ``ServingMetrics`` what happens to its requests (arrived,
migrated in, each step's outputs, left); one instance per process exports.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Counter, Histogram
from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily

from libs.common.types import RequestPhase, RequestState, TokenOutput
from services.instance.engine.base import EngineLoad

LABELS = ("model_name", "engine", "instance_id")
# vLLM's own buckets (vllm/v1/metrics/loggers.py), so that dashboards built for it read these alike.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)

TTFT = Histogram("vllm:time_to_first_token_seconds", "Time to first token (from the request's arrival at this "
                 "instance to its first token)", LABELS, buckets=TTFT_BUCKETS)
TPOT = Histogram("vllm:request_time_per_output_token_seconds", "Time per output token of a request, after its "
                 "first (migrations' downtime included)", LABELS, buckets=TPOT_BUCKETS)
E2E = Histogram("vllm:e2e_request_latency_seconds", "Request latency, from its arrival to its last token "
                "(across migrations)", LABELS, buckets=LATENCY_BUCKETS)
QUEUE = Histogram("vllm:request_queue_time_seconds", "Time a request waited in this instance's queue",
                  LABELS, buckets=LATENCY_BUCKETS)
PROMPT_TOKENS = Counter("vllm:prompt_tokens", "Prompt tokens of requests this instance took (a resumed "
                        "request's delivered tokens included: they are computed again)", LABELS)
GENERATION_TOKENS = Counter("vllm:generation_tokens", "Tokens this instance generated", LABELS)
SUCCESS = Counter("vllm:request_success", "Requests that finished on this instance, by finish reason",
                  [*LABELS, "finished_reason"])


@dataclass
class _Timeline:
    arrival: float  # wall clock (time.time()), where the request arrived in the cluster's first instance
    first_token: float = 0.0
    scheduled: float = 0.0  # left this instance's queue (0: not yet)
    tokens: int = 0  # output tokens so far (all instances)


class ServingMetrics:
    """Per-request histograms and counters of one instance, and the collector
    of its state (``export`` registers it)."""

    # A request that never ends here (its client never attached after a
    # migration in) is forgotten after this many newer ones.
    MAX_TRACKED = 100_000

    def __init__(self, model_name: str, instance_id: str, clock: Callable[[], float] = time.time):
        self.labels = (model_name, "0", instance_id)
        self.clock = clock
        self._requests: dict[str, _Timeline] = {}
        self._ttft, self._tpot, self._e2e, self._queue = (h.labels(*self.labels) for h in (TTFT, TPOT, E2E, QUEUE))
        self._prompt = PROMPT_TOKENS.labels(*self.labels)
        self._generated = GENERATION_TOKENS.labels(*self.labels)
        self._waiting: set[str] = set()  # tracked requests not yet seen running

    def arrived(self, request_id: str, prompt_tokens: int, resumed_tokens: int) -> None:
        self._track(request_id, _Timeline(self.clock(), tokens=resumed_tokens))
        self._waiting.add(request_id)
        self._prompt.inc(prompt_tokens + resumed_tokens)

    def committed_in(self, state: RequestState) -> None:
        """A request committed here by a migration or a handoff: its times
        come with it (its first token was observed where it was produced)."""
        self._track(state.request_id, _Timeline(state.arrival_time or self.clock(), state.first_token_time,
                                                scheduled=self.clock(), tokens=len(state.output_token_ids)))

    def _track(self, request_id: str, t: _Timeline) -> None:
        if len(self._requests) >= self.MAX_TRACKED:
            self._requests.pop(next(iter(self._requests)))
        self._requests[request_id] = t

    def left(self, request_id: str) -> None:
        """Its stream here ended (moved away, aborted, failed): nothing more to observe."""
        self._requests.pop(request_id, None)
        self._waiting.discard(request_id)

    def on_step(self, outputs: list[TokenOutput], load: EngineLoad | None) -> None:
        now = self.clock()
        if self._waiting and load is not None:
            running = {r.request_id for r in load.requests if r.state is RequestPhase.RUNNING}
            for rid in [r for r in self._waiting if r in running]:
                self._scheduled(rid, now)
        tokens = 0
        for out in outputs:
            t = self._requests.get(out.request_id)
            if out.token_id is not None:
                tokens += 1
            if t is None:
                continue
            if out.request_id in self._waiting:
                self._scheduled(out.request_id, now)
            if out.token_id is not None:
                if t.tokens == 0:
                    t.first_token = now
                    self._ttft.observe(now - t.arrival)
                t.tokens += 1
            if out.finish_reason is not None:
                self._finished(out, t, now)
        if tokens:
            self._generated.inc(tokens)

    def _scheduled(self, request_id: str, now: float) -> None:
        self._waiting.discard(request_id)
        t = self._requests.get(request_id)
        if t is not None and not t.scheduled:
            t.scheduled = now
            self._queue.observe(now - t.arrival)

    def _finished(self, out: TokenOutput, t: _Timeline, now: float) -> None:
        del self._requests[out.request_id]
        SUCCESS.labels(*self.labels, out.finish_reason.value).inc()
        self._e2e.observe(now - t.arrival)
        if t.tokens > 1 and t.first_token:
            self._tpot.observe((now - t.first_token) / (t.tokens - 1))

    # --- state, at scrape time ---------------------------------------------------------
    def export(self, load: Callable[[], EngineLoad], migrating: Callable[[], tuple[int, int]]) -> None:
        """Export this process's instance's state: ``load`` gives the latest
        published engine load, ``migrating`` (in, out) migrations in flight.
        One instance per process: a later call replaces the sources."""
        COLLECTOR.sources = (self.labels, load, migrating)
        COLLECTOR.register()


class StateCollector:
    def __init__(self) -> None:
        self.sources: tuple | None = None
        self._registered = False

    def register(self) -> None:
        if not self._registered:
            REGISTRY.register(self)
            self._registered = True

    def describe(self):
        return []  # known only when collected (no source: none)

    def collect(self):
        if self.sources is None:
            return
        labels, load_of, migrating = self.sources
        load = load_of()
        names = list(LABELS)

        def family(kind, name: str, doc: str, v: float):
            m = kind(name, doc, labels=names)
            m.add_metric(list(labels), v)
            return m

        def gauge(name: str, doc: str, v: float):
            return family(GaugeMetricFamily, name, doc, v)

        def counter(name: str, doc: str, v: float):
            return family(CounterMetricFamily, name, doc, v)

        running = sum(1 for r in load.requests if r.state is RequestPhase.RUNNING)
        waiting = sum(1 for r in load.requests if r.state is RequestPhase.WAITING)
        total = max(1, load.total_blocks)
        yield gauge("vllm:num_requests_running", "Requests in the running batch", running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting in the queue", waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full; cached blocks no request uses count "
                    "as free)", (load.total_blocks - load.free_blocks) / total)
        yield counter("vllm:num_preemptions", "Preemptions since start", load.num_preemptions)
        yield gauge("ferry_kv_blocks_total", "KV blocks of this instance", load.total_blocks)
        yield gauge("ferry_kv_blocks_free", "Free KV blocks (cached ones no request uses included)",
                    load.free_blocks)
        yield gauge("ferry_kv_blocks_reserved", "KV blocks held for incoming migrations", load.reserved_blocks)
        m_in, m_out = migrating()
        yield gauge("ferry_migrations_in_flight_in", "Migrations into this instance under way", m_in)
        yield gauge("ferry_migrations_in_flight_out", "Migrations out of this instance under way", m_out)
        s = load.prefix_cache
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens (a request's tokens at its "
                      "admission)", s.queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens (its cached prefix)", s.hits)
        yield counter("ferry_prefix_cache_evictions", "Cached KV blocks whose content was evicted", s.evictions)
        yield gauge("ferry_prefix_cache_blocks", "KV blocks named in the prefix cache (in use or free)",
                    s.cached_blocks)
        yield gauge("ferry_prefix_cache_evictable_blocks", "Cached KV blocks no request uses (counted as free)",
                    s.evictable_blocks)


COLLECTOR = StateCollector()
