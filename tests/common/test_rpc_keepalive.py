"""Inner calls cannot hang on a peer that is gone without a word: every
channel (libs/common/rpc.py) pings its peer, so a long stream on a frozen
process (SIGSTOP: its sockets stay open, nothing answers) ends within the
keepalive time plus its timeout, not TCP's minutes."""

import asyncio
import signal
import subprocess
import time

from ferry.cluster import ferry_command, free_port, grpc_healthy
from libs.common.cluster_view import ClusterView
from libs.common.rpc import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS


async def test_a_watch_on_a_frozen_meta_store_ends_within_the_keepalive():
    port = free_port()
    proc = subprocess.Popen(ferry_command(["serve", "meta-store", "--port", str(port), "--log-level", "warning"]))
    try:
        address = f"127.0.0.1:{port}"
        for _ in range(300):
            if await asyncio.to_thread(grpc_healthy, address):
                break
            await asyncio.sleep(0.05)
        view = ClusterView(address)
        view.start()
        await asyncio.wait_for(view.synced.wait(), 10)
        assert view.connected
        proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        limit = (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000 + 5
        while view.connected and time.monotonic() - t0 < limit + 10:
            await asyncio.sleep(0.1)
        noticed = time.monotonic() - t0
        print(f"frozen peer noticed after {noticed:.1f}s")
        assert not view.connected and noticed < limit
        await view.stop()
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)
