from libs.common import convert
from libs.common.types import InstanceInfo


def test_instance_info_round_trips_the_no_migration_reason():
    info = InstanceInfo("i", "127.0.0.1:1", "vllm", "m", 32, 64, 1024, 5, no_migration="user connector")
    assert convert.info_from_pb(convert.info_to_pb(info)) == info
    assert convert.info_from_pb(convert.info_to_pb(InstanceInfo("j", "a", "native", "m", 16, 8, 64))).no_migration == ""


def test_instance_status_round_trips_the_role():
    import pytest

    from libs.common.errors import InvalidArgument
    from libs.common.types import InstanceStatus, Role

    for role in Role:
        st = InstanceStatus("i", seq=3, total_blocks=10, free_blocks=4, role=role)
        assert convert.status_from_pb(convert.status_to_pb(st)) == st
    assert convert.role_from_pb(convert.role_to_pb(Role.DECODE)) is Role.DECODE
    with pytest.raises(InvalidArgument, match="unknown instance role 9"):
        convert.role_from_pb(9)


def test_every_field_of_a_status_and_its_requests_comes_across():
    """status_from_pb fills the dataclasses field by field (their __dict__):
    a field it left out would read its default. Every field here differs
    from its default, so one left out fails the comparison."""
    import dataclasses

    from libs.common.types import InstanceStatus, PrefixCacheStats, Priority, RequestLoad, RequestPhase, Role

    loads = (RequestLoad("r1", Priority.HIGH, RequestPhase.RUNNING, 3, 40, 2.5),
             RequestLoad("r2", Priority.NORMAL, RequestPhase.MIGRATING, 1, 7, 0.5))
    prefix = PrefixCacheStats(**{f.name: (True if f.type in (bool, "bool") else i + 1)
                                 for i, f in enumerate(dataclasses.fields(PrefixCacheStats))})
    special = {"instance_id": "i9", "requests": loads, "role": Role.DECODE, "prefix_cache": prefix}
    values = {}
    for i, f in enumerate(dataclasses.fields(InstanceStatus)):
        if f.name in special:
            values[f.name] = special[f.name]
        elif f.type in (bool, "bool"):
            values[f.name] = True
        elif f.type in (float, "float"):
            values[f.name] = i + 0.25
        else:
            values[f.name] = i + 1
    st = InstanceStatus(**values)
    for f in dataclasses.fields(InstanceStatus):
        assert getattr(st, f.name) != f.default, f.name  # the test's own premise
    back = convert.status_from_pb(convert.status_to_pb(st))
    assert back == st and back.requests == loads and back.prefix_cache == prefix
    assert dataclasses.asdict(back) == dataclasses.asdict(st)
    assert hash(back.requests[0]) == hash(loads[0]) and back.requests[0].priority is Priority.HIGH
    # Frozen as ever; replace() makes a copy through __init__.
    import pytest

    with pytest.raises(dataclasses.FrozenInstanceError):
        back.seq = 1
    assert dataclasses.replace(back, seq=1).seq == 1
    # No prefix-cache stats on the wire: the default.
    assert convert.status_from_pb(convert.status_to_pb(InstanceStatus("j"))) == InstanceStatus("j")
