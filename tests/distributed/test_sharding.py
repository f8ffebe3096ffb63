"""msa.distributed.shard_tokens: a pure function from the global batch to each rank's rows."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from msa.distributed.sharding import causal_work, shard_tokens
from msa.testing.strategies import offsets


def check_sharding(sh):
    """The invariants every sharding keeps (docs/context_parallel.md)."""
    cu, w, t = sh.cu_seqlens, sh.world_size, sh.total
    ids = [sh.token_ids(r) for r in range(w)]
    # every global token is on exactly one rank, at the row local_index says
    np.testing.assert_array_equal(np.sort(np.concatenate(ids)), np.arange(t))
    for r in range(w):
        np.testing.assert_array_equal(sh.owner[ids[r]], r)
        np.testing.assert_array_equal(sh.local_index[ids[r]], np.arange(ids[r].size))
        assert ids[r].size == sh.counts[r] >= 1  # every rank holds a token
    # chunks tile each sequence in order, at most chunk_size tokens, never across sequences
    seq, p0, p1, rank = sh.chunks.T
    lengths = np.diff(cu)
    assert np.all((p1 > p0) & (p1 - p0 <= sh.chunk_size) & (p1 <= lengths[seq]))
    np.testing.assert_array_equal(np.bincount(seq, weights=p1 - p0, minlength=lengths.size),
                                  lengths)
    np.testing.assert_array_equal(np.bincount(rank, weights=causal_work(p0, p1), minlength=w),
                                  sh.work)
    assert sh.work.sum() == causal_work(0, lengths).sum()
    # at most ceil(C / W) chunks a rank
    assert np.bincount(rank, minlength=w).max() == -(-seq.size // w)
    seq_of = np.repeat(np.arange(lengths.size), lengths)  # [T]
    pos_of = np.arange(t) - cu[seq_of]
    for r in range(w):
        row = 0
        for rd in sh.rounds(r):
            assert rd.row0 == row  # rounds are the local rows in order
            row = rd.row1
            got = ids[r][rd.row0:rd.row1]
            lq, lk = np.diff(rd.cu_seqlens_q), np.diff(rd.cu_seqlens_k)
            seqs = seq_of[rd.key_starts]
            assert np.all(np.diff(seqs) > 0)  # one span per sequence, by sequence
            np.testing.assert_array_equal(rd.key_starts, cu[seqs])
            assert np.all((lq >= 1) & (lq <= lk) & (lk <= lengths[seqs]))
            # the span's queries are the last Lq of its Lk keys: positions Lk - Lq .. Lk - 1
            want = np.concatenate([cu[b] + np.arange(k - q, k) for b, q, k in zip(seqs, lq, lk)])
            np.testing.assert_array_equal(got, want)
            keys = rd.key_ids()
            assert keys.size == rd.cu_seqlens_k[-1]
            np.testing.assert_array_equal(pos_of[keys], np.concatenate([np.arange(k) for k in lk]))
        assert row == sh.counts[r]


def check_pieces(sh, pieces):
    n_pad = sh.padded_rows(pieces)
    assert n_pad % pieces == 0 and n_pad >= sh.counts.max()
    per = n_pad // pieces
    layout = sh.piece_layout(pieces)
    np.testing.assert_array_equal(np.sort(np.concatenate([tok for tok, _ in layout])),
                                  np.arange(sh.total))
    for s, (tok, rows) in enumerate(layout):
        # row r * per + l - s * per of gathered piece s is row l of rank r
        np.testing.assert_array_equal(rows, sh.owner[tok] * per + sh.local_index[tok] - s * per)
        assert np.all((sh.local_index[tok] // per) == s)
    np.testing.assert_array_equal(sh.rank_major_rows(pieces), sh.owner * n_pad + sh.local_index)
    piece = sh.local_index // per
    for r in range(sh.world_size):
        need = sh.pieces_needed(r, pieces)
        for rd, n in zip(sh.rounds(r), need):
            assert piece[rd.key_ids()].max() == n - 1


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_one_sequence_in_2w_chunks_is_the_zigzag(world_size):
    """The min-heap on 2W equal chunks of one sequence is the zigzag: rank r gets r, 2W-1-r."""
    t = 2 * world_size * 5
    sh = shard_tokens([0, t], world_size)  # default chunk_size: ceil(T / 2W) = 5
    assert sh.chunk_size == 5
    for r in range(world_size):
        np.testing.assert_array_equal(np.flatnonzero(sh.chunks[:, 3] == r),
                                      sorted({r, 2 * world_size - 1 - r}))
    assert len(set(sh.work.tolist())) == 1 and len(set(sh.counts.tolist())) == 1
    check_sharding(sh)
    if world_size > 1:
        # early chunk first: with 2 pieces, the early round reads piece 0 only (GPU overlap)
        for r in range(world_size - 1):
            np.testing.assert_array_equal(sh.pieces_needed(r, 2), [1, 2])
        np.testing.assert_array_equal(sh.pieces_needed(world_size - 1, 2), [2])  # one span


@pytest.mark.parametrize("cu, world_size, chunk_size", [
    ([0, 45, 50, 100, 128], 2, 12),
    ([0, 37, 37, 90], 2, 8),  # an empty sequence
    ([0, 70, 75, 76, 100, 128], 4, 8),  # a sequence of one token
    ([0, 1, 2, 3, 4], 4, 1),  # one token a rank
    ([0, 3, 6, 9, 12, 15, 18, 21], 3, 5),  # whole short sequences
    ([0, 1000], 16, 7),
], ids=["packed", "empty-seq", "one-token-seq", "one-token-each", "short-seqs", "16-ranks"])
def test_sharding_table(cu, world_size, chunk_size):
    sh = shard_tokens(cu, world_size, chunk_size)
    check_sharding(sh)
    for pieces in (1, 2, 3):
        check_pieces(sh, min(pieces, int(sh.counts.max())))


def test_local_order_is_global_order_for_whole_sequences():
    sh = shard_tokens([0, 3, 6, 9, 12, 15, 18, 21], 3, 5)
    for r in range(3):
        ids = sh.token_ids(r)
        assert np.all(np.diff(ids) > 0)


def test_the_paper_benchmark_shape_balances():
    """MiniMax's training benchmark: 192K tokens, 16 ranks, 12 chunks of 1024 a rank."""
    sh = shard_tokens([0, 192 * 1024], 16, 1024)
    assert set(sh.counts.tolist()) == {12 * 1024}
    assert sh.work.max() / sh.work.mean() < 1.001


