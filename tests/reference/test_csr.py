"""The k2q CSR (paper §4.2) is the exact transpose of the q2k selection.

Three layers: the paper's worked examples as literal tables, a loop-by-loop oracle on hostile
shapes, and hypothesis properties (the CSR's edge set equals I's, row_ptr counts them, queries
ascend in every row, slots point back into I, the tail is -1).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from msa.reference.blocks import block_row_offsets, query_positions
from msa.reference.csr import build_csr, csr_histogram, csr_scatter, exclusive_prefix_sum
from msa.reference.index import block_scores
from msa.reference.select import select_blocks
from msa.testing.strategies import problem_shapes, problems
from msa.testing.strategies import offsets as cu




def random_block_indices(seq_lens_q, seq_lens_k, num_kv_heads, topk, block_size, seed, *,
                         hot=(), fill=True, future=False, shuffle=False):
    """A valid I int32 [Tq, Hkv, K] without the selector.

    Every query takes its local block, then the ``hot`` blocks it can see (a skewed selection:
    ``hot=(0,)`` makes the sink block a hot row), then random visible blocks: ``min(K, visible)``
    in all when ``fill``, otherwise a random number of them (never fewer than one). ``future``
    also draws blocks after the local one (valid: attention masks them out), ``shuffle`` leaves
    the real entries of a row unsorted (valid: check_block_indices does not require order).
    Unique, -1 padded at the tail.
    """
    rng = np.random.default_rng(seed)
    cu_q, cu_k = cu(seq_lens_q), cu(seq_lens_k)
    batch, pos = query_positions(cu_q, cu_k, int(cu_q[-1]), int(cu_k[-1]))
    seq_blocks = -(-np.diff(cu_k) // block_size)
    out = np.full((pos.size, num_kv_heads, topk), -1, dtype=np.int32)
    for t, p in enumerate(pos):
        local = int(p) // block_size
        pool = int(seq_blocks[batch[t]]) if future else local + 1
        for h in range(num_kv_heads):
            want = min(topk, pool) if fill else int(rng.integers(1, min(topk, pool) + 1))
            chosen = [local] + [b for b in hot if b < local][: want - 1]
            rest = np.setdiff1d(np.arange(pool), chosen)
            chosen += rng.permutation(rest)[: want - len(chosen)].tolist()
            out[t, h, : len(chosen)] = rng.permutation(chosen) if shuffle else np.sort(chosen)
    return out


def naive_csr(block_indices, cu_seqlens_q, cu_seqlens_k, block_size):
    """The transpose by hand: walk queries in order and append each to the list of its block."""
    offsets = block_row_offsets(cu_seqlens_k, block_size)
    rows = int(offsets[-1])
    tq, hkv, topk = block_indices.shape
    row_ptr = np.zeros((hkv, rows + 1), dtype=np.int32)
    q_indices = np.full((hkv, tq * topk), -1, dtype=np.int32)
    slots = np.full((hkv, tq * topk), -1, dtype=np.int32)
    for h in range(hkv):
        lists = [[] for _ in range(rows)]
        for b in range(len(cu_seqlens_q) - 1):
            for t in range(cu_seqlens_q[b], cu_seqlens_q[b + 1]):
                for s in range(topk):
                    j = block_indices[t, h, s]
                    if j >= 0:
                        lists[offsets[b] + j].append((t, s))
        row_ptr[h, 1:] = np.cumsum([len(x) for x in lists])
        flat = [edge for x in lists for edge in x]
        q_indices[h, : len(flat)] = [t for t, _ in flat]
        slots[h, : len(flat)] = [s for _, s in flat]
    return row_ptr, q_indices, slots


def assert_csr_is_transpose(block_indices, cu_seqlens_q, cu_seqlens_k, block_size,
                            row_ptr, q_indices, slots):
    """Every invariant of the contract (docs/api.md), checked without re-deriving the CSR."""
    tq, hkv, topk = block_indices.shape
    offsets = block_row_offsets(cu_seqlens_k, block_size)
    rows = int(offsets[-1])
    assert row_ptr.dtype == q_indices.dtype == slots.dtype == np.int32
    assert row_ptr.shape == (hkv, rows + 1)
    assert q_indices.shape == slots.shape == (hkv, tq * topk)
    q_batch, _ = query_positions(cu_seqlens_q, cu_seqlens_k, tq, int(cu_seqlens_k[-1]))
    row_batch = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    for h in range(hkv):
        nnz = int(np.count_nonzero(block_indices[:, h, :] >= 0))
        assert row_ptr[h, 0] == 0 and row_ptr[h, -1] == nnz
        assert np.all(np.diff(row_ptr[h]) >= 0)
        assert np.all(q_indices[h, nnz:] == -1) and np.all(slots[h, nnz:] == -1)
        q, s = q_indices[h, :nnz].astype(np.int64), slots[h, :nnz].astype(np.int64)
        assert np.all((0 <= q) & (q < tq)) and np.all((0 <= s) & (s < topk))
        row = np.repeat(np.arange(rows), np.diff(row_ptr[h]))  # row of each CSR entry
        block = row - offsets[row_batch[row]]
        # Queries strictly ascend inside a row (ascending and no query listed twice).
        same_row = row[1:] == row[:-1]
        assert np.all(q[1:][same_row] > q[:-1][same_row])
        # A row only holds queries of its own sequence, and the slot points back at the block.
        assert np.all(q_batch[q] == row_batch[row])
        assert np.all(block_indices[q, h, s] == block)
        # The edge sets agree exactly (h is fixed): {(t, j)} from the CSR == {(t, j)} from I.
        t_i, s_i = np.nonzero(block_indices[:, h, :] >= 0)
        from_i = np.stack([t_i, block_indices[t_i, h, s_i]], axis=1)
        from_csr = np.stack([q, block], axis=1)
        np.testing.assert_array_equal(np.unique(from_csr, axis=0), np.unique(from_i, axis=0))
        assert from_csr.shape == from_i.shape


# --- the paper's examples --------------------------------------------------------------------

# One sequence of 16 keys in 4 blocks of Bk=4 (A..D = 0..3); its last 4 positions (12..15) are
# the queries q0..q3, which all see every block, so any selection of the examples is valid.
EXAMPLE_CU_Q, EXAMPLE_CU_K, EXAMPLE_BK = cu([4]), cu([16]), 4

PAPER_EXAMPLES = [
    pytest.param(
        # 003 §2: q0->A,C  q1->A,D  q2->A,C  q3->A,B  gives  A->q0..q3, B->q3, C->q0,q2, D->q1.
        [[0, 2], [0, 3], [0, 2], [0, 1]],
        [0, 4, 5, 7, 8], [0, 1, 2, 3, 3, 0, 2, 1], [0, 0, 0, 0, 1, 1, 1, 1],
        id="003-kv-outer-A-B-C-D"),
    pytest.param(
        # 000 §5.6: q0->0,1  q1->0,2  q2->1,2  q3->2,3.
        [[0, 1], [0, 2], [1, 2], [2, 3]],
        [0, 2, 4, 7, 8], [0, 1, 0, 2, 1, 2, 3, 3], [0, 0, 1, 0, 1, 1, 0, 1],
        id="000-csr-row_ptr-0-2-4-7-8"),
    pytest.param(
        # With -1 padding nnz < Tq*K and the tail of both flat arrays is -1.
        [[0, 3], [3, -1], [1, 3], [3, -1]],
        [0, 1, 2, 2, 6], [0, 2, 0, 1, 2, 3, -1, -1], [0, 0, 1, 0, 1, 0, -1, -1],
        id="padded-tail"),
]


@pytest.mark.parametrize("selection, row_ptr, q_indices, slots", PAPER_EXAMPLES)
def test_paper_examples(selection, row_ptr, q_indices, slots):
    I = np.array(selection, dtype=np.int32)[:, None, :]  # [Tq=4, Hkv=1, K=2]
    got_ptr, got_q, got_s = build_csr(I, EXAMPLE_CU_Q, EXAMPLE_CU_K, EXAMPLE_BK)
    np.testing.assert_array_equal(got_ptr, [row_ptr])
    np.testing.assert_array_equal(got_q, [q_indices])
    np.testing.assert_array_equal(got_s, [slots])


def test_three_steps_on_paper_example():
    I = np.array([[0, 1], [0, 2], [1, 2], [2, 3]], dtype=np.int32)[:, None, :]
    counts = csr_histogram(I, EXAMPLE_CU_Q, EXAMPLE_CU_K, EXAMPLE_BK)
    assert counts.dtype == np.int32
    np.testing.assert_array_equal(counts, [[2, 2, 3, 1]])
    row_ptr = exclusive_prefix_sum(counts)
    np.testing.assert_array_equal(row_ptr, [[0, 2, 4, 7, 8]])
    q_indices, slots = csr_scatter(I, row_ptr, EXAMPLE_CU_Q, EXAMPLE_CU_K, EXAMPLE_BK)
    np.testing.assert_array_equal(q_indices, [[0, 1, 0, 2, 1, 2, 3, 3]])
    np.testing.assert_array_equal(slots, [[0, 0, 1, 0, 1, 1, 0, 1]])


def test_heads_are_independent_matrices():
    # Head 1 is head 0's example with the blocks mirrored: each head gets its own row_ptr.
    h0 = np.array([[0, 1], [0, 2], [1, 2], [2, 3]])
    I = np.stack([h0, np.sort(3 - h0, axis=1)], axis=1).astype(np.int32)  # [4, 2, 2]
    row_ptr, q_indices, _ = build_csr(I, EXAMPLE_CU_Q, EXAMPLE_CU_K, EXAMPLE_BK)
    np.testing.assert_array_equal(row_ptr, [[0, 2, 4, 7, 8], [0, 1, 4, 6, 8]])
    np.testing.assert_array_equal(q_indices, [[0, 1, 0, 2, 1, 2, 3, 3], [3, 1, 2, 3, 0, 2, 0, 1]])


def test_rows_are_batch_local_blocks():
    # Two sequences of 8 keys (2 blocks each, Bk=4): sequence 1's block 0 is row 2, not row 0.
    I = np.array([[[0]], [[1]], [[0]], [[1]]], dtype=np.int32)  # [4, 1, 1]
    row_ptr, q_indices, _ = build_csr(I, cu([2, 2]), cu([8, 8]), 4)
    np.testing.assert_array_equal(row_ptr, [[0, 1, 2, 3, 4]])
    np.testing.assert_array_equal(q_indices, [[0, 1, 2, 3]])


# --- hostile shapes against the loop oracle --------------------------------------------------

SHAPES = [
    # id, seq_lens_q, seq_lens_k, Hkv, K, Bk, hot
    ("T=1", [1], [1], 2, 3, 4, ()),
    ("decode-Lq=1-of-37", [1], [37], 2, 3, 8, ()),
    ("Lk-not-multiple-of-Bk", [13], [13], 1, 2, 4, ()),
    ("NB<K", [10], [10], 2, 4, 8, ()),
    ("Lq<Lk-varlen", [3, 5], [40, 17], 3, 3, 8, ()),
    ("empty-sequences", [0, 5, 0, 3, 0], [0, 9, 4, 3, 0], 2, 2, 4, ()),
    ("many-sequences", [7, 1, 12, 3, 9, 4], [7, 30, 12, 19, 9, 4], 2, 3, 4, ()),
    ("Hkv=4", [20], [33], 4, 2, 4, ()),
    ("skewed-sink", [40, 25], [40, 31], 2, 3, 4, (0,)),
    ("skewed-sink-and-block-2", [64], [64], 1, 4, 4, (0, 2)),
    ("K=1-local-only", [17, 9], [17, 20], 2, 1, 4, ()),
    ("empty-batch", [0], [0], 2, 3, 4, ()),
    ("keys-without-queries", [0, 0], [9, 3], 1, 2, 4, ()),
]


@pytest.mark.parametrize("lq, lk, hkv, topk, bk, hot", [s[1:] for s in SHAPES],
                         ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("variant", [
    dict(), dict(fill=False), dict(future=True, shuffle=True),
], ids=["full", "partial", "future-unsorted"])
def test_matches_loop_oracle(lq, lk, hkv, topk, bk, hot, variant):
    I = random_block_indices(lq, lk, hkv, topk, bk, seed=len(lq) * 7 + topk, hot=hot, **variant)
    cu_q, cu_k = cu(lq), cu(lk)
    got = build_csr(I, cu_q, cu_k, bk)
    want = naive_csr(I, cu_q, cu_k, bk)
    for name, g, w in zip(("row_ptr", "q_indices", "slots"), got, want):
        np.testing.assert_array_equal(g, w, err_msg=name)
    assert_csr_is_transpose(I, cu_q, cu_k, bk, *got)
    np.testing.assert_array_equal(np.diff(got[0], axis=1), csr_histogram(I, cu_q, cu_k, bk))


def test_hot_row_holds_every_query():
    # Everyone picks the sink: row 0 of every head lists all Tq queries, in order.
    I = random_block_indices([50], [50], 2, 3, 4, seed=1, hot=(0,))
    row_ptr, q_indices, _ = build_csr(I, cu([50]), cu([50]), 4)
    np.testing.assert_array_equal(row_ptr[:, 1], [50, 50])
    np.testing.assert_array_equal(q_indices[:, :50], np.tile(np.arange(50), (2, 1)))


def test_accepts_int64_and_non_contiguous_inputs():
    I = random_block_indices([9, 6], [12, 6], 2, 3, 4, seed=3)
    cu_q, cu_k = cu([9, 6]), cu([12, 6])
    want = build_csr(I, cu_q, cu_k, 4)
    strided = np.asfortranarray(I)
    got = build_csr(strided, cu_q.astype(np.int64), cu_k.astype(np.int64), 4)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_production_size_runs():
    # Tq = Tk = 8192, Hkv = 4, K = 16, Bk = 128: the reference must run in seconds.
    tq, hkv, topk, bk = 8192, 4, 16, 128
    local = np.arange(tq) // bk  # [Tq]
    # Query t reads the K blocks ending at its local block (fewer at the start, -1 padded).
    band = np.maximum(local - topk + 1, 0)[:, None] + np.arange(topk)  # [Tq, K] ascending
    I = np.where(band <= local[:, None], band, -1).astype(np.int32)
    I = np.repeat(I[:, None, :], hkv, axis=1)  # [Tq, Hkv, K]
    row_ptr, q_indices, slots = build_csr(I, cu([tq]), cu([tq]), bk)
    nnz = int(np.count_nonzero(I[:, 0] >= 0))
    assert row_ptr[0, -1] == nnz and q_indices[0, nnz - 1] == tq - 1 and q_indices[0, nnz] == -1
    np.testing.assert_array_equal(np.diff(row_ptr[0]),
                                  [min(bk * topk, tq - j * bk) for j in range(tq // bk)])


# --- hypothesis -----------------------------------------------------------------------------

@given(shape=problem_shapes(max_seqs=4), hot=st.sampled_from([(), (0,), (0, 1)]),
       fill=st.booleans(), future=st.booleans(), shuffle=st.booleans())
def test_csr_is_exact_transpose(shape, hot, fill, future, shuffle):
    lq, lk = shape["seq_lens_q"], shape["seq_lens_k"]
    bk, hkv, topk = shape["block_size"], shape["num_kv_heads"], shape["topk"]
    I = random_block_indices(lq, lk, hkv, topk, bk, shape["seed"], hot=hot, fill=fill,
                             future=future, shuffle=shuffle)
    cu_q, cu_k = cu(lq), cu(lk)
    row_ptr, q_indices, slots = build_csr(I, cu_q, cu_k, bk)
    assert_csr_is_transpose(I, cu_q, cu_k, bk, row_ptr, q_indices, slots)
    # Step by step gives the same thing as the composition.
    counts = csr_histogram(I, cu_q, cu_k, bk)
    np.testing.assert_array_equal(exclusive_prefix_sum(counts), row_ptr)
    for g, w in zip(csr_scatter(I, row_ptr, cu_q, cu_k, bk), (q_indices, slots)):
        np.testing.assert_array_equal(g, w)


@given(problem=problems(max_seqs=4))
def test_csr_of_the_selector(problem):
    p = problem
    M = block_scores(p.q_idx, p.k_idx, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    I = select_blocks(M, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, p.topk)
    csr = build_csr(I, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    assert_csr_is_transpose(I, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, *csr)


# --- bad inputs -----------------------------------------------------------------------------

def _one_seq(rows):
    return np.array(rows, dtype=np.int32)[:, None, :]  # [Tq, 1, K]


@pytest.mark.parametrize("fn", ["build_csr", "csr_histogram", "csr_scatter"])
@pytest.mark.parametrize("I, match", [
    pytest.param(_one_seq([[0, 4]] * 4), "block_indices", id="block-out-of-range"),
    pytest.param(_one_seq([[-2, 0]] * 4), "block_indices", id="negative-not-minus-one"),
    pytest.param(_one_seq([[1, 1]] * 4), "block_indices", id="duplicate-in-a-row"),
    pytest.param(np.array([[[0, 2]], [[0, 1]]], np.int32), "block_indices",
                 id="block-of-the-other-sequence"),
    pytest.param(_one_seq([[-1, 0]] * 4), "block_indices", id="minus-one-not-at-tail"),
    pytest.param(_one_seq([[0, 1]] * 3), "cu_seqlens_q|block_indices", id="Tq-not-cu_seqlens_q"),
    pytest.param(np.zeros((4, 2), np.int32), "block_indices", id="rank-2"),
    pytest.param(np.zeros((4, 1, 2), np.float32), "block_indices", id="float-dtype"),
])
def test_bad_block_indices(fn, I, match):
    args = (EXAMPLE_CU_Q, EXAMPLE_CU_K, EXAMPLE_BK)
    if I.shape[0] == 2:  # two sequences of 8 and 16 keys: block 2 exists only in the second
        args = (cu([1, 1]), cu([8, 16]), EXAMPLE_BK)
    with pytest.raises((ValueError, TypeError), match=match):
        if fn == "build_csr":
            build_csr(I, *args)
        elif fn == "csr_histogram":
            csr_histogram(I, *args)
        else:
            csr_scatter(I, np.zeros((1, 5), np.int32), *args)


def test_bad_block_size_and_cu_seqlens():
    I = _one_seq([[0, 1]] * 4)
    with pytest.raises(ValueError, match="block_size"):
        build_csr(I, EXAMPLE_CU_Q, EXAMPLE_CU_K, 0)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        build_csr(I, EXAMPLE_CU_Q, np.array([1, 16], np.int32), 4)
    with pytest.raises(ValueError, match="more queries than keys"):
        build_csr(I, EXAMPLE_CU_Q, cu([3]), 4)  # Lq = 4 > Lk = 3


@pytest.mark.parametrize("row_ptr", [
    pytest.param(np.array([[0, 2, 4, 7]], np.int32), id="rows-not-rows+1"),
    pytest.param(np.array([[0, 2, 4, 7, 8]] * 2, np.int32), id="two-heads-for-one"),
    pytest.param(np.array([0, 2, 4, 7, 8], np.int32), id="rank-1"),
    pytest.param(np.array([[0, 2, 4, 6, 8]], np.int32), id="other-selection"),
    pytest.param(np.array([[1, 3, 5, 8, 9]], np.int32), id="not-starting-at-0"),
    pytest.param(np.array([[0, 2, 4, 7, 8]], np.float32), id="float-dtype"),
])
def test_scatter_rejects_foreign_row_ptr(row_ptr):
    I = _one_seq([[0, 1], [0, 2], [1, 2], [2, 3]])
    with pytest.raises((ValueError, TypeError), match="row_ptr"):
        csr_scatter(I, row_ptr, EXAMPLE_CU_Q, EXAMPLE_CU_K, EXAMPLE_BK)


def test_prefix_sum_guards_int32_overflow():
    fits = np.array([[2**30, 2**30 - 1], [1, 2]], np.int32)
    np.testing.assert_array_equal(exclusive_prefix_sum(fits)[:, -1], [2**31 - 1, 3])
    with pytest.raises(ValueError, match="counts"):
        exclusive_prefix_sum(np.array([[2**30, 2**30]], np.int32))
    with pytest.raises(ValueError, match="counts"):
        exclusive_prefix_sum(np.array([[3, -1]], np.int32))
    with pytest.raises(ValueError, match="counts"):
        exclusive_prefix_sum(np.array([3, 1], np.int32))
    with pytest.raises(TypeError, match="counts"):
        exclusive_prefix_sum(np.array([[3.0, 1.0]]))


def test_prefix_sum_of_no_rows():
    np.testing.assert_array_equal(exclusive_prefix_sum(np.zeros((3, 0), np.int32)),
                                  np.zeros((3, 1), np.int32))
