"""K2 (paper §4.2): the LSE combine of per-block partials is exactly one softmax over their union.

The partials here are cut by hand from one softmax (random scores, values, a random partition
of each row's keys into ``K`` parts, some parts empty), so the expected answer is the softmax
of the whole row. Floats compare against float64 with a float32 yardstick (docs/design.md §5): the same
split run in float32 through a plain float32 NumPy softmax.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from msa.reference.combine import combine_partials

F64_FACTOR = 2.0 ** -20  # float64 has 29 more mantissa bits than float32: 2**9 of headroom
F32_FACTOR = 4.0
# NumPy's warnings as errors; underflow stays silent, it is exp of a very negative score (-> 0).
NO_FP_WARNINGS = dict(divide="raise", over="raise", invalid="raise")


def max_err(got, ref):
    """Largest |got - ref|; equal infinities count 0, NaN or an infinity mismatch count inf."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape
    if got.size == 0:
        return 0.0
    with np.errstate(invalid="ignore"):
        diff = np.where(got == ref, 0.0, np.abs(got - ref))
    return float(np.nan_to_num(diff, nan=np.inf).max())


def yardstick(base32, ref):
    """Error of a float32 run, floored at one float32 ulp of the largest finite |ref|."""
    finite = np.abs(np.asarray(ref, np.float64)[np.isfinite(ref)])
    floor = float(finite.max()) * np.finfo(np.float32).eps if finite.size else 0.0
    return max(max_err(base32, ref), floor)


def softmax_parts(S, V, part):
    """Locally normalised partials of one softmax, computed directly, in S's dtype.

    S [Tq, Hq, N] scores, V [Tq, Hq, N, D] values, part int [Tq, Hq, N] the slot of each key
    (-1: not in the support). Returns ``o_part [K, Tq, Hq, D]``, ``lse_part [K, Tq, Hq]`` for
    ``K = part.max() + 1`` and the whole-row answer ``(o [Tq, Hq, D], lse [Tq, Hq])``.
    """
    num_slots = int(part.max(initial=0)) + 1

    def one_softmax(mask):
        s = np.where(mask, S, -np.inf)
        with np.errstate(invalid="ignore", divide="ignore"):
            m = s.max(axis=-1, keepdims=True, initial=-np.inf)
            m = np.where(np.isfinite(m), m, 0)
            p = np.exp(s - m)
            total = p.sum(axis=-1)
            lse = np.where(total > 0, np.log(total) + m[..., 0], -np.inf)
            o = np.einsum("thn,thnd->thd", p, V) / np.where(total > 0, total, 1)[..., None]
        return o.astype(S.dtype), lse.astype(S.dtype)

    parts = [one_softmax(part == s) for s in range(num_slots)]
    o_part = np.stack([o for o, _ in parts])
    lse_part = np.stack([lse for _, lse in parts])
    return o_part, lse_part, one_softmax(part >= 0)


def random_split(seed, tq, hq, n, d, num_slots, magnitude, p_masked):
    """Scores of size ``magnitude``, and a random partition of each row into ``num_slots`` parts."""
    rng = np.random.default_rng(seed)
    S = rng.standard_normal((tq, hq, n)) * magnitude
    V = rng.standard_normal((tq, hq, n, d))
    part = rng.integers(0, num_slots, size=(tq, hq, n))
    part[rng.random((tq, hq, n)) < p_masked] = -1
    part[..., 0] = num_slots - 1  # every slot index occurs somewhere, so K is num_slots
    if tq * hq > 1:
        part[0, 0] = -1  # one row with nothing at all
    return S, V, part


def check_split(S, V, part):
    o_part, lse_part, (o_ref, lse_ref) = softmax_parts(S, V, part)
    o_part32, lse_part32, (o_base, lse_base) = softmax_parts(
        S.astype(np.float32), V.astype(np.float32), part)
    with np.errstate(**NO_FP_WARNINGS):
        o, lse = combine_partials(o_part, lse_part)
        o32, lse32 = combine_partials(o_part32, lse_part32)
    assert o.dtype == lse.dtype == np.float64 and o32.dtype == lse32.dtype == np.float32
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    np.testing.assert_array_equal(np.isneginf(lse32), np.isneginf(lse_ref))
    assert (o[np.isneginf(lse_ref)] == 0).all() and (o32[np.isneginf(lse_ref)] == 0).all()
    for got, got32, ref, base in ((o, o32, o_ref, o_base), (lse, lse32, lse_ref, lse_base)):
        assert max_err(got, ref) <= F64_FACTOR * yardstick(base, ref)
        assert max_err(got32, ref) <= F32_FACTOR * yardstick(base, ref)
    return o_part, lse_part, o, lse


