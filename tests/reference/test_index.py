"""Paper eq 5-6, 11: index projections, causal index scores and the causal block max-pool.

Exact comparisons use integer-valued float64 inputs: every product and sum is then exact in any
order, so the scalable ``block_scores`` must equal a loop over ``index_scores`` bit for bit (max
and mean pick or combine exact elements). Low precision is compared against float64 with a
tolerance taken from a plain float32 einsum of the same scores.
"""

import math

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from msa.problems import make_problem
from msa.reference.blocks import local_blocks, max_blocks, query_positions
from msa.reference.index import block_scores, index_projections, index_scores
from msa.reference.select import select_blocks
from msa.testing.strategies import problem_shapes
from msa.testing.strategies import offsets as _cu




def _integer_problem(seq_lens_k, seq_lens_q=None, *, num_kv_heads=2, index_dim=8, seed=0, **kw):
    """A problem whose q_idx, k_idx are small integers (exact float64 dot products, many ties)."""
    p = make_problem(seq_lens_k, seq_lens_q, num_q_heads=num_kv_heads, num_kv_heads=num_kv_heads,
                     index_dim=index_dim, seed=seed, **kw)
    p.q_idx = np.rint(2 * p.q_idx)
    p.k_idx = np.rint(2 * p.k_idx)
    return p


def _exact_scale(pool):
    """Max picks one score, so any scale (the default 1/sqrt(Didx) too) compares exactly; a mean
    adds scores, which stay exact only when the scale is a power of two."""
    return None if pool == "max" else 0.25


def _brute_index_scores(q_idx, k_idx, cu_q, cu_k, scale):
    """S[r, t, j] by a loop over visible (query, key) pairs; -inf elsewhere."""
    tq, tk = q_idx.shape[0], k_idx.shape[0]
    batch_q, pos_q = query_positions(cu_q, cu_k, tq, tk)
    S = np.full((q_idx.shape[1], tq, tk), -np.inf)
    for t in range(tq):
        k0 = int(cu_k[batch_q[t]])
        for j in range(k0, k0 + int(pos_q[t]) + 1):
            S[:, t, j] = (q_idx[t] @ k_idx[j]) * scale
    return S


def _brute_block_scores(S, cu_q, cu_k, block_size, pool="max"):
    """M[r, t, b]: max (or mean) of S over the keys of block b that query t sees; a plain loop."""
    hkv, tq, tk = S.shape
    batch_q, pos_q = query_positions(cu_q, cu_k, tq, tk)
    nb = max_blocks(cu_k, block_size)
    M = np.full((hkv, tq, nb), -np.inf)
    for t in range(tq):
        k0 = int(cu_k[batch_q[t]])
        for b in range(nb):
            lo, hi = b * block_size, min((b + 1) * block_size, int(pos_q[t]) + 1)
            if lo < hi:
                vals = S[:, t, k0 + lo:k0 + hi]
                M[:, t, b] = vals.max(axis=-1) if pool == "max" else vals.mean(axis=-1)
    return M


def _float32_tolerance(q64, k64, scale):
    """2x the worst error of a plain float32 einsum of the scores, at least 2 ulp of their size."""
    s64 = np.einsum("trd,jd->rtj", q64, k64) * scale
    s32 = np.einsum("trd,jd->rtj", q64.astype(np.float32), k64.astype(np.float32)) * np.float32(scale)
    err = float(np.max(np.abs(s32 - s64), initial=0.0))
    return 2 * max(err, np.finfo(np.float32).eps * float(np.max(np.abs(s64), initial=0.0)))


