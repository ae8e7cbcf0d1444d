"""Span ids do not follow the ``random`` module's seed (libs/common/tracing.py):
engines seed it (vLLM with 0 in every instance), and with the SDK's default
ids two instances made the same span ids in the same order."""

import random

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from libs.common import tracing


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    assert tracing.configure("ferry-test", exporter=exporter)
    yield exporter
    tracing.reset()


def test_span_and_trace_ids_do_not_repeat_after_the_random_module_is_seeded_again(spans):
    for _ in range(2):
        random.seed(0)  # as vLLM does in each instance's process
        with tracing.span("root"):
            with tracing.span("child"):
                pass
    got = spans.get_finished_spans()
    assert len(got) == 4
    assert len({s.context.span_id for s in got}) == 4
    assert len({s.context.trace_id for s in got}) == 2
