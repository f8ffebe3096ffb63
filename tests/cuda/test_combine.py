"""msa.cuda.combine (K2) against msa.reference.combine: exact LSE merge of the KV-outer partials.

Floats compare with ``msa.testing.tolerance``: the oracle is the reference on float64 copies of
the partials, the baseline the reference on the float32 partials the kernel gets. Outputs the
launcher allocates start as NaN, and unused slots hold NaN partials, so a row the kernel forgets,
or an unused slot it reads, cannot pass.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from msa.cuda import combine as gpu
from msa.cuda._arrays import ArrayContext
from msa.reference import combine as ref
from msa.testing.backends import to_numpy
from msa.testing.tolerance import assert_close_to_oracle, oracle_and_baseline




def partials(num_slots, tq, hq, d, seed, *, unused=0.3, empty_rows=0.1, spread=4.0):
    """Random ``(o_part, lse_part)`` float32: a fraction of slots unused (-inf, NaN partial),
    a fraction of (query, head) rows with every slot unused, LSEs spread over ``spread``."""
    rng = np.random.default_rng(seed)
    o = rng.standard_normal((num_slots, tq, hq, d)).astype(np.float32)
    lse = (rng.standard_normal((num_slots, tq, hq)) * spread).astype(np.float32)
    off = rng.random((num_slots, tq, hq)) < unused
    off |= (rng.random((tq, hq)) < empty_rows)[None]
    lse[off] = -np.inf
    o[off] = np.nan  # an unused slot's O_s must never be read
    return o, lse


def bf16_bits_to_f32(bits):
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x):
    """Round to nearest even, as cvt.rn.bf16.f32 (finite inputs)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def check_against_reference(o_part, lse_part, out_dtype=None):
    (o_ref, lse_ref), (o_base, lse_base) = oracle_and_baseline(ref.combine_partials, o_part, lse_part)
    o, lse = gpu.combine_partials(o_part, lse_part, out_dtype)
    o, lse = to_numpy(o), to_numpy(lse)
    assert lse.dtype == np.float32
    assert_close_to_oracle(lse, lse_ref, lse_base, name="lse")
    empty = np.isneginf(lse_ref)
    if out_dtype == "bfloat16":
        assert o.dtype == np.uint16
        # baseline: the float32 result rounded to bf16, what any float32 kernel would store
        assert_close_to_oracle(bf16_bits_to_f32(o), o_ref, bf16_bits_to_f32(f32_to_bf16_bits(o_base)),
                               name="o (bf16)")
        o = bf16_bits_to_f32(o)
    elif out_dtype is not None:
        assert o.dtype == np.dtype(out_dtype)
        assert_close_to_oracle(o, o_ref, o_base.astype(out_dtype), name="o")
    else:
        assert o.dtype == np.float32
        assert_close_to_oracle(o, o_ref, o_base, name="o")
    # A (query, head) with no used slot: O = 0 exactly, LSE = -inf (checked above), no NaN.
    assert np.all(o[empty] == 0)
    return o, lse


# --- hostile shapes ---------------------------------------------------------------------------

SHAPES = [
    # id, K, Tq, Hq, D, partials kwargs
    ("K=1", 1, 5, 2, 8, {}),
    ("T=1-H=1-D=1", 3, 1, 1, 1, {}),
    ("D-not-multiple-of-lanes", 4, 3, 2, 13, {}),
    ("D=64-wide-lanes", 2, 2, 3, 64, {}),
    ("every-slot-used", 5, 4, 2, 8, dict(unused=0.0, empty_rows=0.0)),
    ("every-row-empty", 3, 4, 2, 8, dict(unused=1.0)),
    ("far-apart-lse", 4, 6, 2, 8, dict(spread=60.0)),
    ("Tq=0", 2, 0, 2, 8, {}),
]


@pytest.mark.parametrize("num_slots,tq,hq,d,kw", [s[1:] for s in SHAPES], ids=[s[0] for s in SHAPES])
def test_combine_matches_reference(num_slots, tq, hq, d, kw):
    o_part, lse_part = partials(num_slots, tq, hq, d, seed=num_slots * 100 + tq, **kw)
    check_against_reference(o_part, lse_part)