# Hostile sizes: T=1, T not a multiple of Bk, NB < K, one and many sequences, empty ones, Lq < Lk.
CASES = {
    "T=1": dict(seq_lens_k=[1], block_size=4),
    "one-block-partial": dict(seq_lens_k=[3], block_size=8),
    "T-not-multiple-of-Bk": dict(seq_lens_k=[37], block_size=8),
    "exact-multiple": dict(seq_lens_k=[32], block_size=8),
    "Bk=1": dict(seq_lens_k=[9], block_size=1),
    "many-seqs": dict(seq_lens_k=[5, 17, 1, 33, 8], block_size=4),
    "empty-seqs": dict(seq_lens_k=[0, 12, 0, 7, 0], block_size=4),
    "Lq<Lk": dict(seq_lens_k=[40, 25], seq_lens_q=[7, 25], block_size=8),
    "decode-Lq=1": dict(seq_lens_k=[33, 64, 5], seq_lens_q=[1, 1, 1], block_size=16),
    "no-queries-in-a-seq": dict(seq_lens_k=[20, 30], seq_lens_q=[0, 4], block_size=8),
    "G=1-Hkv=1": dict(seq_lens_k=[50], block_size=16, num_kv_heads=1),
    "Hkv=4-Didx=16": dict(seq_lens_k=[70, 3], block_size=16, num_kv_heads=4, index_dim=16),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("pool", ["max", "mean"])
def test_block_scores_equal_brute_force_pool_of_index_scores(case, pool):
    p = _integer_problem(**case)
    args = (p.q_idx, p.k_idx, p.cu_seqlens_q, p.cu_seqlens_k)
    scale = _exact_scale(pool)
    S = index_scores(*args, scale=scale)
    M = block_scores(*args, case["block_size"], scale=scale, pool=pool)
    want = _brute_block_scores(S, p.cu_seqlens_q, p.cu_seqlens_k, case["block_size"], pool)
    assert M.dtype == np.float64 and M.shape == want.shape
    np.testing.assert_array_equal(M, want)


@given(shapes=problem_shapes(max_len=80), pool=st.sampled_from(["max", "mean"]))
@example(shapes=dict(seq_lens_q=[1], seq_lens_k=[1], num_q_heads=1, num_kv_heads=1, head_dim=4,
                     index_dim=4, block_size=4, topk=1, seed=0), pool="max")
def test_block_scores_equal_brute_force_fuzz(shapes, pool):
    p = make_problem(**shapes)
    q, k = np.rint(2 * p.q_idx), np.rint(2 * p.k_idx)
    scale = _exact_scale(pool)
    S = index_scores(q, k, p.cu_seqlens_q, p.cu_seqlens_k, scale=scale)
    M = block_scores(q, k, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, scale=scale, pool=pool)
    np.testing.assert_array_equal(M, _brute_block_scores(S, p.cu_seqlens_q, p.cu_seqlens_k,
                                                         p.block_size, pool))


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_index_scores_equal_a_loop_over_visible_pairs(case):
    p = _integer_problem(**case)
    scale = 1 / math.sqrt(p.q_idx.shape[-1])
    S = index_scores(p.q_idx, p.k_idx, p.cu_seqlens_q, p.cu_seqlens_k)
    want = _brute_index_scores(p.q_idx, p.k_idx, p.cu_seqlens_q, p.cu_seqlens_k, scale)
    assert S.dtype == np.float64
    np.testing.assert_array_equal(S, want)


def test_index_scores_scale_multiplies_the_dot_product():
    p = _integer_problem([10, 6], index_dim=4)
    a = index_scores(p.q_idx, p.k_idx, p.cu_seqlens_q, p.cu_seqlens_k, scale=1.0)
    b = index_scores(p.q_idx, p.k_idx, p.cu_seqlens_q, p.cu_seqlens_k)  # 1/sqrt(4) = 0.5, exact
    np.testing.assert_array_equal(b, a * 0.5)


@given(shapes=problem_shapes(max_len=80))
def test_block_scores_are_finite_exactly_on_visible_blocks(shapes):
    p = make_problem(**shapes)
    M = block_scores(p.q_idx, p.k_idx, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    local = local_blocks(p.cu_seqlens_q, p.cu_seqlens_k, p.q_idx.shape[0], p.k_idx.shape[0],
                         p.block_size)
    visible = np.arange(M.shape[-1])[None, :] <= local[:, None]  # [Tq, NB]
    np.testing.assert_array_equal(np.isfinite(M), np.broadcast_to(visible, M.shape))
    assert np.all(M[:, ~visible] == -np.inf)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", ["T-not-multiple-of-Bk", "many-seqs", "Lq<Lk", "Hkv=4-Didx=16"])
@pytest.mark.parametrize("pool", ["max", "mean"])
def test_low_precision_matches_float64_within_float32_baseline(dtype, case, pool):
    kw = dict(CASES[case])
    kw.setdefault("index_dim", 16)
    bk = kw["block_size"]
    p = make_problem(**kw, seed=3)
    # Round the data to `dtype` first: the float64 oracle sees exactly the values the low
    # precision run sees, so only arithmetic error is measured.
    q64 = p.q_idx.astype(dtype).astype(np.float64)
    k64 = p.k_idx.astype(dtype).astype(np.float64)
    args = (p.cu_seqlens_q, p.cu_seqlens_k, bk)
    M = block_scores(q64.astype(dtype), k64.astype(dtype), *args, pool=pool)
    want = block_scores(q64, k64, *args, pool=pool)
    assert M.dtype == np.float32
    np.testing.assert_array_equal(np.isfinite(M), np.isfinite(want))
    tol = _float32_tolerance(q64, k64, 1 / math.sqrt(q64.shape[-1]))
    fin = np.isfinite(want)
    assert np.max(np.abs(M[fin] - want[fin]), initial=0.0) <= tol


def test_max_vs_mean_paper_block_a_b_example():
    # §3.1: block A has one needle (+8.0) among 127 unrelated keys (-1.0); block B is 128 x +0.5.
    # The query sits at position 256, the first key of block 2 (its local block).
    bk = 128
    scores = np.concatenate([[8.0], np.full(127, -1.0), np.full(128, 0.5), [0.0]])  # [257]
    k_idx = scores[:, None]  # [257, 1]: with q_idx = 1 and scale 1 the score is the key itself
    q_idx = np.ones((1, 1, 1))
    cu_q, cu_k = _cu([1]), _cu([257])
    m_max = block_scores(q_idx, k_idx, cu_q, cu_k, bk, scale=1.0)
    m_mean = block_scores(q_idx, k_idx, cu_q, cu_k, bk, scale=1.0, pool="mean")
    np.testing.assert_array_equal(m_max[0, 0], [8.0, 0.5, 0.0])
    assert m_mean[0, 0, 0] == pytest.approx(-0.93, abs=5e-3)
    np.testing.assert_array_equal(m_mean[0, 0], [(8.0 - 127.0) / 128, 0.5, 0.0])
    # With K = 2 the local block 2 takes one slot; max picks the needle block A, mean picks B.
    np.testing.assert_array_equal(select_blocks(m_max, cu_q, cu_k, bk, 2)[0, 0], [0, 2])
    np.testing.assert_array_equal(select_blocks(m_mean, cu_q, cu_k, bk, 2)[0, 0], [1, 2])


def test_nan_scores_are_skipped_by_the_max_pool():
    # Pins the NaN contract (fmax from -inf) for the kernels: keys 1 and 4..7 are NaN.
    k_idx = np.array([0.0, np.nan, 2.0, 1.0] + [np.nan] * 4 + [3.0])[:, None]  # [9, 1]
    q_idx = np.ones((9, 1, 1))
    cu = _cu([9])
    M = block_scores(q_idx, k_idx, cu, cu, 4, scale=1.0)
    np.testing.assert_array_equal(M[0, 8], [2.0, -np.inf, 3.0])
    np.testing.assert_array_equal(M[0, 1], [0.0, -np.inf, -np.inf])
    mean = block_scores(q_idx, k_idx, cu, cu, 4, scale=1.0, pool="mean")
    assert np.isnan(mean[0, 8, 0]) and mean[0, 8, 2] == 3.0


def test_paper_section_3_1_example_at_full_size():
    # N = 8192, Bk = 128 (NB = 64), Hkv = 4, Didx = 64, query i = 5000: local block 39, blocks
    # 0..39 visible (40 finite scores per group), K = 16 selects 15 full blocks + 9 keys of 39.
    n, bk, hkv, d_idx, topk, i = 8192, 128, 4, 64, 16, 5000
    rng = np.random.default_rng(0)
    q_idx = rng.standard_normal((n, hkv, d_idx), dtype=np.float32)
    k_idx = rng.standard_normal((n, d_idx), dtype=np.float32)
    cu = _cu([n])
    M = block_scores(q_idx, k_idx, cu, cu, bk)
    assert M.shape == (hkv, n, 64) and M.dtype == np.float32
    assert local_blocks(cu, cu, n, n, bk)[i] == 39
    np.testing.assert_array_equal(np.isfinite(M[:, i]).sum(axis=-1), [40] * hkv)
    # The pooled row equals the row of a direct float32 computation for query i alone.
    s = (q_idx[i] @ k_idx[: i + 1].T) * np.float32(1 / math.sqrt(d_idx))  # [Hkv, i+1]
    s = np.concatenate([s, np.full((hkv, 40 * bk - i - 1), -np.inf, np.float32)], axis=1)
    np.testing.assert_allclose(M[:, i, :40], s.reshape(hkv, 40, bk).max(-1), rtol=1e-5, atol=1e-5)
    I = select_blocks(M, cu, cu, bk, topk)
    row = I[i]  # [Hkv, K]
    assert np.all(row[:, -1] == 39) and np.all(row >= 0)
    tokens = np.minimum(bk, i + 1 - row * bk).sum(axis=-1)  # visible keys of the selected blocks
    np.testing.assert_array_equal(tokens, [15 * 128 + 9] * hkv)
    assert 15 * 128 + 9 == 1929


def test_index_projections_are_head_major_reshapes_of_x_w():
    rng = np.random.default_rng(1)
    t, d_model, hkv, d_idx = 11, 6, 3, 4
    x = rng.integers(-3, 4, (t, d_model)).astype(np.float64)
    w_q = rng.integers(-3, 4, (d_model, hkv * d_idx)).astype(np.float64)
    w_k = rng.integers(-3, 4, (d_model, d_idx)).astype(np.float64)
    q_idx, k_idx = index_projections(x, w_q, w_k, hkv)
    assert q_idx.shape == (t, hkv, d_idx) and k_idx.shape == (t, d_idx)
    assert q_idx.dtype == k_idx.dtype == np.float64
    for r in range(hkv):
        np.testing.assert_array_equal(q_idx[:, r], x @ w_q[:, r * d_idx:(r + 1) * d_idx])
    np.testing.assert_array_equal(k_idx, x @ w_k)


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["fp16", "fp32"])
def test_index_projections_low_precision(dtype):
    rng = np.random.default_rng(2)
    x64 = rng.standard_normal((9, 32)).astype(dtype).astype(np.float64)
    w_q64 = rng.standard_normal((32, 2 * 8)).astype(dtype).astype(np.float64)
    w_k64 = rng.standard_normal((32, 8)).astype(dtype).astype(np.float64)
    q_idx, k_idx = index_projections(x64.astype(dtype), w_q64.astype(dtype), w_k64.astype(dtype), 2)
    assert q_idx.dtype == k_idx.dtype == np.float32
    q_want, k_want = index_projections(x64, w_q64, w_k64, 2)
    # Yardstick: the same products in float32 through einsum (a different summation order).
    for got, want, w64 in ((q_idx.reshape(9, -1), q_want.reshape(9, -1), w_q64), (k_idx, k_want, w_k64)):
        base = np.einsum("td,de->te", x64.astype(np.float32), w64.astype(np.float32))
        tol = 2 * max(np.max(np.abs(base - want)), np.finfo(np.float32).eps * np.max(np.abs(want)))
        assert np.max(np.abs(got - want)) <= tol


def test_index_pipeline_from_hidden_states():
    # Eq 5 feeds eq 6: the block scores of the projections equal a loop over per-group slices.
    rng = np.random.default_rng(3)
    x = rng.integers(-2, 3, (20, 5)).astype(np.float64)
    w_q = rng.integers(-2, 3, (5, 2 * 4)).astype(np.float64)
    w_k = rng.integers(-2, 3, (5, 4)).astype(np.float64)
    q_idx, k_idx = index_projections(x, w_q, w_k, 2)
    cu = _cu([12, 8])
    q_want = np.stack([x @ w_q[:, :4], x @ w_q[:, 4:]], axis=1)  # [T, Hkv, Didx]
    S = _brute_index_scores(q_want, x @ w_k, cu, cu, 0.5)
    np.testing.assert_array_equal(block_scores(q_idx, k_idx, cu, cu, 4), _brute_block_scores(S, cu, cu, 4))


def _good_index_args():
    p = make_problem([10, 6], num_q_heads=2, num_kv_heads=2, index_dim=8, dtype=np.float32)
    return p.q_idx, p.k_idx, p.cu_seqlens_q, p.cu_seqlens_k


BAD_INDEX = {
    "q_idx-rank": (lambda q, k, cq, ck: (q[:, 0], k, cq, ck, None), ValueError, "q_idx"),
    "q_idx-int": (lambda q, k, cq, ck: (q.astype(np.int32), k, cq, ck, None), TypeError, "q_idx"),
    "q_idx-no-heads": (lambda q, k, cq, ck: (q[:, :0], k, cq, ck, None), ValueError, "q_idx"),
    "k_idx-rank": (lambda q, k, cq, ck: (q, k[:, None], cq, ck, None), ValueError, "k_idx"),
    "k_idx-Didx": (lambda q, k, cq, ck: (q, k[:, :4], cq, ck, None), ValueError, "k_idx"),
    "k_idx-dtype": (lambda q, k, cq, ck: (q, k.astype(np.float64), cq, ck, None), TypeError, "k_idx"),
    "Tq-vs-cu_q": (lambda q, k, cq, ck: (q[:-1], k, cq, ck, None), ValueError, "cu_seqlens_q"),
    "Tk-vs-cu_k": (lambda q, k, cq, ck: (q, k[:-1], cq, ck, None), ValueError, "cu_seqlens_k"),
    "cu-float": (lambda q, k, cq, ck: (q, k, cq.astype(float), ck, None), TypeError, "cu_seqlens_q"),
    "Lq>Lk": (lambda q, k, cq, ck: (q, k, np.array([0, 12, 16], np.int32),
                                    np.array([0, 10, 16], np.int32), None), ValueError, "more queries"),
    "scale-negative": (lambda q, k, cq, ck: (q, k, cq, ck, -1.0), ValueError, "scale"),
    "scale-nan": (lambda q, k, cq, ck: (q, k, cq, ck, float("nan")), ValueError, "scale"),
    "scale-str": (lambda q, k, cq, ck: (q, k, cq, ck, "1"), TypeError, "scale"),
}


@pytest.mark.parametrize("fn", ["index_scores", "block_scores"])
@pytest.mark.parametrize("bad", BAD_INDEX.values(), ids=BAD_INDEX.keys())
def test_bad_index_inputs_name_the_argument(fn, bad):
    make, exc, match = bad
    q, k, cq, ck, scale = make(*_good_index_args())
    with pytest.raises(exc, match=match):
        if fn == "index_scores":
            index_scores(q, k, cq, ck, scale=scale)
        else:
            block_scores(q, k, cq, ck, 4, scale=scale)


@pytest.mark.parametrize("block_size,pool,exc,match", [
    (0, "max", ValueError, "block_size"), (2.0, "max", TypeError, "block_size"),
    (4, "median", ValueError, "pool")], ids=["Bk=0", "Bk-float", "pool"])
def test_bad_block_scores_options(block_size, pool, exc, match):
    q, k, cq, ck = _good_index_args()
    with pytest.raises(exc, match=match):
        block_scores(q, k, cq, ck, block_size, pool=pool)


BAD_PROJ = {
    "x-rank": (lambda x, wq, wk: (x[0], wq, wk, 2), ValueError, "x"),
    "x-int": (lambda x, wq, wk: (x.astype(np.int64), wq, wk, 2), TypeError, "x"),
    "w_q-rows": (lambda x, wq, wk: (x, wq[:-1], wk, 2), ValueError, "w_q_idx"),
    "w_q-cols": (lambda x, wq, wk: (x, wq[:, :-1], wk, 2), ValueError, "w_q_idx"),
    "w_k-rows": (lambda x, wq, wk: (x, wq, wk[:-1], 2), ValueError, "w_k_idx"),
    "w_k-empty": (lambda x, wq, wk: (x, wq, wk[:, :0], 2), ValueError, "w_k_idx"),
    "w_k-dtype": (lambda x, wq, wk: (x, wq, wk.astype(np.float32), 2), TypeError, "w_k_idx"),
    "heads-mismatch": (lambda x, wq, wk: (x, wq, wk, 3), ValueError, "w_q_idx"),
    "heads-zero": (lambda x, wq, wk: (x, wq, wk, 0), ValueError, "num_kv_heads"),
    "heads-float": (lambda x, wq, wk: (x, wq, wk, 2.0), TypeError, "num_kv_heads"),
}


@pytest.mark.parametrize("bad", BAD_PROJ.values(), ids=BAD_PROJ.keys())
def test_bad_projection_inputs_name_the_argument(bad):
    make, exc, match = bad
    rng = np.random.default_rng(0)
    args = make(rng.standard_normal((5, 6)), rng.standard_normal((6, 2 * 4)), rng.standard_normal((6, 4)))
    with pytest.raises(exc, match=match):
        index_projections(*args)


def test_empty_batches():
    q, k = np.zeros((0, 2, 4)), np.zeros((0, 4))
    cu = _cu([0, 0])
    assert block_scores(q, k, cu, cu, 4).shape == (2, 0, 0)
    assert index_scores(q, k, cu, cu).shape == (2, 0, 0)
    k = np.ones((9, 4))
    M = block_scores(q, k, _cu([0]), _cu([9]), 4)
    assert M.shape == (2, 0, 3)
