"""msa._batch.Batch: the packed batch validated once, and its query chunks."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from msa._batch import Batch
from msa.reference.blocks import block_row_offsets, max_blocks, query_positions


@st.composite
def batches(draw):
    b = draw(st.integers(1, 5))
    lk = draw(st.lists(st.integers(0, 300), min_size=b, max_size=b))
    lq = [draw(st.integers(0, n)) for n in lk]
    bk = draw(st.sampled_from([1, 16, 64, 128]))
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    return cu_q, cu_k, bk


@settings(deadline=None, max_examples=60)
@given(batches(), st.integers(1, 400))
def test_batch_matches_the_reference_and_chunks_cover_every_query(args, chunk):
    cu_q, cu_k, bk = args
    batch = Batch.of(cu_q, cu_k, bk, total_q=int(cu_q[-1]), total_k=int(cu_k[-1]))
    np.testing.assert_array_equal(batch.row_offsets, block_row_offsets(cu_k, bk))
    assert batch.rows == int(block_row_offsets(cu_k, bk)[-1])
    assert batch.nb == max_blocks(cu_k, bk)
    qb, qp = query_positions(cu_q, cu_k, int(cu_q[-1]), int(cu_k[-1]))
    np.testing.assert_array_equal(batch.query_batch, qb)
    np.testing.assert_array_equal(batch.query_pos, qp)
    seen = []
    for t0, t1, k_lo, k_hi, sub in batch.chunks(chunk):
        assert 0 < t1 - t0 <= chunk and sub.tq == t1 - t0 and sub.tk == k_hi - k_lo
        # every chunk query keeps its position, hence its blocks
        np.testing.assert_array_equal(sub.query_pos, qp[t0:t1])
        # and its keys: packed key k_lo + cu_k_c[b] + j is key j of the same sequence
        bf = qb[t0]
        np.testing.assert_array_equal(sub.cu_k[:-1] + k_lo, cu_k[bf:bf + sub.num_seqs])
        seen.extend(range(t0, t1))
    assert seen == list(range(int(cu_q[-1])))


def test_batch_is_read_only_and_checks_its_arguments():
    batch = Batch.of(np.array([0, 3]), np.array([0, 5]), 4, total_q=3, total_k=5)
    with pytest.raises(ValueError):
        batch.cu_q[0] = 1
    with pytest.raises(ValueError, match="more queries than keys"):
        Batch.of(np.array([0, 6]), np.array([0, 5]), 4, total_q=6, total_k=5)
    with pytest.raises(ValueError, match="cu_seqlens_k\\[-1\\]"):
        Batch.of(np.array([0, 3]), np.array([0, 5]), 4, total_q=3, total_k=6)
    with pytest.raises(TypeError, match="block_size"):
        Batch.of(np.array([0, 3]), np.array([0, 5]), 16.9)
    with pytest.raises(ValueError, match="block_size"):
        Batch.of(np.array([0, 3]), np.array([0, 5]), 0)
    keys = Batch.of(None, np.array([0, 5, 9]), 4)
    assert keys.tq is None and keys.rows == 2 + 1 and keys.nb == 2


@pytest.mark.parametrize("totals", [{}, {"total_q": 3}, {"total_q": 3, "total_k": 5}])
def test_batch_reads_each_offsets_array_once(monkeypatch, totals):
    """A GPU array's offsets cost a device-to-host copy (a wait for the GPU) per read: Batch.of
    reads and checks each once, whichever totals it is given."""
    import msa._checks as checks

    reads = []
    real = checks.cu_to_host
    monkeypatch.setattr(checks, "cu_to_host", lambda x: reads.append(x) or real(x))
    cu_q, cu_k = np.array([0, 3]), np.array([0, 5])
    batch = Batch.of(cu_q, cu_k, 4, **totals)
    assert len(reads) == 2 and reads[0] is cu_q and reads[1] is cu_k
    assert (batch.tq, batch.tk, batch.rows) == (3, 5, 2)
    with pytest.raises(ValueError, match="more queries than keys"):
        Batch.of(np.array([0, 6]), cu_k, 4, **{k: 6 if k == "total_q" else v
                                               for k, v in totals.items()})
