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
from numba import cuda

from msa.cuda import csr as gpu
from msa.cuda._core import launch as _launch
from msa.cuda._core import scan as _scan
from msa.cuda._core.arrays import SIMULATOR, ArrayContext
from msa.reference import csr as ref
from msa.reference.blocks import block_row_offsets, query_positions
from msa.testing.backends import to_numpy
from msa.testing.strategies import seq_lens
from msa.testing.strategies import offsets as cu


def on_device(x):
    """``x`` where the scan kernels read and write it: itself in the simulator, else a copy on
    the GPU (read back with ``to_numpy``)."""
    return x if SIMULATOR else cuda.to_device(x)






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
# queries per tile, look-back scan blocks of 2 threads: many tiles, many scan blocks), "v2"
# (count v1 into a zeroed array, tile scan + reduce-then-scan prefix sum), "v1" (row-wise
# scatter, serial scan).
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
    ("varlen-count-v1-scan-v2", [5, 0, 21], [9, 3, 30], 2, 3, 4, dict(hot=(0,), fill=False),
     "v2"),
    ("skewed-count-v1-scan-v2", [40, 25], [40, 31], 2, 3, 4, dict(hot=(0,)), "v2"),
]


def run_path(path, I, cu_q, cu_k, bk, scatter):
    if path == "default":  # (build_csr picks v2 for outputs this small)
        if scatter == 2:
            return gpu.build_csr(I, cu_q, cu_k, bk)
        return gpu._build_csr(I, cu_q, cu_k, bk, scatter_version=scatter)
    if path == "tiles":
        chunk = max(1, min(32, gpu._CHUNK_THREADS // I.shape[2]))
        return gpu._build_csr(I, cu_q, cu_k, bk, tile_queries=chunk, scan_threads=2,
                              scatter_version=scatter)
    if path == "v2":
        chunk = max(1, min(32, gpu._CHUNK_THREADS // I.shape[2]))
        return gpu._build_csr(I, cu_q, cu_k, bk, tile_queries=chunk, scan_threads=2,
                              count_version=1, scan_version=2, scatter_version=scatter)
    return gpu._build_csr(I, cu_q, cu_k, bk, scatter_version=1, scan_version=1)


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
    for tile in (None, 50):  # (small tiles mean hundreds of CTAs: minutes in the simulator)
        got = gpu._build_csr(I, cu([300]), cu([300]), 1, scatter_version=3, tile_queries=tile)
        assert_same_csr(got, want)


@pytest.mark.parametrize("threads", [32, 128, pytest.param(256, marks=pytest.mark.sim_heavy), 512])
def test_scatter_v3_block_sizes(monkeypatch, threads):
    # Scatter v3 at 1 to 16 warps a CTA (the simulator's default is 2; the GPU's 16): the
    # multi-split's ranks then come from a scan over that many warps per key. 300 rows of
    # Bk = 1 (three row groups) and hot rows put most keys of a group in every chunk.
    monkeypatch.setattr(gpu, "_SPLIT_THREADS", threads)
    I = selection([300], [300], 1, 5, 1, seed=threads, hot=(0, 129), shuffle=True)
    got = gpu._build_csr(I, cu([300]), cu([300]), 1, scatter_version=3, tile_queries=150)
    assert_same_csr(got, ref.build_csr(I, cu([300]), cu([300]), 1))


def test_build_csr_picks_scatter_v3_for_large_outputs(monkeypatch):
    I = selection([40, 25], [40, 31], 2, 3, 4, seed=5, hot=(0,))
    want = ref.build_csr(I, cu([40, 25]), cu([40, 31]), 4)
    plan = gpu._Plan(I, cu([40, 25]), cu([40, 31]), 4, False)
    assert plan.auto_scatter() == 2  # 8 * Hkv * Tq*K bytes: far below the threshold
    ran = []
    split = gpu._Plan._scatter_split
    monkeypatch.setattr(gpu._Plan, "_scatter_split",
                        lambda self, *a: ran.append(3) or split(self, *a))
    monkeypatch.setattr(gpu, "_SPLIT_MIN_BYTES", 8 * 2 * 65 * 3)  # exactly this output
    assert plan.auto_scatter() == 3
    assert_same_csr(gpu.build_csr(I, cu([40, 25]), cu([40, 31]), 4), want)
    for g, w in zip(gpu.csr_scatter(I, want[0], cu([40, 25]), cu([40, 31]), 4), want[1:]):
        np.testing.assert_array_equal(to_numpy(g), w)
    assert ran == [3, 3]


def test_build_csr_runs_scatter_v2_where_v3_scratch_does_not_fit(monkeypatch):
    # v3 needs two int64 scratch arrays as large as the output (8 * Hkv * Tq*K bytes), which is
    # allocated after the choice too, plus _SPLIT_HEADROOM free; with less free device memory
    # build_csr runs v2, with the same result.
    I = selection([40, 25], [40, 31], 2, 3, 4, seed=7, hot=(0,))
    want = ref.build_csr(I, cu([40, 25]), cu([40, 31]), 4)
    out_bytes = 8 * 2 * 65 * 3
    monkeypatch.setattr(gpu, "_SPLIT_MIN_BYTES", out_bytes)
    ran = []
    for version in (2, 3):
        name = {2: "_scatter_tiled", 3: "_scatter_split"}[version]
        orig = getattr(gpu._Plan, name)
        monkeypatch.setattr(gpu._Plan, name,
                            lambda self, *a, v=version, f=orig: ran.append(v) or f(self, *a))
    need = 3 * out_bytes + gpu._SPLIT_HEADROOM
    for free, version in ((need - 1, 2), (need, 3)):
        monkeypatch.setattr(gpu.ArrayContext, "free_bytes", lambda self, f=free: float(f))
        assert gpu._Plan(I, cu([40, 25]), cu([40, 31]), 4, False).auto_scatter() == version
        ran.clear()
        assert_same_csr(gpu.build_csr(I, cu([40, 25]), cu([40, 31]), 4), want)
        assert ran == [version]


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


def test_scatter_v3_falls_back_past_128_groups(monkeypatch):
    # More rows than 128 groups of 128 hold: v2 runs instead (here with the limit lowered).
    monkeypatch.setattr(gpu, "_MAX_SPLIT_ROWS", 8)
    ran = []
    for name in ("_scatter_split", "_scatter_tiled"):
        method = getattr(gpu._Plan, name)
        monkeypatch.setattr(gpu._Plan, name, lambda self, *a, _m=method, _n=name: (
            ran.append(_n), _m(self, *a))[1])
    I = selection([40, 25], [40, 31], 2, 3, 4, seed=2, hot=(0,))
    plan = gpu._Plan(I, cu([40, 25]), cu([40, 31]), 4, False)
    assert plan.rows > 8 and not plan.split_fits()
    got = gpu._build_csr(I, cu([40, 25]), cu([40, 31]), 4, scatter_version=3)
    assert_same_csr(got, ref.build_csr(I, cu([40, 25]), cu([40, 31]), 4))
    assert ran == ["_scatter_tiled"]
    with pytest.raises(ValueError, match="scatter v3"):
        plan._scatter_split(None, None, 8, None, None)


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
    row_ptr = gpu.exclusive_prefix_sum(counts, version=version)
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


def test_prefix_sum_multi_block_and_overflow_guard():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 50, size=(3, 77)).astype(np.int32)
    want = ref.exclusive_prefix_sum(counts)
    # Two threads x 4 counts per block: 10 blocks per head and a two-round block-sum scan.
    ctx = ArrayContext(counts)
    got = gpu._prefix_sum(ctx, gpu._kinput(ctx, "counts", counts), 2, True, counts, threads=2)
    np.testing.assert_array_equal(to_numpy(got), want)
    np.testing.assert_array_equal(gpu.exclusive_prefix_sum(counts, version=1), want)
    fits = np.array([[2**30, 2**30 - 1], [1, 2]], np.int32)
    np.testing.assert_array_equal(gpu.exclusive_prefix_sum(fits)[:, -1], [2**31 - 1, 3])
    np.testing.assert_array_equal(gpu.exclusive_prefix_sum(np.zeros((2, 0), np.int32)),
                                  np.zeros((2, 1), np.int32))


@pytest.mark.parametrize("ntiles, segments, n, threads", [
    (1, 1, 1, 2), (3, 2, 11, 2), (5, 3, 17, 4), (2, 1, 0, 2), (4, 2, 40, None),
], ids=["one-entry", "six-blocks-per-segment", "odd-tiles", "empty-segment", "default-threads"])
@pytest.mark.parametrize("in_place", [True, False])
def test_lookback_scan_equals_numpy(ntiles, segments, n, threads, in_place):
    rng = np.random.default_rng(ntiles * 100 + n)
    counts = rng.integers(0, 9, size=(ntiles, segments, n)).astype(np.int32)  # [ntiles, S, n]
    totals = counts.astype(np.int64).sum(axis=0)  # [S, n]
    want = np.zeros((segments, n + 1), np.int64)  # [S, n+1]
    want[:, 1:] = np.cumsum(totals, axis=1)
    want_tiles = np.cumsum(counts, axis=0) - counts if in_place else counts  # [ntiles, S, n]
    for _ in range(2):  # the second launch reuses the status words under a new epoch
        tile_counts = on_device(counts.copy())
        dst = on_device(np.full((segments, n + 1), np.iinfo(np.int32).min, np.int32))
        _scan.lookback_scan(_launch.dev(tile_counts), _launch.dev(dst), in_place=in_place,
                           threads=threads)
        np.testing.assert_array_equal(to_numpy(dst), want)
        np.testing.assert_array_equal(to_numpy(tile_counts), want_tiles)


def test_lookback_scan_clamps_past_int32():
    # Outside build_csr's contract (Tq*K < 2**31), but bounded: offsets clamp to int32.
    counts = on_device(np.full((1, 1, 6), 2**30, np.int32))
    dst = on_device(np.zeros((1, 7), np.int32))
    _scan.lookback_scan(_launch.dev(counts), _launch.dev(dst), in_place=False, threads=2)
    np.testing.assert_array_equal(to_numpy(dst)[0], [0, 2**30, 2**31 - 1, 2**31 - 1, 2**31 - 1,
                                           2**31 - 1, 2**31 - 1])


def test_shared_count_bounds():
    I = selection([9], [9], 1, 2, 4, seed=2)
    plan = gpu._Plan(I, cu([9]), cu([9]), 4, True)
    assert plan.shared_count_fits(4)
    plan.rows = 2 * gpu._HIST_WORDS + 1  # one row more than the shared histogram holds
    assert not plan.shared_count_fits(4)
    plan.rows, plan.tq = 3, 1 << 16  # a tile count could reach 2**16: no 16-bit field
    assert not plan.shared_count_fits(1 << 16) and plan.shared_count_fits((1 << 16) - 1)


def test_too_many_rows_for_shared_count_falls_back_to_atomics(monkeypatch):
    # A 4-word (8-row) histogram against 10 rows: build_csr must take count v1 and still be exact.
    monkeypatch.setattr(gpu, "_HIST_WORDS", 4)
    I = selection([40], [40], 2, 3, 4, seed=4, hot=(0,))
    assert not gpu._Plan(I, cu([40]), cu([40]), 4, False).shared_count_fits(8)
    assert_same_csr(gpu._build_csr(I, cu([40]), cu([40]), 4, tile_queries=8),
                    ref.build_csr(I, cu([40]), cu([40]), 4))


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("counts", [
    pytest.param(np.array([[2**30, 2**30]], np.int32), id="nnz-past-int32"),
    pytest.param(np.array([[3, -1]], np.int32), id="negative"),
])
def test_prefix_sum_rejects(counts, version):
    with pytest.raises(ValueError, match="counts"):
        gpu.exclusive_prefix_sum(counts, version=version)
    # Without validation nothing is read back and nothing is out of bounds; past int32 the
    # offsets are clamped.
    row_ptr = gpu.exclusive_prefix_sum(counts, validate=False, version=version)
    if counts.min() >= 0:
        assert row_ptr[0, -1] == 2**31 - 1


# --- hypothesis -------------------------------------------------------------------------------

@settings(max_examples=max(4, settings().max_examples // 2))  # a few seconds per example
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
    plan = gpu._Plan(dI, cu_q, cu_k, bk, False)
    assert plan.auto_scatter() == 3 and plan.tile_queries() == 1024
    got = gpu.build_csr(dI, cu_q, cu_k, bk, validate=False)
    for h in range(hkv):
        want = torch_csr(dI[:, h:h + 1].contiguous(), n // bk)
        for name, g, w in zip(("row_ptr", "q_indices", "slots"), got, want):
            assert torch.equal(g[h], w[0]), f"{name} of head {h}"
    assert int(got[0][:, -1].min()) > 60 * n  # nearly every query fills its 64 slots


@pytest.mark.gpu
def test_fast_launch_equals_numbas_launch():
    # _launch packs the arrays itself (_Dev); Numba's own launch must give the same counts.
    import torch
    from numba import cuda

    I = selection([40, 25], [40, 31], 2, 3, 4, seed=6, hot=(0,))
    plan = gpu._Plan(torch.from_numpy(I).cuda(), cu([40, 25]), cu([40, 31]), 4, False)
    fast = plan.count(8)
    plain = cuda.to_device(np.full(tuple(fast.shape), -7, np.int32))
    gpu._csr_kernel_count_shared[(fast.shape[0], plan.hkv), 64](
        cuda.to_device(I), cuda.to_device(plan.cu_q.astype(np.int32)),
        cuda.to_device(plan.row_offsets.astype(np.int32)), 8, plain)
    np.testing.assert_array_equal(to_numpy(fast), plain.copy_to_host())
    assert _launch.FAST_LAUNCH, "the direct launch failed and fell back to Numba's dispatcher"
    view = _launch.Dev(fast[:, :, 1:])  # a strided view is typed 'A', with its own strides
    assert view._numba_type_.layout == "A" and view.shape == (fast.shape[0], 2, plan.rows - 1)
    assert view._layout.strides_in_bytes == tuple(4 * st for st in fast.stride())


# --- offline compile check (a GPU or NVVM; not the simulator) ---------------------------------

@pytest.mark.skipif(SIMULATOR, reason="compiles PTX for sm_90: not in the simulator")
@pytest.mark.parametrize("kernel", ["_csr_kernel_count", "_csr_kernel_count_shared",
                                    "_scan_kernel_lookback", "_csr_kernel_tile_scan",
                                    "_scan_kernel_serial", "_scan_kernel_reduce",
                                    "_scan_kernel_block_sums", "_scan_kernel_add_back",
                                    "_csr_kernel_scatter_tiled", "_csr_kernel_scatter_rowwise",
                                    "_csr_kernel_fill_tail", "_csr_kernel_split_groups",
                                    "_csr_kernel_split_rows", "_csr_kernel_unpack"])
def test_kernels_compile_for_sm90_without_f64_or_local_memory(kernel):
    import re

    from numba import cuda, types

    i32, i64 = types.int32, types.int64
    i32_1, i32_2, i32_3 = i32[::1], i32[:, ::1], i32[:, :, ::1]
    sigs = {
        "_csr_kernel_count": (i32_3, i32_1, i32_1, i64, i32_3),
        "_csr_kernel_count_shared": (i32_3, i32_1, i32_1, i64, i32_3),
        "_scan_kernel_lookback": (i32_3, i64, i64[::1], i64, i32_2),
        "_csr_kernel_tile_scan": (i32_3, i32_2),
        "_scan_kernel_serial": (i32_2, i32_2, i32_1),
        "_scan_kernel_reduce": (i32_2, i64[:, ::1], i32_1),
        "_scan_kernel_block_sums": (i64[:, :], i64[:, ::1], i32_2, i32_1),
        "_scan_kernel_add_back": (i32_2, i64[:, ::1], i32_2),
        "_csr_kernel_scatter_tiled": (i32_3, i32_1, i32_1, i32_2, i32_3, i64, i64, i64, i32_2,
                                      i32_2),
        "_csr_kernel_scatter_rowwise": (i32_3, i32_1, i32_1, i32_2, i32_2, i32_2),
        "_csr_kernel_fill_tail": (i32_2, i32_2, i32_2),
        "_csr_kernel_split_groups": (i32_3, i32_1, i32_1, i32_2, i32_3, i64, i64[:, ::1]),
        "_csr_kernel_split_rows": (i32_2, i32_3, i64[:, ::1], i64[:, ::1]),
        "_csr_kernel_unpack": (i32_2, i64[:, ::1], i32_2, i32_2),
    }
    source = _scan if kernel.startswith("_scan") or kernel == "_csr_kernel_tile_scan" else gpu
    fn = _scan.tile_scan_kernel if kernel == "_csr_kernel_tile_scan" else getattr(source, kernel)
    ptx, _ = cuda.compile_ptx(fn.py_func, sigs[kernel], cc=(9, 0))
    assert not re.findall(r"\.f64\b", ptx), "float64 instructions in the PTX"
    assert not re.findall(r"\b(ld|st)\.local\b", ptx), "local memory in the PTX"
