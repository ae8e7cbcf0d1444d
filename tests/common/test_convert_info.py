from libs.common import convert
from libs.common.types import InstanceInfo


def test_instance_info_round_trips_the_no_migration_reason():
    info = InstanceInfo("i", "127.0.0.1:1", "vllm", "m", 32, 64, 1024, 5, no_migration="user connector")
    assert convert.info_from_pb(convert.info_to_pb(info)) == info
    assert convert.info_from_pb(convert.info_to_pb(InstanceInfo("j", "a", "native", "m", 16, 8, 64))).no_migration == ""
