"""The tensor-core shims of ``msa.cuda._core`` against NumPy: ``mma.sync.m16n8k16`` (bf16 and
fp16), the bit conversions and pair packing, ``ldmatrix.x4`` and ``.x4.trans``.

Under the simulator these check the pure-Numba twins, on a GPU the inline PTX, with the same
fragment-loading code (K1 v2-v4 and backward v2 are built from them).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from numba import cuda, float32, uint32

from msa.cuda._core import mma as _mma
from msa.cuda._core.arrays import SIMULATOR
from msa.cuda._core.memops import ldmatrix_x4, ldmatrix_x4_trans
from msa.testing.tolerance import assert_close_to_oracle

from .attention_cases import bf16_bits_to_f32, cast, f32_to_bf16_bits


def _mma_kernel(bf16):
    mma = _mma.mma_bf16_m16n8k16 if bf16 else _mma.mma_f16_m16n8k16

    @cuda.jit
    def one_tile(a_words, bt_words, c, out):
        sa = cuda.shared.array(192, uint32)  # 16 rows x (8 + 4 pad) words
        sb = cuda.shared.array(96, uint32)  # 8 rows x (8 + 4 pad) words
        lane = cuda.threadIdx.x
        for i in range(lane, 128, 32):
            sa[(i // 8) * 12 + i % 8] = a_words[i]
        for i in range(lane, 64, 32):
            sb[(i // 8) * 12 + i % 8] = bt_words[i]
        cuda.syncthreads()
        a0, a1, a2, a3 = _mma.load_a_frag(sa, 0, 12)
        b0, b1 = _mma.load_b_frag(sb, 0, 12)
        g = lane // 4
        t = lane % 4
        d = mma(a0, a1, a2, a3, b0, b1, c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t],
                c[g + 8, 2 * t + 1])
        out[g, 2 * t] = d[0]
        out[g, 2 * t + 1] = d[1]
        out[g + 8, 2 * t] = d[2]
        out[g + 8, 2 * t + 1] = d[3]

    return one_tile


@pytest.mark.parametrize("kind", ["bfloat16", "float16"])
def test_mma_m16n8k16_matches_numpy(kind):
    rng = np.random.default_rng(0 if kind == "bfloat16" else 1)
    a = rng.standard_normal((16, 16)).astype(np.float32)
    bt = rng.standard_normal((8, 16)).astype(np.float32)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    (a_bits, a32), (bt_bits, bt32) = cast(a, kind), cast(bt, kind)
    a_words = np.ascontiguousarray(a_bits).view(np.uint32).reshape(-1).copy()
    bt_words = np.ascontiguousarray(bt_bits).view(np.uint32).reshape(-1).copy()
    out = np.full((16, 8), np.nan, np.float32)
    if SIMULATOR:
        _mma_kernel(kind == "bfloat16")[1, 32](a_words, bt_words, c, out)
    else:
        d_out = cuda.to_device(out)
        _mma_kernel(kind == "bfloat16")[1, 32](cuda.to_device(a_words), cuda.to_device(bt_words),
                                                cuda.to_device(c), d_out)
        out = d_out.copy_to_host()
    oracle = a32.astype(np.float64) @ bt32.T.astype(np.float64) + c
    baseline = (a32 @ bt32.T + c).astype(np.float32)
    assert_close_to_oracle(out, oracle, baseline, name=f"mma {kind} ({_mma.MMA_BACKEND})")


@cuda.jit
def _convert_kernel(x, bf16_bits, f16_bits, bf16_pairs, f16_pairs, back, exp2_out):
    i = cuda.grid(1)
    if i < x.shape[0]:
        bf16_bits[i] = _mma.f32_to_bf16(x[i])
        f16_bits[i] = _mma.f32_to_f16_bits(x[i])
        back[i] = _mma.bf16_to_f32(bf16_bits[i]) + _mma.f16_bits_to_f32(f16_bits[i])
        j = (i + 1) % x.shape[0]
        bf16_pairs[i] = _mma.pack_bf16x2(x[i], x[j])
        f16_pairs[i] = _mma.pack_f16x2(x[i], x[j])
        exp2_out[i] = _mma.exp2(float32(-abs(x[i])))


def test_bit_helpers_match_numpy():
    """Round to nearest even (ties, negatives, tiny, huge, infinities) and the pair packing."""
    x = np.array([0.0, -0.0, 1.0, -2.5, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11,
                  3.0e-5, -6.1e-5, 65504.0, 7.0e4, 1e30, np.inf, -np.inf, 0.1, -0.3, 123.456],
                 np.float32)
    n = x.size
    outs = [np.zeros(n, np.uint16), np.zeros(n, np.uint16), np.zeros(n, np.uint32),
            np.zeros(n, np.uint32), np.zeros(n, np.float32), np.zeros(n, np.float32)]
    if SIMULATOR:
        _convert_kernel[1, 32](x, *outs)
    else:
        dev = [cuda.to_device(o) for o in outs]
        _convert_kernel[1, 32](cuda.to_device(x), *dev)
        outs = [d.copy_to_host() for d in dev]
    bf, f16, bfp, f16p, back, e2 = outs
    with np.errstate(over="ignore"):
        want_f16 = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(bf, f32_to_bf16_bits(x), err_msg="f32_to_bf16")
    np.testing.assert_array_equal(f16, want_f16, err_msg="f32_to_f16_bits")
    nxt = np.roll(np.arange(n), -1)
    np.testing.assert_array_equal(bfp, bf.astype(np.uint32) | (bf[nxt].astype(np.uint32) << 16),
                                  err_msg="pack_bf16x2")
    np.testing.assert_array_equal(f16p, f16.astype(np.uint32) | (f16[nxt].astype(np.uint32) << 16),
                                  err_msg="pack_f16x2")
    with np.errstate(over="ignore", invalid="ignore"):
        want_back = bf16_bits_to_f32(bf) + want_f16.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(back, want_back, err_msg="bf16_to_f32 + f16_bits_to_f32")
    want_e2 = np.exp2(-np.abs(x.astype(np.float64)))
    # ex2.approx.ftz: 2 ulp, and subnormal results flush to zero
    ok = np.abs(e2 - want_e2) <= 4 * np.finfo(np.float32).eps * want_e2 + np.finfo(np.float32).tiny
    assert ok.all(), (x[~ok], e2[~ok], want_e2[~ok])


@cuda.jit
def _log2_kernel(x, out):
    i = cuda.grid(1)
    if i < x.shape[0]:
        out[i] = _mma.log2(x[i])


def test_log2_shim():
    """``lg2.approx.f32``: special values exactly (0 -> -inf, +inf -> +inf, negative or NaN ->
    NaN), subnormal inputs not flushed, finite results within 2**-21 (the PTX ISA's 2**-22.6
    on the mantissa's log) plus one float32 ulp of the result (the exponent's add rounds)."""
    tiny = np.finfo(np.float32).tiny
    x = np.array([0.0, -0.0, np.inf, -1.0, -np.inf, np.nan, 1.0, 2.0, 0.5, 1.5, 3.0e-5, 0.999,
                  1.0001, 1e30, tiny, tiny / 8, 1e-44, 0.0625, 7.0, 1 - 2**-24], np.float32)
    out = np.zeros_like(x)
    if SIMULATOR:
        _log2_kernel[1, 32](x, out)
    else:
        d_out = cuda.to_device(out)
        _log2_kernel[1, 32](cuda.to_device(x), d_out)
        out = d_out.copy_to_host()
    with np.errstate(divide="ignore", invalid="ignore"):
        want = np.log2(x.astype(np.float64))
    special = ~np.isfinite(want)
    np.testing.assert_array_equal(out[special], want[special].astype(np.float32),
                                  err_msg=f"log2 special values at x = {x[special]}")
    err = np.abs(out[~special] - want[~special])
    bound = 2.0 ** -21 + np.abs(want[~special]) * np.finfo(np.float32).eps
    assert (err <= bound).all(), (x[~special], out[~special], want[~special])


@functools.lru_cache(maxsize=None)
def _ldmatrix_kernel(trans):
    load = ldmatrix_x4_trans if trans else ldmatrix_x4

    @cuda.jit
    def four_matrices(words, rows, out):
        """Lane l names row l % 8 of matrix l // 8 (word offset ``rows[l]`` of ``s``)."""
        s = cuda.shared.array(512, uint32)
        lane = cuda.threadIdx.x
        for i in range(lane, 512, 32):
            s[i] = words[i]
        cuda.syncthreads()
        r0, r1, r2, r3 = load(s, rows[lane])
        out[lane, 0] = r0
        out[lane, 1] = r1
        out[lane, 2] = r2
        out[lane, 3] = r3

    return four_matrices


