"""The native engine's deterministic mode (native/batch_invariant.py): a
request's tokens and logprobs are bit for bit those it gets alone, whatever
runs beside it, what its engines' prefix caches hold, the chunk budget, a
preemption and recompute, a migration, a handoff (a migration right after the
first token, as Splitwise's) or a resume by recompute on another engine.

A property test draws the scenarios (hypothesis), greedy and seeded, fp32 and
bf16, on SmolLM2. On a CPU above the lowest kind, the same test also runs in a
child process capped at each lower kind (libs/common/cpu_features.CAPS: AVX2,
AVX-512 without BF16, AVX-512 BF16 without AMX), so that one machine checks
every kind's code paths it can run. ``FERRY_DETERMINISM_EXAMPLES`` sets the
number of scenarios per dtype (10 here, 4 in a capped child)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

torch = pytest.importorskip("torch")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.common import cpu_features
from services.instance.engine import create_engine, vllm_kernels
from services.instance.engine.base import EngineConfig, EngineError, EngineRequest
from libs.common.types import SamplingParams
from tests.instance.engine.helpers import deterministic_or_skip, migrate

pytestmark = pytest.mark.model

EXAMPLES = int(os.environ.get("FERRY_DETERMINISM_EXAMPLES", "10"))
CAPPED = os.environ.get("FERRY_DETERMINISM_CAP", "")  # set in the capped children
BS = 32
VOCAB = 49152
DTYPES = os.environ.get("FERRY_DETERMINISM_DTYPES", "float32,bfloat16").split(",")


def _engine(dtype: str, num_blocks: int, **kw):
    return create_engine(EngineConfig(engine="native", model="smollm2", dtype=dtype, block_size=BS,
                                      num_blocks=num_blocks, deterministic=True, watermark=0.0, max_model_len=1024,
                                      extra={"share_weights": True, "warmup": False}, **kw))


@pytest.fixture(scope="module", params=DTYPES)
def engines(request):
    if vllm_kernels.ops() is None:
        pytest.skip("the deterministic mode needs vLLM's CPU kernels (the vllm extra), not runnable here")
    dt = request.param
    # ref: the request alone (one prefill chunk, nothing beside it); a and b: the scenario's
    # two engines, small enough that others make the target wait and be preempted.
    return deterministic_or_skip(lambda: {"dtype": dt, "ref": _engine(dt, 64), "a": _engine(dt, 40),
                                          "b": _engine(dt, 40)})


@dataclass
class Scenario:
    seed: int
    prompt_len: int
    max_tokens: int
    sampling: dict
    budget_a: int
    budget_b: int
    warm_blocks: int  # the target's first blocks computed before by another request (a prefix-cache hit)
    warm_running: bool  # ... which is still running beside it (blocks shared)
    others: list = field(default_factory=list)  # (prompt length, max tokens, the target's step it joins at)
    event: str = "none"  # preempt, migrate, handoff (a migration after the first token), resume
    at: int = 1  # the target's output index the event happens at


@st.composite
def scenarios(draw):
    n = draw(st.integers(8, 150))
    max_tokens = draw(st.integers(3, 10))
    seeded = draw(st.booleans())
    sampling = ({"seed": draw(st.integers(0, 2**31)), "temperature": draw(st.sampled_from([0.6, 1.0])),
                 "top_p": draw(st.sampled_from([0.9, 1.0])), "top_k": draw(st.sampled_from([0, 40]))}
                if seeded else {})
    return Scenario(
        seed=draw(st.integers(0, 2**31)), prompt_len=n, max_tokens=max_tokens, sampling=sampling,
        budget_a=draw(st.sampled_from([16, 40, 97, 2048])), budget_b=draw(st.sampled_from([16, 64, 2048])),
        warm_blocks=draw(st.integers(0, n // BS)), warm_running=draw(st.booleans()),
        others=draw(st.lists(st.tuples(st.integers(5, 140), st.integers(1, 12), st.integers(0, 4)), max_size=3)),
        event=draw(st.sampled_from(["none", "preempt", "migrate", "handoff", "resume"])),
        at=draw(st.integers(1, max_tokens - 1)))


def _target(s: Scenario, prompt: list[int], resume: tuple[int, ...] = ()) -> EngineRequest:
    sp = SamplingParams(max_tokens=s.max_tokens, min_tokens=s.max_tokens, logprobs=3, **s.sampling)
    return EngineRequest("target", tuple(prompt), sp, resume_token_ids=resume)


def _outputs(outs) -> list[tuple]:
    return [(o.token_id, o.logprobs.logprob, o.logprobs.top) for o in outs]


def _play(s: Scenario, e: dict, prompt: list[int], rng: random.Random) -> list:
    """The scenario on engines a and b; returns the target's outputs in order."""
    a, b = e["a"], e["b"]
    a.scheduler.max_num_batched_tokens, b.scheduler.max_num_batched_tokens = s.budget_a, s.budget_b
    got: list = []
    if s.warm_blocks:
        warm = prompt[: s.warm_blocks * BS] + [rng.randrange(100, VOCAB) for _ in range(5)]
        a.add_request(EngineRequest("warm", tuple(warm), SamplingParams(max_tokens=30 if s.warm_running else 1)))
        while "warm" in a.requests and a.requests["warm"].num_computed_tokens < len(warm):
            a.step()  # its prompt's full blocks are in a's cache now (and shared while it runs)
    a.add_request(_target(s, prompt))
    others = sorted(s.others, key=lambda o: o[2])
    on, step = a, 0
    while True:
        while others and others[0][2] <= step:
            n, m, _ = others.pop(0)
            on.add_request(EngineRequest(f"o{len(s.others) - len(others)}", tuple(rng.randrange(100, VOCAB)
                                                                              for _ in range(n)),
                                         SamplingParams(max_tokens=m, temperature=0.8, seed=rng.randrange(99))))
        if "target" not in on.requests:
            break
        for o in on.step():
            if o.request_id == "target":
                got.append(o)
        step += 1
        if s.event != "none" and len(got) == (1 if s.event == "handoff" else s.at) and "target" in on.requests:
            ev, s.event = s.event, "none"
            if ev == "preempt":
                r = on.requests["target"]
                if r in on.scheduler.running:
                    on.scheduler.preempt(r)
            elif ev in ("migrate", "handoff"):
                migrate(on, b, "target")
                on = b
            elif ev == "resume":
                on.abort_request("target")
                b.add_request(_target(s, prompt, tuple(o.token_id for o in got)))
                on = b
    for eng in (a, b):  # the others finish; nothing is left behind
        while eng.has_work():
            eng.step()
        eng.check_integrity()
        assert eng.num_free_blocks == eng.num_total_blocks
    return got


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(s=scenarios())
def test_a_request_gives_what_it_gives_alone(engines, s):
    rng = random.Random(s.seed)
    prompt = [rng.randrange(100, VOCAB) for _ in range(s.prompt_len)]
    ref = engines["ref"]
    ref.add_request(_target(s, prompt))
    alone = []
    while ref.has_work():
        alone += ref.step()
    got = _play(s, engines, prompt, rng)
    assert [o.index for o in got] == list(range(s.max_tokens))
    assert _outputs(got) == _outputs(alone), f"{engines['dtype']}: {s}"


