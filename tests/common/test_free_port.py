"""free_port never hands out the same port twice in one process: a cluster
picks every child's port before any of them binds."""

import itertools

from libs.common import procs as cluster


def test_a_port_is_handed_out_once(monkeypatch):
    picks = itertools.chain([23456, 23456, 23456], itertools.count(23457))
    monkeypatch.setattr(cluster.random, "randrange", lambda *_: next(picks))
    monkeypatch.setattr(cluster, "_handed_out", set())
    first, second = cluster.free_port(), cluster.free_port()
    assert first == 23456 and second == 23457
