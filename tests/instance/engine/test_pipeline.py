"""Pipelined execution across two native engines (KunServe; native/kunserve.py):
each drops half the layers into its KV pool and runs them on the other. Tokens
are exactly those of the full model, greedy and seeded; guests' blocks come
back on finish and preemption; a request with KV on a peer refuses to migrate;
restoring the layers gives the blocks back and serves alone again."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from services.instance.engine import create_engine
from services.instance.engine.base import EngineConfig, EngineError
from services.instance.engine.native.kunserve import LocalPeer, plan_segments
from tests.instance.engine.helpers import req, run

N = 24
PROMPTS = {
    "a0": list(range(200, 260)),
    "a1": [7, 99, 123, 42] * 9,
    "b0": list(range(300, 400, 3)),
    "b1": [11, 12, 13] * 30,
}
SAMPLING = {"a0": {}, "a1": {"temperature": 0.8, "top_p": 0.9, "seed": 5}, "b0": {"temperature": 1.0, "seed": 9},
            "b1": {}}


def _engine(model: str, **kw):
    return create_engine(EngineConfig(engine="native", model=model, num_blocks=kw.pop("num_blocks", 64),
                                      extra={"warmup": False, **kw.pop("extra", {})}, **kw))


def _add(engine, names):
    for n in names:
        engine.add_request(req(n, PROMPTS[n], max_tokens=N, min_tokens=N, **SAMPLING[n]))


def _run_pair(a, b, outputs):
    while a.has_work() or b.has_work():
        for e, peer in ((a, b), (b, a)):
            if e.has_work():
                for o in e.step():
                    outputs.setdefault(o.request_id, []).append(o.token_id)
            e.check_integrity()
            for rid in peer.guests:  # a guest lives only while its request runs on its owner
                assert e.requests[rid].status.value == "running", rid
    return outputs


@pytest.fixture(scope="module", params=["tiny-llama", pytest.param("smollm2", marks=pytest.mark.model)])
def model(request):
    return request.param


@pytest.fixture(scope="module")
def reference(model):
    """The full model, each owner's requests batched as they will be."""
    out = {}
    for names in (("a0", "a1"), ("b0", "b1")):
        e = _engine(model, extra={"share_weights": True})
        _add(e, names)
        out.update(run(e))
    return out


