"""Paper eq 7 (§3.2 final recipe), the §2.2 fixed-rule indexer and the selection validator.

The vectorised selector is checked three ways: against a slow per-row Python oracle written from
the rule (ties on purpose: scores drawn from a small integer set), by invariants as hypothesis
properties, and on distinct scores against the plain "top K-1 plus local" set.
"""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from msa.reference.blocks import local_blocks, max_blocks, query_positions
from msa.reference.select import check_block_indices, fixed_blocks, select_blocks
from msa.testing.strategies import seq_lens
from msa.testing.strategies import offsets as _cu




def _slow_select(M, cu_q, cu_k, topk, block_size):
    """Eq 7 row by row, straight from the rule: local block + best K-1 of the blocks before it."""
    hkv, tq, _ = M.shape
    _, pos = query_positions(cu_q, cu_k, tq, int(cu_k[-1]))
    out = np.full((tq, hkv, topk), -1, dtype=np.int32)
    for t in range(tq):
        local = int(pos[t]) // block_size
        for r in range(hkv):
            candidates = [(-float(M[r, t, b]), b) for b in range(local)
                          if not np.isnan(M[r, t, b]) and M[r, t, b] > -np.inf]
            best = [b for _, b in sorted(candidates)[: topk - 1]]
            row = sorted(best + [local])
            out[t, r, : len(row)] = row
    return out


