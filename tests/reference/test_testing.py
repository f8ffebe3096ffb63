"""msa.testing: the tolerance rule, exact comparison, poison, backends and strategies."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from msa.reference.blocks import local_blocks, max_blocks
from msa.reference.select import check_block_indices
from msa.testing import strategies as mst
from msa.testing.backends import BACKENDS, Backend, poison, poison_value, to_numpy
from msa.testing.tolerance import assert_close_to_oracle, assert_exact, oracle_and_baseline


def _logsumexp(x):
    """A float function with rounding error: log sum exp over the last axis, -inf for empty rows."""
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    with np.errstate(divide="ignore"):
        return np.log(np.sum(np.exp(x - m), axis=-1)) + m[..., 0]


def _rows(seed=0, shape=(6, 50)):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 4
    x[0] = -np.inf  # an empty row: lse = -inf
    x[1, ::2] = -np.inf
    return x


# -- assert_close_to_oracle ---------------------------------------------------------------------

def test_float32_rerun_in_another_order_passes():
    x = _rows()
    oracle, baseline = oracle_and_baseline(_logsumexp, x)
    assert oracle.dtype == np.float64 and baseline.dtype == np.float32
    actual = _logsumexp(x[:, ::-1].copy())  # same precision, other summation order
    report = assert_close_to_oracle(actual, oracle, baseline, name="lse")
    assert report.error <= report.bound and report.baseline_error > 0


def test_float16_result_fails_against_a_float32_baseline():
    x = _rows()
    oracle, baseline = oracle_and_baseline(_logsumexp, x)
    actual = _logsumexp(x.astype(np.float16)).astype(np.float32)
    with pytest.raises(AssertionError,
                       match=r"lse: max \|actual - oracle\| = .* exceeds the bound"):
        assert_close_to_oracle(actual, oracle, baseline, name="lse", dtype=np.float32)


def test_scale_sets_the_floor():
    # An exact baseline leaves only the floor: 4 eps x scale, with scale max|oracle| by default.
    oracle = np.array([0.025, -0.01])
    baseline = oracle.astype(np.float32).astype(np.float64)
    eps = float(np.finfo(np.float32).eps)
    off = baseline + np.array([1e-7, 0.0])  # ~0.8 ulp of 0.25-sized terms, 40 ulps of 0.025
    with pytest.raises(AssertionError, match=r"scale 2\.500e-02"):
        assert_close_to_oracle(off, oracle, baseline, name="lse", dtype=np.float32)
    report = assert_close_to_oracle(off, oracle, baseline, name="lse", dtype=np.float32,
                                    scale=1.5)
    assert report.floor == pytest.approx(4 * eps * 1.5)
    with pytest.raises(ValueError, match="scale"):
        assert_close_to_oracle(off, oracle, baseline, scale=-1.0)


@given(scale=st.floats(0.0, 0.99), index=st.integers(0, 5 * 50 - 1))
def test_one_perturbed_element_fails_exactly_past_the_bound(scale, index):
    """Moving one element by s x the bound passes for s < 1 and fails for s > 1, naming it."""
    oracle = np.random.default_rng(1).standard_normal((5, 50))
    baseline = (oracle + np.random.default_rng(2).standard_normal(oracle.shape) * 1e-6)
    baseline = baseline.astype(np.float32)
    eps = np.finfo(np.float32).eps
    bound = 2 * np.abs(baseline - oracle).max() + 4 * eps * np.abs(oracle).max()
    where = np.unravel_index(index, oracle.shape)
    ok = oracle.copy()
    ok[where] += scale * bound
    assert_close_to_oracle(ok, oracle, baseline)
    bad = oracle.copy()
    bad[where] -= (1 + scale) * bound * 1.001
    with pytest.raises(AssertionError, match=rf"at index \({where[0]}, {where[1]}\)"):
        assert_close_to_oracle(bad, oracle, baseline)


def test_floor_covers_a_few_ulps_when_the_baseline_is_exact():
    oracle = np.array([1.0, -2.0, 0.5])
    baseline = oracle.astype(np.float32)  # exact: error 0
    eps = np.finfo(np.float32).eps
    assert_close_to_oracle(oracle + 4 * eps, oracle, baseline)  # floor: 4 eps * max|o| = 8 eps
    with pytest.raises(AssertionError, match="floor"):
        assert_close_to_oracle(oracle + 20 * eps, oracle, baseline)
    # all-zero oracle (O of an empty row): zero floor, only exact zeros pass
    z = np.zeros(4)
    assert_close_to_oracle(z, z, z.astype(np.float32))
    with pytest.raises(AssertionError):
        assert_close_to_oracle(z + 1e-30, z, z.astype(np.float32))


@pytest.mark.parametrize("actual, match", [
    ([0.0, 1.0, 2.0], r"actual differs from the oracle in special values .* index \(0,\)"),
    ([-np.inf, -np.inf, 2.0], r"special values .* index \(1,\)"),
    ([np.inf, 1.0, 2.0], r"special values .* index \(0,\)"),
    ([-np.inf, np.nan, 2.0], r"actual has NaN at 1 of 3 positions, first at index \(1,\)"),
], ids=["finite-for-minus-inf", "minus-inf-for-finite", "plus-inf-for-minus-inf", "nan"])
def test_special_values_must_match_exactly(actual, match):
    oracle = np.array([-np.inf, 1.0, 2.0])
    baseline = oracle.astype(np.float32)
    assert_close_to_oracle(oracle.copy(), oracle, baseline)
    with pytest.raises(AssertionError, match=match):
        assert_close_to_oracle(np.array(actual), oracle, baseline)


def test_bad_oracle_baseline_or_shapes_are_reported():
    o = np.array([1.0, 2.0])
    with pytest.raises(AssertionError, match="oracle has NaN"):
        assert_close_to_oracle(o, np.array([1.0, np.nan]), o.astype(np.float32))
    with pytest.raises(AssertionError, match="baseline differs from the oracle in special values"):
        assert_close_to_oracle(o, o, np.array([1.0, np.inf], np.float32))
    with pytest.raises(AssertionError, match=r"shapes differ: actual \(3,\)"):
        assert_close_to_oracle(np.zeros(3), o, o.astype(np.float32))
    with pytest.raises(ValueError, match="factor"):
        assert_close_to_oracle(o, o, o, factor=0.5)


def test_the_factor_is_applied():
    oracle = np.zeros(3)
    baseline = np.array([0.0, 1e-3, 0.0], np.float32)
    assert_close_to_oracle([0.0, 0.0, 1.9e-3], oracle, baseline, factor=2.0)
    with pytest.raises(AssertionError, match="2 x baseline error"):
        assert_close_to_oracle([0.0, 0.0, 2.1e-3], oracle, baseline, factor=2.0)
    assert_close_to_oracle([0.0, 0.0, 2.1e-3], oracle, baseline, factor=3.0)


# -- assert_exact, poison, to_numpy --------------------------------------------------------------

def test_assert_exact_names_the_row():
    a = np.array([[[0, 3, -1]], [[1, 2, 5]]], np.int32)
    assert_exact(a, a.astype(np.int64))
    b = a.copy()
    b[1, 0, 2] = 4
    with pytest.raises(AssertionError,
                       match=r"I: 1 of 6 elements differ, first at index \(1, 0, 2\): actual 5, "
                             r"expected 4; row \(1, 0\): actual \[1, 2, 5\]"):
        assert_exact(a, b, name="I")
    with pytest.raises(AssertionError, match="shapes differ"):
        assert_exact(a, a[:1])
    with pytest.raises(AssertionError, match="compares integers"):
        assert_exact(a.astype(np.float32), a)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.int64,
                                   np.uint32])
def test_poison(dtype):
    x = np.zeros(5, dtype)
    assert poison(x) is x
    v = poison_value(dtype)
    if np.dtype(dtype).kind == "f":
        assert np.isnan(x).all() and np.isnan(v)
    else:
        assert (x == np.iinfo(dtype).min).all() and v == np.iinfo(dtype).min
    with pytest.raises(TypeError, match="bool"):
        poison_value(np.bool_)


def test_to_numpy_passes_numpy_through():
    x = np.arange(3)
    assert to_numpy(x) is x
    np.testing.assert_array_equal(to_numpy([1, 2]), [1, 2])


# -- Backend ------------------------------------------------------------------------------------

def test_backend_finds_reference_functions_and_skips_missing_cuda_ones():
    from msa.reference.blocks import query_positions

    assert Backend("reference").blocks.query_positions is query_positions
    with pytest.raises(pytest.skip.Exception,
                       match="msa.cuda.no_such_stage is not implemented yet"):
        Backend("cuda").no_such_stage
    with pytest.raises(pytest.skip.Exception,
                       match=r"msa.cuda.csr.no_such_fn is not implemented"):
        Backend("cuda").stage("csr").no_such_fn
    with pytest.raises(ModuleNotFoundError):
        Backend("reference").no_such_stage
    with pytest.raises(AttributeError):
        Backend("reference").blocks.no_such_fn
    with pytest.raises(ValueError, match="backend must be one of"):
        Backend("torch")


def test_backend_fixture(backend):
    assert backend.name in BACKENDS
    assert backend.is_cuda == (backend.name == "cuda")


# -- strategies ---------------------------------------------------------------------------------

def _local(cu_q, cu_k, block_size):
    return local_blocks(cu_q, cu_k, int(cu_q[-1]), int(cu_k[-1]), block_size)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@given(data=st.data())
def test_block_score_arrays(ties, data):
    p = data.draw(mst.select_problems(ties=ties))
    M, cu_q, cu_k, bk = p["block_scores"], p["cu_seqlens_q"], p["cu_seqlens_k"], p["block_size"]
    local = _local(cu_q, cu_k, bk)
    assert M.dtype == np.float32 and M.shape[1:] == (local.size, max_blocks(cu_k, bk))
    visible = np.arange(M.shape[2])[None, :] <= local[:, None]  # [Tq, NB]
    np.testing.assert_array_equal(np.isfinite(M), np.broadcast_to(visible, M.shape))
    values = M[np.isfinite(M)]
    if ties:
        assert set(values.tolist()) <= {0.0, 1.0, 2.0}
    else:
        assert np.unique(values).size == values.size
    assert 1 <= p["topk"] <= 6


@given(p=mst.block_index_problems())
def test_block_indices_are_valid_selections(p):
    I, cu_q, cu_k, bk = p["block_indices"], p["cu_seqlens_q"], p["cu_seqlens_k"], p["block_size"]
    assert I.dtype == np.int32 and I.shape == (int(cu_q[-1]), p["num_kv_heads"], p["topk"])
    check_block_indices(I, cu_q, cu_k, bk)
    local = _local(cu_q, cu_k, bk)
    real = I >= 0
    assert (real[..., 0]).all(), "every row holds at least the local block"
    assert ((I == local[:, None, None]) & real).any(axis=-1).all(), "local block missing"
    assert (I <= local[:, None, None]).all(), "a block after the local one"
    assert (np.diff(I, axis=-1)[real[..., 1:]] > 0).all(), "rows must be ascending and unique"


@pytest.mark.parametrize("pattern", mst.SELECTION_PATTERNS)
@given(data=st.data())
def test_full_selections_have_min_k_and_visible_blocks(pattern, data):
    cu_q, cu_k = data.draw(mst.packed_batches())
    bk, topk = data.draw(st.sampled_from([4, 16])), data.draw(st.integers(1, 6))
    I = data.draw(mst.block_indices_for(cu_q, cu_k, 2, topk, bk, fill=True, pattern=pattern))
    local = _local(cu_q, cu_k, bk)
    want = np.minimum(topk, local + 1)[:, None].repeat(2, axis=1)  # [Tq, Hkv]
    np.testing.assert_array_equal((I >= 0).sum(-1), want)


@given(data=st.data())
def test_hot_pattern_concentrates_on_few_blocks(data):
    cu = np.array([0, 512], np.int32)
    I = data.draw(mst.block_indices_for(cu, cu, 1, 4, 8, fill=True, pattern="hot"))
    counts = np.bincount(I[I >= 0].ravel())  # queries per block: the k2q CSR row lengths
    assert np.sort(counts)[-2:].min() > 0.8 * 512, "two blocks are chosen by most queries"


@given(pw=mst.problems_with_indices(**mst.KERNEL_SHAPES), c=mst.chunk_sizes(32))
def test_problems_with_indices_and_chunk_sizes(pw, c):
    problem, I = pw
    check_block_indices(I, problem.cu_seqlens_q, problem.cu_seqlens_k, problem.block_size)
    assert I.shape == (problem.q.shape[0], problem.num_kv_heads, problem.topk)
    assert problem.block_size in (16, 32) and problem.q.shape[2] == 16
    assert 1 <= c <= 32


def test_strategy_arguments_are_checked():
    from hypothesis import find

    cu = np.array([0, 8], np.int32)
    with pytest.raises(ValueError, match="pattern must be one of"):
        find(mst.block_indices_for(cu, cu, 1, 2, 4, pattern="zipf"), lambda _: True)
    with pytest.raises(ValueError, match="dtype must be float32 or float64"):
        find(mst.block_score_arrays(cu, cu, 1, 4, dtype=np.float16), lambda _: True)