def test_the_mode_refuses_what_it_cannot_keep():
    """Blocks the kernel cannot attend over in place, CUDA, or no vLLM
    kernels: a clear EngineError, never a mode that is not one."""
    with pytest.raises(EngineError, match="multiple of 32"):
        create_engine(EngineConfig(engine="native", model="smollm2", block_size=16, num_blocks=8,
                                   deterministic=True, extra={"warmup": False}))
    with pytest.raises(EngineError, match="CPU only"):
        create_engine(EngineConfig(engine="native", model="smollm2", device="cuda", block_size=32, num_blocks=8,
                                   deterministic=True, extra={"warmup": False}))
    with pytest.raises(EngineError, match="vLLM's CPU kernels"):
        create_engine(EngineConfig(engine="native", model="smollm2", block_size=32, num_blocks=8,
                                   deterministic=True, extra={"warmup": False, "vllm_kernels": False}))


def test_the_default_mode_is_not_batch_invariant_here(engines):
    """Why the mode exists, shown on this CPU: without it, the same request
    computed as one prefill and as chunks of another budget beside other
    requests differs in its logprobs' last bits (the matmul kernels block by
    the number of rows). If a CPU's kernels ever were invariant at these sizes,
    this says so instead of passing silently."""
    dt = engines["dtype"]
    plain = [create_engine(EngineConfig(engine="native", model="smollm2", dtype=dt, block_size=BS, num_blocks=64,
                                        max_num_batched_tokens=budget,
                                        extra={"share_weights": True, "warmup": False})) for budget in (2048, 24)]
    rng = random.Random(0)
    prompt = [rng.randrange(100, VOCAB) for _ in range(120)]
    sp = SamplingParams(max_tokens=8, min_tokens=8, logprobs=0)
    runs = []
    for k, e in enumerate(plain):
        e.add_request(EngineRequest("t", tuple(prompt), sp))
        for j in range(k * 3):
            e.add_request(EngineRequest(f"o{j}", tuple(rng.randrange(100, VOCAB) for _ in range(40)),
                                        SamplingParams(max_tokens=8)))
        outs = []
        while e.has_work():
            outs += [o for o in e.step() if o.request_id == "t"]
        runs.append([o.logprobs.logprob for o in outs])
    if runs[0] == runs[1]:
        pytest.skip(f"this CPU's default kernels happened to be row-invariant here ({cpu_features.summary()})")
    assert max(abs(x - y) for x, y in zip(*runs)) < (0.5 if dt == "bfloat16" else 1e-3)


