"""An instance's bound on queued prefill work (pure bookkeeping)."""

from libs.common.types import Priority, RequestLoad
from services.instance.admission import QueueBound, queued_tokens
from services.instance.engine.base import EngineLoad


def load(*waiting: int, running: int = 0) -> EngineLoad:
    reqs = [RequestLoad(f"w{i}", Priority.NORMAL, "waiting", 0, n) for i, n in enumerate(waiting)]
    reqs += [RequestLoad(f"r{i}", Priority.NORMAL, "running", 1, 500) for i in range(running)]
    return EngineLoad(total_blocks=100, free_blocks=50, block_size=16, requests=tuple(reqs))


def test_an_empty_queue_admits_anything_and_a_full_one_refuses():
    q = QueueBound(100)
    assert queued_tokens(load(30, 40, running=3)) == 70
    assert q.admit(load(running=5), 5000) is None  # empty queue: even a huge prompt
    q.added(5000)
    assert "queue is full" in q.admit(load(running=5), 10)  # not yet in a published load: counted
    q.on_load()
    assert q.admit(load(60), 40) is None
    q.added(40)
    q.on_load()
    assert q.admit(load(60, 40), 1) is not None
    assert q.admit(load(60, 40), 1, resumed=True) is None  # a resumed request's client is mid-stream


def test_in_flight_admissions_count_until_taken_or_dropped():
    q = QueueBound(100)
    assert q.admit(load(10), 80) is None
    assert q.admit(load(10), 20) is not None  # 10 queued + 80 being added
    q.dropped(80)
    assert q.admit(load(10), 20) is None
    assert QueueBound(0).admit(load(10**6), 10**6) is None  # 0: no bound
