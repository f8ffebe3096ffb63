"""Paper §3.2, eq 9-11 on the GPU: ``msa.cuda.kl`` against ``msa.reference.kl``.

Every comparison is the float rule of ``msa.testing.tolerance``: the kernel's error against the
reference run in float64 on the very inputs the kernel got (rounded to its dtype, float32 ``lse``
included) is at most twice the error of the reference run in float32 on them. The reference's
gradient is checked against finite differences in ``tests/reference/test_kl.py``; equal to it
within that rule, the kernels' gradient is the gradient of their loss.

bf16 has no NumPy dtype: under the simulator bf16 inputs are passed as their uint16 bit patterns
through the private ``_kl_loss(..., bf16_bits=True)``; on a GPU the public functions take torch
bf16 tensors (the ``big`` tests). Outputs a launcher allocates without a fill value start as NaN
(``poisoned_buffers``), so an element no kernel writes cannot pass.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from numba import cuda

import msa.cuda.kl as gpu
import msa.reference.kl as ref
from msa.cuda._core.arrays import SIMULATOR
from msa.cuda._core.memops import is_aligned16
from msa.problems import make_problem
from msa.reference.attention import dense_attention, sparse_attention
from msa.reference.blocks import key_positions, local_blocks, max_blocks, query_positions
from msa.reference.index import block_scores
from msa.reference.select import select_blocks
from msa.testing.backends import to_numpy
from msa.testing.strategies import (block_indices_for, fewer_in_simulator, problem_shapes,
                                    problems_with_indices)
from msa.testing.tolerance import assert_close_to_oracle, oracle_and_baseline

VERSIONS = gpu.VERSIONS  # 1 thread rows, 2 CTA rows, 3 tensor cores (the default it applies)


# --- inputs -----------------------------------------------------------------------------------

def bf16_round(x):
    """float32 values rounded to the nearest bf16 (ties to even) and their uint16 bit patterns."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32), bits


def rounded(p, dtype):
    """``(values, kernel_inputs)`` of ``(q, k, q_idx, k_idx)``: the inputs rounded to ``dtype``
    as arrays the reference takes (float32 for bf16), and what the kernel gets (bf16 as bits)."""
    xs = (p.q, p.k, p.q_idx, p.k_idx)
    if dtype == "bf16":
        pairs = [bf16_round(x) for x in xs]
        return tuple(v for v, _ in pairs), tuple(b for _, b in pairs)
    vals = tuple(np.ascontiguousarray(x.astype(dtype)) for x in xs)
    return vals, vals


