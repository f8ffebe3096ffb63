"""Paper eq 7 / §4.1 on the GPU: ``msa.cuda.select`` equals ``msa.reference.select`` exactly.

Every kernel version runs the same cases: a table of hostile sizes and score patterns (ties,
-inf, NaN, +inf, finite scores on future blocks), hypothesis properties with distinct scores and
with ties on purpose (the tie rule is deterministic, so both compare exactly), bad inputs, and the
fused index + top-k, whose scores the kernel computes itself: there a near tie may swap two
blocks, so the selected blocks' float64 scores are compared with the reference's K-1-th best
within a float32-derived tolerance. Shapes stay tiny: the simulator runs each thread of the warp
kernel as a Python thread and each shuffle as a rendezvous of 32 of them.
"""


import numpy as np
import pytest
from hypothesis import example, given

import msa.cuda.index as cuda_index
import msa.cuda.select as cuda_select
import msa.reference.index as ref_index
import msa.reference.select as ref_select
from msa.cuda._core.arrays import SIMULATOR
from msa.cuda._core.memops import is_aligned16
from msa.problems import make_problem
from msa.reference.blocks import local_blocks, max_blocks
from msa.testing.backends import to_numpy
from msa.testing.strategies import fewer_in_simulator, select_problems
from msa.testing.tolerance import assert_exact
from msa.testing.strategies import offsets as _cu

VERSIONS = cuda_select.VERSIONS

