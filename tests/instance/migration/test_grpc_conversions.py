"""The migration messages across the gRPC edge: what prefix-aware migration
adds (the link request, the linked count, the order's linkable prefixes)
survives protobuf both ways."""

from __future__ import annotations

from libs.common import convert
from libs.common.types import MigrateOutOrder, OrderResult, Outcome
from libs.pb import instance_pb2 as pb
from services.instance.engine.base import KvLayout
from services.instance.migration.grpc_peer import (
    pre_allocate_from_pb,
    pre_allocate_to_pb,
)
from services.instance.migration.messages import PreAllocate

LAYOUT = KvLayout("float32", 16, 2, 2, 8)


def test_a_first_pre_allocation_asks_to_link_and_keeps_its_hashes():
    p = PreAllocate("m", "r", 0, 5, LAYOUT, 3000, "src", 3, block_hashes=(11, 12, 13), link=True)
    assert pre_allocate_from_pb(pre_allocate_to_pb(p)) == p
    q = PreAllocate("m", "r", 1, 2, LAYOUT, 3000, "src")
    assert pre_allocate_from_pb(pre_allocate_to_pb(q)) == q and not q.link


def test_an_outcome_carries_the_linked_blocks_and_an_order_the_linkable_ones():
    o = Outcome("m", "r", True, blocks=3, bytes=384, linked_blocks=4)
    assert convert.outcome_to_pb(o).linked_blocks == 4
    order = convert.migrate_out_from_pb(pb.MigrateOutRequest(dest_instance_id="d", dest_address="a:1",
                                               linkable_blocks={"r1": 4, "r2": 1}))
    assert order.linkable == {"r1": 4, "r2": 1}
    assert convert.migrate_out_from_pb(pb.MigrateOutRequest(dest_instance_id="d")).linkable == {}


def test_an_order_and_its_result_survive_protobuf_both_ways():
    """The scheduler's side (libs/common/instance_client.py) sends what the instance's side reads."""
    order = MigrateOutOrder("d", "a:1", 12.5, max_requests=1, request_id="r7", use_priorities=True,
                            linkable={"r7": 3}, pick="last_running")
    assert convert.migrate_out_from_pb(convert.migrate_out_to_pb(order)) == order
    result = OrderResult(2, 1, 1, [Outcome("m1", "r1", True, stages=3, blocks=9, bytes=1152, duration_ms=4.0,
                                           downtime_ms=1.5, commit_ack_ms=0.5, suspended_at=1.0e9, linked_blocks=2),
                                   Outcome("m2", "r2", False, reason="refused")])
    assert convert.order_result_from_pb(convert.order_result_to_pb(result)) == result
