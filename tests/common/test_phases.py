"""Splitwise's two-step dispatch over snapshots (libs/common/policies/phases.py)."""

import pytest

from libs.common.policies import Dispatcher, DispatchRequest, InstanceView
from libs.common.policies.phases import (
    HandoffMode,
    Phase,
    choose_for_phase,
    handoff_mode,
    is_split,
    needs_handoff,
    phase_views,
)
from libs.common.types import InstanceStatus, Role


def view(iid: str, role: Role, free: int, total: int = 100) -> InstanceView:
    st = InstanceStatus(instance_id=iid, total_blocks=total, free_blocks=free, block_size=16, role=role,
                        virtual_usage=total - free, freeness=float(free))
    return InstanceView(iid, st)


def test_role_parse():
    assert Role.parse(None) is Role.MIXED
    assert Role.parse(" Prefill ") is Role.PREFILL
    assert Role.parse(Role.DECODE) is Role.DECODE
    with pytest.raises(ValueError, match="unknown instance role 'both'"):
        Role.parse("both")
    assert Role.PREFILL.prefills and not Role.PREFILL.decodes
    assert Role.DECODE.decodes and not Role.DECODE.prefills
    assert Role.MIXED.prefills and Role.MIXED.decodes


def test_prefill_goes_to_prefill_pool_even_when_decode_is_freer():
    views = [view("p0", Role.PREFILL, 10), view("d0", Role.DECODE, 90)]
    d = Dispatcher("infaas++")
    req = DispatchRequest("r", num_prompt_tokens=64)
    assert choose_for_phase(d, views, req, Phase.PREFILL) == "p0"
    assert choose_for_phase(d, views, req, Phase.DECODE) == "d0"


def test_mixed_instances_serve_both_phases_by_score():
    views = [view("p0", Role.PREFILL, 10), view("m0", Role.MIXED, 50), view("d0", Role.DECODE, 30)]
    d = Dispatcher("infaas++")
    req = DispatchRequest("r", num_prompt_tokens=64)
    assert choose_for_phase(d, views, req, Phase.PREFILL) == "m0"
    assert choose_for_phase(d, views, req, Phase.DECODE) == "m0"


def test_no_instance_of_the_phase_keeps_everyone():
    views = [view("p0", Role.PREFILL, 10), view("p1", Role.PREFILL, 20)]
    assert [v.instance_id for v in phase_views(views, Phase.DECODE)] == ["p0", "p1"]
    assert not is_split([view("m0", Role.MIXED, 1)])
    assert is_split(views)


def test_handoff_rules():
    assert needs_handoff(Role.PREFILL)
    assert not needs_handoff(Role.MIXED) and not needs_handoff(Role.DECODE)
    assert handoff_mode(100, 512) is HandoffMode.SERIALIZED
    assert handoff_mode(512, 512) is HandoffMode.PER_LAYER
    assert handoff_mode(4096, 0) is HandoffMode.SERIALIZED  # threshold 0: per-layer off


def test_place_both_steps_at_dispatch():
    from libs.common.policies.phases import Placement, place

    views = [view("p0", Role.PREFILL, 10), view("p1", Role.PREFILL, 40), view("d0", Role.DECODE, 30),
             view("d1", Role.DECODE, 80)]
    d = Dispatcher("llumnix")
    assert place(d, views, DispatchRequest("r", 64)) == Placement("p1", "d1")
    # The request failed on p1 (resume after a crash): the other prefill instance.
    assert place(d, views, DispatchRequest("r", 64, exclude=frozenset({"p1"}))) == Placement("p0", "d1")


def test_place_without_a_split_is_the_one_step_choice():
    from libs.common.policies.phases import Placement, place

    views = [view("m0", Role.MIXED, 10), view("m1", Role.MIXED, 50)]
    assert place(Dispatcher("llumnix"), views, DispatchRequest("r", 64)) == Placement("m1", None)
    assert place(Dispatcher("llumnix"), [], DispatchRequest("r", 64)) is None


def test_place_on_a_mixed_or_decode_instance_needs_no_handoff():
    from libs.common.policies.phases import Placement, place

    views = [view("p0", Role.PREFILL, 10), view("m0", Role.MIXED, 60), view("d0", Role.DECODE, 90)]
    assert place(Dispatcher("llumnix"), views, DispatchRequest("r", 64)) == Placement("m0", None)


def test_place_every_prefill_instance_excluded_falls_back_to_the_others():
    """The only prefill instance died with the request: it resumes on a
    decode instance (colocated) rather than nowhere."""
    from libs.common.policies.phases import Placement, place

    views = [view("p0", Role.PREFILL, 10), view("d0", Role.DECODE, 90)]
    assert place(Dispatcher("llumnix"), views, DispatchRequest("r", 64, exclude=frozenset({"p0"}))) == \
        Placement("d0", None)


def test_place_no_decode_instance_left_decodes_where_it_prefills():
    from libs.common.policies.phases import Placement, place

    views = [view("p0", Role.PREFILL, 10), view("d0", Role.DECODE, 90)]
    assert place(Dispatcher("llumnix"), views, DispatchRequest("r", 64, exclude=frozenset({"d0"}))) == \
        Placement("p0", None)
    views = [view("p0", Role.PREFILL, 10), view("p1", Role.PREFILL, 20)]
    assert place(Dispatcher("llumnix"), views, DispatchRequest("r", 64)) == Placement("p1", None)
