"""The KV cache in shared memory (shared_kv.py): another process maps it
read-only and sees its blocks; a wrong name, size or pid is refused; the fake
engine's cache lives in it and a grown cache is another region with the same
blocks."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from services.instance.engine import shared_kv
from services.instance.engine.fake import TokenKvExecutor
from services.instance.engine.shared_kv import KvShareError, PeerKv, SharedRegion, runs

pytestmark = pytest.mark.skipif(not shared_kv.supported(), reason="needs memfd_create and /proc")

BPB = 4096


def region_with_blocks(n: int = 8) -> SharedRegion:
    r = SharedRegion(n * BPB, "test")
    arr = np.frombuffer(r.buffer, dtype=np.uint8).reshape(n, BPB)
    for b in range(n):
        arr[b] = b + 1
    return r


def test_another_process_reads_the_blocks_and_sees_later_writes():
    r = region_with_blocks()
    s = r.share
    code = (
        "import sys, time\n"
        "from services.instance.engine.shared_kv import KvShare, PeerKv\n"
        f"p = PeerKv(KvShare({s.pid}, {s.fd}, {s.name!r}, {s.size}), {BPB})\n"
        "print(p.num_blocks, bytes(p.blocks(2, 3))[::4096].hex(), flush=True)\n"
        "sys.stdin.readline()\n"
        "print(bytes(p.blocks(7, 1))[:1].hex(), flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().split() == ["8", "030405"]
        np.frombuffer(r.buffer, dtype=np.uint8)[7 * BPB] = 0xAB  # written here after the peer mapped it
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "ab"
    finally:
        proc.kill()
        proc.wait()


def test_a_share_that_is_not_the_cache_is_refused():
    r = region_with_blocks()
    s = r.share
    other = SharedRegion(8 * BPB, "test")  # a cache of this process too, another nonce
    with pytest.raises(KvShareError, match="not the source's KV cache"):
        PeerKv(dataclasses.replace(s, fd=other.fd), BPB)  # fd of another memfd (a recycled number)
    with pytest.raises(KvShareError, match="announced"):
        PeerKv(dataclasses.replace(s, size=16 * BPB), BPB)
    with pytest.raises(KvShareError, match="cannot open"):
        PeerKv(dataclasses.replace(s, pid=2**22 + 7), BPB)  # no such process
    with pytest.raises(KvShareError, match="not a KV cache"):
        PeerKv(s, 3000)  # the size is not whole blocks of the layout
    p = PeerKv(s, BPB)
    with pytest.raises(KvShareError, match="blocks 7..9"):
        p.blocks(7, 2)
    assert bytes(p.blocks(7, 1))[:2] == b"\x08\x08"


def test_a_closed_region_cannot_be_mapped_but_stays_valid_here():
    r = region_with_blocks()
    s = r.share
    r.close()
    with pytest.raises(KvShareError):
        PeerKv(s, BPB)
    assert np.frombuffer(r.buffer, dtype=np.uint8)[3 * BPB] == 4


def test_runs_of_consecutive_ids():
    assert runs([]) == []
    assert runs([5, 6, 7, 2, 3, 9]) == [(0, 5, 3), (3, 2, 2), (5, 9, 1)]
    assert runs([4, 4]) == [(0, 4, 1), (1, 4, 1)]


def test_fake_cache_is_shared_and_a_grown_cache_is_another_region_with_the_same_blocks():
    ex = TokenKvExecutor(4, 16)
    ex.cache[2, 0, 0, 5, 0, 0] = 42.0
    s = ex.kv_share()
    assert s is not None and s.size == 4 * ex.kv_layout.bytes_per_block
    assert bytes(PeerKv(s, ex.kv_layout.bytes_per_block).blocks(2, 1)) == bytes(ex.gather_kv([2]))
    ex.grow_kv(6)
    s2 = ex.kv_share()
    assert s2 != s and s2.size == 6 * ex.kv_layout.bytes_per_block
    with pytest.raises(KvShareError):
        PeerKv(s, ex.kv_layout.bytes_per_block)  # the old region is closed
    peer = PeerKv(s2, ex.kv_layout.bytes_per_block)
    assert bytes(peer.blocks(2, 1)) == bytes(ex.gather_kv([2]))
    assert np.frombuffer(peer.blocks(2, 1), dtype=np.float32)[5] == 42.0
    assert TokenKvExecutor(4, 16, share_kv=False).kv_share() is None
