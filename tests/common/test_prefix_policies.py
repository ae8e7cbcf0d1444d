"""The prefix-aware policies (libs/common/policies: llumnix-prefix,
llmd-prefix, dynamo-kv, sglang-cache-aware) on hand-made views: one cluster
where each of them, and prefix-blind llumnix, picks a different instance,
each for its own reason; SGLang's balance guard and match threshold;
llumnix-prefix is llumnix where no instance holds a prefix and none queues;
llumnix-keep's program dispatch (a returning turn goes to the instance
holding its KV unless it does not fit there or prefills sooner elsewhere)."""

import random

import pytest

from libs.common.policies import Dispatcher, DispatchRequest, InstanceView, get, hit_blocks
from libs.common.policies import dynamo_kv, llmd_prefix, llumnix_keep, llumnix_prefix, sglang_cache_aware
from libs.common.types import InstanceStatus

BS, TOTAL = 16, 1000
PROMPT = 1600  # 100 blocks


def view(iid, used=0, running=0, waiting=0, waiting_demand=0, hol=0, pending_blocks=0, pending_requests=0,
         running_prefill=0):
    free = TOTAL - used
    st = InstanceStatus(iid, total_blocks=TOTAL, free_blocks=free, block_size=BS, num_running=running,
                        num_waiting=waiting, head_of_line_demand_blocks=hol, waiting_demand_blocks=waiting_demand,
                        freeness=(free - hol) / max(1, running), used_blocks=used,
                        running_prefill_tokens=running_prefill)
    return InstanceView(iid, st, pending_blocks, pending_requests)


