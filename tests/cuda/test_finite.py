"""``msa.cuda._core.finite``: non-finite 16-bit halves are replaced by +0 and reported, every
finite half (including -0 and subnormals) passes through bit for bit."""

import numpy as np
import pytest
from numba import cuda

from msa.cuda._core.arrays import require_gpu
from msa.cuda._core.finite import (
    clean_bf16x2,
    clean_f16x2,
    is_nonfinite_bf16,
    is_nonfinite_f16,
)


@cuda.jit
def _clean(words, out, bad, nonfinite, use_bf16):
    i = cuda.grid(1)
    if i < words.shape[0]:
        if use_bf16:
            w, b = clean_bf16x2(words[i])
            nonfinite[i] = 1 if is_nonfinite_bf16(words[i] & 0xFFFF) else 0
        else:
            w, b = clean_f16x2(words[i])
            nonfinite[i] = 1 if is_nonfinite_f16(words[i] & 0xFFFF) else 0
        out[i] = w
        bad[i] = b


def _halves(dtype):
    """16-bit patterns: finite values of every kind and each non-finite class."""
    vals = np.array([0.0, -0.0, 1.0, -2.5, 3e-39 if dtype == "bf16" else 6e-8, 65504.0,
                     np.inf, -np.inf, np.nan], np.float32)
    if dtype == "bf16":
        bits = (vals.view(np.uint32) >> 16).astype(np.uint32)
    else:
        bits = vals.astype(np.float16).view(np.uint16).astype(np.uint32)
    extra_nan = np.uint32(0x7FC1 if dtype == "bf16" else 0x7E01)
    return np.append(bits, extra_nan)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_clean_replaces_exactly_the_nonfinite_halves(dtype):
    require_gpu()
    h = _halves(dtype)
    exp = 0x7F80 if dtype == "bf16" else 0x7C00
    lo, hi = np.meshgrid(h, h, indexing="ij")
    words = (lo | (hi << 16)).astype(np.uint32).ravel()
    out = np.zeros_like(words)
    bad = np.zeros_like(words)
    nonfinite = np.zeros_like(words)
    _clean[1, words.size](words, out, bad, nonfinite, dtype == "bf16")
    lo, hi = words & 0xFFFF, words >> 16
    lo_bad, hi_bad = (lo & exp) == exp, (hi & exp) == exp
    want = np.where(lo_bad, 0, lo) | (np.where(hi_bad, 0, hi) << 16)
    np.testing.assert_array_equal(out, want.astype(np.uint32))
    np.testing.assert_array_equal(bad, (lo_bad | hi_bad).astype(np.uint32))
    np.testing.assert_array_equal(nonfinite, lo_bad.astype(np.uint32))
    assert lo_bad.sum() == 4 * h.size  # inf, -inf and two NaNs per row of the grid
