"""msa.cuda.attention's K1 (``attention_partials``) against msa.reference.attention (§4.2).

K1 runs on the reference's CSR and schedule, so that only the attention arithmetic is
compared (``attention_cases``: problems, selections and the float tolerance). Also here: the
planner's choices (version, warp groups, copies) and the register tile's quad transpose.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda, uint32

from msa.cuda import attention as gpu
from msa.cuda._core.arrays import SIMULATOR
from msa.cuda._core.memops import store_u32x4
from msa.cuda._core.wgmma import why_not_available
from msa.cuda.attention._plan import K1Plan, Spec, copy_options, default_groups
from msa.cuda.attention._tile import quad_transpose
from msa.reference.csr import build_csr
from msa.reference.schedule import build_schedule
from msa.testing.backends import to_numpy

from .attention_cases import V4_FP16, bad_input_problem, problem, run_k1


K1_CASES = [
    # id, seq_lens_q, seq_lens_k, Hq, Hkv, D, Bk, K, selection kwargs, chunk_size, pad
    ("one-seq-chunks-of-3", [19], [37], 4, 2, 16, 16, 3, {}, 3, 2),
    ("varlen-empty-Lq<Lk", [9, 0, 14], [20, 6, 40], 2, 1, 16, 16, 2, dict(fill=False), 5, 0),
    ("future-blocks-decode", [1, 2], [50, 33], 4, 1, 16, 16, 4, dict(future=True), 8, 1),
    ("G=16-hot-block", [9], [40], 16, 1, 16, 16, 3, dict(hot=(0,)), 6, 0),
]


@pytest.mark.parametrize("version,kind", [(1, "float32"), (2, "float16"), (3, "float16"),
                                          V4_FP16])
@pytest.mark.parametrize("lq,lk,hq,hkv,d,bk,topk,sel,chunk,pad", [c[1:] for c in K1_CASES],
                         ids=[c[0] for c in K1_CASES])
def test_k1_matches_reference_partials(lq, lk, hq, hkv, d, bk, topk, sel, chunk, pad, version,
                                       kind):
    p, I = problem(lq, lk, hq, hkv, d, bk, topk, seed=len(lq) + topk, **sel)
    run_k1(p, I, kind, version, chunk_size=chunk, pad=pad)


def test_k1_v1_odd_head_dim_and_block():
    """v1 takes any D and Bk (v2 needs multiples of 16)."""
    p, I = problem([11, 7], [19, 7], 2, 2, 5, 6, 3, seed=3)
    run_k1(p, I, "float32", 1, chunk_size=4)


def test_k1_bf16():
    p, I = problem([21], [30], 4, 2, 16, 16, 2, seed=4)
    run_k1(p, I, "bfloat16", 4)
    run_k1(p, I, "bfloat16", 3)
    run_k1(p, I, "bfloat16", 2)
    run_k1(p, I, "bfloat16", 1)


@pytest.mark.parametrize("o_parts", [1, 2])
def test_k1_v3_several_fragments(o_parts):
    """D = Bk = 32 on two warps: two k-steps and two n-tile pairs in both mma stages (the
    unrolled register indexing), and O in one or two column parts."""
    p, I = problem([20], [45], 2, 1, 32, 32, 2, seed=5)
    run_k1(p, I, "float16", 3, chunk_size=16, tile_rows=32, o_parts=o_parts)


def test_k1_v3_copy_options_follow_the_alignment():
    """``cp.async`` where q, k and v are 16-byte aligned, plain loads where one is not; 16-byte
    stores of bf16 partials where ``o_part`` is aligned too; neither when told to assume
    unaligned arrays (the tests' knob)."""
    buf = np.zeros(64, np.uint32)
    assert buf.ctypes.data % 16 == 0
    ok, off = buf[:32], buf[1:33]
    assert copy_options(ok, ok, ok, ok, True) == (True, True)
    assert copy_options(ok, ok, ok, ok, False) == (True, False)
    assert copy_options(ok, off, ok, ok, True) == (False, True)
    assert copy_options(ok, ok, ok, off, True) == (True, False)
    assert copy_options(ok, ok, ok, ok, True, assume_unaligned=True) == (False, False)


def test_k1_v3_plain_loads_match_the_reference():
    """The plain-load copy that inputs which are not 16-byte aligned take instead of
    ``cp.async``."""
    p, I = problem([9], [21], 4, 1, 16, 16, 2, seed=6)
    run_k1(p, I, "float16", 3, chunk_size=4, assume_unaligned=True)


@pytest.mark.parametrize("version", [2, 3])
def test_k1_tile_rows_do_not_change_the_result(version):
    """Tiles are an execution order: 16 and 32 rows give bitwise the same partials."""
    p, I = problem([30], [30], 2, 1, 16, 16, 2, seed=5)
    a = run_k1(p, I, "float16", version, tile_rows=16)
    b = run_k1(p, I, "float16", version, tile_rows=32)
    for x, y in zip(a, b):
        assert x.tobytes() == y.tobytes()


@pytest.mark.parametrize("groups", [
    pytest.param(2, marks=pytest.mark.skipif(SIMULATOR, reason="CI time: 3 groups cover it")), 3])
def test_k1_v3_warp_groups_do_not_change_the_result(groups):
    """v3 with 2 or 3 warp groups per CTA (each walking every groups-th tile of an item, with
    its own barrier) gives bitwise v3's one-group partials: items of up to 4 tiles, so the
    groups get unequal numbers of tiles, and some items fewer tiles than groups."""
    p, I = problem([40, 9], [40, 30], 4, 2, 16, 16, 2, seed=8, hot=(0,))
    a = run_k1(p, I, "float16", 3, chunk_size=28, tile_rows=16)
    b = run_k1(p, I, "float16", 3, chunk_size=28, tile_rows=16, groups=groups)
    for x, y in zip(a, b):
        assert x.tobytes() == y.tobytes()


def test_k1_v4_says_why_it_cannot_run():
    """K1 v4 (wgmma) needs 16-bit inputs and 64-row tiles, and on a GPU compute capability 9.0:
    anything else is a ValueError naming the reason and the versions that do run, before any
    launch. The simulator runs it (the wgmma twins) when asked, v3 by default."""
    spec = Spec(np.zeros((4, 16, 128), np.float16), np.zeros((4, 1, 128), np.float16),
                np.zeros((4, 1, 128), np.float16))
    if why_not_available() is None:
        assert K1Plan(spec, 128, 4, None, None).rows == 64
        assert K1Plan(spec, 128, None, None, None).version == (3 if SIMULATOR else 4)
    else:
        with pytest.raises(ValueError, match="compute capability.*version=1 or 2 or 3"):
            K1Plan(spec, 128, 4, None, None)
    with pytest.raises(ValueError, match="tile_rows=32.*version=1 or 2 or 3"):
        K1Plan(spec, 128, 4, 32, None)
    spec32 = Spec(np.zeros((4, 16, 128), np.float32), np.zeros((4, 1, 128), np.float32),
                  np.zeros((4, 1, 128), np.float32))
    with pytest.raises(ValueError, match="float32"):
        K1Plan(spec32, 128, 4, None, None)


def test_k1_default_groups_keep_a_cta_at_12_warps_or_fewer():
    """The GPU default (3 warp groups) applies to tiles of up to 4 warps only, where launch
    bounds leave 168 registers a thread; 128-row tiles (8 warps) keep one group; an explicit
    ``groups`` is taken as given, and other versions have one."""
    assert default_groups(64, 128, 128, preferred=3) == 3
    assert default_groups(16, 128, 128, preferred=3) == 3
    assert default_groups(128, 128, 128, preferred=3) == 1
    spec = Spec(np.zeros((4, 16, 128), np.float16), np.zeros((4, 1, 128), np.float16),
                np.zeros((4, 1, 128), np.float16))
    assert K1Plan(spec, 128, 3, 128, 2).groups == 2
    assert K1Plan(spec, 128, 2, None, None).groups == 1


def test_quad_transpose():
    @cuda.jit
    def kernel(out):
        lane = cuda.threadIdx.x
        x0, x1, x2, x3 = quad_transpose(lane % 4, uint32(4 * lane), uint32(4 * lane + 1),
                                        uint32(4 * lane + 2), uint32(4 * lane + 3))
        out[lane, 0], out[lane, 1], out[lane, 2], out[lane, 3] = x0, x1, x2, x3

    got = cuda.to_device(np.zeros((32, 4), np.int32))
    kernel[1, 32](got)
    lane = np.arange(32)[:, None]
    k = np.arange(4)[None, :]
    np.testing.assert_array_equal(got.copy_to_host(), 4 * (lane - lane % 4 + k) + lane % 4)


@pytest.mark.skipif(not SIMULATOR, reason="the GPU faults instead (misaligned address)")
@pytest.mark.parametrize("flat,ok", [(8, True), (6, False), (1, False)])
def test_simulated_16_byte_store_checks_alignment(flat, ok):
    """The simulator's ``store_u32x4`` refuses what ``st.global.v4`` would fault on, so a wrong
    offset fails in the simulator too; an aligned store writes its four words."""
    @cuda.jit
    def kernel(a, flat):
        store_u32x4(a, flat, uint32(1), uint32(2), uint32(3), uint32(4))

    a = np.zeros(16, np.uint32)
    assert a.ctypes.data % 16 == 0
    if ok:
        kernel[1, 1](a, flat)
        np.testing.assert_array_equal(a[flat:flat + 4], [1, 2, 3, 4])
    else:
        with pytest.raises(AssertionError, match="16-byte boundary"):
            kernel[1, 1](a, flat)


def test_attention_partials_rejects_bad_work():
    p, I, (q, k, v) = bad_input_problem()
    cq, ck = p.cu_seqlens_q, p.cu_seqlens_k
    row_ptr, qi, sl = build_csr(I, cq, ck, 4)
    work = build_schedule(row_ptr, ck, 4, 4)
    bad_head = work.copy()
    bad_head[0, 0] = 7
    with pytest.raises(ValueError, match="work"):
        gpu.attention_partials(q, k, v, bad_head, qi, sl, cq, ck, 4, 2)
    bad_slot = sl.copy()
    bad_slot[0, 0] = 9
    with pytest.raises(ValueError, match="partial_slots"):
        gpu.attention_partials(q, k, v, work, qi, bad_slot, cq, ck, 4, 2)
    with pytest.raises(ValueError, match="work"):
        gpu.attention_partials(q, k, v, work[:, :5], qi, sl, cq, ck, 4, 2)
    with pytest.raises(ValueError, match="q_indices"):
        gpu.attention_partials(q, k, v, work, qi[:1], sl[:1], cq, ck, 4, 2)


def test_attention_partials_skips_bad_entries_without_validation():
    """``validate=False``: entries naming foreign queries or slots are skipped, never written
    out of bounds (the simulator raises IndexError on any out-of-bounds access)."""
    p, I, (q, k, v) = bad_input_problem()
    cq, ck = p.cu_seqlens_q, p.cu_seqlens_k
    row_ptr, qi, sl = build_csr(I, cq, ck, 4)
    work = build_schedule(row_ptr, ck, 4, 4)
    qi_bad, sl_bad, work_bad = qi.copy(), sl.copy(), work.copy()
    qi_bad[0, 0] = 10**6
    sl_bad[0, 1] = -3
    work_bad[-1, 3] = 10**6  # q_count past the CSR
    work_bad[0, 5] = 99  # a block past the sequence
    o_part, lse_part = gpu.attention_partials(q, k, v, work_bad, qi_bad, sl_bad, cq, ck, 4, 2,
                                              validate=False, version=1)
    assert not np.isnan(to_numpy(o_part)).any()