SPLITS = {
    "one_slot": dict(tq=3, hq=2, n=9, d=4, num_slots=1, magnitude=1.0, p_masked=0.2),
    "K_gt_N_empty_parts": dict(tq=4, hq=2, n=3, d=4, num_slots=8, magnitude=1.0, p_masked=0.0),
    "one_key_per_row": dict(tq=5, hq=3, n=1, d=2, num_slots=2, magnitude=1.0, p_masked=0.0),
    "large_scores": dict(tq=4, hq=4, n=30, d=8, num_slots=5, magnitude=1e3, p_masked=0.3),
    "mostly_masked": dict(tq=6, hq=2, n=12, d=4, num_slots=4, magnitude=3.0, p_masked=0.9),
    "single_row": dict(tq=1, hq=1, n=40, d=16, num_slots=16, magnitude=1.0, p_masked=0.0),
    "no_queries": dict(tq=0, hq=2, n=5, d=4, num_slots=3, magnitude=1.0, p_masked=0.0),
}


@pytest.mark.parametrize("name", SPLITS)
def test_combine_is_exact_on_a_split_softmax(name):
    check_split(*random_split(0, **SPLITS[name]))


@given(st.integers(0, 2**31 - 1), st.integers(0, 6), st.integers(1, 4), st.integers(1, 40),
       st.integers(1, 8), st.integers(1, 8), st.sampled_from([0.1, 1.0, 30.0, 1e4]),
       st.sampled_from([0.0, 0.5, 0.95]))
def test_combine_is_exact_on_a_split_softmax_fuzz(seed, tq, hq, n, d, num_slots, magnitude,
                                                  p_masked):
    check_split(*random_split(seed, tq, hq, n, d, num_slots, magnitude, p_masked))


@given(st.integers(0, 2**31 - 1), st.integers(1, 8))
def test_combine_is_order_independent(seed, num_slots):
    """Permuting the slots (the order K1's items ran in) changes the result only by rounding."""
    S, V, part = random_split(seed, 5, 3, 20, 4, num_slots, 5.0, 0.3)
    o_part, lse_part, o, lse = check_split(S, V, part)
    perm = np.random.default_rng(seed).permutation(num_slots)
    o_p, lse_p = combine_partials(o_part[perm], lse_part[perm])
    o32, lse32 = combine_partials(o_part.astype(np.float32), lse_part.astype(np.float32))
    np.testing.assert_array_equal(np.isneginf(lse_p), np.isneginf(lse))
    assert max_err(o_p, o) <= F64_FACTOR * yardstick(o32, o)
    assert max_err(lse_p, lse) <= F64_FACTOR * yardstick(lse32, lse)


def test_single_slot_is_the_identity():
    """K = 1: the weight is exp(L - L) = 1, so o and lse come back bit for bit."""
    rng = np.random.default_rng(1)
    o_part = rng.standard_normal((1, 7, 3, 5))
    lse_part = rng.standard_normal((1, 7, 3)) * 50
    lse_part[0, 2, 1] = -np.inf
    o_part[0, 2, 1] = 0
    o, lse = combine_partials(o_part, lse_part)
    np.testing.assert_array_equal(o, o_part[0])
    np.testing.assert_array_equal(lse, lse_part[0])


def test_lse_is_log_of_sum_of_exp():
    """L = log sum_s exp(L_s), checked with small L_s where the naive formula is safe."""
    rng = np.random.default_rng(2)
    lse_part = rng.standard_normal((6, 4, 3))
    lse_part[2:4, 1] = -np.inf
    o, lse = combine_partials(np.zeros((6, 4, 3, 2)), lse_part)
    _, lse32 = combine_partials(np.zeros((6, 4, 3, 2), np.float32), lse_part.astype(np.float32))
    want = np.log(np.sum(np.exp(lse_part), axis=0))
    assert max_err(lse, want) <= F64_FACTOR * yardstick(lse32, want)


def test_all_masked_rows_give_zero_and_neg_inf_without_warnings():
    """Every slot -inf: o = 0, lse = -inf; garbage (NaN, inf) in unused slots never leaks."""
    rng = np.random.default_rng(3)
    o_part = rng.standard_normal((4, 5, 2, 3))
    lse_part = rng.standard_normal((4, 5, 2))
    lse_part[:, 1] = -np.inf  # query 1: nothing at all
    lse_part[1:, 3, 0] = -np.inf  # query 3, head 0: only slot 0
    o_part[:, 1] = np.nan
    o_part[1:, 3, 0] = np.inf
    with np.errstate(**NO_FP_WARNINGS):
        o, lse = combine_partials(o_part, lse_part)
    assert (o[1] == 0).all() and np.isneginf(lse[1]).all()
    np.testing.assert_array_equal(o[3, 0], o_part[0, 3, 0])
    assert lse[3, 0] == lse_part[0, 3, 0]
    assert not np.isnan(o).any() and not np.isnan(lse).any()


