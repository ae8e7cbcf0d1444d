"""Drive engines in tests: run to completion, migrate a request."""

from __future__ import annotations

from libs.common.types import SamplingParams
from services.instance.engine.base import Engine, EngineRequest


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