@st.composite
def selection_problems(draw, *, max_len=80):
    """``(M, cu_q, cu_k, topk, block_size, kind)`` with scores of one of several kinds.

    ``ties``: small integers, -inf sprinkled in; ``distinct``: a random permutation;
    ``garbage``: finite values also on future and past-the-end blocks (must be ignored), with NaN
    and +inf sprinkled in; ``realistic``: ties on visible blocks, -inf elsewhere, as
    ``block_scores`` gives.
    """
    lq, lk = draw(seq_lens(max_len=max_len))
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    hkv = draw(st.integers(1, 3))
    topk = draw(st.integers(1, 8))
    kind = draw(st.sampled_from(["ties", "distinct", "garbage", "realistic"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    cu_q, cu_k = _cu(lq), _cu(lk)
    tq, nb = sum(lq), max_blocks(cu_k, block_size)
    shape = (hkv, tq, nb)
    if kind == "distinct":
        M = rng.permutation(hkv * tq * nb).reshape(shape).astype(np.float64)
    else:
        M = rng.integers(-2, 3, shape).astype(np.float64)
        M[rng.random(shape) < 0.1] = -np.inf
    if kind == "garbage":
        M[rng.random(shape) < 0.05] = np.nan
        M[rng.random(shape) < 0.05] = np.inf
    if kind == "realistic" and tq:
        local = local_blocks(cu_q, cu_k, tq, int(cu_k[-1]), block_size)
        M[np.isinf(M)] = 0.0
        M[:, np.arange(nb)[None, :] > local[:, None]] = -np.inf
    dtype = draw(st.sampled_from([np.float64, np.float32]))
    return M.astype(dtype), cu_q, cu_k, topk, block_size, kind


def _locals(cu_q, cu_k, tq, block_size):
    return local_blocks(cu_q, cu_k, tq, int(cu_k[-1]), block_size)


@given(selection_problems())
@example((np.array([[[1.0, 1.0, 1.0, 1.0]]]), _cu([1]), _cu([4]), 3, 1, "ties"))
def test_select_blocks_equals_slow_oracle(prob):
    M, cu_q, cu_k, topk, block_size, _ = prob
    I = select_blocks(M, cu_q, cu_k, block_size, topk)
    assert I.dtype == np.int32 and I.shape == (M.shape[1], M.shape[0], topk)
    np.testing.assert_array_equal(I, _slow_select(M, cu_q, cu_k, topk, block_size))


@given(selection_problems())
def test_select_blocks_invariants(prob):
    M, cu_q, cu_k, topk, block_size, kind = prob
    I = select_blocks(M, cu_q, cu_k, block_size, topk)
    check_block_indices(I, cu_q, cu_k, block_size)  # in range, unique, -1 only at the tail
    local = _locals(cu_q, cu_k, M.shape[1], block_size)[:, None]  # [Tq, 1]
    real = I >= 0
    count = real.sum(axis=-1)  # [Tq, Hkv]
    assert not np.any(real[..., 1:] & ~real[..., :-1])  # -1 only at the tail
    assert np.all(np.diff(I, axis=-1)[real[..., 1:]] > 0)  # ascending, hence unique
    assert np.all((I == local[..., None]).sum(axis=-1) == 1)  # local block present, once
    assert np.all(np.where(real, I, 0) <= local[..., None])  # causal: nothing in the future
    candidates = ((np.arange(M.shape[2])[None, :] < local) & (M > -np.inf)).sum(axis=-1).T  # [Tq, Hkv]
    np.testing.assert_array_equal(count, np.minimum(topk, 1 + candidates))
    if kind == "realistic":
        np.testing.assert_array_equal(count, np.broadcast_to(np.minimum(topk, local + 1), count.shape))


@given(selection_problems())
def test_distinct_scores_select_exactly_top_k_minus_1_plus_local(prob):
    M, cu_q, cu_k, topk, block_size, _ = prob
    M = np.argsort(np.random.default_rng(0).random(M.shape), axis=-1).astype(np.float64)  # distinct
    I = select_blocks(M, cu_q, cu_k, block_size, topk)
    local = _locals(cu_q, cu_k, M.shape[1], block_size)
    for t in range(M.shape[1]):
        for r in range(M.shape[0]):
            before = M[r, t, : local[t]]
            want = set(np.argsort(-before)[: topk - 1].tolist()) | {int(local[t])}
            assert set(I[t, r][I[t, r] >= 0].tolist()) == want


# Hostile sizes, hand-written expected rows. Block size 4 unless stated.
TABLE = {
    # one query at position 0: only block 0, the rest padding
    "T=1": (dict(lq=[1], lk=[1], topk=3, scores=[[5.0]]), [[0, -1, -1]]),
    # NB < K: query at position 9 (block 2) sees 3 blocks, K = 5
    "NB<K": (dict(lq=[1], lk=[10], topk=5, scores=[[1.0, 2.0, 3.0]]), [[0, 1, 2, -1, -1]]),
    # local block forced although it scores lowest; the best other block is 0
    "local-forced-low": (dict(lq=[1], lk=[12], topk=2, scores=[[9.0, 1.0, -5.0]]), [[0, 2]]),
    # local block forced even at -inf
    "local-forced-neginf": (dict(lq=[1], lk=[12], topk=2, scores=[[1.0, 3.0, -np.inf]]), [[1, 2]]),
    # all tied: smallest ids win
    "ties-smallest-id": (dict(lq=[1], lk=[24], topk=3, scores=[[7.0] * 6]), [[0, 1, 5]]),
    # future blocks (b > local) ignored even with a huge finite score (Lq < Lk: query at pos 5)
    "future-ignored": (dict(lq=[1], lk=[6], topk=3, scores=[[0.0, 1.0]]), [[0, 1, -1]]),
    # NaN and -inf are never candidates, +inf is the best score
    "nan-inf": (dict(lq=[1], lk=[20], topk=3, scores=[[np.nan, -np.inf, np.inf, 0.0, 1.0]]), [[2, 3, 4]]),
    # K = 1: only the local block, whatever the scores
    "K=1": (dict(lq=[1], lk=[20], topk=1, scores=[[9.0, 9.0, 9.0, 9.0, 0.0]]), [[4]]),
}


@pytest.mark.parametrize("case,want", TABLE.values(), ids=TABLE.keys())
def test_select_blocks_table(case, want):
    cu_q, cu_k = _cu(case["lq"]), _cu(case["lk"])
    M = np.array(case["scores"], dtype=np.float64)[:, None, :]  # [Hkv=1, Tq=1, NB]
    I = select_blocks(M, cu_q, cu_k, 4, case["topk"])
    np.testing.assert_array_equal(I[:, 0], want)


def test_future_and_past_the_end_blocks_are_never_selected():
    # Two sequences: the short one (8 keys, 2 blocks of 4) shares NB = 5 with the long one.
    # Every block after a query's local block holds a huge score; none may be picked.
    cu_q, cu_k = _cu([8, 20]), _cu([8, 20])
    local = _locals(cu_q, cu_k, 28, 4)
    M = np.zeros((2, 28, 5))
    M[:, np.arange(5)[None, :] > local[:, None]] = 1e30
    I = select_blocks(M, cu_q, cu_k, 4, 3)
    assert np.all(np.where(I >= 0, I, 0) <= local[:, None, None])
    np.testing.assert_array_equal(I[7, 0], [0, 1, -1])  # last query of the short sequence
    np.testing.assert_array_equal(I[27, 0], [0, 1, 4])  # last query of the long one: ties -> 0, 1


def test_varlen_lq_less_than_lk_uses_bottom_right_positions():
    # Lk = 40, Lq = 3 (positions 37..39, local block 9); second sequence decode at position 4.
    cu_q, cu_k = _cu([3, 1]), _cu([40, 5])
    M = np.tile(np.arange(10, dtype=np.float64)[::-1], (2, 4, 1))  # block 0 best, 9 worst
    I = select_blocks(M, cu_q, cu_k, 4, 4)
    np.testing.assert_array_equal(I[:3, 1], [[0, 1, 2, 9]] * 3)
    np.testing.assert_array_equal(I[3, 1], [0, 1, -1, -1])


def test_per_group_selections_differ():
    cu = _cu([16])
    M = np.zeros((2, 16, 4))
    M[0, :, 0], M[1, :, 2] = 1.0, 1.0
    I = select_blocks(M, cu, cu, 4, 2)
    np.testing.assert_array_equal(I[15], [[0, 3], [2, 3]])


def test_wide_rows_nb_8192():
    # NB = 8192 candidates (Bk = 1), tied scores from a small set: the partition + tie fix-up path.
    rng = np.random.default_rng(5)
    cu_q, cu_k = _cu([24]), _cu([8192])
    M = rng.integers(0, 4, (2, 24, 8192)).astype(np.float32)
    I = select_blocks(M, cu_q, cu_k, 1, 16)
    np.testing.assert_array_equal(I, _slow_select(M, cu_q, cu_k, 16, 1))


def test_select_blocks_empty_batch():
    cu = _cu([0, 0])
    I = select_blocks(np.zeros((3, 0, 0)), cu, cu, 8, 4)
    assert I.shape == (0, 3, 4) and I.dtype == np.int32


def _slow_fixed(cu_q, cu_k, hkv, topk, block_size, num_sink):
    """§2.2 from its definition: sinks, then the most recent blocks, local included, K in total."""
    tq = int(cu_q[-1])
    out = np.full((tq, hkv, topk), -1, dtype=np.int32)
    for t, local in enumerate(_locals(cu_q, cu_k, tq, block_size)):
        visible = list(range(local + 1))
        if len(visible) <= topk:
            row = visible
        else:
            sinks = visible[: min(num_sink, topk - 1)]
            row = sinks + visible[len(visible) - (topk - len(sinks)):]
        out[t, :, : len(row)] = row
    return out


FIXED = {
    "sink+window": (dict(lk=[44], topk=4, num_sink=1), 43, [0, 8, 9, 10]),
    "all-fit": (dict(lk=[44], topk=4, num_sink=1), 9, [0, 1, 2, -1]),
    "window-only": (dict(lk=[44], topk=4, num_sink=0), 43, [7, 8, 9, 10]),
    "two-sinks": (dict(lk=[44], topk=4, num_sink=2), 43, [0, 1, 9, 10]),
    "sinks-clamped-to-K-1": (dict(lk=[44], topk=4, num_sink=9), 43, [0, 1, 2, 10]),
    "K=1": (dict(lk=[44], topk=1, num_sink=1), 43, [10]),
    "T=1": (dict(lk=[1], topk=3, num_sink=1), 0, [0, -1, -1]),
}


@pytest.mark.parametrize("case,t,want", FIXED.values(), ids=FIXED.keys())
def test_fixed_blocks_table(case, t, want):
    cu = _cu(case["lk"])
    I = fixed_blocks(cu, cu, 4, case["topk"], num_kv_heads=2, num_sink=case["num_sink"])
    assert I.dtype == np.int32 and I.shape == (case["lk"][0], 2, case["topk"])
    np.testing.assert_array_equal(I[t], [want, want])


@given(lens=seq_lens(max_len=80), hkv=st.integers(1, 3), topk=st.integers(1, 8),
       block_size=st.sampled_from([1, 2, 4, 8]), num_sink=st.integers(0, 4))
def test_fixed_blocks_properties(lens, hkv, topk, block_size, num_sink):
    cu_q, cu_k = _cu(lens[0]), _cu(lens[1])
    I = fixed_blocks(cu_q, cu_k, block_size, topk, num_kv_heads=hkv, num_sink=num_sink)
    np.testing.assert_array_equal(I, _slow_fixed(cu_q, cu_k, hkv, topk, block_size, num_sink))
    check_block_indices(I, cu_q, cu_k, block_size)
    local = _locals(cu_q, cu_k, I.shape[0], block_size)
    count = np.broadcast_to(np.minimum(topk, local + 1)[:, None], I.shape[:2])
    np.testing.assert_array_equal((I >= 0).sum(axis=-1), count)
    assert np.all(I == I[:, :1])  # one row for every group
    if num_sink < topk:
        # The fixed rule is eq 7 on position-only scores: sinks highest, then recency.
        nb = max_blocks(cu_k, block_size)
        b = np.arange(nb, dtype=np.float64)
        scores = np.where(b < num_sink, nb + 1 + b, b)  # [NB]
        M = np.broadcast_to(scores, (hkv, I.shape[0], nb))
        np.testing.assert_array_equal(I, select_blocks(M, cu_q, cu_k, block_size, topk))


def test_check_block_indices_returns_an_int64_host_copy():
    cu = _cu([10, 6])
    I = fixed_blocks(cu, cu, 4, 3, num_kv_heads=2)
    got = check_block_indices(I, cu, cu, 4)
    assert got.dtype == np.int64 and not np.shares_memory(got, I)
    np.testing.assert_array_equal(got, I)
    # Unordered rows and blocks after the local one are valid input (order-free later stages).
    got = check_block_indices(np.array([[[2, 0, -1]]], np.int16), _cu([1]), _cu([12]), 4)
    np.testing.assert_array_equal(got, [[[2, 0, -1]]])


BAD_ROWS = {
    # query 1 of sequence 0 (Lk = 5, 2 blocks of 4): block 2 is past its sequence's end
    "past-sequence-end": ([[0, -1], [2, -1], [0, 1]], "t=1, r=0", r"\[0, 2\)"),
    "below-minus-one": ([[0, -1], [0, -2], [0, 1]], "t=1, r=0", r"-1 or in"),
    "duplicate": ([[0, -1], [1, 1], [0, 1]], "t=1, r=0", "twice"),
    "hole": ([[0, -1], [0, 1], [-1, 1]], "t=2, r=0", "padding"),
}


@pytest.mark.parametrize("rows,where,why", BAD_ROWS.values(), ids=BAD_ROWS.keys())
def test_check_block_indices_names_the_first_bad_row(rows, where, why):
    cu_q, cu_k = _cu([2, 1]), _cu([5, 12])
    # Queries 0, 1 sit at positions 3, 4 of a 5-key sequence (blocks 0, 1); query 2 at position
    # 11 of a 12-key one (blocks 0..2). Group r = 1 is valid everywhere.
    I = np.empty((3, 2, 2), np.int32)  # [Tq, Hkv, K]
    I[:, 0], I[:, 1] = rows, [0, -1]
    with pytest.raises(ValueError, match=rf"block_indices\[{where}\].*{why}"):
        check_block_indices(I, cu_q, cu_k, 4)


@pytest.mark.parametrize("I,exc,match", [
    (np.zeros((3, 2, 2), np.float32), TypeError, "block_indices"),
    (np.zeros((3, 2), np.int32), ValueError, "block_indices"),
    (np.zeros((3, 2, 0), np.int32), ValueError, "block_indices"),
    (np.zeros((4, 2, 2), np.int32), ValueError, "cu_seqlens_q"),
], ids=["float", "rank", "K=0", "Tq-mismatch"])
def test_check_block_indices_bad_arrays(I, exc, match):
    with pytest.raises(exc, match=match):
        check_block_indices(I, _cu([2, 1]), _cu([5, 12]), 4)


def _good_select_args():
    cu_q, cu_k = _cu([3, 2]), _cu([9, 4])
    return np.zeros((2, 5, 3)), cu_q, cu_k


BAD_SELECT = {
    "scores-rank": (lambda m, cq, ck: (m[0], cq, ck, 4, 2), ValueError, "block_scores"),
    "scores-int": (lambda m, cq, ck: (m.astype(np.int32), cq, ck, 4, 2), TypeError, "block_scores"),
    "scores-no-heads": (lambda m, cq, ck: (m[:0], cq, ck, 4, 2), ValueError, "block_scores"),
    "scores-NB": (lambda m, cq, ck: (m[..., :2], cq, ck, 4, 2), ValueError, "block_scores"),
    "scores-NB-wrong-Bk": (lambda m, cq, ck: (m, cq, ck, 2, 2), ValueError, "block_scores"),
    "Tq-vs-cu_q": (lambda m, cq, ck: (m[:, :4], cq, ck, 4, 2), ValueError, "cu_seqlens_q"),
    "cu_k-float": (lambda m, cq, ck: (m, cq, ck.astype(float), 4, 2), TypeError, "cu_seqlens_k"),
    "cu_k-short": (lambda m, cq, ck: (m, cq, ck[:1], 4, 2), ValueError, "cu_seqlens_k"),
    "Lq>Lk": (lambda m, cq, ck: (m, cq, np.array([0, 2, 13], np.int32), 4, 2), ValueError, "more queries"),
    "topk=0": (lambda m, cq, ck: (m, cq, ck, 4, 0), ValueError, "topk"),
    "topk-float": (lambda m, cq, ck: (m, cq, ck, 4, 2.0), TypeError, "topk"),
    "Bk=0": (lambda m, cq, ck: (m, cq, ck, 0, 2), ValueError, "block_size"),
}


@pytest.mark.parametrize("bad", BAD_SELECT.values(), ids=BAD_SELECT.keys())
def test_bad_select_inputs_name_the_argument(bad):
    make, exc, match = bad
    with pytest.raises(exc, match=match):
        select_blocks(*make(*_good_select_args()))


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(num_kv_heads=0), ValueError, "num_kv_heads"),
    (dict(topk=0), ValueError, "topk"),
    (dict(block_size=-4), ValueError, "block_size"),
    (dict(num_sink=-1), ValueError, "num_sink"),
    (dict(num_sink=1.5), TypeError, "num_sink"),
    (dict(cu_seqlens_q=np.array([0, 3, 1], np.int32)), ValueError, "cu_seqlens_q"),
    (dict(cu_seqlens_q=np.array([0.0, 3.0])), TypeError, "cu_seqlens_q"),
    (dict(cu_seqlens_k=np.array([0, 3], np.int32)), ValueError, "cu_seqlens"),
], ids=["heads", "topk", "Bk", "sink-negative", "sink-float", "cu_q-decreasing", "cu_q-float",
        "cu_k-batch"])
def test_bad_fixed_inputs_name_the_argument(kwargs, exc, match):
    args = dict(cu_seqlens_q=_cu([3, 2]), cu_seqlens_k=_cu([9, 4]), num_kv_heads=2, topk=2,
                block_size=4, num_sink=1)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        fixed_blocks(**args)
