"""The event kernel: time order, FIFO among equal times, processes that wait
and receive values or exceptions."""

import pytest

from ferry.sim.kernel import START, Delay, Kernel, Wait


def test_events_run_in_time_order_and_fifo_at_equal_times():
    k = Kernel()
    seen = []
    k.at(START + 2.0, seen.append, "c")
    k.at(START + 1.0, seen.append, "a")
    k.at(START + 1.0, seen.append, "b")  # same time: after "a", scheduled first
    k.after(0.5, seen.append, "first")
    k.run()
    assert seen == ["first", "a", "b", "c"] and k.now == START + 2.0 and k.idle()


def test_run_until_stops_before_later_events_and_past_times_run_now():
    k = Kernel()
    seen = []
    k.at(START + 1.0, seen.append, 1)
    k.at(START + 3.0, seen.append, 3)
    k.run(until=START + 2.0)
    assert seen == [1] and not k.idle()
    k.at(START - 5, seen.append, "late")  # never before now
    k.run()
    assert seen == [1, "late", 3]


class Answer(Wait):
    def __init__(self, value=None, exc=None, after=0.0):
        self.value, self.exc, self.delay = value, exc, after

    def arm(self, kernel, resume, fail):
        if self.exc:
            kernel.after(self.delay, fail, self.exc)
        else:
            kernel.after(self.delay, resume, self.value)


def test_a_process_waits_gets_values_and_exceptions_and_returns():
    k = Kernel()
    log = []

    def proc():
        yield Delay(1.5)
        log.append(("woke", k.now))
        v = yield Answer(42, after=0.5)
        log.append(("got", v, k.now))
        try:
            yield Answer(exc=ValueError("no"))
        except ValueError as e:
            log.append(("caught", str(e)))
        return "done"

    results = []
    p = k.spawn(proc(), on_done=results.append)
    k.run()
    assert log == [("woke", START + 1.5), ("got", 42, START + 2.0), ("caught", "no")]
    assert p.done and p.result == "done" and results == ["done"]


def test_an_uncaught_exception_in_a_process_surfaces():
    k = Kernel()

    def proc():
        yield Answer(exc=RuntimeError("boom"))

    k.spawn(proc())
    with pytest.raises(RuntimeError, match="boom"):
        k.run()
