"""Eq 3-4 helpers and packed-batch positions (msa.reference.blocks, msa._checks)."""

import numpy as np
import pytest
from hypothesis import given

from msa.reference import blocks
from msa.testing.strategies import seq_lens
from msa.testing.strategies import offsets as _cu




def test_gqa_group_maps_adjacent_heads_to_one_kv_head():
    np.testing.assert_array_equal(blocks.gqa_group(8, 2), [0, 0, 0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(blocks.gqa_group(4, 4), [0, 1, 2, 3])
    with pytest.raises(ValueError, match="Hkv"):
        blocks.gqa_group(6, 4)


@pytest.mark.parametrize("length,bk,want", [(0, 4, []), (1, 4, [[0, 1]]), (8, 4, [[0, 4], [4, 8]]),
                                            (9, 4, [[0, 4], [4, 8], [8, 9]])],
                         ids=["empty", "one", "exact", "partial-last"])
def test_block_partition_eq4(length, bk, want):
    got = blocks.block_partition(length, bk)
    assert got.shape == (len(want), 2)
    np.testing.assert_array_equal(got.reshape(-1, 2), np.array(want, dtype=np.int64).reshape(-1, 2))
    assert blocks.num_blocks(length, bk) == len(want)


def test_paper_example_query_5000():
    # §3.1: N = 8192, Bk = 128, i = 5000 -> local block 39, blocks 0..39 visible, 9 keys of block 39
    cu = _cu([8192])
    local = blocks.local_blocks(cu, cu, 8192, 8192, 128)
    assert local[5000] == 39
    vis = blocks.visible_block_mask(np.array([5000]), 64, 128)
    assert vis.sum() == 40
    assert 5000 - 39 * 128 + 1 == 9


@given(seq_lens())
def test_query_positions_are_bottom_right_aligned(lens):
    lq, lk = lens
    cq, ck = _cu(lq), _cu(lk)
    batch, pos = blocks.query_positions(cq, ck, sum(lq), sum(lk))
    want_b, want_p = [], []
    for b, (nq, nk) in enumerate(zip(lq, lk)):
        want_b += [b] * nq
        want_p += list(range(nk - nq, nk))
    np.testing.assert_array_equal(batch, want_b)
    np.testing.assert_array_equal(pos, want_p)
    kb, kp = blocks.key_positions(ck, sum(lk))
    np.testing.assert_array_equal(kb, np.repeat(np.arange(len(lk)), lk))
    off = blocks.block_row_offsets(ck, 16)
    np.testing.assert_array_equal(np.diff(off), [-(-n // 16) for n in lk])


@pytest.mark.parametrize("cq,ck,match", [
    ([1, 3], [0, 3], r"cu_seqlens_q\[0\]"),
    ([0, 3, 2], [0, 3, 5], "non-decreasing"),
    ([0, 3], [0, 2], "more queries than keys"),
    ([0, 3], [0, 3, 4], "same length"),
    ([0, 4], [0, 4], r"cu_seqlens_q\[-1\]"),
], ids=["start", "monotone", "Lq>Lk", "batch-mismatch", "total"])
def test_bad_cu_seqlens(cq, ck, match):
    with pytest.raises(ValueError, match=match):
        blocks.query_positions(np.array(cq, np.int32), np.array(ck, np.int32), 3, ck[-1])


def test_bad_types_name_the_argument():
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        blocks.query_positions(np.array([0.0, 3.0]), np.array([0, 3]), 3, 3)
    with pytest.raises(TypeError, match="block_size"):
        blocks.num_blocks(10, 2.5)
    with pytest.raises(ValueError, match="block_size"):
        blocks.local_blocks(_cu([3]), _cu([3]), 3, 3, 0)
