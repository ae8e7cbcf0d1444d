"""Block hashes for prefix caching: the one function that names a full KV block
by its content, shared by the engines, the frontend, the scheduler's prefix
index and the simulator.

A block's hash is chained over its parent block's hash and its own token ids
(vLLM v1's scheme): equal hashes mean equal prefixes, so a hit on block i
implies hits on blocks 0..i-1. ``salt`` feeds the root of every chain: the
place for whatever else changes the KV (a LoRA adapter, a tenant's cache salt;
none today), so that sequences with different salts never share a block.

The encoding is canonical (little-endian fixed widths, lengths included) and
the digest is BLAKE2b from hashlib: stable across processes, machines and
Python versions, unlike Python's ``hash``.

NOTE: hashes are 64-bit unsigned ints (the width of the block hashes in
Dynamo's KV router and of protobuf's uint64): cheap on the wire and in the
index; a wrong reuse needs a second preimage of a given block (2**64 work).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = int  # 0 .. 2**64-1

_PERSON = b"ferry-kv-v1"  # domain separation from any other use of BLAKE2b


def _digest(data: bytes) -> BlockHash:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=_PERSON).digest(), "little")


def chain_root(salt: bytes = b"") -> BlockHash:
    """The parent hash of a sequence's first block."""
    return _digest(b"root" + struct.pack("<I", len(salt)) + salt)


ROOT: BlockHash = chain_root()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The hash of one full block of ``token_ids`` after the block ``parent``
    (``chain_root(salt)`` for the first block). Token ids are 0 .. 2**32-1."""
    n = len(token_ids)
    return _digest(struct.pack(f"<QI{n}I", parent, n, *token_ids))


def block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes = b"",
                 parent: BlockHash | None = None) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` (a partial last block has
    none), chained from ``parent`` (default: the root of ``salt``)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    h = chain_root(salt) if parent is None else parent
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hash_block(h, token_ids[start:start + block_size])
        out.append(h)
    return out


def extend_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                  root: BlockHash = ROOT) -> list[BlockHash]:
    """Append the hashes of the full blocks of ``token_ids`` that ``hashes``
    (the hashes of its first blocks) lacks; returns ``hashes``."""
    n_full = len(token_ids) // block_size
    h = hashes[-1] if hashes else root
    for i in range(len(hashes), n_full):
        h = hash_block(h, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(h)
    return hashes