@pytest.mark.parametrize("trans", [False, True], ids=["ldmatrix_x4", "ldmatrix_x4_trans"])
def test_ldmatrix_x4_matches_numpy(trans):
    """Four 8x8 matrices of 16-bit values at scattered 16-byte aligned rows: lane ``4g + t``
    gets word ``t`` of row ``g`` of each (``x4``), or the elements ``[2t][g]``, ``[2t+1][g]``
    (``x4.trans``), low half first."""
    rng = np.random.default_rng(7)
    halves = rng.integers(0, 1 << 16, size=1024, dtype=np.uint16)
    words = halves.view(np.uint32).copy()  # 512 words = 128 rows of 4 words
    rows = 4 * rng.permutation(128)[:32].astype(np.int32)  # word offset of each lane's row
    out = np.zeros((32, 4), np.uint32)
    if SIMULATOR:
        _ldmatrix_kernel(trans)[1, 32](words, rows, out)
    else:
        d_out = cuda.to_device(out)
        _ldmatrix_kernel(trans)[1, 32](cuda.to_device(words), cuda.to_device(rows), d_out)
        out = d_out.copy_to_host()
    # matrix m, element [i][c]: 16-bit value c of the row lane 8m + i names
    mats = np.stack([np.stack([halves[2 * rows[8 * m + i]: 2 * rows[8 * m + i] + 8]
                               for i in range(8)]) for m in range(4)])  # [4, 8, 8] uint16
    want = np.zeros((32, 4), np.uint32)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for m in range(4):
            lo, hi = ((mats[m, 2 * t, g], mats[m, 2 * t + 1, g]) if trans
                      else (mats[m, g, 2 * t], mats[m, g, 2 * t + 1]))
            want[lane, m] = int(lo) | (int(hi) << 16)
    np.testing.assert_array_equal(out, want)
