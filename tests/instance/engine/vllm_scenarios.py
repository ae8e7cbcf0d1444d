"""The vLLM engine's serving and migration hooks on one real vLLM engine,
run as ``python -m tests.instance.engine.vllm_scenarios`` in a process of its
own (vLLM keeps process-wide state: one engine per process, and it pins the
process's threads); prints one JSON object of facts that test_vllm.py checks.

A "self-migration" plays both ends of a migration on one engine: pre-copy
of full blocks while the request decodes, suspend, last stage, reserve +
scatter, install under a new id, drop the original."""

from __future__ import annotations

import json
import os
import sys

from libs.common.types import Priority, SamplingParams
from services.instance.engine.base import EngineConfig, EngineRequest

TEXT = ("Write a short story about a ferry that carries travellers across a wide river at night. "
        "The ferryman is old and knows every current; tonight a stranger asks him to cross twice.")
N = 40


def prompt_ids() -> tuple[int, ...]:
    from transformers import AutoTokenizer

    from libs.common.models import ensure_model

    ids = AutoTokenizer.from_pretrained(str(ensure_model("smollm2"))).apply_chat_template(
        [{"role": "user", "content": TEXT}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    return tuple(int(i) for i in ids)


PROMPT = prompt_ids()  # 2 full blocks of 32 and a partial one


def run(engine, stop_after: dict[str, int] | None = None) -> dict[str, list[int]]:
    """Step until idle or until a request in ``stop_after`` has that many tokens."""
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).append(o.token_id)
        if stop_after and any(len(out.get(r, [])) >= n for r, n in stop_after.items()):
            break
    return out


def settle(engine) -> dict:
    """Step until nothing is pending, then the pool's state."""
    for _ in range(4):
        engine.step()
    engine.check_integrity()
    return {"free": engine.num_free_blocks, "total": engine.num_total_blocks}


def main() -> None:
    from services.instance.engine.vllm.engine import VllmEngine

    e = VllmEngine(EngineConfig(engine="vllm", model="smollm2", num_blocks=64, block_size=32, max_model_len=512,
                                dtype="float32", max_num_seqs=8, extra={"vllm_args": "--enforce-eager"}))
    greedy = SamplingParams(max_tokens=N, ignore_eos=True)
    facts: dict = {"prompt_len": len(PROMPT), "migratable": e.migratable, "why": e.migration_error, "layout": e.kv_layout.__dict__,
                   "total": e.num_total_blocks, "block_size": e.block_size}

    from libs.common.kv_events import apply
    from libs.common.prefix_hash import block_hashes

    held: dict = {}
    apply(held, e.take_kv_events())  # recording on
    e.add_request(EngineRequest("ref", PROMPT, greedy))
    facts["ref"] = run(e)["ref"]
    facts["after_ref"] = settle(e)

    # Prefix caching (vLLM's own): the same prompt again hits its whole blocks;
    # the KV events, in Ferry's hashes, replay to what vLLM's cache holds.
    e.add_request(EngineRequest("again", PROMPT, greedy))
    facts["again"] = run(e)["again"]
    facts["prefix_stats"] = e.load().prefix_cache.__dict__
    apply(held, e.take_kv_events())
    facts["events_match_cache"] = set(held) == set(e.cached_hashes())
    facts["prompt_blocks_held"] = set(block_hashes(PROMPT, 32)) <= set(held)
    facts["after_again"] = settle(e)

    # Suspend (abort with the blocks held) and resume (KV copied back, no recompute).
    e.add_request(EngineRequest("sr", PROMPT, greedy))
    got = run(e, {"sr": 9})["sr"]
    facts["suspend"] = e.suspend_request("sr")
    facts["phase_suspended"] = e.request_phase("sr")[0]
    state = e.export_state("sr")
    facts["suspended_computed"] = state.num_computed_tokens
    facts["suspended_tokens"] = len(state.prompt_token_ids) + len(state.output_token_ids)
    facts["suspended_blocks"] = len(e.all_blocks("sr"))
    e.check_integrity()
    e.resume_request("sr")
    facts["resumed"] = got + run(e)["sr"]
    facts["after_resume"] = settle(e)

    # Self-migration: pre-copy, suspend, last stage, reserve, scatter, install, drop.
    # vLLM's cache holds the prompt's whole blocks (ref, again): the installed
    # incarnation hits them and the connector loads only the rest.
    loads = []
    orig = e.sconn.update_state_after_alloc

    def recording(request, blocks, num_external_tokens):
        loads.append(num_external_tokens)
        return orig(request, blocks, num_external_tokens)

    e.sconn.update_state_after_alloc = recording
    e.add_request(EngineRequest("mig", PROMPT, greedy))
    got = run(e, {"mig": 20})["mig"]
    first = e.full_blocks("mig")
    staged = bytes(e.gather_kv(first))
    got += run(e, {"mig": 4})["mig"]  # decodes on while the stage "travels"
    assert e.suspend_request("mig")
    state = e.export_state("mig")
    rest = e.all_blocks("mig")[len(first):]
    staged += bytes(e.gather_kv(rest))
    dst = e.reserve_blocks(len(first) + len(rest))
    facts["reserved_in_load"] = e.load().reserved_blocks
    e.scatter_kv(dst, staged)
    state.request_id = "mig2"
    e.install_request(state, dst)
    e.drop_request("mig")
    e.check_integrity()
    facts["migrated"] = got + run(e)["mig2"]
    facts["migrate_load"] = {"computed": state.num_computed_tokens, "loads": loads}
    e.sconn.update_state_after_alloc = orig
    facts["after_migrate"] = settle(e)

    # Negative control: the same migration with the KV zeroed in transit must
    # change the output (the exact-token checks above can fail).
    e.add_request(EngineRequest("bad", PROMPT, greedy))
    got = run(e, {"bad": 20})["bad"]
    assert e.suspend_request("bad")
    state = e.export_state("bad")
    blocks = e.all_blocks("bad")
    dst = e.reserve_blocks(len(blocks))
    e.scatter_kv(dst, bytes(len(blocks) * e.kv_layout.bytes_per_block))
    state.request_id = "bad2"
    e.install_request(state, dst)
    e.drop_request("bad")
    facts["zeroed_kv_output"] = got + run(e)["bad2"]
    settle(e)

    # Destination aborts: a reservation released, an installed request aborted before it ran.
    ids = e.reserve_blocks(5)
    e.scatter_kv(ids, bytes(5 * e.kv_layout.bytes_per_block))
    e.release_blocks(ids)
    ids = e.reserve_blocks(-(-state.num_computed_tokens // e.block_size))
    state.request_id = "never"
    e.install_request(state, ids)
    facts["abort_installed"] = e.abort_request("never")
    facts["after_dest_aborts"] = settle(e)
    facts["reserve_too_many"] = e.reserve_blocks(e.num_total_blocks + 1)

    # Suspended then dropped (the commit succeeded elsewhere), and aborted while suspended.
    for rid, end in (("dropped", e.drop_request), ("aborted", e.abort_request)):
        e.add_request(EngineRequest(rid, PROMPT, greedy))
        run(e, {rid: 5})
        assert e.suspend_request(rid)
        end(rid)
        facts[f"after_{rid}"] = settle(e)

    # Lite serving: stop tokens, seeds, priority order, abort mid-stream, bad input.
    stop_at = facts["ref"][5]
    e.add_request(EngineRequest("stop", PROMPT, SamplingParams(max_tokens=N, stop_token_ids=(stop_at,),
                                                                  ignore_eos=True)))
    facts["stopped"] = run(e)["stop"]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    for rid in ("s1", "s2"):
        e.add_request(EngineRequest(rid, PROMPT, seeded))
    out = run(e)
    facts["seeded_equal"] = out["s1"] == out["s2"]
    e.add_request(EngineRequest("ab", PROMPT, greedy))
    run(e, {"ab": 3})
    facts["abort_running"] = e.abort_request("ab")
    facts["abort_unknown"] = e.abort_request("nope")
    facts["after_lite"] = settle(e)
    try:
        e.add_request(EngineRequest("long", tuple(range(600)), greedy))
        facts["too_long"] = "accepted"
    except Exception as ex:  # noqa: BLE001
        facts["too_long"] = type(ex).__name__
    # A prompt vLLM computes in chunks (its token budget lowered for the
    # purpose): the load counts what the running request has left of it.
    budget = e.scheduler.max_num_scheduled_tokens
    e.scheduler.max_num_scheduled_tokens = 16
    e.add_request(EngineRequest("chunked", tuple(range(1000, 1150)), SamplingParams(max_tokens=2, ignore_eos=True)))
    facts["chunk_left"] = []
    for _ in range(2):
        e.step()
        facts["chunk_left"].append(e.load().running_prefill_tokens)
    e.scheduler.max_num_scheduled_tokens = budget
    run(e)
    facts["chunk_left_after"] = e.load().running_prefill_tokens
    facts["after_chunked"] = settle(e)
    # Priority: Ferry's HIGH is vLLM's lower value (served first by its priority policy).
    e.add_request(EngineRequest("lo", PROMPT, SamplingParams(max_tokens=2, ignore_eos=True), Priority.NORMAL, 1.0))
    e.add_request(EngineRequest("hi", PROMPT, SamplingParams(max_tokens=2, ignore_eos=True), Priority.HIGH, 2.0))
    load = e.load()
    facts["waiting_before"] = sorted(r.request_id for r in load.requests if r.state == "waiting")
    facts["head_of_line"] = load.head_of_line_demand_blocks
    facts["vllm_priorities"] = {rid: e._vreq(e.reqs[rid]).priority for rid in ("lo", "hi")}
    run(e)
    facts["end"] = settle(e)
    apply(held, e.take_kv_events())
    facts["events_match_cache_at_end"] = set(held) == set(e.cached_hashes()) and len(held) > 0
    print("FACTS " + json.dumps(facts), flush=True)
    sys.stdout.flush()
    os._exit(0)  # vLLM's teardown is slow and noisy; nothing is left to save


if __name__ == "__main__":
    main()