def request(hits, prompt=PROMPT):
    return DispatchRequest("r", prompt, prefix_blocks=prompt // BS, hits=hits)


# A: the longest prefix (90 of 100 blocks) but full and queued; B: 80 blocks,
# half full, 60 running; C: idle, nothing cached; D: 40 blocks, nearly
# empty; F: 50 blocks, 40% full, 10 running.
CLUSTER = [view("A", used=900, running=20, waiting=10, waiting_demand=300, hol=30),
           view("B", used=500, running=60),
           view("C"),
           view("D", used=20, running=5),
           view("F", used=400, running=10)]
HITS = {"A": 90, "B": 80, "D": 40, "F": 50}


@pytest.mark.parametrize("policy, expected", [
    # prefix-blind: the freest after placing 100 blocks (C: 900 free for 1 request)
    ("llumnix", "C"),
    # A does not fit net of its hit; B would be left with 7.9 free blocks per
    # request (< 10); of the roomy C, D, F the least missed + queued prefill:
    # F misses 800 tokens, D 960, C 1600
    ("llumnix-prefix", "F"),
    # 2 x fraction + free KV + queue score: A 1.8+0.1+0, B 1.6+0.5+1, C 0+1+1, D 0.8+0.98+1, F 1.0+0.6+1
    ("llmd-prefix", "B"),
    # prefill blocks + active blocks: A 310+910, B 20+520, C 100+100, D 60+80, F 50+450
    ("dynamo-kv", "D"),
    # loads 30/60/0/5/10 differ by 60 <= 64: balanced; A matches 0.9 > 0.3
    ("sglang-cache-aware", "A"),
])
def test_each_policy_chooses_by_its_own_rule(policy, expected):
    assert Dispatcher(get(policy)).choose(CLUSTER, request(HITS)) == expected


def test_the_terms_behind_the_choices():
    req = request(HITS)
    v = {x.instance_id: x for x in CLUSTER}
    assert [hit_blocks(v[i], req) for i in "ABCDF"] == [90, 80, 0, 40, 50]
    assert llumnix_prefix.prefix_key(v["A"], req)[0] == 0  # does not fit
    assert llumnix_prefix.prefix_key(v["B"], req)[0] == 1  # fits, not roomy
    assert llumnix_prefix.prefix_key(v["F"], req)[:2] == (2, -(PROMPT - 50 * BS))
    s = llmd_prefix.scores(CLUSTER, req)
    assert s["B"] == pytest.approx(3.1) and s["A"] == pytest.approx(1.9) and s["C"] == pytest.approx(2.0)
    assert [dynamo_kv.cost(v[i], req) for i in "ABCDF"] == [1220, 540, 200, 140, 500]
    assert sglang_cache_aware.match_rate(v["A"], req) == pytest.approx(0.9)


def test_a_hit_is_capped_to_leave_one_token_to_compute():
    # a prompt of exactly 2 blocks held whole: the engine recomputes its last block
    req = DispatchRequest("r", 2 * BS, prefix_blocks=2, hits={"A": 2})
    assert hit_blocks(view("A"), req) == 1
    assert hit_blocks(view("B"), req) == 0


def test_sglang_goes_to_the_least_loaded_when_imbalanced_or_nothing_matches():
    busy = [view("A", used=900, running=100), view("C"), view("D", used=20, running=5)]
    # imbalanced (100 vs 0: > 64 and > 1.5x): A's 0.9 match is ignored
    assert Dispatcher(get("sglang-cache-aware")).choose(busy, request({"A": 90})) == "C"
    # balanced, but the best match (D: 0.25) is under the 0.3 threshold
    assert Dispatcher(get("sglang-cache-aware")).choose(CLUSTER, request({"D": 25})) == "C"
    assert Dispatcher(get("sglang-cache-aware")).choose(CLUSTER, request({"D": 25, "F": 31})) == "F"


def test_llumnix_prefix_queued_prefill_outweighs_a_short_hit():
    # X has 800 tokens of prompts queued; Y holds nothing and has no queue.
    # Holding 10 blocks, X costs 1,440 + 800 tokens > Y's 1,600; holding 90, 160 + 800.
    x = view("X", used=100, running=2, waiting=2, waiting_demand=50)
    y = view("Y", used=100, running=2)
    assert Dispatcher(get("llumnix-prefix")).choose([x, y], request({"X": 10})) == "Y"
    assert Dispatcher(get("llumnix-prefix")).choose([x, y], request({"X": 90})) == "X"


@pytest.mark.parametrize("policy", ["llumnix-prefix", "dynamo-kv"])
def test_a_prompt_still_computed_in_chunks_counts_as_queued_prefill(policy):
    # X holds 40 of the prompt's 100 blocks, and a running request there has
    # 1,600 prompt tokens left to compute in chunks; Y holds nothing, idle.
    # Without those tokens X is cheaper (960 missed against 1,600); with them
    # 2,560 against 1,600.
    y = view("Y", used=100, running=2)
    busy = view("X", used=100, running=2, running_prefill=1600)
    idle = view("X", used=100, running=2)
    assert Dispatcher(get(policy)).choose([idle, y], request({"X": 40})) == "X"
    assert Dispatcher(get(policy)).choose([busy, y], request({"X": 40})) == "Y"


def test_llumnix_prefix_is_llumnix_without_hits_or_queues():
    rng = random.Random(7)
    blind, prefix = Dispatcher(get("llumnix")), Dispatcher(get("llumnix-prefix"))
    for _ in range(300):
        views = [view(f"i{k}", used=rng.randrange(0, TOTAL), running=rng.randrange(0, 50)) for k in range(5)]
        req = DispatchRequest("r", rng.randrange(1, 3000))
        assert prefix.choose(views, req) == blind.choose(views, req)


def test_prefix_blind_policies_ignore_hits():
    for name in ("llumnix", "llumnix_base", "infaas++"):
        d = Dispatcher(get(name))
        assert d.choose(CLUSTER, request(HITS)) == d.choose(CLUSTER, request({}))


def test_splitwise_decode_choice_counts_the_prefix_the_decode_instance_holds():
    from dataclasses import replace

    from libs.common.policies.phases import place
    from libs.common.types import Role

    def role(v, r):
        return replace(v, status=replace(v.status, role=r))

    p = role(view("P"), Role.PREFILL)
    d1, d2 = role(view("D1", used=100, running=2), Role.DECODE), role(view("D2", used=100, running=2), Role.DECODE)
    # D2 holds the prompt: the handoff links it there and sends only the rest
    placed = place(Dispatcher(get("llumnix-prefix")), [p, d1, d2], request({"D2": 90}))
    assert placed.prefill == "P" and placed.decode == "D2"
    # held nowhere: the tie goes to the lowest id
    placed = place(Dispatcher(get("llumnix-prefix")), [p, d1, d2], request({}))
    assert placed.prefill == "P" and placed.decode == "D1"


# A program's returning turn (100 blocks): H holds 80 blocks of it (its kept
# history) but is tight: 900 used, 10 running, so 80 free blocks for 11
# requests after placing its 20 missed blocks (7.3 < ROOMY); R is roomy and
# holds only the shared 18-block system prompt.
HOME = view("H", used=900, running=10)
ROOMY_VIEW = view("R", used=100, running=5)
PROGRAM_HITS = {"H": 80, "R": 18}


def turn(hits, program="p1", seen=5):
    return DispatchRequest("t", PROMPT, prefix_blocks=PROMPT // BS, hits=hits, program_id=program,
                           program_turn=seen if program else -1)


def test_a_returning_turn_goes_home_where_llumnix_prefix_leaves_it():
    cluster, req = [HOME, ROOMY_VIEW], turn(PROGRAM_HITS)
    assert llumnix_prefix.prefix_key(HOME, req)[0] == 1  # fits, not roomy: llumnix-prefix goes to R
    assert Dispatcher(get("llumnix-prefix")).choose(cluster, req) == "R"
    # home: 320 missed tokens, nothing queued; R: 1600 - 18 x 16 = 1312 recomputed
    assert llumnix_keep.prefill_cost(HOME, req) == 320 and llumnix_keep.prefill_cost(ROOMY_VIEW, req) == 1312
    assert Dispatcher(get("llumnix-keep")).choose(cluster, req) == "H"
    # a request of no program is dispatched as llumnix-prefix does
    assert Dispatcher(get("llumnix-keep")).choose(cluster, turn(PROGRAM_HITS, program="")) == "R"


def test_an_overloaded_home_or_a_longer_wait_there_sends_the_turn_elsewhere():
    full = view("H", used=990, running=10)  # 20 missed blocks do not fit beside 990 used
    assert llumnix_keep.overloaded(full, turn(PROGRAM_HITS))
    assert Dispatcher(get("llumnix-keep")).choose([full, ROOMY_VIEW], turn(PROGRAM_HITS)) == "R"
    # fits, but 1,000 prompt tokens queued there: 1,320 to compute before its first token > R's 1,312
    busy = view("H", used=900, running=10, running_prefill=1000)
    assert not llumnix_keep.overloaded(busy, turn(PROGRAM_HITS))
    assert Dispatcher(get("llumnix-keep")).choose([busy, ROOMY_VIEW], turn(PROGRAM_HITS)) == "R"
    # 990 queued: 1,310 <= 1,312, home
    near = view("H", used=900, running=10, running_prefill=990)
    assert Dispatcher(get("llumnix-keep")).choose([near, ROOMY_VIEW], turn(PROGRAM_HITS)) == "H"


def test_a_returning_turn_whose_home_holds_only_the_shared_prompt_is_dispatched_as_llumnix_prefix():
    # the system prompt cached on both: the home (lowest id of equal hits) holds no more than R
    req = turn({"H": 18, "R": 18})
    assert llumnix_keep.home([HOME, ROOMY_VIEW], req)[0].instance_id == "H"
    assert Dispatcher(get("llumnix-keep")).choose([HOME, ROOMY_VIEW], req) == "R"
    assert llumnix_keep.home([HOME, ROOMY_VIEW], turn({}))[0] is None


def test_a_first_turn_goes_to_the_freest_not_to_the_shared_prompt():
    # S holds the 18-block system prompt, roomy (300 used, 5 running); E is empty
    s, e = view("S", used=300, running=5), view("E")
    first = turn({"S": 18}, seen=0)
    assert Dispatcher(get("llumnix-prefix")).choose([s, e], first) == "S"  # 288 tokens less to prefill
    assert Dispatcher(get("llumnix-keep")).choose([s, e], first) == "E"
    # counted by the ledger as a later turn (or not counted): the rule for returning turns, home S
    assert Dispatcher(get("llumnix-keep")).choose([s, e], turn({"S": 18}, seen=1)) == "S"
    assert Dispatcher(get("llumnix-keep")).choose([s, e], turn({"S": 18}, seen=-1)) == "S"
    # where it fits nowhere: the smallest shortfall, as llumnix-prefix
    full = [view("S", used=995, running=5), view("E", used=990, running=5)]
    assert Dispatcher(get("llumnix-keep")).choose(full, first) == Dispatcher(get("llumnix-prefix")).choose(full, first)


def test_the_ledger_counts_turns_before_each_dispatch():
    from libs.common.programs import ProgramLedger
    ledger = ProgramLedger()
    assert ledger.turns_before("") == -1 and ledger.turns_before("p") == 0
    ledger.record("p", 100, 0, 1.0)
    ledger.record("p", 200, 100, 2.0)
    assert ledger.turns_before("p") == 2 and ledger.turns_before("q") == 0


def test_program_dispatch_equals_llumnix_prefix_on_the_prefix_cluster():
    # no program named: the five-instance cluster above picks F under both
    assert Dispatcher(get("llumnix-keep")).choose(CLUSTER, request(HITS)) == "F"
    # named: the home A does not fit, so F still
    assert Dispatcher(get("llumnix-keep")).choose(CLUSTER, turn(HITS)) == "F"