@pytest.mark.parametrize("bad,want_lse", [(np.nan, np.nan), (np.inf, np.inf)],
                         ids=["nan", "+inf"])
def test_a_nan_or_inf_slot_is_not_skipped(bad, want_lse):
    """L_s NaN: o = NaN, lse = NaN; L_s = +inf (and no NaN): o = NaN, lse = +inf -- what
    log sum exp gives, and eq 8 for a query that sees a NaN or +inf score (a skip would drop the
    block silently). Only that (query, head) changes; -inf slots stay skipped."""
    rng = np.random.default_rng(4)
    o_part = rng.standard_normal((3, 4, 2, 5))
    lse_part = rng.standard_normal((3, 4, 2))
    lse_part[2, 1] = -np.inf
    o_part[2, 1] = np.nan  # an unused slot's garbage
    want_o, want = combine_partials(o_part, lse_part)
    lse_part[1, 2, 0] = bad
    o, lse = combine_partials(o_part, lse_part)
    assert np.isnan(o[2, 0]).all() and np.array_equal(lse[2, 0], want_lse, equal_nan=True)
    rest = np.ones((4, 2), bool)
    rest[2, 0] = False
    np.testing.assert_array_equal(o[rest], want_o[rest])
    np.testing.assert_array_equal(lse[rest], want[rest])
    lse_part[0, 2, 0] = np.inf if bad != np.inf else np.nan  # NaN wins over +inf
    assert np.isnan(combine_partials(o_part, lse_part)[1][2, 0])


@pytest.mark.parametrize("o_dtype,lse_dtype,out_dtype,want_o,want_lse", [
    (np.float64, np.float64, None, np.float64, np.float64),
    (np.float32, np.float32, None, np.float32, np.float32),
    (np.float16, np.float32, None, np.float16, np.float32),
    (np.float32, np.float64, None, np.float32, np.float64),
    (np.float64, np.float64, np.float16, np.float16, np.float64),
    (np.float32, np.float32, "float64", np.float64, np.float32),
], ids=["f64", "f32", "f16_partials", "f64_lse", "out_f16", "out_f64_name"])
def test_output_dtypes(o_dtype, lse_dtype, out_dtype, want_o, want_lse):
    o, lse = combine_partials(np.ones((2, 3, 4, 5), o_dtype), np.zeros((2, 3, 4), lse_dtype),
                              out_dtype=out_dtype)
    assert o.dtype == want_o and lse.dtype == want_lse
    assert o.shape == (3, 4, 5) and lse.shape == (3, 4)
    np.testing.assert_array_equal(o, 1)  # two equal slots of ones average to ones
    np.testing.assert_array_equal(lse, np.log(want_lse(2)))


O = np.zeros((3, 4, 2, 5))
L = np.zeros((3, 4, 2))

BAD = {
    "o_part_rank": ((O[0], L), {}, ValueError, "o_part"),
    "o_part_int": ((O.astype(np.int32), L), {}, TypeError, "o_part"),
    "o_part_no_slots": ((O[:0], L[:0]), {}, ValueError, "o_part"),
    "o_part_list": ((O.tolist(), L), {}, TypeError, "o_part"),
    "lse_part_rank": ((O, L[0]), {}, ValueError, "lse_part"),
    "lse_part_int": ((O, L.astype(np.int64)), {}, TypeError, "lse_part"),
    "K_mismatch": ((O, L[:2]), {}, ValueError, "lse_part"),
    "Tq_mismatch": ((O, L[:, :3]), {}, ValueError, "lse_part"),
    "Hq_mismatch": ((O, L[:, :, :1]), {}, ValueError, "lse_part"),
    "out_dtype_int": ((O, L), dict(out_dtype=np.int32), TypeError, "out_dtype"),
    "out_dtype_nonsense": ((O, L), dict(out_dtype="not a dtype"), TypeError, "out_dtype"),
}


@pytest.mark.parametrize("bad", BAD)
def test_bad_inputs(bad):
    args, kwargs, err, match = BAD[bad]
    with pytest.raises(err, match=match):
        combine_partials(*args, **kwargs)
