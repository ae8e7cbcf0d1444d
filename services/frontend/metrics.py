"""Prometheus metrics of the frontend."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("ferry_requests_total", "Requests by endpoint and outcome", ["endpoint", "status"])
IN_FLIGHT = Gauge("ferry_requests_in_flight", "Requests being generated")
TTFT = Histogram("ferry_time_to_first_token_seconds", "Time to first token",
                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
ITL = Histogram("ferry_inter_token_latency_seconds", "Time between two tokens of a request",
                buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
E2E = Histogram("ferry_request_latency_seconds", "End-to-end request latency",
                buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
PER_INSTANCE = Counter("ferry_instance_requests_total", "Requests dispatched per instance", ["instance"])
TOKENS = Counter("ferry_generated_tokens_total", "Tokens delivered to clients")
BYPASS = Gauge("ferry_dispatch_bypass", "1 while the scheduler is unreachable and the frontend dispatches")
BYPASS_PREFIX_INSTANCES = Gauge("ferry_bypass_prefix_index_instances", "Instances whose cached prefixes this "
                                "frontend follows for bypass dispatch (while the scheduler's policy is prefix-aware)")
BYPASS_DISPATCHES = Counter("ferry_bypass_dispatches_total", "Requests dispatched by the frontend itself")
MIGRATIONS_FOLLOWED = Counter("ferry_migrations_followed_total", "Streams re-attached after a migration")
RESUMES = Counter("ferry_resumes_total", "Requests resumed on another instance after a failure")
STALLED = Counter("ferry_stalled_requests_total",
                  "Instance streams that made no progress past the stall limit (cancelled; the request resumed "
                  "elsewhere or failed)")
REFUSED = Counter("ferry_requests_refused_total", "Requests refused at admission, by reason (in_flight: over "
                  "--max-in-flight; draining: the frontend stops; instances_full: every instance's queue is full)",
                  ["reason"])
DISCONNECTS = Counter("ferry_client_disconnects_total", "Requests aborted because their client went away, by "
                      "when", ["when"])
REQUEST_ERRORS = Counter("ferry_request_errors_total", "Requests an instance failed on their own, by code", ["code"])
INSTANCE_FREENESS = Gauge("ferry_instance_freeness", "Last reported freeness per instance", ["instance"])
INSTANCE_RUNNING = Gauge("ferry_instance_running", "Running requests per instance", ["instance"])
INSTANCE_WAITING = Gauge("ferry_instance_waiting", "Waiting requests per instance", ["instance"])
