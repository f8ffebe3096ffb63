"""The hot-row scheduler (paper §4.2): chunks cover every CSR entry once, largest first.

The scheduler only reads ``row_ptr``, so most tests draw row counts directly (hot rows, empty
rows, empty sequences): a table against a loop oracle and hypothesis properties. The end-to-end
tests feed it the CSR of real selections (``select_blocks``, ``fixed_blocks``) and check that the
gathered queries are exactly the selection's edges.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from msa.reference.blocks import block_row_offsets, query_positions
from msa.reference.csr import build_csr
from msa.reference.schedule import build_schedule, schedule_stats
from msa.reference.index import block_scores
from msa.reference.select import fixed_blocks, select_blocks
from msa.testing.strategies import problems, seq_lens
from msa.testing.strategies import offsets as cu




def random_row_ptr(seq_lens_k, block_size, num_kv_heads, seed, *, hot_rows=0, max_count=12):
    """row_ptr int32 [Hkv, rows+1] from random counts: some rows empty, ``hot_rows`` of them
    (per head) far above the rest so that they must be split."""
    rng = np.random.default_rng(seed)
    rows = int(block_row_offsets(cu(seq_lens_k), block_size)[-1])
    counts = rng.integers(0, max_count + 1, size=(num_kv_heads, rows))
    counts[rng.random(counts.shape) < 0.3] = 0
    for h in range(num_kv_heads):
        hot = rng.permutation(rows)[:hot_rows]
        counts[h, hot] = rng.integers(5 * max_count, 10 * max_count, size=hot.size)
    row_ptr = np.zeros((num_kv_heads, rows + 1), np.int32)
    row_ptr[:, 1:] = np.cumsum(counts, axis=1)
    return row_ptr


def naive_schedule(row_ptr, cu_seqlens_k, block_size, chunk_size):
    """Item by item: walk heads, rows, chunks; then sort by (-q_count, kv_head, row, q_begin)."""
    offsets = block_row_offsets(cu_seqlens_k, block_size)
    items = []
    for h in range(row_ptr.shape[0]):
        for b in range(len(offsets) - 1):
            for j in range(offsets[b + 1] - offsets[b]):
                r = offsets[b] + j
                for begin in range(row_ptr[h, r], row_ptr[h, r + 1], chunk_size):
                    count = min(chunk_size, row_ptr[h, r + 1] - begin)
                    items.append((h, r, begin, count, b, j))
    items.sort(key=lambda w: (-w[3], w[0], w[1], w[2]))
    return np.array(items, dtype=np.int32).reshape(-1, 6)


def assert_schedule_valid(work, row_ptr, cu_seqlens_k, block_size, chunk_size):
    """The contract of docs/api.md, property by property."""
    assert work.dtype == np.int32 and work.ndim == 2 and work.shape[1] == 6
    head, row, begin, count, batch, block = (work[:, i].astype(np.int64) for i in range(6))
    offsets = block_row_offsets(cu_seqlens_k, block_size)
    hkv, rows = row_ptr.shape[0], row_ptr.shape[1] - 1
    assert np.all((0 <= head) & (head < hkv)) and np.all((0 <= row) & (row < rows))
    assert np.all((1 <= count) & (count <= chunk_size))
    # Each item stays inside its row, and chunks are cut at multiples of chunk_size.
    assert np.all(row_ptr[head, row] <= begin)
    assert np.all(begin + count <= row_ptr[head, row + 1])
    assert np.all((begin - row_ptr[head, row]) % chunk_size == 0)
    # (batch, kv_block) is the row's (sequence, block).
    assert np.all(offsets[batch] + block == row)
    assert np.all((0 <= block) & (block < offsets[batch + 1] - offsets[batch]))
    # Every CSR entry of every head is covered exactly once.
    covered = [np.zeros(row_ptr[h, -1], np.int64) for h in range(hkv)]
    for h, b0, c in zip(head, begin, count):
        covered[h][b0:b0 + c] += 1
    for h in range(hkv):
        np.testing.assert_array_equal(covered[h], 1)
    # Largest first, ties by (kv_head, row, q_begin).
    np.testing.assert_array_equal(np.lexsort((begin, row, head, -count)), np.arange(len(work)))


SHAPES = [
    # id, seq_lens_k, Bk, Hkv, hot rows per head
    ("one-row", [3], 4, 1, 0),
    ("T=1", [1], 4, 2, 0),
    ("Lk-not-multiple-of-Bk", [13], 4, 1, 1),
    ("empty-sequences", [0, 9, 0, 5, 0], 4, 2, 1),
    ("many-sequences", [7, 30, 12, 19, 9, 4], 4, 3, 2),
    ("every-row-hot", [32], 8, 2, 4),
    ("Hkv=4", [40], 8, 4, 1),
    ("no-keys", [0], 4, 2, 0),
]


@pytest.mark.parametrize("lk, bk, hkv, hot_rows", [s[1:] for s in SHAPES],
                         ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("chunk_size", [1, 3, 8, 10_000])
def test_matches_loop_oracle(lk, bk, hkv, hot_rows, chunk_size):
    row_ptr = random_row_ptr(lk, bk, hkv, seed=len(lk) + hkv, hot_rows=hot_rows)
    work = build_schedule(row_ptr, cu(lk), bk, chunk_size)
    np.testing.assert_array_equal(work, naive_schedule(row_ptr, cu(lk), bk, chunk_size))
    assert_schedule_valid(work, row_ptr, cu(lk), bk, chunk_size)


def test_literal_schedule_of_paper_example():
    # 000 §5.6: row_ptr = [0, 2, 4, 7, 8] (one sequence, 4 blocks), chunks of 2.
    work = build_schedule(np.array([[0, 2, 4, 7, 8]], np.int32), cu([16]), 4, 2)
    np.testing.assert_array_equal(work, [
        # kv_head, row, q_begin, q_count, batch, kv_block
        [0, 0, 0, 2, 0, 0],
        [0, 1, 2, 2, 0, 1],
        [0, 2, 4, 2, 0, 2],
        [0, 2, 6, 1, 0, 2],
        [0, 3, 7, 1, 0, 3],
    ])


def sink_and_local(seq_lens_q, seq_lens_k, num_kv_heads, block_size):
    """I [Tq, Hkv, 2]: every query selects the sink block 0 and its local block (skewed)."""
    cu_q, cu_k = cu(seq_lens_q), cu(seq_lens_k)
    _, pos = query_positions(cu_q, cu_k, int(cu_q[-1]), int(cu_k[-1]))
    local = pos // block_size  # [Tq]
    I = np.stack([np.zeros_like(local), np.where(local > 0, local, -1)], axis=1)  # [Tq, 2]
    return np.repeat(I[:, None, :], num_kv_heads, axis=1).astype(np.int32)


def test_hot_sink_row_is_split():
    # Everyone selects block 0: the sink row holds all 100 queries of each head; with chunks of
    # 16 it becomes ceil(100/16) = 7 items, and the 12 full sink chunks lead the schedule.
    lq = lk = [100]
    I = sink_and_local(lq, lk, 2, 8)
    row_ptr, _, _ = build_csr(I, cu(lq), cu(lk), 8)
    np.testing.assert_array_equal(row_ptr[:, 1], [100, 100])
    work = build_schedule(row_ptr, cu(lk), 8, 16)
    for h in range(2):
        sink = work[(work[:, 0] == h) & (work[:, 1] == 0)]
        np.testing.assert_array_equal(sink[:, 2], np.arange(0, 100, 16))
        np.testing.assert_array_equal(sink[:, 3], [16] * 6 + [4])
    np.testing.assert_array_equal(work[:12, [0, 1, 3]],
                                  [[h, 0, 16] for h in (0, 1) for _ in range(6)])
    # A local row holds at most Bk = 8 queries, so every other item comes after the sinks.
    assert np.all(work[12:, 3] <= 8)
    split, unsplit = schedule_stats(work), schedule_stats(build_schedule(row_ptr, cu(lk), 8, 10**4))
    assert split["edges"] == unsplit["edges"] == 2 * np.count_nonzero(I[:, 0] >= 0)
    assert (split["max_q_count"], unsplit["max_q_count"]) == (16, 100)
    assert split["imbalance"] < unsplit["imbalance"]


def test_varlen_rows_map_to_their_sequence():
    # Sequences of 0, 9, 0 and 5 keys with Bk=4: rows 0-2 are sequence 1, rows 3-4 sequence 3.
    row_ptr = np.array([[0, 1, 1, 4, 6, 7]], np.int32)
    work = build_schedule(row_ptr, cu([0, 9, 0, 5]), 4, 2)
    np.testing.assert_array_equal(work, [
        [0, 2, 1, 2, 1, 2],
        [0, 3, 4, 2, 3, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 2, 3, 1, 1, 2],
        [0, 4, 6, 1, 3, 1],
    ])


def test_empty_schedule_shape():
    for row_ptr, cu_k in ((np.zeros((2, 4), np.int32), cu([9])),   # rows, but nobody selected
                          (np.zeros((3, 1), np.int32), cu([0]))):  # no keys at all
        work = build_schedule(row_ptr, cu_k, 4, 5)
        assert work.shape == (0, 6) and work.dtype == np.int32
    assert schedule_stats(np.zeros((0, 6), np.int32))["items"] == 0


@given(lens=seq_lens(max_seqs=4), block_size=st.sampled_from([1, 4, 8, 16]),
       num_kv_heads=st.integers(1, 4), hot_rows=st.integers(0, 3), chunk_size=st.integers(1, 20),
       seed=st.integers(0, 2**31 - 1))
def test_schedule_properties(lens, block_size, num_kv_heads, hot_rows, chunk_size, seed):
    lk = lens[1]
    row_ptr = random_row_ptr(lk, block_size, num_kv_heads, seed, hot_rows=hot_rows)
    work = build_schedule(row_ptr, cu(lk), block_size, chunk_size)
    assert_schedule_valid(work, row_ptr, cu(lk), block_size, chunk_size)
    # Items per row = ceil(n / chunk_size); empty rows get none.
    n = np.diff(row_ptr, axis=1)
    per_row = np.zeros_like(n)
    np.add.at(per_row, (work[:, 0], work[:, 1]), 1)
    np.testing.assert_array_equal(per_row, -(-n // chunk_size))
    np.testing.assert_array_equal(work, naive_schedule(row_ptr, cu(lk), block_size, chunk_size))


def assert_gathers_the_selection(I, cu_q, cu_k, block_size, chunk_size):
    """What K1 will do: walk the work items, gather their queries, and get back exactly I."""
    row_ptr, q_indices, slots = build_csr(I, cu_q, cu_k, block_size)
    work = build_schedule(row_ptr, cu_k, block_size, chunk_size)
    assert_schedule_valid(work, row_ptr, cu_k, block_size, chunk_size)
    gathered = []
    for h, _, q_begin, q_count, b, j in work:
        t = q_indices[h, q_begin:q_begin + q_count]
        s = slots[h, q_begin:q_begin + q_count]
        assert np.all((cu_q[b] <= t) & (t < cu_q[b + 1]))  # the item's queries are in its sequence
        assert np.all(I[t, h, s] == j)  # and their slot s holds the item's block
        gathered += [(int(h), int(x), int(y)) for x, y in zip(t, s)]
    want = [(int(h), int(t), int(s)) for t, h, s in zip(*np.nonzero(I >= 0))]
    assert sorted(gathered) == sorted(want)


@given(problem=problems(max_seqs=4), chunk_size=st.integers(1, 20), fixed=st.booleans())
def test_schedule_of_real_selections(problem, chunk_size, fixed):
    p = problem
    if fixed:  # sink + sliding window: the sink row is as hot as it gets
        I = fixed_blocks(p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, p.topk,
                         num_kv_heads=p.num_kv_heads)
    else:
        M = block_scores(p.q_idx, p.k_idx, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
        I = select_blocks(M, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, p.topk)
    assert_gathers_the_selection(I, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, chunk_size)


@pytest.mark.parametrize("lq, lk, bk", [([1], [1], 4), ([3, 0, 5], [40, 6, 17], 8),
                                        ([100], [100], 8)],
                         ids=["T=1", "varlen-Lq<Lk-empty", "skewed-sink"])
@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_schedule_of_skewed_selection(lq, lk, bk, chunk_size):
    I = sink_and_local(lq, lk, 2, bk)
    assert_gathers_the_selection(I, cu(lq), cu(lk), bk, chunk_size)


# --- bad inputs -----------------------------------------------------------------------------

GOOD_ROW_PTR, GOOD_CU_K = np.array([[0, 2, 4, 7, 8]], np.int32), cu([16])


@pytest.mark.parametrize("chunk_size, error", [(0, ValueError), (-3, ValueError),
                                               (2.0, TypeError), (True, TypeError)],
                         ids=["zero", "negative", "float", "bool"])
def test_bad_chunk_size(chunk_size, error):
    with pytest.raises(error, match="chunk_size"):
        build_schedule(GOOD_ROW_PTR, GOOD_CU_K, 4, chunk_size)


@pytest.mark.parametrize("row_ptr, error", [
    pytest.param(np.array([[0, 2, 4, 7]], np.int32), ValueError, id="rows-not-rows+1"),
    pytest.param(np.array([0, 2, 4, 7, 8], np.int32), ValueError, id="rank-1"),
    pytest.param(np.array([[1, 2, 4, 7, 8]], np.int32), ValueError, id="not-starting-at-0"),
    pytest.param(np.array([[0, 4, 2, 7, 8]], np.int32), ValueError, id="decreasing"),
    pytest.param(np.array([[0, 2, 4, 7, 2**31]], np.int64), ValueError, id="past-int32"),
    pytest.param(np.array([[0, 2, 4, 7, 8]], np.float64), TypeError, id="float-dtype"),
])
def test_bad_row_ptr(row_ptr, error):
    with pytest.raises(error, match="row_ptr"):
        build_schedule(row_ptr, GOOD_CU_K, 4, 2)


@pytest.mark.parametrize("cu_k", [
    pytest.param(np.array([1, 16], np.int32), id="not-starting-at-0"),
    pytest.param(np.array([0, 9, 5], np.int32), id="decreasing"),
    pytest.param(np.array([0], np.int32), id="no-sequence"),
    pytest.param(np.array([[0, 16]], np.int32), id="rank-2"),
    pytest.param(np.array([0.0, 16.0]), id="float-dtype"),
])
def test_bad_cu_seqlens_k(cu_k):
    with pytest.raises((ValueError, TypeError), match="cu_seqlens_k"):
        build_schedule(GOOD_ROW_PTR, cu_k, 4, 2)


def test_bad_block_size_and_work():
    with pytest.raises(ValueError, match="block_size"):
        build_schedule(GOOD_ROW_PTR, GOOD_CU_K, 0, 2)
    with pytest.raises(ValueError, match="work"):
        schedule_stats(np.zeros((3, 5), np.int32))