@pytest.mark.parametrize("out_dtype", [np.float32, np.float16, "bfloat16"],
                         ids=["float32", "float16", "bfloat16"])
def test_combine_out_dtypes(out_dtype):
    o_part, lse_part = partials(3, 7, 2, 12, seed=5)
    check_against_reference(o_part, lse_part, out_dtype)


def test_combine_bf16_partials_in():
    """bf16 partials (``o_part`` as bf16 bits) are widened exactly before the merge."""
    o_part, lse_part = partials(3, 4, 2, 8, seed=9, unused=0.3, empty_rows=0.0)
    bits = f32_to_bf16_bits(np.nan_to_num(o_part))
    (o_ref, _), (o_base, _) = oracle_and_baseline(ref.combine_partials, bf16_bits_to_f32(bits),
                                                  lse_part)
    launch_out = ArrayContext(bits).empty((4, 2, 8), np.float32)
    lse_out = ArrayContext(bits).empty((4, 2), np.float32)
    gpu.launch_combine(None, bits, lse_part, launch_out, lse_out, head_dim=8, bf16_part=True,
                       bf16_out=False)
    assert_close_to_oracle(to_numpy(launch_out), o_ref, o_base, name="o")


def test_combine_is_order_independent():
    """Permuting the slots permutes nothing in the result (up to float32 rounding)."""
    o_part, lse_part = partials(6, 5, 3, 8, seed=11)
    perm = np.random.default_rng(0).permutation(6)
    o1, lse1 = check_against_reference(o_part, lse_part)
    o2, lse2 = check_against_reference(o_part[perm].copy(), lse_part[perm].copy())
    (o_ref, lse_ref), (o_base, lse_base) = oracle_and_baseline(ref.combine_partials, o_part, lse_part)
    assert_close_to_oracle(o2, o_ref, o_base, name="o (permuted slots)")
    np.testing.assert_array_equal(np.isneginf(lse1), np.isneginf(lse2))


def test_combine_reruns_are_bitwise_identical():
    o_part, lse_part = partials(4, 6, 2, 8, seed=3)
    o1, lse1 = (to_numpy(x).copy() for x in gpu.combine_partials(o_part, lse_part))
    o2, lse2 = (to_numpy(x) for x in gpu.combine_partials(o_part, lse_part))
    assert o1.tobytes() == o2.tobytes() and lse1.tobytes() == lse2.tobytes()


@given(num_slots=st.integers(1, 6), tq=st.integers(0, 6), hq=st.integers(1, 3),
       d=st.integers(1, 20), unused=st.floats(0, 1), seed=st.integers(0, 2**31 - 1))
def test_combine_property(num_slots, tq, hq, d, unused, seed):
    o_part, lse_part = partials(num_slots, tq, hq, d, seed, unused=unused)
    check_against_reference(o_part, lse_part)


# --- bad input --------------------------------------------------------------------------------

def test_combine_rejects_bad_inputs():
    o_part, lse_part = partials(2, 3, 2, 4, seed=0)
    with pytest.raises(ValueError, match="o_part"):
        gpu.combine_partials(o_part[0], lse_part)
    with pytest.raises(ValueError, match="o_part"):
        gpu.combine_partials(o_part[:0], lse_part[:0])
    with pytest.raises(TypeError, match="o_part"):
        gpu.combine_partials(o_part.astype(np.float64), lse_part)
    with pytest.raises(ValueError, match="lse_part"):
        gpu.combine_partials(o_part, lse_part[:, :2])
    with pytest.raises(TypeError, match="lse_part"):
        gpu.combine_partials(o_part, lse_part.astype(np.float16))
    with pytest.raises(TypeError, match="out_dtype"):
        gpu.combine_partials(o_part, lse_part, np.int32)
    with pytest.raises(TypeError, match="out_dtype"):
        gpu.combine_partials(o_part, lse_part, np.float64)
    with pytest.raises(ValueError, match="version"):
        gpu.combine_partials(o_part, lse_part, version=7)
