"""The one block hash (libs/common/prefix_hash.py): chained, canonical, and the
same in every process and on every machine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from libs.common.prefix_hash import ROOT, block_hashes, chain_root, extend_hashes, hash_block

# Pinned values: a change here changes every cache key in a cluster (and the
# scheduler's index against instances of another version): make it on purpose.
GOLDEN = [3346890508720202565, 17226892037097347875]


def test_values_are_pinned():
    assert block_hashes(list(range(8)), 4) == GOLDEN
    assert ROOT == 0x1E844A9795B3B38D


def test_same_in_a_process_with_another_hash_seed():
    code = "from libs.common.prefix_hash import block_hashes; print(block_hashes(list(range(8)), 4))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.stdout.strip() == str(GOLDEN)


def test_chained_over_the_parent():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[1] != b[1], "the same block after a different parent has another hash"
    assert a[0] == hash_block(ROOT, [1, 2, 3, 4]) and a[1] == hash_block(a[0], [5, 6, 7, 8])


def test_partial_blocks_have_no_hash_and_extend_matches():
    toks = list(range(100, 137))
    full = block_hashes(toks, 8)
    assert len(full) == 4
    grown: list[int] = []
    for n in (0, 5, 8, 20, 37):
        extend_hashes(grown, toks[:n], 8)
        assert grown == full[: n // 8]


def test_salt_separates_chains_and_encoding_is_unambiguous():
    assert block_hashes([1, 2], 2, salt=b"lora-a") != block_hashes([1, 2], 2)
    assert chain_root(b"a") != chain_root(b"b")
    assert hash_block(ROOT, [1, 2]) != hash_block(ROOT, [1, 2, 0])
    assert hash_block(ROOT, [256]) != hash_block(ROOT, [1, 0])
    with pytest.raises(ValueError):
        block_hashes([1], 0)
