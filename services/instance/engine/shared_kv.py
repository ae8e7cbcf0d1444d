"""A KV cache another process on this host can read: the cache's memory is
an anonymous shared-memory file (``memfd_create``) that the engine maps, and
a destination instance on the same host maps it too, read-only, through
``/proc/<pid>/fd/<fd>`` of the source. A migration's stages then send block
ids instead of bytes: the destination copies each block straight from the
source's cache into its own (one copy, on its side), and the source does no
copy at all (no gather, no protobuf bytes, no socket traffic) while its
request and the others keep decoding.

The file has no name in any file system: it goes away with the last process
that has it mapped or open (a killed source leaks nothing). Its memfd name
carries a random nonce that the destination checks against the one the
source sent, together with the size, so a recycled pid or fd never maps the
wrong memory. A destination that cannot open it (another PID namespace: one
container per instance; another user; not Linux) says so at the first
pre-allocation, and the migration sends bytes as before.

Correctness is the protocol's, as for bytes gathered at the source: a stage
copies full blocks (never written again while the request holds them) and
the source verifies after the stage that the request still runs with the
same preemption count, so the blocks were its own during the copy; the last
stage copies a suspended request's blocks."""

from __future__ import annotations

import mmap
import os
import secrets
import weakref
from dataclasses import dataclass

PREFIX = "ferry-kv-"


class KvShareError(Exception):
    """The source's shared cache cannot be mapped here."""


@dataclass(frozen=True)
class KvShare:
    """Where a cache can be mapped from: ``/proc/<pid>/fd/<fd>``, whose memfd
    name must be ``name`` and size ``size`` bytes."""

    pid: int
    fd: int
    name: str
    size: int


def supported() -> bool:
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


class SharedRegion:
    """``size`` bytes of zeroed shared memory, mapped read-write here."""

    def __init__(self, size: int, tag: str = ""):
        if size <= 0:
            raise ValueError("a shared region needs at least one byte")
        self.name = f"{PREFIX}{tag}{'-' if tag else ''}{secrets.token_hex(8)}"
        self.fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.buffer = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.size = size
        # The mapping (self.buffer, and the arrays made on it) outlives the
        # fd; the fd is what a peer opens, closed once this region is gone.
        self._closer = weakref.finalize(self, os.close, self.fd)

    def close(self) -> None:
        """No peer can map it from now on; the mapping stays valid here."""
        self._closer()

    @property
    def share(self) -> KvShare:
        return KvShare(os.getpid(), self.fd, self.name, self.size)


def allocate(size: int, tag: str = "") -> SharedRegion | None:
    """A shared region, or None where this system has none (the cache is
    then ordinary memory and migrations send bytes)."""
    if not supported():
        return None
    try:
        return SharedRegion(size, tag)
    except OSError:
        return None


def zeroed(size: int, tag: str, share: bool) -> tuple[mmap.mmap, SharedRegion | None]:
    """``size`` zeroed bytes for a KV cache, committed page by page as they
    are first written: a shared region's (``share`` and possible), else
    anonymous memory (region None). Whoever views the buffer keeps it
    mapped; the region is what a peer maps, until closed."""
    region = allocate(size, tag) if share else None
    return (region.buffer if region is not None else mmap.mmap(-1, size)), region


class PeerKv:
    """Another process's shared cache, mapped read-only: ``blocks(first, n)``
    is a zero-copy view of ``n`` consecutive blocks of ``bytes_per_block``."""

    def __init__(self, share: KvShare, bytes_per_block: int):
        if not share.name.startswith(PREFIX) or bytes_per_block <= 0 or share.size % bytes_per_block:
            raise KvShareError(f"not a KV cache of {bytes_per_block}-byte blocks: {share}")
        path = f"/proc/{share.pid}/fd/{share.fd}"
        try:
            link = os.readlink(path)
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise KvShareError(f"cannot open the source's KV cache ({path}): {e.strerror}") from None
        try:
            if link != f"/memfd:{share.name} (deleted)":
                raise KvShareError(f"{path} is {link!r}, not the source's KV cache {share.name!r}")
            size = os.fstat(fd).st_size
            if size != share.size:
                raise KvShareError(f"the source's KV cache is {size} bytes, {share.size} announced")
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.share = share
        self.bytes_per_block = bytes_per_block
        self.num_blocks = size // bytes_per_block
        self._view = memoryview(self._map)

    def blocks(self, first: int, n: int) -> memoryview:
        if first < 0 or n < 0 or first + n > self.num_blocks:
            raise KvShareError(f"blocks {first}..{first + n} of a {self.num_blocks}-block shared cache")
        return self._view[first * self.bytes_per_block:(first + n) * self.bytes_per_block]


def runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """``(position, first id, count)`` of each run of consecutive ids."""
    out: list[tuple[int, int, int]] = []
    for pos, b in enumerate(ids):
        if out and out[-1][1] + out[-1][2] == b:
            p, f, n = out[-1]
            out[-1] = (p, f, n + 1)
        else:
            out.append((pos, b, 1))
    return out
