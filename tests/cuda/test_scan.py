"""The prefix sums of ``msa.cuda._core.scan`` (paper §4.2, step 2 of the reverse index): scan v1
and v2 through ``msa.cuda.csr.exclusive_prefix_sum``, scan v3 (look-back) on its own.

Outputs start poisoned; small CTAs (2 or 4 threads) push tiny inputs through the multi-block
paths the large ones take.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from msa.cuda import csr as gpu
from msa.cuda._core import launch as _launch
from msa.cuda._core import scan as _scan
from msa.cuda._core.arrays import SIMULATOR, ArrayContext
from msa.reference import csr as ref
from msa.testing.backends import to_numpy


def on_device(x):
    """``x`` where the scan kernels read and write it: itself in the simulator, else a copy on
    the GPU (read back with ``to_numpy``)."""
    return x if SIMULATOR else cuda.to_device(x)


def test_prefix_sum_multi_block_and_overflow_guard():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 50, size=(3, 77)).astype(np.int32)
    want = ref.exclusive_prefix_sum(counts)
    # Two threads x 4 counts per block: 10 blocks per head and a two-round block-sum scan.
    ctx = ArrayContext(counts)
    got = gpu._prefix_sum(ctx, _launch.kinput(ctx, "counts", counts), 2, True, counts,
                          threads=2)
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


def test_prefix_sum_version_is_1_or_2():
    with pytest.raises(ValueError, match="version"):
        gpu.exclusive_prefix_sum(np.zeros((1, 3), np.int32), version=3)