def test_pure_and_read_only():
    a = shard_tokens(np.array([0, 30, 64]), 2, 8)
    b = shard_tokens([0, 30, 64], 2, 8)
    assert a is b  # cached: every rank and call gets the same plan
    for arr in (a.owner, a.local_index, a.chunks, a.counts, a.work, a.cu_seqlens):
        with pytest.raises(ValueError):
            arr[0] = 1


@given(lengths=st.lists(st.integers(0, 60), min_size=1, max_size=6),
       world_size=st.integers(1, 6), chunk_size=st.integers(1, 40), pieces=st.integers(1, 4))
def test_sharding_fuzz(lengths, world_size, chunk_size, pieces):
    cu = offsets(lengths)
    n_chunks = int(sum(-(-n // chunk_size) for n in lengths))
    if n_chunks < world_size:
        with pytest.raises(ValueError, match="at least world_size"):
            shard_tokens(cu, world_size, chunk_size)
        return
    sh = shard_tokens(cu, world_size, chunk_size)
    check_sharding(sh)
    check_pieces(sh, min(pieces, int(sh.counts.max())))
    # longest processing time first: no rank exceeds the mean by more than the largest chunk
    assert sh.work.max() <= sh.work.mean() + causal_work(sh.chunks[:, 1], sh.chunks[:, 2]).max()


@pytest.mark.parametrize("args, err, match", [
    (([0, 10], 0, 4), ValueError, "world_size must be >= 1"),
    (([0, 10], 2, 0), ValueError, "chunk_size must be >= 1"),
    (([0, 10], 2, 4.0), TypeError, "chunk_size must be an integer"),
    (([0, 10], 4, 5), ValueError, "at least world_size=4 chunks"),
    (([0, 0], 1, None), ValueError, "at least world_size=1 chunks"),
    (([1, 10], 2, 4), ValueError, r"cu_seqlens\[0\] must be 0"),
    (([0, 10, 5], 2, 4), ValueError, "cu_seqlens must be non-decreasing"),
])
def test_invalid_arguments(args, err, match):
    with pytest.raises(err, match=match):
        shard_tokens(*args)


def test_invalid_rank_and_pieces():
    sh = shard_tokens([0, 10], 2, 5)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 1\]"):
        sh.token_ids(2)
    with pytest.raises(ValueError, match="pieces must be >= 1"):
        sh.padded_rows(0)
