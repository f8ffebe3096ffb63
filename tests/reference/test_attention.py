"""Eq 1 (dense), eq 8 (sparse) and K1 (KV-outer partials) against slow per-query formulas.

Floats compare against a float64 per-(query, head) loop. The yardstick is a float32 run of the
same loop (docs/design.md §5): a float64 result must be ``2**-20`` times as close as that baseline
(float64 has 29 more mantissa bits than float32, so this leaves 2**9 of headroom), and a float32
result may be at most ``F32_FACTOR`` times as far. Integers and sentinels (-inf) compare exactly.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from msa.problems import make_problem
from msa.reference import attention
from msa.reference.attention import (attention_partials, dense_attention, sparse_attention,
                                     sparse_attention_backward)
from msa.reference.blocks import query_positions
from msa.reference.combine import combine_partials
from msa.reference.csr import build_csr
from msa.reference.schedule import build_schedule
from msa.reference.select import fixed_blocks
from msa.testing.strategies import problem_shapes

F64_FACTOR = 2.0 ** -20
F32_FACTOR = 4.0
# NumPy's warnings as errors; underflow stays silent, it is exp of a very negative score (-> 0).
NO_FP_WARNINGS = dict(divide="raise", over="raise", invalid="raise")


# Slow, obviously correct formulas.


def supports_dense(cu_q, cu_k):
    """support(t, r): packed ids of the keys query t may see (eq 1), for every group r."""
    batch, pos = query_positions(cu_q, cu_k, int(cu_q[-1]), int(cu_k[-1]))
    return lambda t, r: int(cu_k[batch[t]]) + np.arange(int(pos[t]) + 1)


def supports_sparse(block_indices, cu_q, cu_k, block_size):
    """support(t, r) of eq 8: the keys of the blocks in I[t, r] at positions <= pos[t]."""
    batch, pos = query_positions(cu_q, cu_k, int(cu_q[-1]), int(cu_k[-1]))

    def support(t, r):
        j = np.arange(int(pos[t]) + 1)  # the causally visible key positions
        chosen = np.isin(j // block_size, block_indices[t, r])
        return int(cu_k[batch[t]]) + j[chosen]
    return support


def slow_attention(q, k, v, support, scale=None):
    """softmax over support(t, h // G) for every (t, h), one at a time, in q's dtype."""
    tq, hq, d = q.shape
    g = hq // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    o = np.zeros(q.shape, dtype=q.dtype)
    lse = np.full((tq, hq), -np.inf, dtype=q.dtype)
    for t in range(tq):
        for h in range(hq):
            keys = support(t, h // g)
            if keys.size == 0:
                continue
            s = (k[keys, h // g] @ q[t, h]) * q.dtype.type(scale)
            m = s.max()
            p = np.exp(s - m)
            o[t, h] = (p @ v[keys, h // g]) / p.sum()
            lse[t, h] = m + np.log(p.sum())
    return o, lse


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
    """Error of a float32 run ``base32`` against the float64 ``ref``.

    Floored at one float32 ulp of the largest finite |ref| (2**-23 relative): on a handful of
    outputs a float32 run can land closer than that by luck, and no float32 result is owed more.
    """
    finite = np.abs(np.asarray(ref, np.float64)[np.isfinite(ref)])
    floor = float(finite.max()) * np.finfo(np.float32).eps if finite.size else 0.0
    return max(max_err(base32, ref), floor)


def assert_f64_close(got, ref, base32):
    """A float64 result is 2**-20 times closer to ``ref`` than the float32 run ``base32``."""
    assert max_err(got, ref) <= F64_FACTOR * yardstick(base32, ref)


def f32(p):
    return tuple(x.astype(np.float32) for x in (p.q, p.k, p.v))


def check_against_loop(fn, p, support, scale=None):
    """fn(q, k, v) in float64 and float32 against slow_attention, with the float32 yardstick."""
    o64, lse64 = fn(p.q, p.k, p.v)
    ref_o, ref_lse = slow_attention(p.q, p.k, p.v, support, scale)
    base_o, base_lse = slow_attention(*f32(p), support, scale)
    o32, lse32 = fn(*f32(p))
    assert o64.dtype == lse64.dtype == np.float64 and o32.dtype == lse32.dtype == np.float32
    # Sentinels are exact: the same rows are empty in every run.
    np.testing.assert_array_equal(np.isneginf(lse64), np.isneginf(ref_lse))
    np.testing.assert_array_equal(np.isneginf(lse32), np.isneginf(ref_lse))
    for got64, got32, ref, base in ((o64, o32, ref_o, base_o), (lse64, lse32, ref_lse, base_lse)):
        assert_f64_close(got64, ref, base)
        assert max_err(got32, ref) <= F32_FACTOR * yardstick(base, ref)
    assert not np.isnan(o64).any() and not np.isnan(o32).any()
    return o64, lse64


@contextmanager
def tile(elements):
    """Shrink the score-tile budget so that small problems cross chunk boundaries."""
    with mock.patch.object(attention, "_TILE_ELEMENTS", elements):
        yield


def random_block_indices(p, seed, *, topk=None, empty_rows=True, future=True, shuffle=True):
    """A valid I int32 [Tq, Hkv, K] drawn without the selector.

    Each row holds a random number of distinct blocks of the query's sequence (possibly none,
    possibly blocks after the local one when ``future``), in random order when ``shuffle``,
    -1 padded at the tail. Such rows are all legal input of eq 8.
    """
    rng = np.random.default_rng(seed)
    topk = p.topk if topk is None else topk
    cu_q, cu_k = p.cu_seqlens_q, p.cu_seqlens_k
    batch, pos = query_positions(cu_q, cu_k, int(cu_q[-1]), int(cu_k[-1]))
    seq_blocks = -(-np.diff(cu_k.astype(np.int64)) // p.block_size)
    out = np.full((pos.size, p.num_kv_heads, topk), -1, dtype=np.int32)
    for t in range(pos.size):
        pool = int(seq_blocks[batch[t]]) if future else int(pos[t]) // p.block_size + 1
        for r in range(p.num_kv_heads):
            n = int(rng.integers(0 if empty_rows else 1, min(topk, pool) + 1))
            chosen = rng.choice(pool, size=n, replace=False)
            out[t, r, :n] = chosen if shuffle else np.sort(chosen)
    return out


def all_blocks(p, topk):
    """I with every block of the query's sequence (in order), K >= NB, -1 padded."""
    cu_q, cu_k = p.cu_seqlens_q, p.cu_seqlens_k
    batch, _ = query_positions(cu_q, cu_k, int(cu_q[-1]), int(cu_k[-1]))
    nb = -(-np.diff(cu_k.astype(np.int64)) // p.block_size)
    j = np.arange(topk)
    row = np.where(j[None, :] < nb[batch][:, None], j[None, :], -1)  # [Tq, K]
    return np.repeat(row[:, None, :], p.num_kv_heads, axis=1).astype(np.int32)


CASES = {
    "T1": dict(seq_lens_k=(1,), num_q_heads=4, num_kv_heads=2, block_size=4, topk=2),
    "T_not_multiple_of_Bk": dict(seq_lens_k=(37,), block_size=16, topk=2),
    "NB_lt_K": dict(seq_lens_k=(20,), block_size=16, topk=5),
    "G1": dict(seq_lens_k=(45,), num_q_heads=3, num_kv_heads=3, block_size=8, topk=3),
    "G16": dict(seq_lens_k=(30,), num_q_heads=16, num_kv_heads=1, block_size=8, topk=2),
    "G8_two_groups": dict(seq_lens_k=(26, 9), num_q_heads=16, num_kv_heads=2, block_size=4),
    "empty_sequences": dict(seq_lens_k=(0, 25, 0, 3), seq_lens_q=(0, 25, 0, 0), block_size=8),
    "no_queries": dict(seq_lens_k=(10, 4), seq_lens_q=(0, 0), block_size=4),
    "decode_Lq1": dict(seq_lens_k=(40, 70), seq_lens_q=(1, 1), block_size=16, topk=3),
    "Lq_lt_Lk": dict(seq_lens_k=(50, 33), seq_lens_q=(20, 7), block_size=8, topk=3),
    "many_sequences": dict(seq_lens_k=(5, 17, 1, 64, 9, 30), seq_lens_q=(5, 3, 1, 64, 0, 30),
                           block_size=8, topk=4),
    "Bk1": dict(seq_lens_k=(12,), block_size=1, topk=3),
    "one_big_block": dict(seq_lens_k=(23,), block_size=64, topk=1),
}


def case(name, dtype=np.float64, seed=0):
    return make_problem(**CASES[name], dtype=dtype, seed=seed)


def shapes_and_seed():
    return st.tuples(problem_shapes(), st.integers(0, 2**31 - 1))


# Eq 1: dense causal GQA attention.


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("tile_elements", [1, 1 << 22], ids=["tile_one_query", "tile_default"])
def test_dense_matches_loop(name, tile_elements):
    p = case(name)
    with tile(tile_elements):
        check_against_loop(lambda q, k, v: dense_attention(q, k, v, p.cu_seqlens_q, p.cu_seqlens_k),
                           p, supports_dense(p.cu_seqlens_q, p.cu_seqlens_k))


@given(shapes_and_seed(), st.sampled_from([1, 200, 1 << 22]))
def test_dense_matches_loop_fuzz(shape_seed, tile_elements):
    shape, _ = shape_seed
    p = make_problem(**shape)
    scale = 0.3
    with tile(tile_elements):
        check_against_loop(
            lambda q, k, v: dense_attention(q, k, v, p.cu_seqlens_q, p.cu_seqlens_k, scale=scale),
            p, supports_dense(p.cu_seqlens_q, p.cu_seqlens_k), scale=scale)


def test_dense_lse_is_log_of_sum_of_exp_scores():
    """lse from the whole masked score matrix at once (no max trick: scores are small here)."""
    p = make_problem((19, 30), (11, 30), num_q_heads=4, num_kv_heads=2, head_dim=8)
    _, lse = dense_attention(p.q, p.k, p.v, p.cu_seqlens_q, p.cu_seqlens_k)
    _, lse32 = dense_attention(*f32(p), p.cu_seqlens_q, p.cu_seqlens_k)
    batch_q, pos_q = query_positions(p.cu_seqlens_q, p.cu_seqlens_k, 41, 49)
    batch_k = np.repeat([0, 1], [19, 30])
    pos_k = np.arange(49) - np.array([0, 19])[batch_k]
    k_h = np.repeat(p.k, 2, axis=1)  # [Tk, Hq, D], head h reads kv head h // 2
    scores = np.einsum("thd,jhd->thj", p.q, k_h) / math.sqrt(8)  # [Tq, Hq, Tk]
    visible = (batch_q[:, None] == batch_k[None, :]) & (pos_k[None, :] <= pos_q[:, None])
    want = np.log(np.sum(np.exp(scores) * visible[:, None, :], axis=-1))  # [Tq, Hq]
    assert_f64_close(lse, want, lse32)


def test_dense_first_query_copies_its_value():
    """A query that sees one key returns that key's value, and lse is its score."""
    p = make_problem((6,), num_q_heads=4, num_kv_heads=2, head_dim=8)
    o, lse = dense_attention(p.q, p.k, p.v, p.cu_seqlens_q, p.cu_seqlens_k, scale=0.5)
    _, lse32 = dense_attention(*f32(p), p.cu_seqlens_q, p.cu_seqlens_k, scale=0.5)
    np.testing.assert_array_equal(o[0], np.repeat(p.v[0], 2, axis=0))
    want = np.einsum("hd,hd->h", p.q[0], np.repeat(p.k[0], 2, axis=0)) * 0.5
    assert_f64_close(lse[0], want, lse32[0])


@pytest.mark.parametrize("dtype,want", [(np.float64, np.float64), (np.float32, np.float32),
                                        (np.float16, np.float32)], ids=["f64", "f32", "f16"])
def test_dense_output_dtype(dtype, want):
    p = make_problem((9,), dtype=dtype)
    o, lse = dense_attention(p.q, p.k, p.v, p.cu_seqlens_q, p.cu_seqlens_k)
    assert o.dtype == want and lse.dtype == want
    assert o.shape == p.q.shape and lse.shape == p.q.shape[:2]


def test_dense_large_scores_are_stable():
    """Scores of +-1e4 overflow a naive exp; the max-subtracted softmax stays finite."""
    p = make_problem((40,), num_q_heads=2, num_kv_heads=1, head_dim=4)
    o, lse = dense_attention(p.q * 300, p.k * 300, p.v, p.cu_seqlens_q, p.cu_seqlens_k)
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    assert np.abs(lse).max() > 1e3


# Eq 8: sparse attention on the selected support.


@pytest.mark.parametrize("name", CASES)
def test_sparse_with_every_block_equals_dense(name):
    p = case(name)
    cu_q, cu_k = p.cu_seqlens_q, p.cu_seqlens_k
    nb = max(1, -(-int(np.diff(cu_k).max()) // p.block_size))
    I = all_blocks(p, nb + 2)  # K >= NB, with -1 padding
    o_s, lse_s = sparse_attention(p.q, p.k, p.v, I, cu_q, cu_k, p.block_size)
    o_d, lse_d = dense_attention(p.q, p.k, p.v, cu_q, cu_k)
    o_32, lse_32 = dense_attention(*f32(p), cu_q, cu_k)
    np.testing.assert_array_equal(np.isneginf(lse_s), np.isneginf(lse_d))
    assert_f64_close(o_s, o_d, o_32)
    assert_f64_close(lse_s, lse_d, lse_32)


@given(shapes_and_seed(), st.sampled_from([1, 300, 1 << 22]))
def test_sparse_with_every_block_equals_dense_fuzz(shape_seed, tile_elements):
    shape, seed = shape_seed
    p = make_problem(**shape)
    cu_q, cu_k = p.cu_seqlens_q, p.cu_seqlens_k
    nb = max(1, -(-int(np.diff(cu_k).max()) // p.block_size))
    I = all_blocks(p, nb)
    # Order inside a row is free: shuffle the real entries of every row.
    rng = np.random.default_rng(seed)
    for t, r in np.ndindex(I.shape[:2]):
        n = int((I[t, r] >= 0).sum())
        I[t, r, :n] = rng.permutation(I[t, r, :n])
    with tile(tile_elements):
        o_s, lse_s = sparse_attention(p.q, p.k, p.v, I, cu_q, cu_k, p.block_size)
    o_d, lse_d = dense_attention(p.q, p.k, p.v, cu_q, cu_k)
    o_32, lse_32 = dense_attention(*f32(p), cu_q, cu_k)
    assert_f64_close(o_s, o_d, o_32)
    assert_f64_close(lse_s, lse_d, lse_32)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("tile_elements", [1, 1 << 22], ids=["tile_one_query", "tile_default"])
def test_sparse_matches_masked_loop(name, tile_elements):
    p = case(name)
    I = random_block_indices(p, seed=1)
    cu_q, cu_k = p.cu_seqlens_q, p.cu_seqlens_k
    with tile(tile_elements):
        check_against_loop(lambda q, k, v: sparse_attention(q, k, v, I, cu_q, cu_k, p.block_size),
                           p, supports_sparse(I, cu_q, cu_k, p.block_size))


@given(shapes_and_seed(), st.sampled_from([1, 300, 1 << 22]), st.booleans())
def test_sparse_matches_masked_loop_fuzz(shape_seed, tile_elements, future):
    shape, seed = shape_seed
    p = make_problem(**shape)
    I = random_block_indices(p, seed, future=future, empty_rows=future)
    cu_q, cu_k = p.cu_seqlens_q, p.cu_seqlens_k
    with tile(tile_elements):
        check_against_loop(lambda q, k, v: sparse_attention(q, k, v, I, cu_q, cu_k, p.block_size),
                           p, supports_sparse(I, cu_q, cu_k, p.block_size))


def test_sparse_fixed_blocks_matches_loop():
    """The fixed-rule indexer (sink + sliding window) as a realistic, ascending selection."""
    p = make_problem((70, 41), (70, 13), num_q_heads=8, num_kv_heads=2, block_size=8, topk=4)
    cu_q, cu_k = p.cu_seqlens_q, p.cu_seqlens_k
    I = fixed_blocks(cu_q, cu_k, 8, 4, num_kv_heads=2)
    check_against_loop(lambda q, k, v: sparse_attention(q, k, v, I, cu_q, cu_k, 8),
                       p, supports_sparse(I, cu_q, cu_k, 8))


def test_sparse_empty_support_gives_zero_and_neg_inf():
    """A row of only -1, and a row of only future blocks, see nothing: o = 0, lse = -inf."""
    p = make_problem((20,), num_q_heads=4, num_kv_heads=2, block_size=4, topk=2)
    I = np.full((20, 2, 2), -1, dtype=np.int32)
    I[:, 1, 0] = 4  # block 4 = positions 16..19: future for queries 0..15
    with np.errstate(**NO_FP_WARNINGS):
        o, lse = sparse_attention(p.q, p.k, p.v, I, p.cu_seqlens_q, p.cu_seqlens_k, 4)
    assert (o[:, :2] == 0).all() and np.isneginf(lse[:, :2]).all()
    assert (o[:16, 2:] == 0).all() and np.isneginf(lse[:16, 2:]).all()
    assert np.isfinite(lse[16:, 2:]).all()



# The gradient of eq 8 (the main branch's backward).


def slow_attention_backward(q, k, v, do, support, scale=None):
    """(dq, dk, dv) of sum(do * o) for slow_attention, one (t, h) at a time: the softmax
    Jacobian written out (dS_j = P_j (dP_j - sum_i P_i dP_i)), no LSE or D_t shortcut."""
    tq, hq, d = q.shape
    g = hq // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(k.shape)
    for t in range(tq):
        for h in range(hq):
            r = h // g
            keys = support(t, r)
            if keys.size == 0:
                continue
            s = (k[keys, r] @ q[t, h]) * scale
            p = np.exp(s - s.max())
            p /= p.sum()
            dp = v[keys, r] @ do[t, h]  # dL/dP_j
            ds = p * (dp - p @ dp)  # dL/dS_j
            dq[t, h] = scale * (ds @ k[keys, r])
            dk[keys, r] += scale * ds[:, None] * q[t, h]
            dv[keys, r] += p[:, None] * do[t, h]
    return dq, dk, dv


def backward_problem(p, I, seed=0):
    """(o, lse, do) of eq 8 on p's float64 inputs: the forward's outputs and a random dO."""
    o, lse = sparse_attention(p.q, p.k, p.v, I, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    do = np.random.default_rng(seed).standard_normal(o.shape)
    return o, lse, do


def check_backward(p, I, seed=0):
    cu_q, cu_k, bk = p.cu_seqlens_q, p.cu_seqlens_k, p.block_size
    o, lse, do = backward_problem(p, I, seed)
    with np.errstate(**NO_FP_WARNINGS):
        got = sparse_attention_backward(p.q, p.k, p.v, o, lse, do, I, cu_q, cu_k, bk)
    ref = slow_attention_backward(p.q, p.k, p.v, do, supports_sparse(I, cu_q, cu_k, bk))
    q32, k32, v32 = f32(p)
    o32, lse32 = sparse_attention(q32, k32, v32, I, cu_q, cu_k, bk)
    base32 = sparse_attention_backward(q32, k32, v32, o32, lse32, do.astype(np.float32), I,
                                       cu_q, cu_k, bk)
    # A query that sees one key has dS = dP - D = 0 exactly in exact arithmetic (P = 1, O = V),
    # and 0 up to rounding of dO.V in floating point: the floor is a float32 ulp of the largest
    # gradient of the three, not of dq's zeros.
    floor = max(float(np.abs(x).max(initial=0.0)) for x in ref) * np.finfo(np.float32).eps
    for name, a, b, c in zip(("dq", "dk", "dv"), got, ref, base32):
        assert a.dtype == np.float64 and c.dtype == np.float32, name
        assert max_err(a, b) <= F64_FACTOR * max(yardstick(c, b), floor), name


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("tile_elements", [1, 1 << 22], ids=["tile_one_query", "tile_default"])
def test_sparse_backward_matches_loop(name, tile_elements):
    p = case(name)
    with tile(tile_elements):
        check_backward(p, random_block_indices(p, seed=2))


@given(shapes_and_seed(), st.sampled_from([1, 300, 1 << 22]), st.booleans())
def test_sparse_backward_matches_loop_fuzz(shape_seed, tile_elements, future):
    shape, seed = shape_seed
    p = make_problem(**shape)
    with tile(tile_elements):
        check_backward(p, random_block_indices(p, seed, future=future, empty_rows=future), seed)


@pytest.mark.parametrize("name", ["G8_two_groups", "T_not_multiple_of_Bk", "G1"])
def test_sparse_backward_is_the_derivative(name):
    """A central difference of sum(dO * O) along a random direction, in float64."""
    p = case(name, seed=4)
    cu_q, cu_k, bk = p.cu_seqlens_q, p.cu_seqlens_k, p.block_size
    I = random_block_indices(p, seed=5, future=False)
    o, lse, do = backward_problem(p, I, seed=6)
    grads = sparse_attention_backward(p.q, p.k, p.v, o, lse, do, I, cu_q, cu_k, bk)
    rng = np.random.default_rng(7)
    eps = 1e-6
    for i, name_x in enumerate(("q", "k", "v")):
        u = rng.standard_normal(grads[i].shape)

        def loss(step):
            x = [p.q, p.k, p.v]
            x[i] = x[i] + step * u
            return float((sparse_attention(*x, I, cu_q, cu_k, bk)[0] * do).sum())

        numeric = (loss(eps) - loss(-eps)) / (2 * eps)
        analytic = float((grads[i] * u).sum())
        assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), name_x


def test_sparse_backward_of_an_empty_support_is_zero():
    """Rows that see nothing (lse = -inf) give dq = 0 and touch no key; no NaN anywhere."""
    p = make_problem((20,), num_q_heads=4, num_kv_heads=2, block_size=4, topk=2)
    I = np.full((20, 2, 2), -1, dtype=np.int32)
    I[:, 1, 0] = 4  # block 4 = positions 16..19: future for queries 0..15
    o, lse, do = backward_problem(p, I)
    with np.errstate(**NO_FP_WARNINGS):
        dq, dk, dv = sparse_attention_backward(p.q, p.k, p.v, o, lse, do, I, p.cu_seqlens_q,
                                               p.cu_seqlens_k, 4)
    assert (dq[:, :2] == 0).all() and (dq[:16, 2:] == 0).all() and (dq[16:, 2:] != 0).any()
    assert (dk[:, 0] == 0).all() and (dv[:, 0] == 0).all()  # group 0 sees nothing
    assert (dk[:16, 1] == 0).all() and (dv[:16, 1] == 0).all()  # only block 4 is seen
    assert (dv[16:, 1] != 0).all()
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()


def test_sparse_backward_ignores_huge_scores_off_the_support():
    """A future key (in the chunk's block union, not in the query's support) that scores far
    above the LSE must not overflow: the support is masked before the exp (float32)."""
    p = make_problem((16,), num_q_heads=2, num_kv_heads=1, block_size=4, topk=2, dtype=np.float32)
    p.k[12:] *= 1e3  # block 3: only queries 12..15 see it
    p.q[:] = np.abs(p.q)
    p.k[12:] = np.abs(p.k[12:])
    I = np.array([[[t // 4, 3 if t // 4 != 3 else 0]] for t in range(16)], dtype=np.int32)
    I.sort(axis=-1)
    o, lse, do = backward_problem(p, I)
    with np.errstate(**NO_FP_WARNINGS):
        grads = sparse_attention_backward(p.q, p.k, p.v, o, lse, do.astype(np.float32), I,
                                          p.cu_seqlens_q, p.cu_seqlens_k, 4)
    assert all(np.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("bad", ["o_shape", "do_shape", "lse_shape", "do_int"])
def test_bad_inputs_sparse_backward(bad):
    p = make_problem((9,), block_size=4, topk=2)
    I = random_block_indices(p, 0)
    o, lse, do = backward_problem(p, I)
    args = dict(o=o, lse=lse, do=do)
    name = bad.split("_")[0]
    args[name] = {"o_shape": o[:, :1], "do_shape": do[:-1], "lse_shape": lse[:, None],
                  "do_int": do.astype(np.int64)}[bad]
    with pytest.raises((TypeError, ValueError), match=name):
        sparse_attention_backward(p.q, p.k, p.v, args["o"], args["lse"], args["do"], I,
                                  p.cu_seqlens_q, p.cu_seqlens_k, 4)


@pytest.mark.parametrize("dtype,want", [(np.float64, np.float64), (np.float32, np.float32),
                                        (np.float16, np.float32)], ids=["f64", "f32", "f16"])
def test_sparse_output_dtype(dtype, want):
    p = make_problem((9,), dtype=dtype, block_size=4, topk=2)
    I = random_block_indices(p, 0)
    o, lse = sparse_attention(p.q, p.k, p.v, I, p.cu_seqlens_q, p.cu_seqlens_k, 4)
    assert o.dtype == want and lse.dtype == want


# K1 (KV-outer partials) + K2 (combine) == eq 8.


def k1(p, I, chunk_size, q=None, k=None, v=None):
    cu_q, cu_k = p.cu_seqlens_q, p.cu_seqlens_k
    row_ptr, q_indices, slots = build_csr(I, cu_q, cu_k, p.block_size)
    work = build_schedule(row_ptr, cu_k, p.block_size, chunk_size)
    q, k, v = (p.q, p.k, p.v) if q is None else (q, k, v)
    return attention_partials(q, k, v, work, q_indices, slots, cu_q, cu_k, p.block_size,
                              I.shape[2])


def check_k1_k2(p, I, chunk_size):
    cu_q, cu_k = p.cu_seqlens_q, p.cu_seqlens_k
    o_part, lse_part = k1(p, I, chunk_size)
    o, lse = combine_partials(o_part, lse_part)
    ref_o, ref_lse = sparse_attention(p.q, p.k, p.v, I, cu_q, cu_k, p.block_size)
    base_o, base_lse = sparse_attention(*f32(p), I, cu_q, cu_k, p.block_size)
    o32, lse32 = combine_partials(*k1(p, I, chunk_size, *f32(p)))
    assert o.dtype == np.float64 and o32.dtype == np.float32
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    np.testing.assert_array_equal(np.isneginf(lse32), np.isneginf(ref_lse))
    for got64, got32, ref, base in ((o, o32, ref_o, base_o), (lse, lse32, ref_lse, base_lse)):
        assert_f64_close(got64, ref, base)
        assert max_err(got32, ref) <= F32_FACTOR * yardstick(base, ref)
    # Slots past a row's last block are never written: 0 / -inf.
    unused = np.repeat(np.transpose(I, (2, 0, 1)) < 0, p.group_size, axis=2)  # [K, Tq, Hq]
    assert np.isneginf(lse_part[unused]).all() and (o_part[unused] == 0).all()


@pytest.mark.parametrize("chunk_size", [1, 3, 1 << 20], ids=["chunk1", "chunk3", "chunk_whole_row"])
@pytest.mark.parametrize("name", CASES)
def test_k1_k2_equals_sparse(name, chunk_size):
    p = case(name)
    check_k1_k2(p, random_block_indices(p, seed=2), chunk_size)


@given(shapes_and_seed(), st.one_of(st.integers(1, 12), st.just(1 << 20)), st.booleans())
def test_k1_k2_equals_sparse_fuzz(shape_seed, chunk_size, future):
    shape, seed = shape_seed
    p = make_problem(**shape)
    check_k1_k2(p, random_block_indices(p, seed, future=future, empty_rows=future), chunk_size)


def test_k1_slot_is_the_attention_on_that_block_alone():
    """Slot s of query t holds eq 8 on its s-th block alone: sparse_attention with I[..., s]."""
    p = make_problem((37, 20), (30, 20), num_q_heads=8, num_kv_heads=2, block_size=8, topk=3)
    I = random_block_indices(p, seed=3)
    o_part, lse_part = k1(p, I, chunk_size=4)
    for s in range(3):
        one = I[..., s:s + 1]  # [Tq, Hkv, 1], -1 where the row has fewer than s+1 blocks
        o_s, lse_s = sparse_attention(p.q, p.k, p.v, one, p.cu_seqlens_q, p.cu_seqlens_k, 8)
        o_32, lse_32 = sparse_attention(*f32(p), one, p.cu_seqlens_q, p.cu_seqlens_k, 8)
        np.testing.assert_array_equal(np.isneginf(lse_part[s]), np.isneginf(lse_s))
        assert_f64_close(o_part[s], o_s, o_32)
        assert_f64_close(lse_part[s], lse_s, lse_32)


def test_k1_future_block_writes_zero_and_neg_inf():
    """A block wholly after the query: the partial is written as o = 0, lse = -inf (no NaN)."""
    p = make_problem((16,), num_q_heads=2, num_kv_heads=1, block_size=4, topk=2)
    I = np.full((16, 1, 2), -1, dtype=np.int32)
    I[:, 0, 0] = np.arange(16) // 4
    I[:4, 0, 1] = 3  # queries 0..3 select block 3 (positions 12..15): all future
    with np.errstate(**NO_FP_WARNINGS):
        o_part, lse_part = k1(p, I, chunk_size=2)
    assert np.isneginf(lse_part[1, :4]).all() and (o_part[1, :4] == 0).all()
    assert np.isfinite(lse_part[0]).all()


def test_k1_is_independent_of_work_order():
    """Every partial has its own slot: shuffling the work items changes no bit."""
    p = make_problem((60, 33), num_q_heads=4, num_kv_heads=2, block_size=8, topk=4)
    I = random_block_indices(p, seed=4)
    cu_q, cu_k = p.cu_seqlens_q, p.cu_seqlens_k
    row_ptr, q_indices, slots = build_csr(I, cu_q, cu_k, 8)
    work = build_schedule(row_ptr, cu_k, 8, 5)
    args = (q_indices, slots, cu_q, cu_k, 8, 4)
    a = attention_partials(p.q, p.k, p.v, work, *args)
    shuffled = work[np.random.default_rng(0).permutation(len(work))]
    b = attention_partials(p.q, p.k, p.v, shuffled, *args)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


# Inputs users get wrong.


def base_problem():
    p = make_problem((10, 6), (4, 6), num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=4,
                     topk=2)
    I = random_block_indices(p, 0, empty_rows=False, future=False)
    row_ptr, q_indices, slots = build_csr(I, p.cu_seqlens_q, p.cu_seqlens_k, 4)
    work = build_schedule(row_ptr, p.cu_seqlens_k, 4, 3)
    return p, I, work, q_indices, slots


def call(fn, **changes):
    """Call ``fn`` ('dense', 'sparse' or 'partials') on base_problem with arguments replaced."""
    p, I, work, q_indices, slots = base_problem()
    kw = dict(q=p.q, k=p.k, v=p.v, cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_k)
    if fn == "sparse":
        kw.update(block_indices=I, block_size=4)
    if fn == "partials":
        kw.update(work=work, q_indices=q_indices, partial_slots=slots, block_size=4, topk=2)
    kw.update({k: (v(kw) if callable(v) else v) for k, v in changes.items()})
    return {"dense": dense_attention, "sparse": sparse_attention,
            "partials": attention_partials}[fn](**kw)


COMMON_BAD = {
    "q_rank": (dict(q=lambda kw: kw["q"][:, 0]), ValueError, "q"),
    "q_int": (dict(q=lambda kw: kw["q"].astype(np.int32)), TypeError, "q"),
    "k_dtype": (dict(k=lambda kw: kw["k"].astype(np.float32)), TypeError, "k"),
    "k_head_dim": (dict(k=lambda kw: kw["k"][..., :4], v=lambda kw: kw["v"][..., :4]), ValueError,
                   "k"),
    "v_shape": (dict(v=lambda kw: kw["v"][:-1]), ValueError, "v"),
    "v_heads": (dict(v=lambda kw: kw["v"][:, :1]), ValueError, "v"),
    "heads_not_multiple": (dict(q=lambda kw: kw["q"][:, :3]), ValueError, "Hq"),
    "empty_head_dim": (dict(q=lambda kw: kw["q"][..., :0], k=lambda kw: kw["k"][..., :0],
                            v=lambda kw: kw["v"][..., :0]), ValueError, "q"),
    "cu_q_total": (dict(cu_seqlens_q=np.array([0, 4, 9], np.int32)), ValueError, "cu_seqlens_q"),
    "cu_k_decreasing": (dict(cu_seqlens_k=np.array([0, 12, 10, 16], np.int32)), ValueError,
                        "cu_seqlens_k"),
    "cu_batch_mismatch": (dict(cu_seqlens_k=np.array([0, 16], np.int32)), ValueError, "cu_seqlens"),
    "cu_float": (dict(cu_seqlens_q=np.array([0.0, 4, 10])), TypeError, "cu_seqlens_q"),
    "more_queries_than_keys": (dict(cu_seqlens_q=np.array([0, 8, 10], np.int32),
                                    cu_seqlens_k=np.array([0, 4, 16], np.int32)), ValueError, "Lq"),
    "scale_negative": (dict(scale=-1.0), ValueError, "scale"),
    "scale_string": (dict(scale="1"), TypeError, "scale"),
}


@pytest.mark.parametrize("fn", ["dense", "sparse", "partials"])
@pytest.mark.parametrize("bad", COMMON_BAD)
def test_bad_inputs_common(fn, bad):
    changes, err, match = COMMON_BAD[bad]
    with pytest.raises(err, match=match):
        call(fn, **changes)


def _item(i, col, value):
    def change(kw):
        work = kw["work"].copy()
        work[i, col] = value
        return work
    return change


SPARSE_BAD = {
    "I_rank": (dict(block_indices=lambda kw: kw["block_indices"][:, 0]), ValueError),
    "I_float": (dict(block_indices=lambda kw: kw["block_indices"].astype(np.float32)), TypeError),
    "I_Tq": (dict(block_indices=lambda kw: kw["block_indices"][:-1]), ValueError),
    "I_Hkv": (dict(block_indices=lambda kw: kw["block_indices"][:, :1]), ValueError),
    "I_out_of_range": (dict(block_indices=lambda kw: np.where(kw["block_indices"] == 0, 9,
                                                              kw["block_indices"])), ValueError),
    "I_block_size_zero": (dict(block_size=0), ValueError),
}


@pytest.mark.parametrize("bad", SPARSE_BAD)
def test_bad_inputs_sparse(bad):
    changes, err = SPARSE_BAD[bad]
    with pytest.raises(err, match="block_indices" if bad != "I_block_size_zero" else "block_size"):
        call("sparse", **changes)


def _other_sequence_query(kw):
    q_indices = kw["q_indices"].copy()
    h, _, q_begin = (int(x) for x in kw["work"][0, :3])
    # Queries 0..3 belong to sequence 0, 4..9 to sequence 1: swap in one of the other sequence.
    q_indices[h, q_begin] = 9 if q_indices[h, q_begin] < 4 else 0
    return q_indices


def _duplicate_item(kw):
    return np.concatenate([kw["work"], kw["work"][:1]])


PARTIALS_BAD = {
    "work_columns": (dict(work=lambda kw: kw["work"][:, :5]), ValueError, "work"),
    "work_float": (dict(work=lambda kw: kw["work"].astype(np.float32)), TypeError, "work"),
    "kv_head": (dict(work=_item(0, 0, 2)), ValueError, "work"),
    "row_inconsistent": (dict(work=_item(0, 1, 99)), ValueError, "work"),
    "q_range": (dict(work=_item(0, 2, 10**6)), ValueError, "work"),
    "q_count_negative": (dict(work=_item(0, 3, -1)), ValueError, "work"),
    "batch": (dict(work=_item(0, 4, 7)), ValueError, "work"),
    "kv_block": (dict(work=_item(0, 5, 40)), ValueError, "work"),
    "duplicate_item": (dict(work=_duplicate_item), ValueError, "work"),
    "q_indices_heads": (dict(q_indices=lambda kw: kw["q_indices"][:1]), ValueError, "q_indices"),
    "q_indices_foreign_query": (dict(q_indices=_other_sequence_query), ValueError, "q_indices"),
    "q_indices_out_of_range": (dict(q_indices=lambda kw: kw["q_indices"] + 100), ValueError,
                               "q_indices"),
    "slots_shape": (dict(partial_slots=lambda kw: kw["partial_slots"][:, :-1]), ValueError,
                    "partial_slots"),
    "slot_ge_topk": (dict(topk=1), ValueError, "partial_slots"),
    "topk_zero": (dict(topk=0), ValueError, "topk"),
    "block_size_zero": (dict(block_size=0), ValueError, "block_size"),
}


@pytest.mark.parametrize("bad", PARTIALS_BAD)
def test_bad_inputs_partials(bad):
    changes, err, match = PARTIALS_BAD[bad]
    with pytest.raises(err, match=match):
        call("partials", **changes)


def test_bad_input_base_problem_is_valid():
    """The bad-input tests start from a call that succeeds."""
    for fn in ("dense", "sparse", "partials"):
        call(fn)