def selection(p, mode, seed=0):
    """Block indices: ``select`` (the reference selector), ``random`` (random valid rows with
    -1 padding and blocks in random slot order), ``future`` (also blocks after the local one,
    which hold only future keys), ``empty`` (random, then some rows emptied or given only a
    future block), or None for ``warmup``."""
    if mode == "warmup":
        return None
    tq, tk, hkv, bk = p.q.shape[0], p.k.shape[0], p.num_kv_heads, p.block_size
    if mode == "select":
        m = block_scores(p.q_idx, p.k_idx, p.cu_seqlens_q, p.cu_seqlens_k, bk)
        return select_blocks(m, p.cu_seqlens_q, p.cu_seqlens_k, bk, p.topk)
    rng = np.random.default_rng(seed)
    batch, pos = query_positions(p.cu_seqlens_q, p.cu_seqlens_k, tq, tk)
    lk = np.diff(p.cu_seqlens_k.astype(np.int64))
    I = np.full((tq, hkv, p.topk), -1, dtype=np.int32)
    for t in range(tq):
        local = int(pos[t]) // bk
        nblocks = -(-int(lk[batch[t]]) // bk)
        for r in range(hkv):
            pool = np.arange(nblocks if mode in ("future", "empty") else local + 1)
            pool = pool[pool != local]
            n = int(rng.integers(0, min(p.topk - 1, pool.size) + 1))
            row = rng.permutation(np.append(rng.choice(pool, size=n, replace=False), local))
            if mode == "empty" and rng.random() < 0.4:
                future = pool[pool > local]
                row = future[:1] if future.size and rng.random() < 0.5 else row[:0]
            I[t, r, :row.size] = row
    return I


def main_lse(vals, I, p):
    """The main branch's LSE on the support (float32, ``-inf`` where it is empty), from the
    attention reference in float64: what ``sparse_attention`` hands the KL on a GPU."""
    q, k = (x.astype(np.float64) for x in vals[:2])
    v = np.zeros_like(k)
    if I is None:
        _, lse = dense_attention(q, k, v, p.cu_seqlens_q, p.cu_seqlens_k)
    else:
        _, lse = sparse_attention(q, k, v, I, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    return np.ascontiguousarray(lse.astype(np.float32))


def run_kernels(version, kernel_inputs, I, lse, p, dtype, **kw):
    """``(kl, loss, dq_idx, dk_idx)`` of the CUDA launchers as NumPy arrays."""
    a = (*kernel_inputs, I, lse, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    bits = dtype == "bf16"
    grad_kw = {k: v for k, v in kw.items() if k in ("grad_loss", "max_ds_bytes")}
    loss_kw = {k: v for k, v in kw.items() if k not in ("grad_loss", "max_ds_bytes")}
    kl, loss = gpu._kl_loss(*a, version=version, bf16_bits=bits, **loss_kw)
    dq, dk = gpu._kl_backward(*a, version=version, bf16_bits=bits, **loss_kw, **grad_kw)
    return to_numpy(kl), np.float32(to_numpy(loss)), to_numpy(dq), to_numpy(dk)


def floor_ulps_for(oracle, scale, ulps=8.0):
    """``floor_ulps`` for ``assert_close_to_oracle`` making its floor ``ulps`` ulps of
    ``max(scale, max|oracle|)``, the magnitude of the terms the result sums."""
    top = float(np.abs(oracle).max(initial=0.0))
    return ulps * max(scale, top) / top if top > 0 else ulps


def gradient_scales(vals, I, lse, p, grad_loss=1.0, scale=None, index_scale=None):
    """``(dq_scale, dk_scale)``: what the gradients sum, ``coef s_idx sum |dS| |x|`` bounded by
    the probability mass ``P + P_idx`` (an element's rounding floor is ulps of that: with one
    key per support ``P = P_idx = 1`` and ``dS`` is a difference of two roundings of 1)."""
    q, k, q_idx, k_idx = (x.astype(np.float64) for x in vals)
    tail = (p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    P = ref.teacher_probs(q, k, I, lse, *tail, scale=scale)  # [Hkv, Tq, Tk]
    Pi = ref.student_probs(q_idx, k_idx, I, *tail, index_scale=index_scale)
    mass = P + Pi
    s_idx = index_scale if index_scale is not None else 1 / np.sqrt(q_idx.shape[2])
    coef = abs(grad_loss) / max(1, q.shape[0] * q_idx.shape[1]) * s_idx
    k_max = np.abs(k_idx).max(axis=1, initial=0.0)  # [Tk]
    q_max = np.abs(q_idx).max(axis=2, initial=0.0).T  # [Hkv, Tq]
    dq_scale = coef * float((mass * k_max).sum(axis=2).max(initial=0.0))
    dk_scale = coef * float((mass * q_max[:, :, None]).sum(axis=(0, 1)).max(initial=0.0))
    return dq_scale, dk_scale


def check(p, I, version, dtype="float32", lse_mode="given", **kw):
    """Kernel ``kl``, ``loss``, ``dq_idx``, ``dk_idx`` within the float rule of the reference."""
    vals, kernel_inputs = rounded(p, dtype)
    lse = main_lse(vals, I, p) if lse_mode == "given" else None
    got = run_kernels(version, kernel_inputs, I, lse, p, dtype, **kw)
    ref_kw = {k: v for k, v in kw.items() if k in ("scale", "index_scale")}
    tail = (I, lse, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    (kl64, loss64), (kl32, loss32) = oracle_and_baseline(ref.kl_loss, *vals, *tail, **ref_kw)
    grad_kw = {k: v for k, v in kw.items() if k in ("scale", "index_scale", "grad_loss")}
    (dq64, dk64), (dq32, dk32) = oracle_and_baseline(ref.kl_backward, *vals, *tail, **grad_kw)
    name = f"v{version} {dtype} lse={lse_mode}"
    assert got[0].dtype == got[2].dtype == got[3].dtype == np.float32
    # Floors for results near 0 (e.g. every support one key, P = P_idx = 1): a KL sums
    # probabilities (O(1)) times log ratios, so its rounding floor is ulps of 1, not of the KL;
    # a gradient's is ulps of the probability mass it sums (gradient_scales).
    floor = floor_ulps_for(kl64, 1.0)
    assert_close_to_oracle(got[0], kl64, kl32, name=f"kl [{name}]", floor_ulps=floor)
    assert_close_to_oracle(np.array(got[1]), np.array(loss64), np.array(loss32),
                           name=f"loss [{name}]", floor_ulps=floor)
    dq_scale, dk_scale = gradient_scales(vals, I, lse, p, **grad_kw)
    assert_close_to_oracle(got[2], dq64, dq32, name=f"dq_idx [{name}]",
                           floor_ulps=floor_ulps_for(dq64, dq_scale))
    assert_close_to_oracle(got[3], dk64, dk32, name=f"dk_idx [{name}]",
                           floor_ulps=floor_ulps_for(dk64, dk_scale))
    return got


# --- hostile sizes ----------------------------------------------------------------------------

# id: (seq_lens_q, seq_lens_k, Hq, Hkv, D, Didx, Bk, K, selection mode)
CASES = {
    "T=1": ([1], [1], 2, 1, 8, 8, 16, 1, "select"),
    "T-not-multiple-of-Bk": ([37], [37], 4, 2, 8, 16, 16, 2, "select"),
    "NB<K": ([20], [20], 2, 1, 16, 8, 16, 4, "select"),
    "G=1": ([23], [23], 2, 2, 8, 8, 16, 2, "random"),
    "G=8": ([18], [18], 8, 1, 8, 8, 16, 2, "select"),
    "varlen-empty-seqs": ([0, 9, 0, 14], [0, 9, 3, 14], 2, 1, 8, 8, 4, 3, "random"),
    "Lq<Lk-decode": ([1, 3], [50, 40], 4, 2, 8, 8, 16, 2, "select"),
    "future-blocks": ([21], [33], 2, 1, 8, 8, 8, 3, "future"),
    "empty-supports": ([13, 6], [20, 6], 2, 2, 8, 8, 4, 2, "empty"),
    "warmup": ([19, 5], [19, 12], 4, 2, 8, 8, 8, 2, "warmup"),
}


def case_problem(lq, lk, hq, hkv, d, d_idx, bk, topk, seed=0):
    return make_problem(lk, lq, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, index_dim=d_idx,
                        block_size=bk, topk=topk, seed=seed)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference(case, version):
    *shape, mode = case
    p = case_problem(*shape)
    check(p, selection(p, mode), version)


# v3 (tensor cores) takes fp16/bf16 with D, Didx, Bk multiples of 16 and a selection. Its mma
# twin pays two barriers per call in the simulator, so these stay tiny.
V3_CASES = {
    "T=1": ([1], [1], 2, 1, 1, "select", "float16"),
    "T-not-multiple-of-Bk": ([37], [37], 4, 2, 2, "select", "bf16"),
    "varlen-empty-seqs": ([0, 9, 0, 20], [0, 9, 3, 20], 2, 1, 3, "random", "float16"),
    "Lq<Lk-decode": ([1, 3], [50, 40], 4, 2, 2, "select", "bf16"),
    "G=16": ([9], [20], 16, 1, 2, "random", "float16"),
    "G=1": ([20], [20], 2, 2, 2, "random", "bf16"),
    "future-and-empty-supports": ([13, 6], [40, 6], 2, 1, 2, "empty", "float16"),
}


@pytest.mark.parametrize("case", V3_CASES.keys())
def test_v3_matches_reference(case):
    lq, lk, hq, hkv, topk, mode, dtype = V3_CASES[case]
    p = case_problem(lq, lk, hq, hkv, 16, 16, 16, topk, seed=1)
    check(p, selection(p, mode), 3, dtype)


@pytest.mark.parametrize("hq", [16, pytest.param(8, marks=pytest.mark.sim_heavy)])
def test_v3_head_sum_on_blocks_of_eight_n_tiles(hq):
    """Bk = 64 (8 n-tiles, as many as the lanes sharing a position's row half): v3's head sum
    is the production one, a reduce-scatter over all of g4's bits (Bk = 16 mixes in the
    all-reduce); G = 8 keeps two positions per lane (the teacher through sT)."""
    p = case_problem([3], [128], hq, 1, 16, 16, 64, 2, seed=21)  # 3 queries x 2 blocks: slow sim
    check(p, selection(p, "random"), 3, "bf16")


@pytest.mark.parametrize("hq,bk,dtype", [
    (16, 16, "bf16"), pytest.param(4, 32, "float16", marks=pytest.mark.sim_heavy)])
def test_v3_teacher_on_wgmma_equals_mma(monkeypatch, hq, bk, dtype):
    """The teacher's ``S = Q Kᵀ`` on ``wgmma`` (``v3.TEACHER_WGMMA``, tiles of whole
    warpgroups: 64 rows, K in shared memory as core matrices) gives the ``mma.sync`` path's
    kl, loss, dq_idx and dk_idx bitwise (the same fragments, the same fp32 sums), and both
    match the reference. On a GPU this needs compute capability 9.0."""
    from msa.cuda._core import wgmma
    from msa.cuda.kl import v3_tensor_cores as v3

    if wgmma.why_not_available():
        pytest.skip(wgmma.why_not_available())
    monkeypatch.setattr(v3, "TILE_ROWS", 64)
    built = []
    kernel_grad = v3.kl_kernel_grad

    def spy(*args):
        built.append(args[-1])  # teacher_wgmma
        return kernel_grad(*args)

    monkeypatch.setattr(v3, "kl_kernel_grad", spy)
    p = case_problem([5, 4], [40, 20], hq, 1, 16, 16, bk, 2, seed=5)
    I = selection(p, "random")
    results = []
    for on in (False, True):
        monkeypatch.setattr(v3, "TEACHER_WGMMA", on)
        built.clear()
        results.append(check(p, I, 3, dtype))
        assert built and set(built) == {on}
    for a, b in zip(*results):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_v3_hot_block_split_over_work_items():
    """Block 0 chosen by every query: its CSR row is longer than a work item (2 K Bk = 64
    queries), so the schedule cuts it and several CTAs write the row's partials."""
    p = case_problem([90], [90], 2, 1, 16, 16, 16, 2, seed=3)
    local = local_blocks(p.cu_seqlens_q, p.cu_seqlens_k, 90, 90, 16)
    I = np.stack([np.zeros(90, np.int64), np.where(local > 0, local, -1)], axis=1)
    check(p, I[:, None, :].astype(np.int32), 3, "float16")


def test_v3_dk_idx_rows_cut_into_parts(monkeypatch):
    """dk_idx on tensor cores (bf16, ``v3_dk_idx``) of CSR rows longer than
    ``KEYS_PART_ENTRIES``: block 0 chosen by every query of both groups (120 entries), cut into
    parts of one step (32 entries; the second spans the two groups) whose scratch slots
    ``keys_sum_kernel`` adds in part order."""
    from msa.cuda.kl import v3_dk_idx as v3dk

    monkeypatch.setattr(v3dk, "KEYS_PART_ENTRIES", 32)
    p = case_problem([60], [60], 2, 2, 16, 16, 16, 2, seed=3)
    local = local_blocks(p.cu_seqlens_q, p.cu_seqlens_k, 60, 60, 16)
    I = np.stack([np.zeros(60, np.int64), np.where(local > 0, local, -1)], axis=1)
    check(p, np.repeat(I[:, None, :], 2, axis=1).astype(np.int32), 3, "bf16")


def test_v3_unaligned_inputs_take_plain_loads():
    """Inputs whose rows are not 16-byte aligned (views 4 bytes into their buffers) cannot be
    copied by ``cp.async``: v3 falls back to plain loads, with bitwise the same results."""
    p = case_problem([9], [20], 4, 2, 16, 16, 16, 2, seed=12)
    I = selection(p, "random")
    vals, kin = rounded(p, "float16")
    lse = main_lse(vals, I, p)

    def words(x):  # the kernels' uint32 view, on the device
        return (x if SIMULATOR or hasattr(x, "copy_to_host") else cuda.to_device(x)).view(
            np.uint32)

    def shifted(x):  # a view 4 bytes into its buffer, on the GPU where the kernels read it
        if not SIMULATOR:
            out = cuda.device_array(x.size + 2, x.dtype)[2:].reshape(x.shape)
            out.copy_to_device(np.ascontiguousarray(x))
            return out
        buf = np.empty(x.size + 2, x.dtype)
        out = buf[2:].reshape(x.shape)
        out[...] = x
        return out

    shifted_kin = tuple(shifted(x) for x in kin)
    # the launchers' test (the chunk slices of aligned rows stay aligned: D, Didx % 16 == 0)
    assert all(is_aligned16(words(x)) for x in kin)
    assert not any(is_aligned16(words(x)) for x in shifted_kin)
    aligned = check(p, I, 3, "float16")  # against the oracle, then the plain loads bitwise
    moved = (lambda x: x) if SIMULATOR else cuda.to_device  # all inputs where the views are
    plain = run_kernels(3, shifted_kin, moved(I), moved(lse), p, "float16")
    for a, b in zip(aligned, plain):
        np.testing.assert_array_equal(a, b)


def test_v3_refuses_what_it_cannot_run():
    version = 3
    p = case_problem([5], [5], 2, 1, 8, 16, 16, 1)
    vals, kin = rounded(p, "float16")
    I = selection(p, "select")
    a = (*kin, I, None, p.cu_seqlens_q, p.cu_seqlens_k, 16)
    for fn in (gpu.kl_loss, gpu.kl_backward):
        with pytest.raises(ValueError, match=f"version={version}"):
            fn(*a, version=version)  # D = 8
        with pytest.raises(ValueError, match=f"version={version}"):
            fn(*vals[:2], *kin[2:], None, None, p.cu_seqlens_q, p.cu_seqlens_k, 16,
               version=version)
    f32 = rounded(case_problem([5], [5], 2, 1, 16, 16, 16, 1), "float32")[1]
    with pytest.raises(ValueError, match="float32"):
        gpu.kl_loss(*f32, I, None, p.cu_seqlens_q, p.cu_seqlens_k, 16, version=version)


# In the simulator each (mode, version) runs at one of the two 16-bit dtypes, alternating so that
# v1 and v2 see both (the others, the same kernel on the other dtype, run on a GPU; v3 on fp16:
# test_v3_matches_reference's float16 cases)
_HALF_IN_SIMULATOR = {("select", "float16", 1), ("warmup", "bf16", 1), ("select", "bf16", 2),
                      ("warmup", "float16", 2), ("select", "bf16", 3), ("warmup", "float16", 3)}


@pytest.mark.parametrize("mode,dtype,version", [
    pytest.param(m, d, v, id=f"{m}-{d}-{v}",
                 marks=() if (m, d, v) in _HALF_IN_SIMULATOR else pytest.mark.sim_heavy)
    for m in ("select", "warmup") for d in ("float16", "bf16") for v in VERSIONS])
def test_half_precision_inputs(mode, dtype, version):
    """fp16 and bf16 inputs (bf16 as bit patterns) accumulate in float32 like the reference
    (the last 11 of the first sequence's queries in the simulator, a Python thread per CUDA
    thread: still two blocks, a partial one and Lq < Lk)."""
    p = case_problem([11 if SIMULATOR else 21, 6], [21, 16], 4, 2, 16, 16, 16, 2, seed=3)
    check(p, selection(p, mode), version, dtype)


@pytest.mark.parametrize("dtype, d, mode, want", [
    ("float16", 16, "select", 3), ("bf16", 32, "select", 3), ("float16", 16, "warmup", 3),
    ("float32", 16, "warmup", 2), ("float32", 16, "select", 2), ("bf16", 8, "select", 2)],
    ids=["fp16", "bf16", "warmup", "warmup-fp32", "fp32", "D=8"])
def test_default_version_is_the_fastest_that_applies(dtype, d, mode, want):
    p = case_problem([9], [9], 4, 2, d, 16, 16, 2)
    vals, kin = rounded(p, dtype)
    plan = gpu._validated(*kin, selection(p, mode), None, p.cu_seqlens_q, p.cu_seqlens_k, 16,
                          None, None, None, True, dtype == "bf16")
    assert plan.version == want


def test_default_is_v2_where_the_tensor_core_tiles_do_not_fit():
    """Shapes v3 takes in principle (multiples of 16) whose tiles exceed shared memory (here
    its key block alone, K and K_idx of Bk = 256 keys of D = Didx = 208) run v2 by default;
    ``version=3`` names the limit."""
    version, tiles = gpu._version(None, "bfloat16", False, 256, 208, 208, 16)
    assert version == 2 and tiles is None
    with pytest.raises(ValueError, match="version=3 .*shared memory"):
        gpu._version(3, "bfloat16", False, 256, 208, 208, 16)
    assert gpu._version(None, "bfloat16", False, 128, 128, 128, 16)[0] == 3


@pytest.mark.parametrize("group, want", [(16, (8, 128)), (8, (8, 64)), (4, (16, 64)),
                                         (2, (32, 64)), (1, (32, 32))])
def test_v3_grad_tile_keeps_eight_positions(group, want):
    """The GPU's grad tile (64 rows and 8 positions at least: the student's scores and dq_idx
    pad positions to 16-row m-tiles) at the paper's sizes: 128 rows at G = 16, one CTA of 8
    warps in 164864 bytes (two Q buffers; the dS planes in two regions of 16 rows); 64 rows at
    G = 8, 4, 2; at G = 1 the 64 positions' buffers do not fit, so 32."""
    from msa.cuda._core.mma import DYNAMIC_SMEM_LIMIT
    from msa.cuda.kl._plan import tensor_core_tiles

    positions, rows, smem, _ = tensor_core_tiles(128, 128, 128, group, tile_rows=64,
                                                 min_positions=8)
    assert (positions, rows) == want and smem <= DYNAMIC_SMEM_LIMIT
    if group == 16:
        assert smem == 164864
        # Bk = 256: 8 positions would not fit, so 4 (64 rows)
        assert tensor_core_tiles(256, 128, 128, 16, tile_rows=64,
                                 min_positions=8)[:2] == (4, 64)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("mode", ["random", "warmup"])
def test_lse_computed_when_not_given(mode, version):
    """``lse=None``: the teacher is normalised by its own LSE over the support."""
    p = case_problem([17, 4], [17, 9], 4, 2, 8, 8, 4, 3, seed=5)
    check(p, selection(p, mode), version, lse_mode="none")


@pytest.mark.parametrize("version", [1, 2])
def test_scales_and_grad_loss(version):
    p = case_problem([15], [26], 4, 2, 8, 8, 8, 2, seed=7)
    check(p, selection(p, "random"), version, scale=0.9, index_scale=0.2, grad_loss=-3.5)


@pytest.mark.parametrize("version", [1, 2])
def test_empty_supports_give_exact_zeros(version):
    """A row with no block, or only a block after its own, has ``kl = 0`` and ``dq_idx = 0``
    exactly (its ``lse`` is ``-inf``); keys no query reads get ``dk_idx = 0``."""
    p = case_problem([10], [18], 2, 2, 8, 8, 4, 2, seed=2)
    tq, tk = p.q.shape[0], p.k.shape[0]
    I = np.full((tq, 2, 2), -1, dtype=np.int32)
    I[:, :, 0] = local_blocks(p.cu_seqlens_q, p.cu_seqlens_k, tq, tk, 4)[:, None]
    I[:4, 0, 0] = -1  # nothing selected
    I[4:6, 1, 0] = 4  # block 4 holds keys 16, 17: after rows 4, 5 (positions 12, 13)
    vals, kin = rounded(p, "float32")
    lse = main_lse(vals, I, p)
    assert np.isneginf(lse[:4, :1]).all() and np.isneginf(lse[4:6, 1:]).all()
    kl, _, dq, dk = run_kernels(version, kin, I, lse, p, "float32")
    assert (kl[:4, 0] == 0).all() and (kl[4:6, 1] == 0).all()
    assert (dq[:4, 0] == 0).all() and (dq[4:6, 1] == 0).all()
    assert (dk[:8] == 0).all()  # blocks 0, 1: before every query's local block, never selected
    assert np.abs(dk[8:]).min() > 0
    check(p, I, version)


def test_empty_batch():
    """Tq = 0: an empty kl, loss 0, zero gradients, no launch of a row kernel."""
    p = make_problem((5, 0), (0, 0), num_q_heads=2, num_kv_heads=1, head_dim=8, index_dim=8,
                     block_size=4, dtype=np.float32)
    I = np.zeros((0, 1, 2), dtype=np.int32)
    a = (p.q, p.k, p.q_idx, p.k_idx, I, None, p.cu_seqlens_q, p.cu_seqlens_k, 4)
    kl, loss = gpu.kl_loss(*a)
    assert to_numpy(kl).shape == (0, 1) and float(to_numpy(loss)) == 0.0
    dq, dk = gpu.kl_backward(*a)
    assert to_numpy(dq).shape == (0, 1, 8)
    assert to_numpy(dk).shape == (5, 8) and (to_numpy(dk) == 0).all()


# --- properties -------------------------------------------------------------------------------

@st.composite
def kl_cases(draw):
    """A small problem, a selection (random valid rows of any pattern, or the warmup) and a
    version."""
    kw = draw(problem_shapes(max_seqs=2, max_len=28, max_heads=4, max_topk=3,
                             block_sizes=(4, 8, 16), dims=(4, 8)))
    p = make_problem(**kw)
    if draw(st.booleans()) and p.q.shape[0]:
        I = draw(block_indices_for(p.cu_seqlens_q, p.cu_seqlens_k, p.num_kv_heads, p.topk,
                                   p.block_size))
    else:
        I = None
    return p, I


@fewer_in_simulator(4)  # each simulated example launches four kernels; the table covers the rest
@given(kl_cases(), st.sampled_from([1, 2]))
@example(problem=(case_problem([1], [1], 1, 1, 4, 4, 4, 1), None), version=1)
def test_matches_reference_fuzz(problem, version):
    p, I = problem
    check(p, I, version)


@fewer_in_simulator(2)  # the simulated mma costs seconds per example
@given(problems_with_indices(max_seqs=2, max_len=32, max_heads=8, max_topk=3, block_sizes=(16,),
                             dims=(16,)),
       st.sampled_from(["float16", "bf16"]))
def test_v3_matches_reference_fuzz(problem, dtype):
    p, I = problem
    check(p, I, 3, dtype)


def test_warmup_past_the_full_selection_budget_runs_v2():
    """v3 runs the warmup on its full causal support written as a selection ``[Tq, Hkv, NB]``
    int32; where that would pass ``MAX_DS_BYTES`` the default is v2 and ``version=3`` says
    why."""
    over = gpu.MAX_DS_BYTES + 4
    assert gpu._version(None, "float16", True, 128, 128, 128, 16,
                        full_selection_bytes=over)[0] == 2
    assert gpu._version(None, "float16", True, 128, 128, 128, 16,
                        full_selection_bytes=gpu.MAX_DS_BYTES)[0] == 3
    with pytest.raises(ValueError, match="version=3 .*warmup at this size"):
        gpu._version(3, "float16", True, 128, 128, 128, 16, full_selection_bytes=over)


def every_visible_block(p):
    """The warmup's support as a selection: int32 [Tq, Hkv, NB], every block up to each query's
    own ascending, -1 after."""
    tq, tk = p.q.shape[0], p.k.shape[0]
    nb = max_blocks(p.cu_seqlens_k, p.block_size)
    local = local_blocks(p.cu_seqlens_q, p.cu_seqlens_k, tq, tk, p.block_size)
    b = np.arange(nb)
    row = np.where(b[None, :] <= local[:, None], b[None, :], -1).astype(np.int32)  # [Tq, NB]
    return np.ascontiguousarray(np.broadcast_to(row[:, None, :], (tq, p.num_kv_heads, nb)))


def test_v3_warmup_is_the_selection_of_every_visible_block():
    """v3's warmup (``block_indices=None``) runs the selection path on every visible block:
    all four outputs bitwise equal to passing that selection, and within the float rule of the
    reference's warmup (bottom-right queries, a partial last block, a one-block sequence)."""
    p = case_problem([13, 5], [37, 9], 4, 2, 16, 16, 16, 2, seed=12)
    every = every_visible_block(p)
    nb = every.shape[2]
    vals, kin = rounded(p, "float16")
    lse = main_lse(vals, None, p)
    plan = gpu._validated(*kin, None, lse, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size,
                          None, None, None, True, False)
    assert plan.version == 3 and not plan.warmup and plan.topk == nb
    np.testing.assert_array_equal(to_numpy(plan.I), every)
    warm = gpu.kl_loss_and_backward(*kin, None, lse, p.cu_seqlens_q, p.cu_seqlens_k,
                                    p.block_size)
    sel = gpu.kl_loss_and_backward(*kin, every, lse, p.cu_seqlens_q, p.cu_seqlens_k,
                                   p.block_size)
    for a, b_ in zip(warm, sel):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b_))
    check(p, None, 3, "float16")


@pytest.mark.parametrize("version", [1, 2])
def test_warmup_equals_selecting_every_visible_block(version):
    """``block_indices=None`` is the same loss and gradient as selecting every visible block:
    ``kl`` and ``dq_idx`` bitwise (the same key loop), ``dk_idx`` to rounding (the warmup
    recomputes ``dS`` where a selection reads its buffer)."""
    p = case_problem([13, 5], [13, 9], 4, 2, 8, 8, 4, 2, seed=11)
    every = every_visible_block(p)
    vals, kin = rounded(p, "float32")
    lse = main_lse(vals, None, p)
    warm = check(p, None, version)  # each against the oracle, then against each other
    sel = check(p, every, version)
    np.testing.assert_array_equal(warm[0], sel[0])
    assert warm[1] == sel[1]
    np.testing.assert_array_equal(warm[2], sel[2])
    (_, dk64), (_, dk32) = oracle_and_baseline(ref.kl_backward, *vals, None, lse,
                                               p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    assert_close_to_oracle(sel[3], dk64, dk32, name="dk_idx, every block selected")
    assert_close_to_oracle(warm[3], dk64, dk32, name="dk_idx, warmup")


@pytest.mark.parametrize("version", VERSIONS)
def test_reruns_are_bitwise_identical(version):
    if version >= 3:
        p, dtype, modes = case_problem([11, 4], [17, 9], 4, 2, 16, 16, 16, 2, seed=4), "float16", \
            ("random",)
    else:
        p, dtype, modes = case_problem([11, 4], [11, 9], 4, 2, 8, 8, 4, 3, seed=4), "float32", \
            ("random", "warmup")
    for mode in modes:
        I = selection(p, mode)
        vals, kin = rounded(p, dtype)
        lse = main_lse(vals, I, p)
        first = check(p, I, version, dtype)  # against the oracle, then a rerun bitwise
        again = run_kernels(version, kin, I, lse, p, dtype)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("mode", ["random", "warmup"])
def test_loss_and_backward_in_one_call(mode, version):
    """``kl_loss_and_backward`` = ``kl_loss`` then ``kl_backward``: the gradients and the loss
    bitwise (v1/v2 run the same kernels; v3's forward is its backward's passes without the
    gradients), and those of the separate calls within the float rule of the reference."""
    if version >= 3:
        p, dtype = case_problem([11, 4], [27, 9], 4, 2, 16, 16, 16, 2, seed=9), "float16"
    else:
        p, dtype = case_problem([11, 4], [11, 9], 4, 2, 8, 8, 4, 3, seed=9), "float32"
    I = selection(p, mode)
    vals, kin = rounded(p, dtype)
    lse = main_lse(vals, I, p)
    tail = (I, lse, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    kl, loss, dq, dk = (to_numpy(x) for x in gpu.kl_loss_and_backward(
        *kin, *tail, grad_loss=0.5, version=version))
    # the separate calls, their kl, loss and gradients checked against the oracle
    kl1, loss1, dq1, dk1 = check(p, I, version, dtype, grad_loss=0.5)
    np.testing.assert_array_equal(dq, dq1)
    np.testing.assert_array_equal(dk, dk1)
    np.testing.assert_array_equal(kl, kl1)
    assert np.float32(loss) == loss1
    (kl64, loss64), (kl32, loss32) = oracle_and_baseline(ref.kl_loss, *vals, *tail)
    floor = floor_ulps_for(kl64, 1.0)
    assert_close_to_oracle(kl, kl64, kl32, name="kl, one call", floor_ulps=floor)
    assert_close_to_oracle(np.array(loss), np.array(loss64), np.array(loss32),
                           name="loss, one call", floor_ulps=floor)


def test_loss_and_backward_refuses_bad_input():
    with pytest.raises(ValueError, match="block_indices"):
        gpu.kl_loss_and_backward(**bad(block_indices=I_OUT))
    with pytest.raises(TypeError, match="grad_loss"):
        gpu.kl_loss_and_backward(**bad(), grad_loss="1")


@pytest.mark.parametrize("mode", ["random", "future"])
@pytest.mark.parametrize("version", VERSIONS)
def test_query_chunks_of_the_ds_buffer(version, mode):
    """Buffers for 5 queries at a time (many chunks, each with its own CSR, chunks cutting
    sequences) give the same result within the float rule; ``kl`` and ``dq_idx`` do not depend
    on the chunking at all (only ``dk_idx`` adds the chunks' contributions in turn). ``future``
    also selects blocks past a chunk's cut of its last sequence: no CSR entry there, so the
    slot sums must not read those slots (v3 did, with the whole batch's offsets)."""
    if version >= 3:  # dS, dq_idx partials and states: (Bk + Didx + 5) floats per slot
        p, dtype = case_problem([9, 1, 6], [20, 7, 6], 4, 2, 16, 16, 16, 2, seed=6), "float16"
        per_query = 2 * 2 * (16 + 16 + 5) * 4
    else:
        p, dtype = case_problem([9, 1, 6], [14, 7, 6], 4, 2, 8, 8, 4, 3, seed=6), "float32"
        per_query = 2 * 3 * 4 * 4
    I = selection(p, mode)
    chunked = check(p, I, version, dtype, max_ds_bytes=5 * per_query)
    vals, kin = rounded(p, dtype)
    whole = run_kernels(version, kin, I, main_lse(vals, I, p), p, dtype)
    np.testing.assert_array_equal(chunked[0], whole[0])
    np.testing.assert_array_equal(chunked[2], whole[2])


@pytest.mark.parametrize("version", [pytest.param(2, marks=pytest.mark.sim_heavy) if v == 2 else v
                                     for v in VERSIONS])
def test_gradient_through_the_kernels_end_to_end(version):
    """The training path (float32; float16 for v3): ``lse`` from
    ``msa.cuda.attention.sparse_attention`` (the kernel, not the reference), selection from
    ``msa.cuda.select``, then the KL backward; the gradient equals the reference's
    finite-difference-checked gradient computed in float64 with the exact teacher normaliser
    (``lse=None``), within twice the float32 reference's error."""
    from msa.cuda.attention import sparse_attention as gpu_attention
    from msa.cuda.index import block_scores as gpu_block_scores
    from msa.cuda.select import select_blocks as gpu_select

    dtype = np.float16 if version >= 3 else np.float32  # v3 runs on tensor cores
    # fewer queries of the same sequences in the simulator (a Python thread per CUDA thread)
    lq = [12, 6] if SIMULATOR else [24, 11]
    p = make_problem([24, 16], lq, num_q_heads=4, num_kv_heads=2, head_dim=16,
                     index_dim=16, block_size=16, topk=2, dtype=dtype, seed=8)
    m = gpu_block_scores(p.q_idx, p.k_idx, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    I = to_numpy(gpu_select(m, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, p.topk))
    _, lse = gpu_attention(p.q, p.k, p.v, I, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    lse = np.ascontiguousarray(to_numpy(lse))
    a = (p.q, p.k, p.q_idx, p.k_idx, I)
    tail = (p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    dq, dk = gpu.kl_backward(*a, lse, *tail, grad_loss=0.5, version=version)
    (dq64, dk64), (dq32, dk32) = oracle_and_baseline(ref.kl_backward, *a, None, *tail,
                                                     grad_loss=0.5)
    assert_close_to_oracle(to_numpy(dq), dq64, dq32, name="dq_idx end to end")
    assert_close_to_oracle(to_numpy(dk), dk64, dk32, name="dk_idx end to end")
    kl, loss = gpu.kl_loss(*a, lse, *tail, version=version)
    (kl64, loss64), (kl32, loss32) = oracle_and_baseline(ref.kl_loss, *a, None, *tail)
    assert_close_to_oracle(to_numpy(kl), kl64, kl32, name="kl end to end")
    assert_close_to_oracle(np.array(to_numpy(loss)), np.array(loss64), np.array(loss32),
                           name="loss end to end", floor_ulps=floor_ulps_for(kl64, 1.0))
    assert (to_numpy(kl) >= -1e-6).all()  # Gibbs: KL >= 0 up to rounding


# --- bad inputs -------------------------------------------------------------------------------

P_BAD = make_problem((10, 7), num_q_heads=4, num_kv_heads=2, head_dim=8, index_dim=8,
                     block_size=4, topk=2, dtype=np.float32, seed=1)
I_BAD = select_blocks(block_scores(P_BAD.q_idx, P_BAD.k_idx, P_BAD.cu_seqlens_q,
                                   P_BAD.cu_seqlens_k, 4), P_BAD.cu_seqlens_q,
                      P_BAD.cu_seqlens_k, 4, 2)
LSE_BAD = main_lse((P_BAD.q, P_BAD.k), I_BAD, P_BAD)
I_OUT = I_BAD.copy()
I_OUT[3, 1, 0] = 7
I_DUP = I_BAD.copy()
I_DUP[9, 0, :] = [1, 1]
LSE_NEG_INF = LSE_BAD.copy()
LSE_NEG_INF[5, 3] = -np.inf


def bad(**change):
    a = dict(q=P_BAD.q, k=P_BAD.k, q_idx=P_BAD.q_idx, k_idx=P_BAD.k_idx, block_indices=I_BAD,
             lse=LSE_BAD, cu_seqlens_q=P_BAD.cu_seqlens_q, cu_seqlens_k=P_BAD.cu_seqlens_k,
             block_size=4)
    a.update(change)
    return a


@pytest.mark.parametrize("change, error, match", [
    (dict(q=P_BAD.q[0]), ValueError, "q must have 3"),
    (dict(q=P_BAD.q.astype(np.int64)), TypeError, "q must have dtype"),
    (dict(q=P_BAD.q.astype(np.float64)), TypeError,
     "q.dtype = 'float64' is not supported by msa.cuda.*msa.reference accepts it"),
    (dict(k=P_BAD.k[:, :, :4]), ValueError, "k must have shape"),
    (dict(k=P_BAD.k.astype(np.float16)), TypeError, "k must have the dtype of q"),
    (dict(k_idx=P_BAD.k_idx.astype(np.float16)), TypeError, "k_idx must have the dtype of q"),
    (dict(k=np.concatenate([P_BAD.k, P_BAD.k[:, :1]], axis=1)), ValueError, "kv heads"),
    (dict(q_idx=P_BAD.q_idx[:, :1]), ValueError, "q_idx must have shape"),
    (dict(q_idx=P_BAD.q_idx[:5]), ValueError, "q_idx must have shape"),
    (dict(k_idx=P_BAD.k_idx[:, :3]), ValueError, "k_idx must have shape"),
    (dict(k_idx=P_BAD.k_idx[:5]), ValueError, "k_idx must have shape"),
    (dict(lse=LSE_BAD[:, :2]), ValueError, "lse must have shape"),
    (dict(lse=LSE_BAD[:9]), ValueError, "lse must have shape"),
    (dict(lse=LSE_BAD.astype(np.float64)), TypeError, "lse.dtype = 'float64' is not supported"),
    (dict(lse=LSE_BAD.astype(np.float16)), TypeError, "which accepts float32"),
    (dict(lse=np.full_like(LSE_BAD, np.nan)), ValueError, r"lse\[0, 0\] = nan"),
    (dict(lse=LSE_NEG_INF), ValueError, r"lse\[5, 3\] = -inf .*non-empty"),
    (dict(block_indices=I_BAD[:, :1]), ValueError, "block_indices must have shape"),
    (dict(block_indices=I_BAD[:9]), ValueError, "block_indices must have shape"),
    (dict(block_indices=I_BAD[:, :, :0]), ValueError, "block_indices must have shape"),
    (dict(block_indices=I_BAD.astype(np.float32)), TypeError, "block_indices"),
    (dict(block_indices=I_OUT), ValueError, "block_indices"),
    (dict(block_indices=I_DUP), ValueError, "block_indices"),
    (dict(cu_seqlens_q=np.array([0, 10, 16], dtype=np.int32)), ValueError, "cu_seqlens_q"),
    (dict(cu_seqlens_k=np.array([0, 5, 17], dtype=np.int32)), ValueError, "more queries"),
    (dict(block_size=0), ValueError, "block_size"),
    (dict(scale=-1.0), ValueError, "scale"),
    (dict(index_scale=float("inf")), ValueError, "index_scale"),
    (dict(version=3), ValueError, "version=3"),
    (dict(version=4), ValueError, "version must be one of"),
    (dict(version=True), ValueError, "version must be one of"),
], ids=["q-rank", "q-int", "q-float64", "k-dim", "k-dtype", "k_idx-dtype", "G-not-int",
        "q_idx-heads", "q_idx-length", "k_idx-dim", "k_idx-length", "lse-heads", "lse-length",
        "lse-float64", "lse-float16", "lse-nan", "lse-inf-on-support", "I-heads", "I-length",
        "I-K=0", "I-float", "I-out-of-range", "I-duplicate", "cu_q-total", "Lq>Lk", "Bk=0",
        "scale<0", "index_scale-inf", "version=3-float32", "version=4-deleted",
        "version-bool"])
def test_bad_inputs(change, error, match):
    for fn in (gpu.kl_loss, gpu.kl_backward):
        with pytest.raises(error, match=match):
            fn(**bad(**change))


@pytest.mark.parametrize("change, error, match", [
    (dict(grad_loss=float("nan")), ValueError, "grad_loss"),
    (dict(grad_loss="1"), TypeError, "grad_loss"),
    (dict(grad_loss=True), TypeError, "grad_loss"),
    (dict(max_ds_bytes=0), ValueError, "max_ds_bytes"),
], ids=["grad_loss-nan", "grad_loss-str", "grad_loss-bool", "max_ds_bytes=0"])
def test_bad_backward_arguments(change, error, match):
    with pytest.raises(error, match=match):
        gpu.kl_backward(**bad(**change))


def test_validate_false_skips_the_host_checks_but_stays_in_bounds():
    """Out-of-range blocks are skipped by the kernels (no out-of-bounds access) when the host
    check is turned off; the other rows are bitwise what the valid selection gives."""
    for version in (1, 2):  # P_BAD is float32: v3 takes fp16/bf16
        kl, _ = gpu.kl_loss(**bad(block_indices=I_OUT), validate=False, version=version)
        want, _ = gpu.kl_loss(**bad(), version=version)
        kl, want = to_numpy(kl), to_numpy(want)
        assert np.isfinite(kl).all()
        rows = np.ones(kl.shape, dtype=bool)
        rows[3, 1] = False
        np.testing.assert_array_equal(kl[rows], want[rows])
        assert kl[3, 1] != want[3, 1]


# --- masking by selection (docs/design.md §3) -------------------------------------------------
#
# A query's kl and dq_idx must not depend on a key it cannot see (a later position of its local
# block, a block its group did not select, another sequence): poisoning k and k_idx there, to
# NaN or an infinity too, leaves them bitwise unchanged (tests/test_masked_keys.py's property,
# here for every rung). v3 multiplies whole tiles (dq_idx = dS K_idx), so its key blocks with a
# non-finite value take a cleaned path that this must reach.

# 1e30 is finite in fp32 and bf16: the scores of the queries that see it overflow exp, which
# the simulator's math.exp raises on (the GPU's gives inf), so there it is an fp16 poison only
# (where it rounds to inf).
MASK_POISONS = [np.nan, np.inf, -np.inf, 1e30, -3.0]


def poisoned(x, j, value):
    y = np.array(x, copy=True)
    y[j] = value
    return y


def bits(x):
    x = np.ascontiguousarray(x)
    return x.view(np.dtype(f"u{x.itemsize}"))


def sees_key(p, I, j):
    """bool [Tq, Hkv]: (query t, group r) has packed key ``j`` on its support."""
    tq, tk = p.q.shape[0], p.k.shape[0]
    bq, pq = query_positions(p.cu_seqlens_q, p.cu_seqlens_k, tq, tk)
    bk_, pk = key_positions(p.cu_seqlens_k, tk)
    causal = (bq == bk_[j]) & (pk[j] <= pq)  # [Tq]
    if I is None:
        return np.broadcast_to(causal[:, None], (tq, p.num_kv_heads))
    return causal[:, None] & (np.asarray(I) == pk[j] // p.block_size).any(axis=-1)


def kernel_input(x, dtype):
    """``x`` as the kernels take it: rounded to ``dtype`` (bf16 as its bit patterns)."""
    with np.errstate(over="ignore"):  # 1e30 in fp16 is inf, on purpose
        return bf16_round(x)[1] if dtype == "bf16" else np.ascontiguousarray(x.astype(dtype))


def kl_and_dq(version, p, I, lse, k, k_idx, dtype):
    """``(kl, dq_idx, dk_idx)`` of ``kl_loss_and_backward`` on ``p`` with ``k``, ``k_idx``
    replaced."""
    kin = tuple(kernel_input(x, dtype) for x in (p.q, k, p.q_idx, k_idx))
    with np.errstate(all="ignore"):
        kl, _, dq, dk = gpu._kl_backward(*kin, I, lse, p.cu_seqlens_q, p.cu_seqlens_k,
                                         p.block_size, version=version,
                                         bf16_bits=dtype == "bf16", with_kl=True,
                                         validate=False)
    return to_numpy(kl), to_numpy(dq), to_numpy(dk)


@st.composite
def masked_kl_cases(draw):
    """``(version, dtype, p, I or None, j, value)``: every rung (v1, v2 with and without a
    selection, fp32 and the half types; v3 fp16/bf16 with D = Didx = Bk = 16), a key ``j``
    (counted from the end: the simplest example poisons the last key) and its poison."""
    version = draw(st.sampled_from(VERSIONS))
    tc = version == 3
    dtype = draw(st.sampled_from(["float16", "bf16"] if tc else ["float32", "float16", "bf16"]))
    kw = draw(problem_shapes(max_seqs=2, max_len=32 if tc else 28, max_heads=4, max_topk=3,
                             block_sizes=(16,) if tc else (4, 8, 16),
                             dims=(16,) if tc else (8, 16)))
    p = make_problem(**kw)
    if p.q.shape[0] == 0:
        return version, dtype, p, None, 0, 0.0
    I = None
    if tc or draw(st.booleans()):
        I = draw(block_indices_for(p.cu_seqlens_q, p.cu_seqlens_k, p.num_kv_heads, p.topk,
                                   p.block_size))
    j = p.k.shape[0] - 1 - draw(st.integers(0, p.k.shape[0] - 1))
    poisons = MASK_POISONS if not SIMULATOR or dtype == "float16" else [
        x for x in MASK_POISONS if x != 1e30]
    return version, dtype, p, I, j, draw(st.sampled_from(poisons))


@fewer_in_simulator(5)  # two simulated kl_loss_and_backward calls an example (v3: ~10 s)
@given(masked_kl_cases())
@example(case=(3, "float16", case_problem([20], [20], 4, 2, 16, 16, 16, 2, seed=5),
               np.array([[[0, 1]] * 2] * 16 + [[[1, -1]] * 2] * 4, np.int32), 17, np.nan))
def test_invisible_keys_leave_kl_and_dq_idx_bitwise_unchanged(case):
    """Key 17 of the example sits in block 1 after queries 16 (which see block 1) and before
    the queries of block 0 (which selected it and cannot see it): one tile with both."""
    version, dtype, p, I, j, value = case
    if p.q.shape[0] == 0:
        return
    vals, _ = rounded(p, dtype)
    lse = main_lse(vals, I, p)
    kl1, dq1, dk1 = kl_and_dq(version, p, I, lse, p.k, p.k_idx, dtype)
    kl2, dq2, dk2 = kl_and_dq(version, p, I, lse, poisoned(p.k, j, value),
                              poisoned(p.k_idx, j, value), dtype)
    blind = ~sees_key(p, I, j)  # [Tq, Hkv]
    # dk_idx of a key sums the dS of the rows that see it: unchanged if none of them sees j
    apart = np.array([i != j and not (sees_key(p, I, i) & ~blind).any()
                      for i in range(p.k.shape[0])])
    assert np.isfinite(dk1).all()
    assert np.array_equal(bits(dk1)[apart], bits(dk2)[apart]), (
        f"v{version} {dtype}: dk_idx of keys "
        f"{np.flatnonzero(apart & (bits(dk1) != bits(dk2)).reshape(len(apart), -1).any(-1))[:5]}")
    assert np.isfinite(kl1).all() and np.isfinite(dq1).all()
    assert np.array_equal(bits(kl1)[blind], bits(kl2)[blind]), (
        f"v{version} {dtype}: kl of rows {np.argwhere(blind & (bits(kl1) != bits(kl2)))[:5]}")
    assert np.array_equal(bits(dq1)[blind], bits(dq2)[blind]), (
        f"v{version} {dtype}: dq_idx of rows "
        f"{np.argwhere(blind & (bits(dq1) != bits(dq2)).any(-1))[:5]}")


# Poisons of one visible key: k_idx in one dimension (S^idx = +inf or -inf by the sign of the
# query's q_idx there: NaN LSE^idx, or a -inf logit with dS = -P and a KL term +inf), k_idx
# NaN, and k in one dimension (a teacher of +inf: dS = -inf, dq_idx +-inf by k_idx's signs).
VISIBLE_POISONS = {
    "k_idx[c, 0]=+inf": lambda k, k_idx, c: k_idx.__setitem__((c, 0), np.inf),
    "k_idx[c, 0]=-inf": lambda k, k_idx, c: k_idx.__setitem__((c, 0), -np.inf),
    "k_idx[c]=nan": lambda k, k_idx, c: k_idx.__setitem__(c, np.nan),
    "k[c, :, 0]=+inf": lambda k, k_idx, c: k.__setitem__((c, slice(None), 0), np.inf),
}


def nonfinite_classes(x):
    return np.stack([np.isnan(x), np.isposinf(x), np.isneginf(x)])


# 30-80 s each in the simulator, where each mode (v1 select, v2 warmup) and v3 (float16) run
_HEAVY = [pytest.mark.sim_heavy]


@pytest.mark.parametrize("version, dtype, mode", [
    (1, "float32", "select"), pytest.param(1, "float32", "warmup", marks=_HEAVY),
    pytest.param(2, "float32", "select", marks=_HEAVY), (2, "float32", "warmup"),
    (3, "float16", "select"), pytest.param(3, "bf16", "select", marks=_HEAVY)])
def test_visible_poison_gives_the_references_nan_and_inf(version, dtype, mode):
    """The queries that do see a poisoned key get NaN, +inf and -inf in ``kl`` and ``dq_idx``
    exactly where the reference has them (v3: its cleaned tile and the rows it rewrites on CUDA
    cores), and the others stay finite."""
    bk = 16 if version == 3 else 8
    p = case_problem([20, 9], [20, 9], 4, 2, 16, 16, bk, 2, seed=4)
    vals, _ = rounded(p, dtype)
    q, k, q_idx, k_idx = vals
    I = selection(p, mode)
    lse = main_lse(vals, I, p)
    tail = (I, lse, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    # Keys 3 (inside block 0 of sequence 0) and 24 (in sequence 1): no row sees both, so the
    # simulator (a Python thread per CUDA thread) poisons the two at once; a GPU one at a time.
    keys = [(3, 24)] if SIMULATOR else [(3,), (24,)]
    for name, poison in VISIBLE_POISONS.items():
        for c in keys:
            k2, ki2 = k.copy(), k_idx.copy()
            for j in c:
                poison(k2, ki2, j)
            with np.errstate(all="ignore"):
                want = ref.kl_loss_and_backward(q, k2, q_idx, ki2, *tail, validate=False)
            got = kl_and_dq(version, p, I, lse, k2, ki2, dtype)
            for j in c:  # the case reaches the rows that see each poisoned key
                assert not np.isfinite(want[0][sees_key(p, I, j)]).all()
            for what, a, b in (("kl", got[0], want[0]), ("dq_idx", got[1], want[2])):
                np.testing.assert_array_equal(
                    nonfinite_classes(a), nonfinite_classes(b),
                    err_msg=f"v{version} {dtype} {mode} {name} at key {c}: {what}")


# --- production sizes (real GPU only) ---------------------------------------------------------

def _torch_problem(n, hq, hkv, d, d_idx, bk, topk, seed=0):
    torch = pytest.importorskip("torch")
    p = make_problem((n,), num_q_heads=hq, num_kv_heads=hkv, head_dim=d, index_dim=d_idx,
                     block_size=bk, topk=topk, dtype=np.float32, seed=seed)
    vals = tuple(bf16_round(x)[0] for x in (p.q, p.k, p.q_idx, p.k_idx))
    tens = tuple(torch.tensor(x, dtype=torch.bfloat16, device="cuda") for x in vals)
    return p, vals, tens


@pytest.mark.big
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("mode", ["select", "warmup"])
def test_production_sizes_bf16(mode, version):
    """N = 8K (2K for the warmup, whose reference is dense), Hq=16, Hkv=4, D=Didx=64, Bk=128,
    K=16, bf16 torch tensors: loss, kl and both gradients within the float rule (factor 2).

    These sizes sum thousands of terms per output (a KL over up to 8K keys, a key's ``dk_idx``
    over up to ``Tq Hkv`` queries): plain float32 running sums there were 8-25x the NumPy
    baseline's error (section "Accuracy" of ``msa.cuda.kl``), which the simulator cannot show
    (its scalars drift to float64); this test is where the compensated sums prove themselves."""
    torch = pytest.importorskip("torch")
    n = 8192 if mode == "select" else 2048
    p, vals, tens = _torch_problem(n, 16, 4, 64, 64, 128, 16)
    I = selection(p, mode)
    lse = main_lse(vals, I, p)
    cu_q, cu_k = (torch.tensor(x, device="cuda") for x in (p.cu_seqlens_q, p.cu_seqlens_k))
    I_t = None if I is None else torch.tensor(I, device="cuda")
    lse_t = torch.tensor(lse, device="cuda")
    a = (*tens, I_t, lse_t, cu_q, cu_k, p.block_size)
    # (the warmup on version 3 runs the selection of every visible block: kl/_plan.py)
    kl, loss = gpu.kl_loss(*a, version=version)
    dq, dk = gpu.kl_backward(*a, version=version)
    tail = (I, lse, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
    (kl64, loss64), (kl32, loss32) = oracle_and_baseline(ref.kl_loss, *vals, *tail)
    (dq64, dk64), (dq32, dk32) = oracle_and_baseline(ref.kl_backward, *vals, *tail)
    assert_close_to_oracle(kl, kl64, kl32, name="kl")
    assert_close_to_oracle(np.array(float(loss)), np.array(loss64), np.array(loss32), name="loss")
    assert_close_to_oracle(dq, dq64, dq32, name="dq_idx")
    assert_close_to_oracle(dk, dk64, dk32, name="dk_idx")
    again = gpu.kl_backward(*a, version=version)
    assert torch.equal(dq, again[0]) and torch.equal(dk, again[1])
    kl1, loss1, dq1, dk1 = gpu.kl_loss_and_backward(*a, version=version)
    assert torch.equal(dq, dq1) and torch.equal(dk, dk1)
    assert_close_to_oracle(kl1, kl64, kl32, name="kl, kl_loss_and_backward")
    assert_close_to_oracle(np.array(float(loss1)), np.array(loss64), np.array(loss32),
                           name="loss, kl_loss_and_backward")
