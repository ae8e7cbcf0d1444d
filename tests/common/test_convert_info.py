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
