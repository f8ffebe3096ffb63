"""msa.cuda.csr equals msa.reference.csr exactly (paper §4.2, the k2q reverse index).

Every output and every intermediate buffer starts poisoned (the most negative integer), so an
entry a kernel forgets to write cannot match the reference. Small tiles and small scan blocks
push tiny problems through the multi-tile and multi-block paths the large ones take.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from msa._batch import Batch
from msa.cuda import csr as gpu
from msa.cuda._core import launch as _launch
from msa.cuda._core.arrays import ArrayContext
from msa.cuda.csr import _plan, v2_tiled, v3_multisplit
from msa.reference import csr as ref
from msa.reference.blocks import block_row_offsets, query_positions
from msa.testing.backends import SIMULATOR, to_numpy
from msa.testing.strategies import offsets as cu
from msa.testing.strategies import seq_lens


def selection(lq, lk, hkv, topk, bk, seed, *, hot=(), fill=True, future=False, shuffle=False):
    """A valid I int32 [Tq, Hkv, K]: the local block, the visible ``hot`` blocks (a skewed
    selection), then random blocks; ``fill=False`` keeps a random number of them (-1 padded),
    ``future`` also draws blocks after the local one, ``shuffle`` leaves rows unsorted."""
    rng = np.random.default_rng(seed)
    cu_q, cu_k = cu(lq), cu(lk)
    batch, pos = query_positions(cu_q, cu_k, int(cu_q[-1]), int(cu_k[-1]))
    seq_blocks = -(-np.diff(cu_k) // bk)
    out = np.full((pos.size, hkv, topk), -1, dtype=np.int32)
    for t, p in enumerate(pos):
        local = int(p) // bk
        pool = int(seq_blocks[batch[t]]) if future else local + 1
        for h in range(hkv):
            want = min(topk, pool) if fill else int(rng.integers(1, min(topk, pool) + 1))
            chosen = [local] + [b for b in hot if b < pool and b != local][: want - 1]
            rest = np.setdiff1d(np.arange(pool), chosen)
            chosen += rng.permutation(rest)[: want - len(chosen)].tolist()
            out[t, h, : len(chosen)] = rng.permutation(chosen) if shuffle else np.sort(chosen)
    return out


def assert_same_csr(got, want):
    for name, g, w in zip(("row_ptr", "q_indices", "slots"), got, want):
        g = to_numpy(g)
        assert g.dtype == np.int32, name
        np.testing.assert_array_equal(g, w, err_msg=name)


# --- hostile shapes ---------------------------------------------------------------------------

# Each row also picks the kernel path: "default" (build_csr as shipped), "tiles" (one chunk of
# queries per tile, look-back scan blocks of 2 threads: many tiles, many scan blocks),
# "count-v1" (those tiles counted by count v1, global atomics into a zeroed array: the fallback
# past 22528 rows), "v1" (row-wise scatter).
SHAPES = [
    # id, seq_lens_q, seq_lens_k, Hkv, K, Bk, selection kwargs, path
    ("T=1", [1], [1], 2, 3, 4, {}, "default"),
    ("T=1-tiles", [1], [1], 1, 1, 4, {}, "tiles"),
    ("decode-Lq=1-of-37", [1], [37], 2, 3, 8, dict(future=True), "default"),
    ("Lk-not-multiple-of-Bk", [13], [13], 1, 2, 4, {}, "tiles"),
    ("NB<K", [10], [10], 2, 4, 8, {}, "default"),
    ("Lq<Lk-varlen", [3, 5], [40, 17], 3, 3, 8, dict(fill=False), "tiles"),
    ("empty-sequences", [0, 5, 0, 3, 0], [0, 9, 4, 3, 0], 2, 2, 4, {}, "tiles"),
    ("many-sequences", [7, 1, 12, 3, 9, 4], [7, 30, 12, 19, 9, 4], 2, 3, 4, dict(fill=False),
     "default"),
    ("skewed-sink", [40, 25], [40, 31], 2, 3, 4, dict(hot=(0,)), "tiles"),
    ("skewed-sink-and-block-2-unsorted", [64], [64], 1, 4, 4, dict(hot=(0, 2), shuffle=True),
     "default"),
    ("K=1-local-only", [17, 9], [17, 20], 2, 1, 4, {}, "tiles"),
    ("future-unsorted-partial", [9, 6], [12, 6], 2, 3, 4,
     dict(future=True, shuffle=True, fill=False), "tiles"),
    ("empty-batch", [0], [0], 2, 3, 4, {}, "default"),
    ("keys-without-queries", [0, 0], [9, 3], 1, 2, 4, {}, "tiles"),
    ("32-queries-per-chunk", [70], [70], 1, 2, 4, dict(hot=(0,)), "default"),
    ("varlen-v1", [3, 0, 6], [11, 4, 6], 2, 3, 4, dict(hot=(0,), fill=False), "v1"),
    ("skewed-v1", [20], [20], 1, 3, 4, dict(hot=(0, 1), shuffle=True), "v1"),
    ("varlen-count-v1", [5, 0, 21], [9, 3, 30], 2, 3, 4, dict(hot=(0,), fill=False), "count-v1"),
    ("skewed-count-v1", [40, 25], [40, 31], 2, 3, 4, dict(hot=(0,)), "count-v1"),
]


def run_path(path, I, cu_q, cu_k, bk, scatter):
    if path == "default":  # (build_csr picks v2 for outputs this small)
        if scatter == 2:
            return gpu.build_csr(I, cu_q, cu_k, bk)
        return gpu._build_csr(I, cu_q, cu_k, bk, scatter_version=scatter)
    if path in ("tiles", "count-v1"):
        return gpu._build_csr(I, cu_q, cu_k, bk, tile_queries=_plan.chunk_queries(I.shape[2]),
                              scan_threads=2, count_version=1 if path == "count-v1" else 2,
                              scatter_version=scatter)
    return gpu._build_csr(I, cu_q, cu_k, bk, scatter_version=1)


# Every path but v1 with both tiled scatters: v2 (hash table of rows per chunk) and v3 (two
# stable multi-splits, by row group then by row).
SHAPE_RUNS = [pytest.param(*sh[1:], scatter, id=f"{sh[0]}-scatter{scatter}")
              for sh in SHAPES for scatter in ((1,) if sh[-1] == "v1" else (2, 3))]


@pytest.mark.parametrize("lq, lk, hkv, topk, bk, kwargs, path, scatter", SHAPE_RUNS)
def test_build_csr_equals_reference(lq, lk, hkv, topk, bk, kwargs, path, scatter):
    I = selection(lq, lk, hkv, topk, bk, seed=len(lq) * 7 + topk, **kwargs)
    cu_q, cu_k = cu(lq), cu(lk)
    assert_same_csr(run_path(path, I, cu_q, cu_k, bk, scatter), ref.build_csr(I, cu_q, cu_k, bk))


def test_scatter_v3_groups_many_rows():
    # 300 rows of one block each (Bk = 1): three row groups, the last one partial, and a few
    # hot rows; with small tiles each tile holds a handful of every group's edges.
    I = selection([300], [300], 2, 5, 1, seed=11, hot=(0, 129), shuffle=True)
    want = ref.build_csr(I, cu([300]), cu([300]), 1)
    # (small tiles mean hundreds of CTAs: minutes in the simulator, which runs the default
    # tile; tiles of 150 and 64 queries cut the row groups in test_scatter_v3_block_sizes and
    # test_scatter_v3_groups_varlen_padded)
    for tile in (None,) if SIMULATOR else (None, 50):
        got = gpu._build_csr(I, cu([300]), cu([300]), 1, scatter_version=3, tile_queries=tile)
        assert_same_csr(got, want)


# 256 and 512 (the GPU's 16 warps) run on a GPU: 128 takes the same scan over several warps
@pytest.mark.parametrize("threads", [32, 128, pytest.param(256, marks=pytest.mark.sim_heavy),
                                     pytest.param(512, marks=pytest.mark.sim_heavy)])
def test_scatter_v3_block_sizes(threads):
    # Scatter v3 at 1 to 16 warps a CTA (the simulator's default is 2; the GPU's 16): the
    # multi-split's ranks then come from a scan over that many warps per key. 300 rows of
    # Bk = 1 (three row groups) and hot rows put most keys of a group in every chunk.
    I = selection([300], [300], 1, 5, 1, seed=threads, hot=(0, 129), shuffle=True)
    got = gpu._build_csr(I, cu([300]), cu([300]), 1, scatter_version=3, tile_queries=150,
                         split_threads=threads)
    assert_same_csr(got, ref.build_csr(I, cu([300]), cu([300]), 1))


def test_scatter_choice():
    # build_csr's scatter: v3 for outputs (q_indices + slots, 8 * Hkv * Tq*K bytes) of at least
    # 192 MiB where its scratch (two int64 arrays like the output, allocated after the choice
    # with the output) fits in free memory with SPLIT_HEADROOM to spare, and where there are at
    # most 128 groups of 128 rows; else v2. An explicit version runs, but 3 becomes 2 past 128
    # groups. Free memory is asked for only when v3 is in question.
    out, rows, big = 8 * 2 * 65 * 3, 20, v3_multisplit.MAX_SPLIT_ROWS + 1
    need = 3 * out + _plan.SPLIT_HEADROOM

    def never():
        raise AssertionError("free memory asked for")

    assert _plan.pick_scatter(None, rows, out, never) == 2  # far below 192 MiB
    assert _plan.pick_scatter(None, rows, _plan.SPLIT_MIN_BYTES, lambda: float("inf")) == 3
    assert _plan.pick_scatter(None, rows, out, lambda: need - 1, min_bytes=out) == 2
    assert _plan.pick_scatter(None, rows, out, lambda: need, min_bytes=out) == 3
    assert _plan.pick_scatter(None, big, out, never, min_bytes=out) == 2
    assert [_plan.pick_scatter(v, rows, out, never) for v in (1, 2, 3)] == [1, 2, 3]
    assert _plan.pick_scatter(3, big, out, never) == 2
    assert _plan.split_fits(big - 1) and not _plan.split_fits(big)
    I = selection([40, 25], [40, 31], 2, 3, 4, seed=5, hot=(0,))
    batch = Batch.of(cu([40, 25]), cu([40, 31]), 4, total_q=65)
    ctx = ArrayContext(I)
    assert _plan.Plan(batch, ctx.input("block_indices", I), ctx).scatter_version() == 2


def test_free_bytes_from_numba_and_its_memory_managers(monkeypatch):
    # On a GPU, free_bytes asks Numba's context for NumPy/Numba arrays; an external memory
    # manager may not know (NotImplementedError), and then v3 is not ruled out.
    from collections import namedtuple

    from msa.cuda._core import arrays as _arrays

    class Ctx:
        def __init__(self, free):
            self.free = free

        def get_memory_info(self):
            if self.free is None:
                raise NotImplementedError
            return namedtuple("MemoryInfo", "free,total")(self.free, 2 * self.free)

    monkeypatch.setattr(_arrays, "SIMULATOR", False)
    ctx = _arrays.ArrayContext(np.zeros(3, np.int32))
    for free, want in ((12345, 12345.0), (None, float("inf"))):
        monkeypatch.setattr(_arrays.cuda, "current_context", lambda c=Ctx(free): c)
        assert ctx.free_bytes() == want


def test_scatter_v3_groups_varlen_padded():
    # Several sequences (one with no queries), -1 padding, a partial last group, 3 heads and
    # tiles that cut sequences: rows 0-89 | 90-94 | 95-154 of Bk = 4 blocks, 155 rows in all.
    lq, lk = [150, 0, 90], [360, 17, 240]
    I = selection(lq, lk, 3, 4, 4, seed=23, hot=(0, 1), fill=False, shuffle=True)
    want = ref.build_csr(I, cu(lq), cu(lk), 4)
    assert want[0].shape[1] - 1 > 128  # two row groups
    got = gpu._build_csr(I, cu(lq), cu(lk), 4, scatter_version=3, tile_queries=64)
    assert_same_csr(got, want)


@pytest.mark.parametrize("lq, lk, hkv, topk, bk, kwargs", [
    pytest.param([5, 0, 21], [9, 3, 30], 2, 3, 4, dict(hot=(0,), fill=False), id="varlen-skewed"),
    pytest.param([1], [1], 1, 2, 4, {}, id="T=1"),
])
@pytest.mark.parametrize("version", [1, 2, 3])
def test_three_steps_equal_reference(lq, lk, hkv, topk, bk, kwargs, version):
    I = selection(lq, lk, hkv, topk, bk, seed=3, **kwargs)
    cu_q, cu_k = cu(lq), cu(lk)
    counts = gpu.csr_histogram(I, cu_q, cu_k, bk)
    np.testing.assert_array_equal(counts, ref.csr_histogram(I, cu_q, cu_k, bk))
    row_ptr = gpu.exclusive_prefix_sum(counts, version=min(version, 2))
    np.testing.assert_array_equal(row_ptr, ref.exclusive_prefix_sum(counts))
    want = ref.csr_scatter(I, row_ptr, cu_q, cu_k, bk)
    for g, w in zip(gpu.csr_scatter(I, row_ptr, cu_q, cu_k, bk, version=version), want):
        np.testing.assert_array_equal(g, w)


def test_hot_row_holds_every_query_in_order():
    # Everyone picks the sink: row 0 of each head lists all queries ascending, across tiles.
    I = selection([50], [50], 2, 3, 4, seed=1, hot=(0,))
    row_ptr, q_indices, _ = gpu._build_csr(I, cu([50]), cu([50]), 4, tile_queries=8)
    np.testing.assert_array_equal(row_ptr[:, 1], [50, 50])
    np.testing.assert_array_equal(q_indices[:, :50], np.tile(np.arange(50), (2, 1)))


def test_accepts_int64_inputs():
    I = selection([9, 6], [12, 6], 2, 3, 4, seed=3)
    cu_q, cu_k = cu([9, 6]), cu([12, 6])
    got = gpu.build_csr(I.astype(np.int64), cu_q.astype(np.int64), cu_k.astype(np.int64), 4)
    assert_same_csr(got, ref.build_csr(I, cu_q, cu_k, 4))


def test_reruns_are_bitwise_identical():
    # Hot rows shared by every query of a chunk are where an atomic order would show.
    I = selection([30, 14], [30, 20], 2, 4, 4, seed=5, hot=(0, 1), shuffle=True)
    args = (I, cu([30, 14]), cu([30, 20]), 4)
    first = [to_numpy(x).copy() for x in gpu._build_csr(*args, tile_queries=16)]
    second = [to_numpy(x) for x in gpu._build_csr(*args, tile_queries=16)]
    for a, b in zip(first, second):
        assert a.tobytes() == b.tobytes()


def test_shared_count_bounds():
    # Count v2 holds two 16-bit counts a word: at most 2 * HIST_WORDS rows, tiles of fewer than
    # 2**16 queries (a tile longer than Tq is Tq queries); else count v1 runs.
    rows = 2 * v2_tiled.HIST_WORDS
    assert _plan.shared_count_fits(rows, 9, 4) and not _plan.shared_count_fits(rows + 1, 9, 4)
    assert not _plan.shared_count_fits(3, 1 << 16, 1 << 16)
    assert _plan.shared_count_fits(3, 1 << 16, (1 << 16) - 1)
    assert _plan.shared_count_fits(3, (1 << 16) - 1, 1 << 20)


def test_launch_build_csr_on_query_chunks():
    # What other stages call: the unchecked build on a validated batch, here on the query
    # chunks of one (Batch.chunks), each chunk's selection a slice of the whole.
    lq, lk = [30, 0, 21], [40, 9, 21]
    I = selection(lq, lk, 2, 3, 4, seed=8, hot=(0,), fill=False)
    ctx = ArrayContext(I)
    dI = ctx.input("block_indices", I)  # on the device, as the callers hold it
    for t0, t1, _, _, sub in Batch.of(cu(lq), cu(lk), 4).chunks(16):
        got = gpu.launch_build_csr(sub, dI[t0:t1], ctx)
        assert_same_csr(got, ref.build_csr(I[t0:t1], sub.cu_q, sub.cu_k, 4))


# --- hypothesis -------------------------------------------------------------------------------

# a few seconds per example in the simulator: 5 there (and the two explicit ones)
@settings(max_examples=5 if SIMULATOR else max(4, settings().max_examples // 2))
@given(lens=seq_lens(max_seqs=3, max_len=40), hkv=st.integers(1, 2), topk=st.integers(1, 5),
       bk=st.sampled_from([4, 8, 16]), hot=st.sampled_from([(), (0,), (0, 1)]),
       fill=st.booleans(), future=st.booleans(), shuffle=st.booleans(),
       tile=st.sampled_from([None, 1, 3, 32]), scatter=st.sampled_from([2, 3]),
       seed=st.integers(0, 2**31 - 1))
@example(lens=([40], [40]), hkv=1, topk=5, bk=4, hot=(0, 1), fill=True, future=False,
         shuffle=True, tile=3, scatter=2, seed=0)
@example(lens=([40], [40]), hkv=1, topk=5, bk=4, hot=(0, 1), fill=True, future=False,
         shuffle=True, tile=3, scatter=3, seed=0)
def test_csr_equals_reference(lens, hkv, topk, bk, hot, fill, future, shuffle, tile, scatter,
                              seed):
    lq, lk = lens
    I = selection(lq, lk, hkv, topk, bk, seed, hot=hot, fill=fill, future=future, shuffle=shuffle)
    cu_q, cu_k = cu(lq), cu(lk)
    got = [to_numpy(x) for x in gpu._build_csr(I, cu_q, cu_k, bk, tile_queries=tile,
                                               scatter_version=scatter)]
    want = ref.build_csr(I, cu_q, cu_k, bk)
    assert_same_csr(got, want)
    # The contract's properties, which equality implies but which say what went wrong.
    row_ptr, q_indices, slots = got
    nnz = np.count_nonzero(I >= 0, axis=(0, 2))  # [Hkv]
    assert np.all(np.diff(row_ptr, axis=1) >= 0) and np.array_equal(row_ptr[:, -1], nnz)
    for h in range(hkv):
        q, s = q_indices[h, : nnz[h]], slots[h, : nnz[h]]
        assert np.all(q_indices[h, nnz[h]:] == -1) and np.all(slots[h, nnz[h]:] == -1)
        assert np.all(I[q, h, s] >= 0)  # each entry points back at a real edge ...
        assert len(set(zip(q.tolist(), s.tolist()))) == nnz[h]  # ... and no edge twice


# --- bad input --------------------------------------------------------------------------------

EX_CU_Q, EX_CU_K, EX_BK = cu([4]), cu([16]), 4


def _one_seq(rows):
    return np.array(rows, dtype=np.int32)[:, None, :]  # [Tq, 1, K]


BAD_SELECTIONS = [
    pytest.param(_one_seq([[0, 4]] * 4), "block_indices", id="block-out-of-range"),
    pytest.param(_one_seq([[-2, 0]] * 4), "block_indices", id="negative-not-minus-one"),
    pytest.param(_one_seq([[1, 1]] * 4), "block_indices", id="duplicate-in-a-row"),
    pytest.param(_one_seq([[-1, 0]] * 4), "block_indices", id="minus-one-not-at-tail"),
    pytest.param(np.array([[[0, 2]], [[0, 1]]], np.int32), "block_indices",
                 id="block-of-the-other-sequence"),
]


def _call(fn, I, cu_q, cu_k, bk, **kw):
    if fn == "csr_scatter":
        rows = int(block_row_offsets(cu_k, bk)[-1])
        return gpu.csr_scatter(I, np.zeros((I.shape[1], rows + 1), np.int32), cu_q, cu_k, bk, **kw)
    return getattr(gpu, fn)(I, cu_q, cu_k, bk, **kw)


def _bad_args(I):
    # Two sequences of 8 and 16 keys: block 2 exists only in the second.
    return (cu([1, 1]), cu([8, 16]), EX_BK) if I.shape[0] == 2 else (EX_CU_Q, EX_CU_K, EX_BK)


@pytest.mark.parametrize("fn", ["build_csr", "csr_histogram", "csr_scatter"])
@pytest.mark.parametrize("I, match", BAD_SELECTIONS)
def test_bad_selection_is_rejected(fn, I, match):
    with pytest.raises(ValueError, match=match):
        _call(fn, I, *_bad_args(I))


@pytest.mark.parametrize("fn", ["build_csr", "csr_histogram", "csr_scatter"])
@pytest.mark.parametrize("I, match", BAD_SELECTIONS)
def test_unvalidated_bad_selection_stays_in_bounds(fn, I, match):
    # The simulator raises IndexError on any out-of-bounds access; bad entries are skipped.
    _call(fn, I, *_bad_args(I), validate=False)


def test_unvalidated_out_of_range_entries_are_skipped():
    # 9, 4 and -5 are no blocks of the 16-key sequence (blocks 0..3): they count nowhere, and
    # slots still name each real entry's own position in its row.
    I = _one_seq([[0, 9], [1, 4], [2, 3], [-5, 3]])
    row_ptr, q_indices, slots = gpu.build_csr(I, EX_CU_Q, EX_CU_K, EX_BK, validate=False)
    np.testing.assert_array_equal(row_ptr, [[0, 1, 2, 3, 5]])
    np.testing.assert_array_equal(q_indices, [[0, 1, 2, 2, 3, -1, -1, -1]])
    np.testing.assert_array_equal(slots, [[0, 0, 0, 1, 1, -1, -1, -1]])


@pytest.mark.parametrize("make, error, match", [
    pytest.param(lambda: _one_seq([[0, 1]] * 3), ValueError, "cu_seqlens_q",
                 id="Tq-not-cu_seqlens_q"),
    pytest.param(lambda: np.zeros((4, 2), np.int32), ValueError, "block_indices", id="rank-2"),
    pytest.param(lambda: np.zeros((4, 1, 2), np.float32), TypeError, "block_indices", id="float"),
    pytest.param(lambda: np.zeros((4, 0, 2), np.int32), ValueError, "block_indices", id="Hkv=0"),
    pytest.param(lambda: np.zeros((4, 1, 0), np.int32), ValueError, "block_indices", id="K=0"),
    pytest.param(lambda: np.broadcast_to(np.int32(0), (4, 1, 1025)), ValueError, "block_indices",
                 id="K>1024"),
    pytest.param(lambda: np.broadcast_to(np.int32(0), (2**21 + 1, 1, 1024)), ValueError,
                 "block_indices", id="Tq*K-past-int32"),
])
def test_bad_shapes(make, error, match):
    with pytest.raises(error, match=match):
        gpu.build_csr(make(), EX_CU_Q, EX_CU_K, EX_BK, validate=False)


def test_bad_block_size_and_cu_seqlens():
    I = _one_seq([[0, 1]] * 4)
    with pytest.raises(ValueError, match="block_size"):
        gpu.build_csr(I, EX_CU_Q, EX_CU_K, 0)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        gpu.build_csr(I, EX_CU_Q, np.array([1, 16], np.int32), 4)
    with pytest.raises(ValueError, match="more queries than keys"):
        gpu.build_csr(I, EX_CU_Q, cu([3]), 4)


@pytest.mark.parametrize("row_ptr, error", [
    pytest.param(np.array([[0, 2, 4, 7]], np.int32), ValueError, id="rows-not-rows+1"),
    pytest.param(np.array([0, 2, 4, 7, 8], np.int32), ValueError, id="rank-1"),
    pytest.param(np.array([[0, 2, 4, 6, 8]], np.int32), ValueError, id="other-selection"),
    pytest.param(np.array([[1, 3, 5, 8, 9]], np.int32), ValueError, id="not-starting-at-0"),
    pytest.param(np.array([[0, 2, 4, 7, 8]], np.float32), TypeError, id="float-dtype"),
])
def test_scatter_rejects_foreign_row_ptr(row_ptr, error):
    I = _one_seq([[0, 1], [0, 2], [1, 2], [2, 3]])
    with pytest.raises(error, match="row_ptr"):
        gpu.csr_scatter(I, row_ptr, EX_CU_Q, EX_CU_K, EX_BK)


@pytest.mark.parametrize("version", [1, 2, 3])
@pytest.mark.parametrize("row_ptr", [[[0, 2, 4, 6, 8]], [[-9, 100, 4, 2**31 - 1, -3]]],
                         ids=["other-selection", "garbage"])
def test_unvalidated_foreign_row_ptr_stays_in_bounds(row_ptr, version):
    I = _one_seq([[0, 1], [0, 2], [1, 2], [2, 3]])
    gpu.csr_scatter(I, np.array(row_ptr, np.int32), EX_CU_Q, EX_CU_K, EX_BK, validate=False,
                    version=version)


# --- production sizes (GPU only) --------------------------------------------------------------

def production_selection(n, hkv, topk, bk, seed, *, hot=0):
    """I int32 [n, Hkv, K] for one sequence of n tokens, built vectorised: the local block L,
    blocks ``0..hot-1`` when visible (a skewed selection), and one random block from each of
    the ``K-1-hot`` equal strata of ``[hot, L)`` (ascending, unique); -1 padded."""
    rng = np.random.default_rng(seed)
    local = np.arange(n, dtype=np.int64) // bk  # [n]
    free = topk - 1 - hot
    lo, span = hot, np.maximum(local - hot, 0)  # strata cover [hot, L)
    k = np.arange(free)
    start = lo + (span[:, None, None] * k) // free  # [n, 1, free]
    stop = lo + (span[:, None, None] * (k + 1)) // free
    draw = start + (rng.random((n, hkv, free)) * (stop - start)).astype(np.int64)
    rand = np.where(stop > start, draw, -1)  # [n, Hkv, free]; empty strata give nothing
    sink = np.where(np.arange(hot) < local[:, None], np.arange(hot), -1)[:, None, :]
    rows = np.concatenate([np.broadcast_to(sink, (n, hkv, hot)), rand,
                           np.broadcast_to(local[:, None, None], (n, hkv, 1))], axis=2)
    rows = np.sort(np.where(rows < 0, np.iinfo(np.int64).max, rows), axis=2)  # -1 to the tail
    return np.where(rows == np.iinfo(np.int64).max, -1, rows).astype(np.int32)


def torch_csr(I, rows_total):
    """The PyTorch build (stable argsort of row keys, bincount, cumsum) for one sequence."""
    import torch
    tq, hkv, topk = I.shape
    edges = I.permute(1, 0, 2).reshape(hkv, -1).long()  # [Hkv, Tq*K], (t, s) order per head
    valid = edges >= 0
    key = torch.where(valid, edges, torch.full_like(edges, rows_total))
    key = key + torch.arange(hkv, device=I.device)[:, None] * (rows_total + 1)
    order = torch.sort(key.reshape(-1), stable=True).indices.reshape(hkv, -1) % (tq * topk)
    counts = torch.bincount(key.reshape(-1), minlength=hkv * (rows_total + 1)).reshape(
        hkv, rows_total + 1)[:, :rows_total]
    row_ptr = torch.zeros((hkv, rows_total + 1), dtype=torch.int64, device=I.device)
    row_ptr[:, 1:] = torch.cumsum(counts, dim=1)
    nnz = row_ptr[:, -1:]
    pos = torch.arange(tq * topk, device=I.device)[None, :]
    q_indices = torch.where(pos < nnz, order // topk, -1)
    slots = torch.where(pos < nnz, order % topk, -1)
    return row_ptr.int(), q_indices.int(), slots.int()


@pytest.mark.big
@pytest.mark.parametrize("n", [128 * 1024, 1024 * 1024], ids=["128K", "1M"])
@pytest.mark.parametrize("hot", [0, 3], ids=["uniform", "skewed"])
@pytest.mark.parametrize("scatter", [2, 3])
def test_production_size_equals_reference(n, hot, scatter):
    import torch
    hkv, topk, bk = 4, 16, 128
    I = production_selection(n, hkv, topk, bk, seed=n + hot, hot=hot)
    dI = torch.from_numpy(I).cuda()
    cu_q = cu_k = cu([n])
    got = gpu._build_csr(dI, cu_q, cu_k, bk, validate=False, scatter_version=scatter)
    again = gpu._build_csr(dI, cu_q, cu_k, bk, validate=False, scatter_version=scatter)
    rows = n // bk
    if n <= 128 * 1024:
        want = ref.build_csr(I, cu_q, cu_k, bk)
    else:  # the NumPy reference would take minutes: the PyTorch build is the oracle
        want = [to_numpy(x) for x in torch_csr(dI, rows)]
    for name, g, a, w in zip(("row_ptr", "q_indices", "slots"), got, again, want):
        assert torch.equal(g, a), name  # a rerun is bitwise identical
        np.testing.assert_array_equal(to_numpy(g), w, err_msg=name)
    np.testing.assert_array_equal(to_numpy(gpu.csr_histogram(dI, cu_q, cu_k, bk, validate=False)),
                                  np.diff(want[0], axis=1))


@pytest.mark.big
def test_largest_configuration_equals_torch():
    # The limits together: N = 1M, Hkv = 16, K = 64 (a billion edges; Tq*K = 2**26 per
    # head, 8 GiB of output, 24 GiB with scatter v3's scratch). Heads are independent, so the
    # PyTorch oracle runs head by head, on the GPU.
    import torch

    from benchmarks.bench_csr import selection as gpu_selection
    n, hkv, topk, bk = 1 << 20, 16, 64, 128
    dI = gpu_selection(n, hkv, topk, bk, hot=2, seed=5)
    cu_q = cu_k = cu([n])
    assert _plan.default_tile(n // bk, topk) == 1024
    assert _plan.pick_scatter(None, n // bk, 8 * hkv * n * topk, ArrayContext(dI).free_bytes) == 3
    got = gpu.build_csr(dI, cu_q, cu_k, bk, validate=False)
    for h in range(hkv):
        want = torch_csr(dI[:, h:h + 1].contiguous(), n // bk)
        for name, g, w in zip(("row_ptr", "q_indices", "slots"), got, want):
            assert torch.equal(g[h], w[0]), f"{name} of head {h}"
    assert int(got[0][:, -1].min()) > 60 * n  # nearly every query fills its 64 slots


@pytest.mark.gpu
def test_fast_launch_equals_numbas_launch():
    # _core.launch packs the arrays itself (Dev); Numba's own launch must give the same counts.
    import torch
    from numba import cuda

    I = selection([40, 25], [40, 31], 2, 3, 4, seed=6, hot=(0,))
    dI = torch.from_numpy(I).cuda()
    batch = Batch.of(cu([40, 25]), cu([40, 31]), 4, total_q=65)
    plan = _plan.Plan(batch, dI, ArrayContext(dI))
    fast = plan.count(8)
    plain = cuda.to_device(np.full(tuple(fast.shape), -7, np.int32))
    v2_tiled.count_kernel[(fast.shape[0], plan.hkv), 64](
        cuda.to_device(I), cuda.to_device(batch.cu_q.astype(np.int32)),
        cuda.to_device(batch.row_offsets.astype(np.int32)), 8, plain)
    np.testing.assert_array_equal(to_numpy(fast), plain.copy_to_host())
    assert _launch.FAST_LAUNCH, "the direct launch failed and fell back to Numba's dispatcher"
    assert _launch.DRIVER_LAUNCH, "the driver launch failed and fell back to cuda.core's"
    view = _launch.Dev(fast[:, :, 1:])  # a strided view is typed 'A', with its own strides
    assert view._numba_type_.layout == "A" and view.shape == (fast.shape[0], 2, plan.rows - 1)
    assert view._layout.strides_in_bytes == tuple(4 * st for st in fast.stride())


@pytest.mark.parametrize("topk", [5, 32, 33, 64])
def test_slot_mask_marks_the_csr_entries(topk):
    """``launch_slot_mask`` against its definition, row by row: bit s of (t, g) is 1 iff
    ``I[t, g, s]`` is a block of t's sequence that no earlier slot of the row names. Ids out of
    range, -1, repeats, and ``K`` past one 32-bit word (bit 31 and a partial last word)."""
    rng = np.random.default_rng(topk)
    cu_q = np.array([0, 3, 3, 7], np.int32)  # an empty sequence in the middle
    cu_k = np.array([0, 40, 40, 300], np.int32)
    bs, hkv, tq = 8, 2, 7
    nblocks = [5, 5, 5, 33, 33, 33, 33]  # ceil(Lk / Bk) of each query's sequence
    I = rng.integers(-2, 36, size=(tq, hkv, topk)).astype(np.int32)
    I[0, 0, :3] = [4, 4, 4]  # a repeat
    I[3, 1, -1] = I[3, 1, 0]  # a repeat at the last slot
    ctx = ArrayContext(I=I)
    mask = ctx.empty((tq, hkv, gpu.mask_words(topk)), np.int32)
    gpu.launch_slot_mask(_launch.kernel_array(ctx.input("I", I)), _launch.upload_ints(cu_q),
                         _launch.upload_ints(cu_k), bs, ctx.arg(mask))
    bits = to_numpy(ctx.output(mask)).view(np.uint32)
    for t in range(tq):
        for g in range(hkv):
            row = I[t, g]
            want = [0 <= row[s] < nblocks[t] and row[s] not in row[:s] for s in range(topk)]
            got = [bool((bits[t, g, s // 32] >> (s % 32)) & 1) for s in range(topk)]
            assert got == want, (t, g)
        unused = 32 * gpu.mask_words(topk) - topk  # bits past K in the last word are 0
        if unused:
            assert (bits[t, :, -1] >> np.uint32(32 - unused) == 0).all(), t
