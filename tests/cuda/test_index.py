"""Paper eq 6 on the GPU: ``msa.cuda.index.block_scores`` against ``msa.reference.index``.

Two kinds of comparison, for every kernel version and input dtype it supports:

* exact: small-integer inputs make every product and partial sum exact in float32 whatever the
  order (tensor cores included), and the max picks one of them, so the kernel must equal the
  reference bit for bit (the mean too, with a power-of-two scale);
* float: Gaussian inputs rounded to the kernel's dtype, the error against a float64 oracle at
  most twice the float32 reference's (``msa.testing.tolerance``).

bf16 has no NumPy dtype: the simulator tests pass bf16 bit patterns (uint16) through the private
``_block_scores(..., bf16_bits=True)``; on a GPU the public function takes torch bf16 tensors.
Kernel versions: 1 (CUDA cores), 2 (tensor cores), 3 (v2 pipelined, two m-tiles a warp).
"""


import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import msa.cuda.index as cuda_index
import msa.reference.index as ref_index
from msa.cuda._core.arrays import SIMULATOR
from msa.problems import make_problem
from msa.testing.backends import to_numpy
from msa.testing.strategies import KERNEL_SHAPES, fewer_in_simulator, problem_shapes
from msa.testing.tolerance import assert_close_to_oracle, oracle_and_baseline
from msa.testing.strategies import offsets as _cu

DTYPES = ("float32", "float64", "float16", "bf16")

