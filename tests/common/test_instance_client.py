"""libs/common/instance_client.py: the control plane's one way to an
instance. Channels are kept one per address and go when the last instance
at that address leaves (or moves); a call to an address nobody answers is a
FerryError the loops handle, not a gRPC exception; and the simulator's
clients run an order on the simulated source's own migration manager."""

from __future__ import annotations

import pytest

from libs.common.errors import FerryError
from libs.common.instance_client import GrpcInstanceClients
from libs.common.types import MigrateOutOrder


async def test_one_channel_per_address_kept_until_its_last_instance_leaves():
    clients = GrpcInstanceClients()
    clients("a", "127.0.0.1:1")
    clients("b", "127.0.0.1:1")
    clients("c", "127.0.0.1:2")
    assert clients.open_channels == 2
    clients.forget("a")
    assert clients.open_channels == 2  # b is still reached there
    clients.forget("b")
    assert clients.open_channels == 1
    clients("c", "127.0.0.1:3")  # c restarted elsewhere: its old channel goes
    assert clients.open_channels == 1
    clients.forget("nobody")
    await clients.close()
    assert clients.open_channels == 0


async def test_an_unreachable_instance_is_a_ferry_error():
    from ferry.cluster import free_port

    clients = GrpcInstanceClients(timeout_s=1.0, order_timeout_s=1.0)
    try:
        client = clients("gone", f"127.0.0.1:{free_port()}")
        with pytest.raises(FerryError):
            await client.status()
        with pytest.raises(FerryError):
            await client.migrate_out(MigrateOutOrder("d", "127.0.0.1:1"))
    finally:
        await clients.close()
