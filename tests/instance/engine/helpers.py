"""Drive engines in tests: run to completion, migrate a request."""

from __future__ import annotations

from libs.common.types import SamplingParams
from services.instance.engine.base import Engine, EngineRequest


# The engine's refusals of the deterministic mode on a CPU where it does not hold
# (services/instance/engine/native/runner.py, engine.py): the mode is refused, by design.
NOT_HERE = ("the deterministic mode does not hold on this CPU", "the deterministic mode cannot run")


def deterministic_or_skip(make):
    """``make()``, an engine in the deterministic mode; where this CPU's
    kernels fail the mode's start-up check (e.g. a kernel choice of an AMX
    CPU this project has not seen), the test skips with the engine's reason
    instead of failing: the mode is refused there, never claimed."""
    import pytest

    from services.instance.engine.base import EngineError

    try:
        return make()
    except EngineError as e:
        if str(e).startswith(NOT_HERE):
            pytest.skip(f"deterministic mode refused on this CPU: {e}")
        raise


def req(rid: str, prompt, max_tokens: int = 16, priority=0, arrival: float = 0.0, resume=(), **sp) -> EngineRequest:
    return EngineRequest(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens, **sp), priority,
                         arrival_time=arrival, resume_token_ids=tuple(resume))


def run(engine: Engine, outputs: dict | None = None, max_steps: int = 100_000, check: bool = True) -> dict:
    """Step until idle; returns {request_id: [token ids]} (indices checked)."""
    outputs = {} if outputs is None else outputs
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for o in engine.step():
            toks = outputs.setdefault(o.request_id, [])
            assert o.index == len(toks), f"{o.request_id}: index {o.index} after {len(toks)} tokens"
            toks.append(o.token_id)
        if check:
            engine.check_integrity()
    assert not engine.has_work()
    return outputs


def run_alone(engine: Engine, r: EngineRequest) -> list[int]:
    engine.add_request(r)
    return run(engine)[r.request_id]


def step_collect(engine: Engine, outputs: dict, n: int) -> None:
    for _ in range(n):
        for o in engine.step():
            outputs.setdefault(o.request_id, []).append(o.token_id)


def migrate(src: Engine, dst: Engine, rid: str) -> int:
    """Two-stage migration through the hooks: copy the full blocks while the
    request runs, step the source once more, then suspend, copy the rest and
    install. Returns the output index the destination continues at."""
    full = src.full_blocks(rid)
    staged = dst.reserve_blocks(len(full))
    assert staged is not None
    dst.scatter_kv(staged, src.gather_kv(full))
    assert src.suspend_request(rid)
    assert src.request_phase(rid)[0] == "suspended"
    blocks = src.all_blocks(rid)
    assert blocks[: len(full)] == full, "full blocks changed while copying"
    rest = dst.reserve_blocks(len(blocks) - len(full))
    assert rest is not None
    dst.scatter_kv(rest, src.gather_kv(blocks[len(full):]))
    state = src.export_state(rid)
    dst.install_request(state, staged + rest)
    src.drop_request(rid)
    assert src.request_phase(rid) is None
    return len(state.output_token_ids)


def collect(engine: Engine, outputs: dict | None = None, max_steps: int = 100_000) -> dict:
    """Step until idle; returns {request_id: [TokenOutput]} (with their logprobs, if asked for)."""
    outputs = {} if outputs is None else outputs
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for o in engine.step():
            outputs.setdefault(o.request_id, []).append(o)
        engine.check_integrity()
    assert not engine.has_work()
    return outputs


def exact(outs: list) -> list[tuple]:
    """What the deterministic mode keeps bit for bit: each token, its logprob and its top logprobs."""
    return [(o.token_id, o.logprobs.logprob if o.logprobs else None, o.logprobs.top if o.logprobs else None)
            for o in outs]


# How far a token's logprob may move from arithmetic alone in the default mode,
# when its rows are computed in another batch, chunk or cached prefix
# (docs/determinism.md: seen up to 0.15 nats in bf16 and 3e-5 in fp32 on this
# project's CPUs); a wrong KV or a lost token moves it by whole nats.
LOGPROB_NOISE = {"bfloat16": 0.5, "float32": 1e-3}


def assert_bounded_divergence(ref: list, got: list, noise: float, greedy: bool = True) -> int:
    """The default mode's promise where two runs' arithmetic may differ (outputs
    with logprobs, k >= 2): the same tokens with logprobs within ``noise``, up to
    the first position where the runs choose differently; there, both chosen
    tokens are among both runs' top logprobs, each within ``noise`` of itself
    in the other run, and (greedy) the two are a near-tie: within 2 * noise in
    the reference. Past it the requests are different texts. Returns the
    number of tokens before it."""
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        lr, lg = r.logprobs, g.logprobs
        if r.token_id == g.token_id:
            assert abs(lr.logprob - lg.logprob) <= noise, f"position {i}: logprob {lr.logprob} vs {lg.logprob}"
            continue
        top_r, top_g = dict(lr.top), dict(lg.top)
        for t in (r.token_id, g.token_id):
            assert t in top_r and t in top_g, f"position {i}: token {t} is not among both runs' top logprobs"
            assert abs(top_r[t] - top_g[t]) <= noise, f"position {i}: token {t}: {top_r[t]} vs {top_g[t]}"
        if greedy:
            assert top_r[r.token_id] - top_r[g.token_id] <= 2 * noise, f"position {i}: not a near-tie"
        return i
    return len(ref)