def _bf16_round(x):
    """float32 values rounded to the nearest bf16 (ties to even) and their uint16 bit patterns."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32), bits


def _inputs(q64, k64, dtype):
    """``(values, kernel_args)``: the inputs rounded to ``dtype`` as float arrays the reference
    takes (float32 for bf16), and the arrays the kernel gets (bf16 as uint16 bits)."""
    if dtype == "bf16":
        (qv, qb), (kv, kb) = _bf16_round(q64), _bf16_round(k64)
        return (qv, kv), (qb, kb)
    q, k = q64.astype(dtype), k64.astype(dtype)
    return (q, k), (q, k)


def _versions(dtype, d_idx, block_size):
    """Kernel versions for a table case; a GPU runs every one that applies. The simulator runs
    the tensor-core kernels on bf16 only (float16 differs in the mma type alone and goes through
    them in the fuzz tests and in tests/cuda/test_select.py's fused tests), and v2 only where
    v3 does not apply (Bk % 16 != 0): elsewhere v3, the default, runs the same case."""
    tc = dtype in ("float16", "bf16") and d_idx % 16 == 0 and block_size % 8 == 0
    v3 = tc and block_size % 16 == 0
    if SIMULATOR:
        return [1] + ([3] if v3 and dtype == "bf16" else [2] if tc and dtype == "bf16" else [])
    return [1] + ([2] if tc else []) + ([3] if v3 else [])


def _all_versions(dtype, d_idx, block_size):
    """Every version that applies, float16 tensor cores included (the fuzz tests)."""
    tc = dtype in ("float16", "bf16") and d_idx % 16 == 0 and block_size % 8 == 0
    return [1] + ([2] if tc else []) + ([3] if tc and block_size % 16 == 0 else [])


# Sequences up to 40 tokens under the simulator (still several blocks of 16 and partial ones).
_FUZZ_SHAPES = dict(KERNEL_SHAPES, max_len=40) if SIMULATOR else KERNEL_SHAPES


def _run(args, cu_q, cu_k, block_size, scale, pool, version, dtype, warps=None):
    q, k = args
    M = cuda_index._block_scores(q, k, cu_q, cu_k, block_size, scale=scale, pool=pool,
                                 version=version,
                                 bf16_bits=dtype == "bf16", warps=warps)
    M = to_numpy(M)
    assert M.dtype == (np.float64 if dtype == "float64" else np.float32)
    return M


def _problem(lq, lk, hkv, d_idx, block_size, seed, integer):
    p = make_problem(seq_lens_k=lk, seq_lens_q=lq, num_q_heads=hkv, num_kv_heads=hkv,
                     index_dim=d_idx, block_size=block_size, dtype=np.float64, seed=seed)
    q, k = p.q_idx, p.k_idx
    if integer:  # small integers: exact in every dtype, exact products and sums
        q, k = np.rint(2 * q), np.rint(2 * k)
    return q, k, p.cu_seqlens_q, p.cu_seqlens_k


def _check_exact(lq, lk, hkv, d_idx, block_size, dtype, pool, seed=0, versions=None, warps=None):
    q64, k64, cu_q, cu_k = _problem(lq, lk, hkv, d_idx, block_size, seed, integer=True)
    scale = None if pool == "max" else 0.25  # a mean stays exact with a power-of-two scale
    (qv, kv), args = _inputs(q64, k64, dtype)
    # The reference in the kernel's compute precision: exact dot products, then the same
    # rounding of `dot * scale` (float32 unless the inputs are float64).
    want = ref_index.block_scores(qv, kv, cu_q, cu_k, block_size, scale=scale, pool=pool)
    for version in versions or _versions(dtype, d_idx, block_size):
        got = _run(args, cu_q, cu_k, block_size, scale, pool, version, dtype, warps)
        assert got.shape == want.shape
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want, err_msg=f"{version} {dtype}")


# Error allowed, in units of the float32 reference's error against float64. Tensor cores sum the
# exact products of an mma in fp32 but align and truncate instead of rounding each addition, so
# their error may be a few times that of round-to-nearest float32 sums.
_FACTOR = {1: 2.0, 2: 4.0, 3: 4.0}


def _check_float(lq, lk, hkv, d_idx, block_size, dtype, pool, seed=0, versions=None):
    q64, k64, cu_q, cu_k = _problem(lq, lk, hkv, d_idx, block_size, seed, integer=False)
    (qv, kv), args = _inputs(q64, k64, dtype)
    if dtype == "float64":  # float32-representable inputs, so that float32 gives the yardstick
        qv, kv = q64.astype(np.float32), k64.astype(np.float32)
        args = (qv.astype(np.float64), kv.astype(np.float64))
    oracle, baseline = oracle_and_baseline(ref_index.block_scores, qv, kv, cu_q, cu_k, block_size,
                                           pool=pool)
    for version in versions or _versions(dtype, d_idx, block_size):
        got = _run(args, cu_q, cu_k, block_size, None, pool, version, dtype)
        assert_close_to_oracle(got, oracle, baseline, factor=_FACTOR[version],
                               name=f"M[{version}, {dtype}]")


# (seq_lens_q, seq_lens_k, Hkv, Didx, block_size): hostile sizes, tiny for the simulator.
CASES = {
    "T=1": ([1], [1], 2, 16, 16),
    "T-not-multiple-of-Bk": ([37], [37], 1, 16, 16),
    "one-partial-block": ([5], [5], 2, 16, 8),
    "varlen-empty-seqs": ([0, 9, 0, 20], [0, 9, 3, 20], 2, 16, 8),
    "Lq<Lk-decode": ([1, 2], [40, 24], 2, 16, 16),
    "no-queries-in-a-seq": ([0, 6], [20, 30], 1, 16, 8),
    "Hkv=3-rows-not-a-multiple": ([11], [30], 3, 16, 8),
    "Didx=32-Bk=32": ([4], [40], 1, 32, 32),
    "Didx=8-Bk=4-v1-only": ([9], [21], 2, 8, 4),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lq,lk,hkv,d_idx,block_size", CASES.values(), ids=CASES.keys())
def test_block_scores_exact_on_integer_inputs(lq, lk, hkv, d_idx, block_size, dtype):
    _check_exact(lq, lk, hkv, d_idx, block_size, dtype, "max")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bf16"])
@pytest.mark.parametrize("case", ["varlen-empty-seqs", "Lq<Lk-decode"])
def test_block_scores_mean_pool_exact_on_integer_inputs(case, dtype):
    _check_exact(*CASES[case], dtype, "mean")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["T-not-multiple-of-Bk", "varlen-empty-seqs", "Lq<Lk-decode",
                                  "Didx=32-Bk=32"])
def test_block_scores_within_float32_tolerance(case, dtype):
    _check_float(*CASES[case], dtype, "max", seed=1)


@pytest.mark.parametrize("dtype", ["float32", "bf16"])
def test_block_scores_mean_pool_within_float32_tolerance(dtype):
    _check_float(*CASES["varlen-empty-seqs"], dtype, "mean", seed=2)


def _shapes_args(shapes):
    return (shapes["seq_lens_q"], shapes["seq_lens_k"], shapes["num_kv_heads"],
            shapes["index_dim"], shapes["block_size"])


@fewer_in_simulator(4)
@given(shapes=problem_shapes(**_FUZZ_SHAPES), dtype=st.sampled_from(DTYPES))
@example(shapes=dict(seq_lens_q=[1], seq_lens_k=[1], num_q_heads=1, num_kv_heads=1, head_dim=16,
                     index_dim=16, block_size=16, topk=1, seed=0), dtype="bf16")
def test_block_scores_exact_fuzz(shapes, dtype):
    args = _shapes_args(shapes)
    _check_exact(*args, dtype, "max", seed=shapes["seed"], versions=_all_versions(dtype, *args[3:]))


@fewer_in_simulator(2)
@given(shapes=problem_shapes(**_FUZZ_SHAPES), dtype=st.sampled_from(DTYPES))
def test_block_scores_float_fuzz(shapes, dtype):
    args = _shapes_args(shapes)
    _check_float(*args, dtype, "max", seed=shapes["seed"], versions=_all_versions(dtype, *args[3:]))


def test_nan_scores_are_skipped_by_the_max_pool():
    # The reference's NaN contract (fmax from -inf): keys 1 and 4..7 are NaN.
    k_idx = np.array([0.0, np.nan, 2.0, 1.0] + [np.nan] * 4 + [3.0], np.float32)[:, None]
    q_idx = np.ones((9, 1, 1), np.float32)
    cu = _cu([9])
    M = to_numpy(cuda_index.block_scores(q_idx, k_idx, cu, cu, 4, scale=1.0))
    np.testing.assert_array_equal(M, ref_index.block_scores(q_idx, k_idx, cu, cu, 4, scale=1.0))


def test_block_scores_empty_batch():
    cu = _cu([0, 0])
    M = to_numpy(cuda_index.block_scores(np.zeros((0, 2, 16), np.float16),
                                         np.zeros((0, 16), np.float16), cu, cu, 8))
    assert M.shape == (2, 0, 0) and M.dtype == np.float32
    M = to_numpy(cuda_index.block_scores(np.zeros((0, 2, 16), np.float16),
                                         np.ones((9, 16), np.float16), _cu([0]), _cu([9]), 8))
    assert M.shape == (2, 0, 2)


def test_block_scores_unaligned_k_idx_falls_back_to_v2():
    # v3 copies 16-byte pieces of k_idx: data off a 16-byte boundary takes v2, and says so.
    q64, k64, cu_q, cu_k = _problem([6], [40], 2, 16, 16, 3, integer=True)
    q, k = q64.astype(np.float16), k64.astype(np.float16)
    buf = np.zeros(k.size + 2, np.float16)  # 4 bytes in: aligned to 4, not to 16
    buf[2:] = k.ravel()
    if SIMULATOR:
        k_view, q_arg, cq, ck = buf[2:].reshape(k.shape), q, cu_q, cu_k
    else:
        from numba import cuda

        k_view = cuda.to_device(buf)[2:].reshape(k.shape)
        q_arg, cq, ck = (cuda.to_device(x) for x in (q, cu_q, cu_k))
    want = ref_index.block_scores(q, k, cu_q, cu_k, 16)
    got = to_numpy(cuda_index.block_scores(q_arg, k_view, cq, ck, 16))
    np.testing.assert_array_equal(got, want)
    assert cuda_index.IndexPlan.of(q_arg, k_view, cq, ck, 16).version == 2
    with pytest.raises(ValueError, match="version 3 cannot run.*aligned"):
        cuda_index.block_scores(q_arg, k_view, cq, ck, 16, version=3)


# -- masking by selection (docs/design.md §3) ----------------------------------------------------
#
# A query's block scores and its selection must not depend on a key it cannot see (a later
# position, another sequence): poisoning k_idx there, to NaN or an infinity too, leaves its row
# of M (every group, every block) bitwise unchanged, and its row of select_blocks_fused equal.

_POISONS = [np.nan, np.inf, -np.inf, 1e30, -3.0]


def _bits(x):
    x = np.ascontiguousarray(x)
    return x.view(np.dtype(f"u{x.itemsize}"))


def _sees(cu_q, cu_k, tq, tk, j):
    """bool [Tq]: query t can see packed key j (same sequence, not later)."""
    from msa.reference.blocks import key_positions, query_positions

    bq, pq = query_positions(cu_q, cu_k, tq, tk)
    bk, pk = key_positions(cu_k, tk)
    return (bq == bk[j]) & (pk[j] <= pq)


@st.composite
def _masked_index_cases(draw):
    """``(shapes, dtype, version, j, value)``: a small problem, a version that runs on it
    (1 on every dtype; 2 and 3 on fp16/bf16 with Didx = 16), a key counted from the end."""
    dtype = draw(st.sampled_from(DTYPES))
    tc = dtype in ("float16", "bf16")
    shapes = draw(problem_shapes(max_seqs=2, max_len=32, max_heads=2, max_topk=3,
                                 block_sizes=(8, 16) if tc else (4, 8, 16),
                                 dims=(16,) if tc else (8, 16)))
    version = draw(st.sampled_from(_all_versions(dtype, shapes["index_dim"],
                                                 shapes["block_size"])))
    tk = sum(shapes["seq_lens_k"])
    j = tk - 1 - draw(st.integers(0, max(tk - 1, 0)))
    return shapes, dtype, version, j, draw(st.sampled_from(_POISONS))


def _poisoned(k64, j, value):
    k = np.array(k64, copy=True)
    k[j] = value
    return k


@fewer_in_simulator(8)
@given(case=_masked_index_cases(), pool=st.sampled_from(["max", "mean"]))
@example(case=(dict(seq_lens_q=[20, 5], seq_lens_k=[20, 9], num_q_heads=2, num_kv_heads=2,
                    head_dim=16, index_dim=16, block_size=16, topk=2, seed=0),
               "bf16", 3, 17, np.nan), pool="max")
def test_invisible_keys_leave_block_scores_bitwise_unchanged(case, pool):
    shapes, dtype, version, j, value = case
    lq, lk, hkv, d_idx, bk = _shapes_args(shapes)
    if sum(lk) == 0:
        return
    q64, k64, cu_q, cu_k = _problem(lq, lk, hkv, d_idx, bk, shapes["seed"], integer=False)
    _, args = _inputs(q64, k64, dtype)
    with np.errstate(all="ignore"):
        _, args2 = _inputs(q64, _poisoned(k64, j, value), dtype)
        m1 = _run(args, cu_q, cu_k, bk, None, pool, version, dtype)
        m2 = _run(args2, cu_q, cu_k, bk, None, pool, version, dtype)
    blind = ~_sees(cu_q, cu_k, q64.shape[0], k64.shape[0], j)  # [Tq]
    a, b = _bits(m1).transpose(1, 0, 2)[blind], _bits(m2).transpose(1, 0, 2)[blind]
    assert np.array_equal(a, b), (
        f"v{version} {dtype} {pool}: rows {np.flatnonzero(blind)[(a != b).any(axis=(1, 2))][:5]}")


@fewer_in_simulator(4)
@given(case=_masked_index_cases())
def test_invisible_keys_leave_the_fused_selection_unchanged(case):
    """``select_blocks_fused`` (its index kernel with the top-k epilogue, or the chunks):
    the rows that cannot see the poisoned key select the same blocks (bf16 runs on a GPU only:
    the simulator's fused launcher takes no bf16 bit patterns)."""
    from msa.cuda import select as cuda_select

    shapes, dtype, version, j, value = case
    lq, lk, hkv, d_idx, bk = _shapes_args(shapes)
    if sum(lq) == 0 or dtype == "bf16":
        return
    q64, k64, cu_q, cu_k = _problem(lq, lk, hkv, d_idx, bk, shapes["seed"], integer=False)
    (q, k), _ = _inputs(q64, k64, dtype)
    with np.errstate(all="ignore"):
        (_, k2), _ = _inputs(q64, _poisoned(k64, j, value), dtype)
        got = [to_numpy(cuda_select.select_blocks_fused(q, x, cu_q, cu_k, bk, shapes["topk"],
                                                        version=version))
               for x in (k, k2)]
    blind = ~_sees(cu_q, cu_k, q64.shape[0], k64.shape[0], j)
    np.testing.assert_array_equal(got[0][blind], got[1][blind])


@pytest.mark.parametrize("version, dtype", [(1, "float32"), (1, "bf16"), (2, "float16"),
                                            (3, "float16"), (3, "bf16")])
@pytest.mark.parametrize("pool", ["max", "mean"])
def test_visible_poison_gives_the_references_nan_and_inf(version, dtype, pool):
    """The queries that see a poisoned key: NaN, +inf and -inf in M exactly where the
    reference has them (the max skips a NaN score, the mean keeps it), in one dimension of the
    key (a score of +-inf by the query's sign there) and in all of them."""
    bk = 8 if version == 2 else 16
    q64, k64, cu_q, cu_k = _problem([20, 5], [20, 9], 2, 16, bk, 4, integer=False)
    # Keys 3, 17 (blocks 0 and 1 or 2 of sequence 0) and 24 (sequence 1): an entry M[r, t, b]
    # reads the keys of one block, so no entry depends on two of them, and the simulator (a
    # Python thread per CUDA thread) poisons the three at once; a GPU poisons one at a time.
    keys = [(3, 17, 24)] if SIMULATOR else [(3,), (17,), (24,)]
    for value in (np.nan, np.inf, -np.inf):
        for dims in (slice(0, 1), slice(None)):
            for c in keys:
                k2 = np.array(k64, copy=True)
                for j in c:
                    k2[j, dims] = value
                with np.errstate(all="ignore"):
                    (qv, kv), args = _inputs(q64, k2, dtype)
                    want = ref_index.block_scores(qv, kv, cu_q, cu_k, bk, pool=pool)
                    got = _run(args, cu_q, cu_k, bk, None, pool, version, dtype)
                for name, f in (("nan", np.isnan), ("+inf", np.isposinf),
                                ("-inf", np.isneginf)):
                    np.testing.assert_array_equal(
                        f(got), f(want), err_msg=f"v{version} {dtype} {pool} {value} at key "
                        f"{c}, dims {dims}: {name}")


# -- bad inputs ---------------------------------------------------------------------------------

def _good():
    q64, k64, cu_q, cu_k = _problem([10, 6], [10, 6], 2, 16, 8, 0, integer=False)
    return dict(q_idx=q64.astype(np.float16), k_idx=k64.astype(np.float16), cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k, block_size=8)


BAD = {
    "q_idx-rank": (lambda a: dict(q_idx=a["q_idx"][:, 0]), ValueError, "q_idx"),
    "q_idx-int": (lambda a: dict(q_idx=a["q_idx"].astype(np.int32)), TypeError, "q_idx"),
    "q_idx-no-heads": (lambda a: dict(q_idx=a["q_idx"][:, :0]), ValueError, "q_idx"),
    "k_idx-rank": (lambda a: dict(k_idx=a["k_idx"][:, None]), ValueError, "k_idx"),
    "k_idx-Didx": (lambda a: dict(k_idx=np.ascontiguousarray(a["k_idx"][:, :8])), ValueError, "k_idx"),
    "k_idx-dtype": (lambda a: dict(k_idx=a["k_idx"].astype(np.float32)), TypeError, "k_idx"),
    "Tq-vs-cu_q": (lambda a: dict(q_idx=a["q_idx"][:-1]), ValueError, "cu_seqlens_q"),
    "Tk-vs-cu_k": (lambda a: dict(k_idx=a["k_idx"][:-1]), ValueError, "cu_seqlens_k"),
    "cu-float": (lambda a: dict(cu_seqlens_q=a["cu_seqlens_q"].astype(float)), TypeError,
                 "cu_seqlens_q"),
    "Lq>Lk": (lambda a: dict(cu_seqlens_q=_cu([12, 4]), cu_seqlens_k=_cu([10, 6])), ValueError,
              "more queries"),
    "block_size=0": (lambda a: dict(block_size=0), ValueError, "block_size"),
    "block_size-float": (lambda a: dict(block_size=8.0), TypeError, "block_size"),
    "scale-negative": (lambda a: dict(scale=-1.0), ValueError, "scale"),
    "scale-nan": (lambda a: dict(scale=float("nan")), ValueError, "scale"),
    "pool": (lambda a: dict(pool="median"), ValueError, "pool"),
    "version-unknown": (lambda a: dict(version=7), ValueError, "version"),
    "version-old-name": (lambda a: dict(version="tc3"), ValueError, "version"),
    "version-bool": (lambda a: dict(version=True), ValueError, "version"),
    "version-float": (lambda a: dict(version=3.0), ValueError, "version"),
    "version-2-fp32": (lambda a: dict(q_idx=a["q_idx"].astype(np.float32),
                                      k_idx=a["k_idx"].astype(np.float32), version=2),
                       ValueError, "version 2 cannot run.*float32"),
    "version-2-Bk=4": (lambda a: dict(block_size=4, version=2), ValueError, "version 2"),
    "version-3-Bk=8": (lambda a: dict(version=3), ValueError, "version 3 cannot run.*% 16"),
}


def test_default_versions():
    """v3 where it applies (bf16/fp16, Bk % 16 == 0), v2 at Bk % 16 != 0, v1 for float32."""
    q64, k64, cu_q, cu_k = _problem([20], [40], 2, 16, 16, 0, integer=True)
    q, k = q64.astype(np.float16), k64.astype(np.float16)
    assert cuda_index.IndexPlan.of(q, k, cu_q, cu_k, 16).version == 3
    assert cuda_index.IndexPlan.of(q, k, cu_q, cu_k, 8).version == 2
    assert cuda_index.IndexPlan.of(q.astype(np.float32), k.astype(np.float32), cu_q, cu_k,
                                   16).version == 1


@pytest.mark.parametrize("change,error,match", BAD.values(), ids=BAD.keys())
def test_block_scores_rejects_bad_input(change, error, match):
    kwargs = _good()
    kwargs.update(change(kwargs))
    with pytest.raises(error, match=match):
        cuda_index.block_scores(**kwargs)


# -- production sizes (real GPU only) -----------------------------------------------------------

@pytest.mark.big
@pytest.mark.parametrize("dtype", ["bf16", "float16"])
def test_block_scores_production_sizes(dtype):
    torch = pytest.importorskip("torch")
    q64, k64, cu_q, cu_k = _problem([1000, 3096], [3000, 5000], 4, 128, 128, 4, integer=False)
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float16
    q = torch.tensor(q64, dtype=tdt, device="cuda")
    k = torch.tensor(k64, dtype=tdt, device="cuda")
    cq, ck = (torch.tensor(c, device="cuda") for c in (cu_q, cu_k))
    got = cuda_index.block_scores(q, k, cq, ck, 128)
    assert got.dtype == torch.float32 and got.is_cuda
    qv, kv = q.float().cpu().numpy(), k.float().cpu().numpy()
    oracle, baseline = oracle_and_baseline(ref_index.block_scores, qv, kv, cu_q, cu_k, 128)
    assert_close_to_oracle(got, oracle, baseline, factor=_FACTOR[2], name=f"M[{dtype}]")


@pytest.mark.parametrize("pool", ["max", pytest.param("mean", marks=pytest.mark.sim_heavy)])
def test_v3_equals_the_reference_and_v2(pool):
    """v3 (cp.async, ldmatrix, two m-tiles a warp, the chunk walked n-tile pair by pair) on the
    simulator's tile of 2 warps = 64 rows: exact against the reference on integer inputs (causal
    masks inside chunks, partial blocks, varlen with Lq < Lk, a partial last tile), and bitwise
    equal to v2 on random ones (the same products, sums and maxima in the same order), at
    Bk = 16 (one n-tile pair a chunk) and Bk = 32 (two)."""
    for bk, lq, lk in ((16, [21, 9], [37, 30]), (32, [40], [70])):
        _check_exact(lq, lk, 2, 16, bk, "bf16", pool, seed=bk, versions=[3])
        q64, k64, cu_q, cu_k = _problem(lq, lk, 2, 16, bk, bk, integer=False)
        (_, _), args = _inputs(q64, k64, "bf16")
        scale = None if pool == "max" else 0.25
        a = _run(args, cu_q, cu_k, bk, scale, pool, 2, "bf16")
        b = _run(args, cu_q, cu_k, bk, scale, pool, 3, "bf16")
        assert a.tobytes() == b.tobytes()


def test_tc_kernels_with_the_gpu_tile_of_8_warps():
    # The simulator runs the tensor-core kernels with 2 warps a CTA for speed; the GPU uses 8
    # (128 rows a CTA in v2, 256 in v3). Same kernel body, so run that geometry here too.
    # 30 queries x 4 groups = 120 rows: v2's eighth warp holds a partial tile.
    import msa.cuda.select as cuda_select
    import msa.reference.select as ref_select

    # The simulator runs the default kernels (v3, fused 3) in this geometry; a GPU runs both.
    versions = [3] if SIMULATOR else [2, 3]
    _check_exact([30], [32], 4, 16, 16, "bf16", "max", seed=5, versions=versions, warps=8)
    q64, k64, cu_q, cu_k = _problem([30], [32], 4, 16, 16, 5, integer=False)
    q, k = q64.astype(np.float16), k64.astype(np.float16)
    M = to_numpy(cuda_index.block_scores(q, k, cu_q, cu_k, 16))
    for version in versions:
        got = cuda_select._select_blocks_fused(q, k, cu_q, cu_k, 16, 2, version=version, warps=8)
        np.testing.assert_array_equal(to_numpy(got), ref_select.select_blocks(M, cu_q, cu_k, 16, 2))