def _scores(kind, hkv, cu_q, cu_k, block_size, seed=0, dtype=np.float32):
    """M [Hkv, Tq, NB] of one kind: ``distinct`` (a permutation), ``ties`` (values in {0, 1, 2}),
    ``garbage`` (ties plus -inf, NaN and +inf anywhere, finite values on future blocks) or
    ``realistic`` (distinct on visible blocks, -inf after the local block, as block_scores),
    ``ascending`` (each block beats every earlier one: the most insertions), ``descending``
    (each block loses to every earlier one), ``equal`` (one score everywhere), ``sparse``
    (-inf and NaN but for a few finite scores: fewer candidates than K - 1, most lanes of a
    warp without one) or ``lanes4``/``lanes1`` (block ``b`` scores the warp lane that reads it
    in v3's 128-bit/scalar layout, ``(b % 128) // 4`` / ``b % 32``: every lane's best
    occurs 16 times in its own slots, all tied)."""
    rng = np.random.default_rng(seed)
    tq, nb = int(cu_q[-1]), max_blocks(cu_k, block_size)
    shape = (hkv, tq, nb)
    if kind in ("distinct", "realistic"):
        M = (rng.permutation(hkv * tq * nb).reshape(shape) - hkv * tq * nb // 2) / 8.0
    elif kind in ("ascending", "descending", "lanes4", "lanes1"):
        b = np.arange(nb)
        row = {"ascending": b, "descending": -b, "lanes4": (b % 128) // 4, "lanes1": b % 32}[kind]
        M = np.broadcast_to(row.astype(np.float64), shape).copy()
    elif kind == "equal":
        M = np.full(shape, 0.25)
    elif kind == "sparse":
        M = np.where(rng.random(shape) < 0.5, -np.inf, np.nan)
        M[rng.random(shape) < 0.02] = 1.0  # ties among the few candidates
    else:
        M = rng.integers(0, 3, shape).astype(np.float64)
    if kind == "garbage":
        for value, p in ((-np.inf, 0.1), (np.nan, 0.05), (np.inf, 0.05)):
            M[rng.random(shape) < p] = value
    if kind == "realistic":
        local = local_blocks(cu_q, cu_k, tq, int(cu_k[-1]), block_size)
        M[:, np.arange(nb)[None, :] > local[:, None]] = -np.inf
    return np.ascontiguousarray(M.astype(dtype))


def _check(M, cu_q, cu_k, topk, block_size, version):
    want = ref_select.select_blocks(M, cu_q, cu_k, block_size, topk)
    got = cuda_select.select_blocks(M, cu_q, cu_k, block_size, topk, version=version)
    got = to_numpy(got)
    assert got.dtype == np.int32 and got.shape == want.shape
    assert_exact(got, want, name=f"select_blocks[{version}]")


# (seq_lens_q, seq_lens_k, Hkv, block_size, topk, kind, dtype); at most ~20 (query, group) rows
# (each row of a warp kernel is 32 Python threads in the simulator). NB % 4 == 0 float32 rows
# take v3's 128-bit loads, the others its scalar loads; rows of more than 512 candidates
# hold a full v3 batch and a partial one.
TABLE = {
    "T=1": ([1], [1], 2, 16, 4, "distinct", np.float32),
    "decode-Lq=1": ([1], [200], 2, 16, 4, "realistic", np.float32),
    "T-not-multiple-of-Bk": ([9], [37], 1, 8, 3, "realistic", np.float32),
    "NB<K": ([6], [20], 1, 8, 6, "distinct", np.float32),
    "Hkv=1-G=1": ([6], [12], 1, 4, 3, "ties", np.float32),
    "varlen-empty-seq": ([3, 0, 4], [40, 3, 12], 2, 4, 4, "distinct", np.float32),
    "Lq<Lk": ([4], [64], 2, 8, 5, "realistic", np.float32),
    "K=1": ([3], [40], 2, 8, 1, "distinct", np.float32),
    "ties": ([4], [48], 2, 4, 5, "ties", np.float32),
    "garbage-nan-inf-future": ([6], [40], 2, 4, 4, "garbage", np.float32),
    "garbage-NB%4=0": ([4], [64], 2, 4, 7, "garbage", np.float32),
    "float64": ([4], [40], 2, 4, 4, "ties", np.float64),
    "float16": ([3], [60], 2, 4, 4, "distinct", np.float16),
    "K=64-wide-NB=516": ([1], [4128], 1, 8, 64, "ties", np.float32),
    "K=33-two-winners-per-lane": ([1], [400], 1, 8, 33, "ties", np.float32),
    "long-row-NB=700": ([2], [700], 1, 1, 16, "ties", np.float32),
    "ascending-every-block-inserted": ([1], [72], 1, 1, 16, "ascending", np.float32),
    # v3's seed (each lane's best of its first 16 slots, sorted across the warp, then removed
    # from the lane's slots): ties inside a lane and across lanes, lanes without a candidate,
    # a seed that already holds the answer or only the worst, K - 1 = 1 and lists of 31, 33 and 63 entries.
    "seed-all-equal-NB=600": ([1], [600], 1, 1, 16, "equal", np.float32),
    "seed-all-equal-K=64-NB=300": ([1], [300], 1, 1, 64, "equal", np.float32),
    "seed-lane-ties-vec": ([2], [520], 1, 1, 16, "lanes4", np.float32),
    "seed-lane-ties-scalar": ([2], [521], 1, 1, 16, "lanes1", np.float32),
    "seed-lane-ties-K=34-wide": ([1], [520], 1, 1, 34, "lanes4", np.float32),
    "seed-sparse-nan-inf": ([3], [300], 1, 1, 16, "sparse", np.float32),
    "seed-descending-holds-answer": ([1], [600], 1, 1, 16, "descending", np.float32),
    "seed-ascending-new-best-later": ([1], [600], 1, 1, 16, "ascending", np.float32),
    "seed-K=2": ([2], [300], 1, 1, 2, "ties", np.float32),
    "seed-K=32": ([1], [512], 1, 1, 32, "distinct", np.float32),
    "seed-K=64-distinct": ([1], [1100], 1, 1, 64, "distinct", np.float32),
}


# The paper's rung (v2, the warp heap) runs every case on a GPU; the simulator keeps it to the
# cases about its own logic (heap sizes, merge rounds, ties, -inf/NaN): the others are about the
# row mapping and loads, which v3 covers there.
_WARP_IN_SIMULATOR = {"T=1", "NB<K", "Hkv=1-G=1", "K=1", "ties", "garbage-nan-inf-future",
                      "K=64-wide-NB=516", "K=33-two-winners-per-lane"}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", TABLE.keys())
def test_select_blocks_table(case, version):
    if SIMULATOR and version == 2 and case not in _WARP_IN_SIMULATOR:
        pytest.skip("the simulator runs the warp rung on fewer cases (a GPU runs them all)")
    lq, lk, hkv, block_size, topk, kind, dtype = TABLE[case]
    cu_q, cu_k = _cu(lq), _cu(lk)
    M = _scores(kind, hkv, cu_q, cu_k, block_size, seed=len(lk) + topk, dtype=dtype)
    _check(M, cu_q, cu_k, topk, block_size, version)


@pytest.mark.parametrize("version", VERSIONS)
def test_select_blocks_hand_written_rows(version):
    # One query at position 23 of 24 keys, Bk = 4: local block 5; blocks 0..4 are candidates.
    cu_q, cu_k = _cu([1]), _cu([24])
    rows = {
        (9.0, 1.0, -5.0, 2.0, 0.0, 7.0): [0, 3, 5],  # local forced although it scores low
        (7.0, 7.0, 7.0, 7.0, 7.0, 7.0): [0, 1, 5],  # all tied: the smaller ids
        (np.nan, -np.inf, np.inf, 0.0, 1.0, 0.0): [2, 4, 5],  # NaN/-inf never, +inf first
        (np.nan, np.nan, -np.inf, np.nan, -np.inf, 0.0): [5, -1, -1],  # no candidate at all
    }
    M = np.zeros((1, 1, 6), np.float32)
    for scores, want in rows.items():
        M[0, 0] = scores
        got = to_numpy(cuda_select.select_blocks(M, cu_q, cu_k, 4, 3, version=version))
        np.testing.assert_array_equal(got[0, 0], want)


def test_select_blocks_v3_unaligned_scores():
    # float32 rows with NB % 4 == 0 whose data is not 16-byte aligned: no 128-bit loads.
    cu_q, cu_k = _cu([3]), _cu([64])
    M = _scores("ties", 1, cu_q, cu_k, 4, seed=5)  # NB = 16
    buf = np.zeros(M.size + 1, np.float32)
    buf[1:] = M.ravel()
    if SIMULATOR:
        view = buf[1:].reshape(M.shape)
    else:
        from numba import cuda

        view = cuda.to_device(buf)[1:].reshape(M.shape)
        cu_q, cu_k = cuda.to_device(cu_q), cuda.to_device(cu_k)
    assert not is_aligned16(view)
    want = ref_select.select_blocks(M, to_numpy(cu_q), to_numpy(cu_k), 4, 5)
    got = to_numpy(cuda_select.select_blocks(view, cu_q, cu_k, 4, 5, version=3))
    assert_exact(got, want, name="select_blocks[3, unaligned]")


@pytest.mark.parametrize("version", VERSIONS)
def test_select_blocks_empty_batch(version):
    cu = _cu([0, 0])
    got = to_numpy(cuda_select.select_blocks(np.zeros((3, 0, 0), np.float32), cu, cu, 8, 4,
                                             version=version))
    assert got.shape == (0, 3, 4) and got.dtype == np.int32


_SMALL = dict(max_seqs=2, max_len=20, max_kv_heads=2, block_sizes=(1, 2, 4, 8), max_topk=9)


@pytest.mark.parametrize("version", VERSIONS)
@fewer_in_simulator(3)
@given(prob=select_problems(ties=False, **_SMALL))
@example(prob=dict(block_scores=np.array([[[0.5, -0.5, 0.0]]], np.float32), cu_seqlens_q=_cu([1]),
                   cu_seqlens_k=_cu([3]), topk=2, block_size=1))
def test_select_blocks_distinct_scores_exact(version, prob):
    _check(prob["block_scores"], prob["cu_seqlens_q"], prob["cu_seqlens_k"], prob["topk"],
           prob["block_size"], version)


@pytest.mark.parametrize("version", VERSIONS)
@fewer_in_simulator(3)
@given(prob=select_problems(ties=True, **_SMALL))
def test_select_blocks_ties_exact(version, prob):
    _check(prob["block_scores"], prob["cu_seqlens_q"], prob["cu_seqlens_k"], prob["topk"],
           prob["block_size"], version)


# -- bad inputs ---------------------------------------------------------------------------------

def _good():
    cu_q, cu_k = _cu([4, 2]), _cu([10, 6])
    M = _scores("distinct", 2, cu_q, cu_k, 4)
    return dict(block_scores=M, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, topk=3, block_size=4)


BAD = {
    "topk=0": (dict(topk=0), ValueError, "topk"),
    "topk=65": (dict(topk=65), ValueError, "topk"),
    "topk-float": (dict(topk=2.0), TypeError, "topk"),
    "block_size=0": (dict(block_size=0), ValueError, "block_size"),
    "scores-rank-2": (dict(block_scores=np.zeros((6, 3), np.float32)), ValueError, "block_scores"),
    "scores-int": (dict(block_scores=np.zeros((2, 6, 3), np.int32)), TypeError, "block_scores"),
    "NB-too-small": (dict(block_scores=np.zeros((2, 6, 2), np.float32)), ValueError, "NB"),
    "NB-too-large": (dict(block_scores=np.zeros((2, 6, 4), np.float32)), ValueError, "NB"),
    "Tq-mismatch": (dict(block_scores=np.zeros((2, 5, 3), np.float32)), ValueError, "cu_seqlens_q"),
    "cu-not-starting-at-0": (dict(cu_seqlens_q=np.array([1, 4, 6], np.int32)), ValueError,
                             "cu_seqlens_q"),
    "Lq>Lk": (dict(cu_seqlens_k=_cu([3, 13])), ValueError, "more queries than keys"),
    "cu-float": (dict(cu_seqlens_k=_cu([10, 6]).astype(np.float32)), TypeError, "cu_seqlens_k"),
}


@pytest.mark.parametrize("change,error,match", BAD.values(), ids=BAD.keys())
def test_select_blocks_rejects_bad_input(change, error, match):
    kwargs = {**_good(), **change}
    with pytest.raises(error, match=match):
        cuda_select.select_blocks(**kwargs)


@pytest.mark.parametrize("version", [0, 4, "warp3", True, 3.0])
def test_select_blocks_rejects_unknown_version(version):
    with pytest.raises(ValueError, match="version"):
        cuda_select.select_blocks(**_good(), version=version)


def test_select_blocks_reads_offsets_of_any_library():
    # cu_seqlens are read on the host once: host offsets beside GPU scores, and the reverse.
    kw = _good()
    want = ref_select.select_blocks(**kw)
    if SIMULATOR:
        got = cuda_select.select_blocks(**kw)
    else:
        from numba import cuda

        got = cuda_select.select_blocks(cuda.to_device(kw["block_scores"]), kw["cu_seqlens_q"],
                                        cuda.to_device(kw["cu_seqlens_k"]), 4, 3)
    assert_exact(to_numpy(got), want, name="select_blocks[host offsets]")


# -- fused index + top-k ------------------------------------------------------------------------

def _assert_near_tie_equivalent(got, M64, M32, cu_q, cu_k, topk, block_size, *, factor=4.0):
    """A selection from kernel-computed scores, judged on the float64 scores ``M64``.

    Rows are checked exactly for structure (ascending, local block last, ``min(K, L + 1)``
    blocks, -1 tail) and on content up to near ties: every selected non-local block scores at
    least the reference's (K-1)-th best minus ``tol``, where ``tol`` is ``factor`` times the
    float32 reference's error against float64 plus a few ulps, per row (4: tensor cores truncate
    where float32 sums round, see tests/cuda/test_index.py).
    """
    want = ref_select.select_blocks(M64, cu_q, cu_k, block_size, topk)
    got = to_numpy(got)
    assert got.shape == want.shape and got.dtype == np.int32
    assert_exact(got == -1, want == -1, name="padding")  # same counts, -1 only at the tail
    assert_exact(got.max(axis=-1), want.max(axis=-1), name="local block")  # the largest id
    real = got[..., 1:] >= 0
    assert np.all(np.diff(got, axis=-1)[real] > 0), "rows must be ascending"
    with np.errstate(invalid="ignore"):  # -inf - -inf where nothing is visible
        err = np.where(np.isfinite(M64), np.abs(M32.astype(np.float64) - M64), 0.0)  # [Hkv, Tq, NB]
    eps = np.finfo(np.float32).eps
    tq, hkv, _ = got.shape
    for t in range(tq):
        for r in range(hkv):
            g = [b for b in got[t, r] if b >= 0][:-1]  # without the local block
            w = [b for b in want[t, r] if b >= 0][:-1]
            if not w:
                continue
            kth = min(M64[r, t, b] for b in w)
            tol = factor * err[r, t].max() + 4 * eps * np.abs(M64[r, t][np.isfinite(M64[r, t])]).max()
            worst = min(M64[r, t, b] for b in g)
            assert worst >= kth - tol, (
                f"row (t={t}, r={r}): selected {got[t, r].tolist()} holds a block scoring "
                f"{worst:.6g} < the K-1-th best {kth:.6g} - tol {tol:.3g} (reference "
                f"{want[t, r].tolist()})")


def _index_problem(lq, lk, hkv, d_idx, block_size, seed):
    p = make_problem(seq_lens_k=lk, seq_lens_q=lq, num_q_heads=hkv, num_kv_heads=hkv,
                     index_dim=d_idx, block_size=block_size, dtype=np.float64, seed=seed)
    return p.q_idx, p.k_idx, p.cu_seqlens_q, p.cu_seqlens_k


FUSED = {
    "fp32-v1-varlen": ([3, 9], [40, 9], 2, 8, 8, 3, np.float32),
    "fp16-v2-Lq<Lk-Bk=8": ([4], [70], 2, 16, 8, 4, np.float16),
    "fp16-v3-NB<K": ([12], [20], 1, 16, 16, 4, np.float16),
    "fp16-v3-varlen-Didx=32": ([2, 2], [33, 5], 2, 32, 16, 3, np.float16),
}


def _fused_versions(dtype, d_idx, block_size):
    tc = np.dtype(dtype) == np.float16 and d_idx % 16 == 0 and block_size % 8 == 0
    v3 = tc and block_size % 16 == 0
    # version 1 (chunks) with the default budget (one chunk) and with many chunks; the
    # tensor-core cases only with many, as the float32 case covers the single chunk
    chunked = [(1, 1)] if tc else [(1, None), (1, 1)]
    return chunked + ([(2, None)] if tc else []) + ([(3, None)] if v3 else [])


@pytest.mark.parametrize("lq,lk,hkv,d_idx,block_size,topk,dtype", FUSED.values(), ids=FUSED.keys())
def test_select_blocks_fused_matches_reference_up_to_near_ties(lq, lk, hkv, d_idx, block_size,
                                                               topk, dtype):
    q64, k64, cu_q, cu_k = _index_problem(lq, lk, hkv, d_idx, block_size, seed=7)
    q, k = q64.astype(dtype), k64.astype(dtype)
    M64 = ref_index.block_scores(q.astype(np.float64), k.astype(np.float64), cu_q, cu_k, block_size)
    M32 = ref_index.block_scores(q, k, cu_q, cu_k, block_size)
    for version, budget in _fused_versions(dtype, d_idx, block_size):
        got = cuda_select.select_blocks_fused(q, k, cu_q, cu_k, block_size, topk, version=version,
                                              memory_budget=budget)
        _assert_near_tie_equivalent(got, M64, M32, cu_q, cu_k, topk, block_size)


@pytest.mark.parametrize("topk,lq,lk", [(1, [2], [20]), (17, [3, 0, 4], [40, 5, 12])],
                         ids=["K=1", "K=17-varlen"])
def test_select_blocks_fused_versions_equal_the_two_stages(topk, lq, lk):
    # Same block scores (same kernels, same order of arithmetic), hence the same selection.
    q64, k64, cu_q, cu_k = _index_problem(lq, lk, 2, 16, 16, seed=3)
    q, k = q64.astype(np.float16), k64.astype(np.float16)
    M = cuda_index.block_scores(q, k, cu_q, cu_k, 16)
    want = to_numpy(cuda_select.select_blocks(M, cu_q, cu_k, 16, topk))
    for version, budget in ((1, 1), (2, None), (3, None)):
        got = cuda_select.select_blocks_fused(q, k, cu_q, cu_k, 16, topk, version=version,
                                              memory_budget=budget)
        assert_exact(to_numpy(got), want, name=f"fused[{version}]")


def test_select_blocks_fused_rejects_bad_input():
    q64, k64, cu_q, cu_k = _index_problem([4], [8], 1, 16, 4, seed=0)
    q, k = q64.astype(np.float32), k64.astype(np.float32)
    with pytest.raises(ValueError, match="topk"):
        cuda_select.select_blocks_fused(q, k, cu_q, cu_k, 4, 65)
    with pytest.raises(ValueError, match="memory_budget"):
        cuda_select.select_blocks_fused(q, k, cu_q, cu_k, 4, 2, memory_budget=0)
    with pytest.raises(TypeError, match="k_idx"):
        cuda_select.select_blocks_fused(q, k.astype(np.float64), cu_q, cu_k, 4, 2)
    with pytest.raises(ValueError, match="version 2 cannot run.*float32"):
        cuda_select.select_blocks_fused(q, k, cu_q, cu_k, 4, 2, version=2)
    with pytest.raises(ValueError, match="version 3 cannot run.*% 16"):
        cuda_select.select_blocks_fused(q.astype(np.float16), k.astype(np.float16), cu_q, cu_k,
                                        8, 2, version=3)  # Bk % 16 != 0
    for version in ("heap3", 4, 0, True, 3.0):
        with pytest.raises(ValueError, match="version"):
            cuda_select.select_blocks_fused(q, k, cu_q, cu_k, 4, 2, version=version)


# -- production sizes (real GPU only) -----------------------------------------------------------

@pytest.mark.big
@pytest.mark.parametrize("topk", [16, 64])
def test_select_blocks_nb_16384(topk):
    rng = np.random.default_rng(11)
    cu_q, cu_k = _cu([64]), _cu([16384 * 8])  # the last 64 queries see all 16384 blocks of 8
    M = rng.integers(0, 50, (2, 64, 16384)).astype(np.float32)  # plenty of ties
    for version in VERSIONS:
        _check(M, cu_q, cu_k, topk, 8, version)


@pytest.mark.big
@pytest.mark.parametrize("nb", [1024, 8192])
def test_select_blocks_benchmark_rows(nb):
    # The benchmark's rows (random normal float32, every block visible, K = 16) on 512 rows,
    # plus the same rows rounded to 1/4 (ties at the cutoff): v3 exactly.
    rng = np.random.default_rng(nb)
    cu_q, cu_k = _cu([256]), _cu([nb * 256])  # Bk = 256: the 256 queries are all in block NB-1
    M = rng.standard_normal((2, 256, nb)).astype(np.float32)
    for scores in (M, np.round(4 * M) / 4):
        _check(scores, cu_q, cu_k, 16, 256, 3)


@pytest.mark.big
def test_select_blocks_fused_production_sizes_bf16():
    torch = pytest.importorskip("torch")
    q64, k64, cu_q, cu_k = _index_problem([2048], [8192], 4, 128, 128, seed=5)
    q = torch.tensor(q64, dtype=torch.bfloat16, device="cuda")
    k = torch.tensor(k64, dtype=torch.bfloat16, device="cuda")
    cq, ck = (torch.tensor(c, device="cuda") for c in (cu_q, cu_k))
    qf, kf = q.float().cpu().numpy(), k.float().cpu().numpy()
    M64 = ref_index.block_scores(qf.astype(np.float64), kf.astype(np.float64), cu_q, cu_k, 128)
    M32 = ref_index.block_scores(qf, kf, cu_q, cu_k, 128)
    results = {}
    for version, budget in ((1, 1 << 20), (2, None), (3, None)):
        got = cuda_select.select_blocks_fused(q, k, cq, ck, 128, 16, version=version,
                                              memory_budget=budget)
        _assert_near_tie_equivalent(got, M64, M32, cu_q, cu_k, 16, 128)
        results[version] = got.cpu().numpy()
    assert_exact(results[2], results[1], name="fused 2 vs 1")
    assert_exact(results[3], results[1], name="fused 3 vs 1")


@pytest.mark.big
def test_select_blocks_rows_of_every_length():
    # 300 queries of one sequence of 300 keys with Bk = 1: rows of 1..300 candidates.
    rng = np.random.default_rng(2)
    cu = _cu([300])
    M = rng.standard_normal((3, 300, 300)).astype(np.float32)
    for topk in (1, 2, 31, 32, 33, 64):
        for version in (2, 3):
            _check(M, cu, cu, topk, 1, version)