@pytest.mark.skipif(bool(CAPPED), reason="already a capped child")
@pytest.mark.parametrize("cap", list(cpu_features.CAPS))
def test_every_lower_cpu_kind_it_can_run(cap):
    """This test file again in a child capped at a lower kind (its oneDNN,
    MKL, torch and vLLM paths); on AMX the AVX-512 BF16 cap is its non-AMX path."""
    if cap not in cpu_features.caps_below():
        pytest.skip(f"{cap} is not below this CPU ({cpu_features.level()})")
    env = {**os.environ, **cpu_features.cap_env(cap), "FERRY_DETERMINISM_CAP": cap,
           "FERRY_DETERMINISM_EXAMPLES": "4",
           # the dtype dtype=auto picks on that kind: fp32 without BF16 arithmetic, else both
           "FERRY_DETERMINISM_DTYPES": "float32,bfloat16" if cap == "avx512_bf16" else "float32"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                           "-k", "gives_what_it_gives_alone"], env=env, capture_output=True, text=True,
                          timeout=1500, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
                              os.path.abspath(__file__))))))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


def test_a_refusal_of_the_mode_on_this_cpu_skips_and_any_other_error_fails():
    from tests.instance.engine.helpers import NOT_HERE

    def refused():
        raise EngineError(NOT_HERE[0] + " (AVX-512 with AMX, 2 threads): projection 1536 x 576 differs")

    with pytest.raises(pytest.skip.Exception, match="refused on this CPU"):
        deterministic_or_skip(refused)

    def broken():
        raise EngineError("the deterministic mode needs blocks of a multiple of 32 positions")

    with pytest.raises(EngineError):
        deterministic_or_skip(broken)
    assert deterministic_or_skip(lambda: 7) == 7


def test_prefill_first_scheduling_gives_what_the_request_gives_alone(engines):
    """vLLM 0.4's scheduling (--prefill-first: whole prompts in prefill-only
    steps, decodes only when nobody is admitted) changes which steps a
    request runs in and beside whom, never its tokens or logprobs."""
    dt, ref = engines["dtype"], engines["ref"]
    e = _engine(dt, 64, prefill_first=True, max_num_batched_tokens=1024)
    rng = random.Random(7)
    prompt = [rng.randrange(100, VOCAB) for _ in range(90)]
    s = Scenario(seed=7, prompt_len=90, max_tokens=8, sampling={"seed": 3, "temperature": 0.8}, budget_a=0,
                 budget_b=0, warm_blocks=0, warm_running=False)
    ref.add_request(_target(s, prompt))
    alone = []
    while ref.has_work():
        alone += ref.step()
    e.add_request(_target(s, prompt))
    got, step = [], 0
    while e.has_work():
        if step in (1, 3):  # prompts arrive while the target decodes: its next steps are prefill-only
            e.add_request(EngineRequest(f"o{step}", tuple(rng.randrange(100, VOCAB) for _ in range(60)),
                                        SamplingParams(max_tokens=5)))
        out = e.step()
        assert not (step in (1, 3) and any(o.request_id == "target" for o in out)), "a decode in a prefill step"
        got += [o for o in out if o.request_id == "target"]
        step += 1
    assert _outputs(got) == _outputs(alone)
    e.check_integrity()