def _split(model, **kw):
    """A holds the first half of the layers, B the second; each runs the other half on the other."""
    a, b = _engine(model, **kw), _engine(model, **kw)
    layers = a.kv_layout.num_layers
    first, second = range(layers // 2), range(layers // 2, layers)
    before = (a.num_total_blocks, b.num_total_blocks)
    grown = (a.drop_layers(second), b.drop_layers(first))
    a.set_pipeline(first, [(second, LocalPeer(b))])
    b.set_pipeline(second, [(first, LocalPeer(a))])
    return a, b, before, grown


def _sampled_logits(monkeypatch, serve) -> dict:
    """Every sampled row's logits while ``serve()`` runs, by (request, output index)."""
    from services.instance.engine.native import runner

    got, real = {}, runner.sample

    def spy(lg, reqs, eos):
        for row, r in zip(lg, reqs):
            got[(r.request_id, len(r.output_token_ids))] = row.clone()
        return real(lg, reqs, eos)

    with monkeypatch.context() as m:
        m.setattr(runner, "sample", spy)
        serve()
    return got


def test_a_pipeline_gives_the_full_models_logits(monkeypatch):
    """Closer than tokens (a small random model's greedy tokens hide a lot):
    every sampled row's logits match the full model's."""
    def full():
        e = _engine("tiny-llama", extra={"share_weights": True})
        _add(e, ("a0", "a1"))
        run(e)

    def pipeline():
        a, b, _, _ = _split("tiny-llama")
        _add(a, ("a0", "a1"))
        _run_pair(a, b, {})

    want, got = _sampled_logits(monkeypatch, full), _sampled_logits(monkeypatch, pipeline)
    assert want.keys() == got.keys() and len(want) == 2 * N
    for k, row in want.items():
        assert torch.allclose(row, got[k], rtol=0, atol=1e-5), k


def test_a_pipeline_of_two_engines_gives_the_full_models_tokens(model, reference):
    a, b, before, grown = _split(model)
    assert all(g > 0 for g in grown)  # the dropped layers' memory became blocks
    assert (a.num_total_blocks, b.num_total_blocks) == (before[0] + grown[0], before[1] + grown[1])
    _add(a, ("a0", "a1"))
    _add(b, ("b0", "b1"))
    got = _run_pair(a, b, {})
    assert got == reference
    for e in (a, b):  # every guest released as its request finished
        assert not e.guests
        assert e.num_free_blocks == e.num_total_blocks


def test_guests_are_released_on_preemption_and_recompute_is_exact(model, reference):
    # 4 blocks of 16 tokens: a0 and a1 (60 and 36 tokens + 24 new) cannot both stay: one is preempted.
    a, b, _, _ = _split(model, num_blocks=7)
    a.pool.shrink(a.num_total_blocks - 7)  # back to 7 blocks: memory pressure on A alone
    _add(a, ("a0", "a1"))
    got = _run_pair(a, b, {})
    assert a.scheduler.num_preemptions > 0
    assert {k: got[k] for k in ("a0", "a1")} == {k: reference[k] for k in ("a0", "a1")}
    assert not b.guests and b.num_free_blocks == b.num_total_blocks


def test_a_request_with_kv_on_a_peer_refuses_to_migrate():
    a, b, _, _ = _split("tiny-llama")
    _add(a, ("a0",))
    a.step()
    with pytest.raises(EngineError, match="pipeline peer"):
        a.full_blocks("a0")
    assert a.abort_request("a0")
    assert not b.guests  # the abort released it on the peer


def test_restore_gives_the_blocks_back_and_serves_alone(model, reference):
    a, b, before, _ = _split(model)
    _add(a, ("a0", "a1"))
    _run_pair(a, b, {})
    host = _engine(model, extra={"share_weights": True})  # a full copy in host memory
    layers = a.kv_layout.num_layers
    a.restore_layers(host.layer_states(range(layers // 2, layers)))
    a.set_pipeline(range(layers), [])
    assert a.num_total_blocks == before[0]
    assert a.executor.model.dropped() == []
    _add(a, ("a0", "a1"))
    assert run(a) == {k: reference[k] for k in ("a0", "a1")}


def _steps(engine, outputs, n):
    for _ in range(n):
        for o in engine.step():
            outputs.setdefault(o.request_id, []).append(o.token_id)
        engine.check_integrity()


def test_requests_live_through_drop_pipeline_and_restore_with_exact_tokens(model, reference):
    """Requests decoding on A when A enters a pipeline (their KV of the
    dropped layers handed to B in a pause), run pipelined, then A takes its
    layers back from B and the KV back, and they finish alone: the full
    model's tokens."""
    a, b = _engine(model), _engine(model)
    layers = a.kv_layout.num_layers
    first, second = range(layers // 2), range(layers // 2, layers)
    own_blocks = a.num_total_blocks
    _add(a, ("a0", "a1"))
    got: dict = {}
    _steps(a, got, 5)  # prefills and a few decodes, alone
    assert a.enter_pipeline(first, [(second, LocalPeer(b))], live=False) == 2  # both requests' KV moved
    assert set(b.guests) == {"a0", "a1"}
    assert a.drop_layers(second) > 0
    _steps(a, got, 8)  # pipelined
    assert a.executor.model.dropped() == list(second)
    a.restore_layers(b.layer_states(second))
    assert a.leave_pipeline(live=False) == 2  # both requests' KV came back
    assert not b.guests and b.num_free_blocks == b.num_total_blocks
    run(a, got)
    assert {k: got[k] for k in ("a0", "a1")} == {k: reference[k] for k in ("a0", "a1")}
    assert a.num_total_blocks == own_blocks and a.num_free_blocks == own_blocks


def test_leaving_a_pipeline_needs_the_layers_back():
    a, b = _engine("tiny-llama"), _engine("tiny-llama")
    a.enter_pipeline(range(1), [(range(1, 2), LocalPeer(b))])
    a.drop_layers(range(1, 2))
    with pytest.raises(EngineError, match="still dropped"):
        a.leave_pipeline()
    with pytest.raises(EngineError, match="dropped here too"):
        a.layer_states(range(2))


def _decoding_pair(model):
    """A pair (``_split``) with A's two requests decoding: (a, b, their tokens so far, A's layers, B's)."""
    a, b, _, _ = _split(model)
    _add(a, ["a0", "a1"])
    out = {}
    _steps(a, out, 3)
    half = a.kv_layout.num_layers // 2
    return a, b, out, range(half), range(half, a.kv_layout.num_layers)


def test_a_pipeline_re_forms_between_steps_and_its_requests_keep_their_tokens(model, reference):
    # A merge (services/scheduler/kunserve.py) re-forms live pipelines: every member holds its
    # steps first (a member that runs layers for its pipeline refuses to drop them otherwise),
    # then each sets its new stages and the KV of each layer whose holder changed moves from
    # the old holder to the new one. Here A's second half moves from B to C, mid-decode.
    a, b, out, first, second = _decoding_pair(model)
    with pytest.raises(EngineError, match="hold its steps first"):
        a.drop_layers(range(first.stop - 1, first.stop))
    c = _engine(model)
    c.drop_layers(first)
    stages = a.executor.peer_segments()
    a.hold_steps()
    assert not a.has_work()
    assert a.enter_pipeline(first, stages) == 0 and a.has_work()  # the same stages: nothing moves, no hold
    a.hold_steps()
    stages = [(second, LocalPeer(c))]
    assert a.enter_pipeline(first, stages, hold=True) == 2
    assert not b.guests and set(c.guests) == {"a0", "a1"}  # released on the peer no longer one
    assert not a.has_work()  # held until the same stages again (a merge's last round)
    assert a.enter_pipeline(first, stages) == 0 and a.has_work()
    assert _run_pair(a, c, out) == {k: reference[k] for k in ("a0", "a1")}
    assert not c.guests


def test_a_re_forming_that_fails_changes_nothing_and_the_pipeline_serves_on(model, reference):
    a, b, out, first, second = _decoding_pair(model)
    full = _engine(model, num_blocks=2)  # no room for the requests' KV of its layers
    full.drop_layers(first)
    full.pool.shrink(full.pool.num_free - 2)
    stages = a.executor.peer_segments()
    a.hold_steps()
    with pytest.raises(EngineError, match="free here"):
        a.enter_pipeline(first, [(second, LocalPeer(full))])
    assert not full.guests and set(b.guests) == {"a0", "a1"} and not a.has_work()  # held
    assert a.enter_pipeline(first, stages) == 0  # the old stages again
    assert _run_pair(a, b, out) == {k: reference[k] for k in ("a0", "a1")}


def test_a_dropped_layer_cannot_run_here():
    a = _engine("tiny-llama")
    a.drop_layers(range(1, 2))
    with pytest.raises(EngineError, match="dropped here"):
        a.set_pipeline(range(2), [])
    with pytest.raises(EngineError, match="not held here"):
        a.forward_guest(range(1, 2), [], torch.zeros(0, 64))
    shared = _engine("tiny-llama", extra={"share_weights": True})
    with pytest.raises(EngineError, match="shares its weights"):
        shared.drop_layers(range(1))


def test_plan_segments_covers_every_layer_once():
    p = object()
    assert [s for s, _ in plan_segments(4, range(2), [(range(2, 4), p)])] == [range(2), range(2, 4)]
    with pytest.raises(ValueError, match="no holder"):
        plan_segments(4, range(2), [(range(3, 4), p)])
    with pytest.raises(ValueError, match="two holders"):
        plan_segments(4, range(3), [(range(2, 4), p)])
    with pytest.raises(ValueError, match="no holder"):
        plan_segments(4, range(2), [])


def test_a_short_peer_preempts_the_latest_request_and_the_step_goes_on():
    """The peer has not the blocks for every guest: the owner preempts its
    latest request (as when short itself) instead of failing the step; every
    request still gets the full model's tokens."""
    a, b = _engine("tiny-llama"), _engine("tiny-llama", num_blocks=9)
    a.set_pipeline(range(1), [(range(1, 2), LocalPeer(b))])
    b.drop_layers(range(1))
    b.pool.shrink(b.num_total_blocks - 9)  # 9 blocks: a0 and a1 (5 + 3 blocks, growing) cannot both live there
    full = _engine("tiny-llama", extra={"share_weights": True})
    _add(full, ("a0", "a1"))
    want = run(full)
    _add(a, ("a0", "a1"))
    got = run(a)
    assert a.scheduler.num_preemptions > 0
    assert got == want
    assert not b.guests and b.num_free_blocks == b.num_total_blocks


def test_an_engine_holds_its_steps_between_a_drop_and_its_pipeline():
    a, b = _engine("tiny-llama"), _engine("tiny-llama")
    _add(a, ("a0",))
    got: dict = {}
    _steps(a, got, 1)
    a.drop_layers(range(1, 2), hold=True)
    assert not a.has_work()  # it would run a dropped layer otherwise
    a.enter_pipeline(range(1), [(range(1, 2), LocalPeer(b))])
    assert a.has_work()
    assert len(run(a, got)["a0"]) == N


def test_a_guest_handed_over_during_the_owners_step_leaves_the_step_alone():
    """Between agents, a peer's KV hand-over runs on the owner's engine thread
    while the owner's own step waits on that peer: it must not disturb the
    step (it once dropped the owner's dense decode slots mid-step)."""
    a, b = _engine("tiny-llama"), _engine("tiny-llama")
    full = _engine("tiny-llama", extra={"share_weights": True})
    _add(full, ("a0", "a1"))
    want = run(full)

    class HandsOverOnce(LocalPeer):
        done = False

        def forward_layers(self, layers, chunks, hidden, attend=None):
            if not self.done and all(c.num_new == 1 for c in chunks):  # a decode step, dense slots in use
                self.done = True
                a.adopt_guest_kv("b-guest", range(1), 20, a.executor.gather_kv_layers([0, 1], range(1)))
            return super().forward_layers(layers, chunks, hidden, attend)

    def isolate(chunks, error):  # the engine would rerun each request alone: the step failed
        raise AssertionError(f"the step failed: {error!r}")

    a._isolate = isolate
    peer = HandsOverOnce(b)
    a.set_pipeline(range(1), [(range(1, 2), peer)])
    _add(a, ("a0", "a1"))
    got = run(a)
    assert peer.done and got == want
    a.release_guests(["b-guest"])


def test_a_failed_hand_over_leaves_nothing_half_moved():
    """The peer refuses the second request's KV: the first one's is released
    there, no request counts as remote, and the engine holds its steps until
    its layers are back; then both requests finish with the full model's tokens."""
    a, b = _engine("tiny-llama"), _engine("tiny-llama")
    full = _engine("tiny-llama", extra={"share_weights": True})
    _add(full, ("a0", "a1"))
    want = run(full)

    class RefusesTheSecond(LocalPeer):
        def push_kv(self, layers, request_id, num_tokens, data):
            if request_id == "a1":
                raise EngineError("no room here")
            super().push_kv(layers, request_id, num_tokens, data)

    _add(a, ("a0", "a1"))
    got: dict = {}
    _steps(a, got, 3)
    a.drop_layers(range(1, 2), hold=True)
    with pytest.raises(EngineError, match="no room"):
        a.enter_pipeline(range(1), [(range(1, 2), RefusesTheSecond(b))], live=False)
    assert not b.guests and not a.executor.remote_requests
    assert not a.has_work()  # held: it would run layer 1 without its KV on the peer
    a.restore_layers(b.layer_states(range(1, 2)))
    assert a.leave_pipeline() == 0
    assert run(a, got) == want


class CountsAttention(LocalPeer):
    """A peer that counts the rows that attend at the owner and takes the
    owner's KV only once ``accept`` is set (it refuses, as a peer with no room)."""

    def __init__(self, engine, accept=False):
        super().__init__(engine)
        self.accept = accept
        self.remote_rows = 0

    def forward_layers(self, layers, chunks, hidden, attend=None):
        if attend is not None:
            def counted(layer, q, k, v):
                self.remote_rows += q.shape[0]
                return attend(layer, q, k, v)
            return super().forward_layers(layers, chunks, hidden, counted)
        return super().forward_layers(layers, chunks, hidden)

    def push_kv(self, layers, request_id, num_tokens, data):
        if not self.accept:
            raise EngineError("no room here yet")
        super().push_kv(layers, request_id, num_tokens, data)


def _decoding_on_a(model, steps: int):
    """A (exchanging one request's KV a step) with a0 and a1 decoding after
    ``steps`` steps, and B; A will keep the first half of the layers."""
    a, b = _engine(model, extra={"kunserve_exchange_mb": 0}), _engine(model)
    layers = a.kv_layout.num_layers
    own_blocks = a.num_total_blocks
    _add(a, ("a0", "a1"))
    got: dict = {}
    _steps(a, got, steps)
    return a, b, range(layers // 2), range(layers // 2, layers), own_blocks, got


def test_requests_keep_decoding_through_a_live_kv_exchange(model, reference):
    """KunServe's live exchange: A enters the pipeline with requests decoding
    and they decode on at once. While B cannot take their KV, their attention
    for B's layers runs at A (remote attention); then their KV moves, one
    request a step, and they attend at B. Exact tokens; A takes the layers and
    the KV back; nothing is left on either side."""
    a, b, first, second, own_blocks, got = _decoding_on_a(model, 5)
    peer = CountsAttention(b)
    a.drop_layers(second, hold=True)
    assert a.enter_pipeline(first, [(second, peer)]) == 2  # both will move; nothing moved yet
    assert a.has_work() and not b.guests
    _steps(a, got, 3)  # B refuses their KV: every row of theirs attends at A
    assert peer.remote_rows == 3 * 2 * len(second)
    assert a.executor.pending_exchange == ["a0", "a1"]
    peer.accept = True
    _steps(a, got, 1)  # a0's KV moves before the step; a1 still attends at A
    assert a.executor.pending_exchange == ["a1"]
    assert peer.remote_rows == 4 * 2 * len(second) - len(second)
    _steps(a, got, 3)
    assert not a.executor.pending_exchange and set(b.guests) == {"a0", "a1"}
    a.restore_layers(b.layer_states(second))
    assert a.leave_pipeline(live=False) == 2
    assert not b.guests and b.num_free_blocks == b.num_total_blocks
    run(a, got)
    assert {k: got[k] for k in ("a0", "a1")} == {k: reference[k] for k in ("a0", "a1")}
    assert a.num_total_blocks == own_blocks and a.num_free_blocks == own_blocks


def test_a_pipeline_left_before_the_exchange_needs_no_kv_back():
    """No KV ever moved (the peer had no room): the requests attended at A
    the whole time, so leaving fetches nothing and their tokens are exact; a
    request aborted meanwhile leaves no guest and no pending exchange."""
    a, b = _engine("tiny-llama"), _engine("tiny-llama")
    full = _engine("tiny-llama", extra={"share_weights": True})
    _add(full, ("a0", "a1"))
    want = run(full)
    _add(a, ("a0", "a1", "b0"))
    got: dict = {}
    _steps(a, got, 2)
    peer = CountsAttention(b)
    a.drop_layers(range(1, 2), hold=True)
    a.enter_pipeline(range(1), [(range(1, 2), peer)])
    _steps(a, got, 4)
    assert a.abort_request("b0")
    assert a.executor.pending_exchange == ["a0", "a1"] and set(b.guests) == {"a0", "a1"}
    a.restore_layers(b.layer_states(range(1, 2)))
    assert a.leave_pipeline() == 0
    assert not b.guests and not a.executor.pending_exchange
    run(a, got)
    assert {k: got[k] for k in ("a0", "a1")} == want
    assert peer.remote_rows > 0
    a.check_integrity()
    assert a.num_free_blocks == a.num_total_blocks


def test_a_drop_and_a_restore_prepared_off_the_engine_thread():
    """The grown KV storage (prepare_drop) and the restored layers
    (build_layers) are made ahead, off the engine thread: the drop uses that
    storage when its size still fits (else makes its own), the restore
    installs those layers; tokens stay exact and the blocks come back."""
    a, b = _engine("tiny-llama"), _engine("tiny-llama")
    full = _engine("tiny-llama", extra={"share_weights": True})
    _add(full, ("a0", "a1"))
    want = run(full)
    own = a.num_total_blocks
    _add(a, ("a0", "a1"))
    got: dict = {}
    _steps(a, got, 3)
    fresh = a.prepare_drop(range(1, 2))
    assert fresh is not None and fresh.shape[0] > own and not fresh.any()
    added = a.drop_layers(range(1, 2), hold=True, fresh=fresh)
    assert a.num_total_blocks == own + added == fresh.shape[0]
    assert a.executor.kv_cache is fresh  # the blocks were copied into it, no second tensor
    assert a.prepare_drop(range(1, 2)) is None  # nothing more to lend
    a.enter_pipeline(range(1), [(range(1, 2), LocalPeer(b))])
    _steps(a, got, 3)
    states = b.layer_states(range(1, 2))
    built = a.build_layers(states)
    assert a.executor.model.dropped() == [1]  # built, not yet installed
    a.restore_layers(states, built)
    assert a.executor.model.layers[1] is built[1]
    a.leave_pipeline()
    run(a, got)
    assert got == want
    assert a.num_total_blocks == own and a.num_free_blocks == own
    # A second drop after the restore reuses the ids (and storage) it gave back: nothing grows.
    size = a.executor.kv_cache.shape[0]
    assert a.prepare_drop(range(1, 2)) is None
    assert a.drop_layers(range(1, 2)) == added and a.executor.kv_cache.shape[0] == size
    a.restore_layers(states)
    # Storage made for a pool that changed since is not used: the drop makes its own.
    c = _engine("tiny-llama")
    stale = c.prepare_drop(range(1, 2))
    c.grow_blocks(1)
    c.drop_layers(range(1, 2), fresh=stale)
    assert c.executor.kv_cache is not stale and c.executor.kv_cache.shape[0] == c.pool.num_blocks


def test_requests_leave_a_pipeline_live_with_exact_tokens(model, reference):
    """Restore, live: A has its layers back and leaves the pipeline while its
    requests decode. Their KV comes back one request a step; a request whose
    KV is back runs every layer at A, the other still runs B's layers on B
    meanwhile. Exact tokens; B keeps no guest and A ends alone; neither
    drops layers while the return is under way."""
    a, b, first, second, own_blocks, got = _decoding_on_a(model, 4)
    peer = LocalPeer(b)
    a.drop_layers(second, hold=True)
    a.enter_pipeline(first, [(second, peer)])
    _steps(a, got, 4)  # both KV moved (one a step), then pipelined
    assert not a.executor.pending_exchange and set(b.guests) == {"a0", "a1"}
    a.restore_layers(b.layer_states(second))
    assert a.leave_pipeline() == 2  # both will come back
    assert a.executor.returning and set(b.guests) == {"a0", "a1"}
    with pytest.raises(EngineError, match="taking its requests' KV back"):
        a.drop_layers(second)
    with pytest.raises(EngineError, match="runs layers for 2 requests"):
        b.drop_layers(first)
    calls = peer.calls
    _steps(a, got, 1)  # a0 back before the step; a1 still runs B's layers there
    assert set(b.guests) == {"a1"} and a.executor.remote_requests == {"a1"}
    assert peer.calls == calls + 1
    _steps(a, got, 1)  # a1 back: every layer here from now on
    assert not b.guests and not a.executor.returning and not a.executor.peer_segments()
    run(a, got)
    assert peer.calls == calls + 1
    assert {k: got[k] for k in ("a0", "a1")} == {k: reference[k] for k in ("a0", "a1")}
    assert a.num_total_blocks == own_blocks and a.num_free_blocks == own_blocks
    assert b.num_free_blocks == b.num_total_blocks
