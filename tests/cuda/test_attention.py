"""msa.cuda.attention (K1, K1+K2, the prefill) against msa.reference.attention (paper eq 8, §4.2).

The reference's CSR and schedule are fed to K1 (DESIGN §5: test selection on its own, then feed
its indices), so that only the attention arithmetic is compared. Floats use
``msa.testing.tolerance``: the oracle is the reference in float64 on the exact values the kernel
got (16-bit inputs widened), the baseline the reference in float32. Versions 2 and 3 (tensor
cores) also round the probabilities P to the input's 16-bit type before ``P V``, as
FlashAttention does; that adds at most ``u * max|v|`` (``u`` the 16-bit unit roundoff) to ``o``, which its
bound allows for explicitly (``p_floor``). Outputs the launchers allocate start as NaN.

The ``mma`` shim is tested on its own against NumPy (``test_mma_*``): under the simulator that
checks the twin, on a GPU the inline PTX, with the same fragment-loading code; likewise
``ldmatrix_x4``/``ldmatrix_x4_trans`` (``msa.cuda._core.memops``), which feed version 3's fragments.

``big`` tests (GPU only) run the paper configuration (Hq=64, Hkv=4, D=128, Bk=128, K=16) at 8K
tokens against the reference.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from numba import cuda, float32, uint32

from msa.cuda._core import mma as _mma
from msa.cuda import attention as gpu
from msa.cuda._core.arrays import SIMULATOR
from msa.problems import make_problem
from msa.reference import attention as ref
from msa.reference.attention import _supports
from msa.reference.blocks import query_positions
from msa.reference.csr import build_csr
from msa.reference.schedule import build_schedule
from msa.testing.backends import to_numpy
from msa.testing.ptx import assert_no_f64_or_local, sm90_ptx
from msa.testing.strategies import fewer_in_simulator
from msa.testing.tolerance import assert_close_to_oracle, oracle_and_baseline
from msa.testing.strategies import offsets as cu

U16 = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}  # unit roundoff of P in versions 2, 3




@pytest.fixture
def bf16_as_uint16(monkeypatch):
    """NumPy has no bf16: let the launchers take uint16 arrays as bf16 bit patterns."""
    monkeypatch.setattr(gpu, "is_bf16", lambda x: np.dtype(getattr(x, "dtype", None)) == np.uint16)


# --- problems ---------------------------------------------------------------------------------



def selection(cu_q, cu_k, hkv, topk, bk, seed, *, hot=(), fill=True, future=False):
    """A valid I int32 [Tq, Hkv, K]: the local block, the visible ``hot`` blocks (skew), then
    random ones; ``fill=False`` keeps a random number (-1 padded), ``future`` also draws blocks
    after the local one (allowed; they hold no visible key)."""
    rng = np.random.default_rng(seed)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    batch, pos = query_positions(cu_q, cu_k, tq, tk)
    seq_blocks = -(-np.diff(cu_k.astype(np.int64)) // bk)
    out = np.full((tq, hkv, topk), -1, dtype=np.int32)
    for t in range(tq):
        local = int(pos[t]) // bk
        pool = int(seq_blocks[batch[t]]) if future else local + 1
        for h in range(hkv):
            want = min(topk, pool) if fill else int(rng.integers(1, min(topk, pool) + 1))
            chosen = [local] + [b for b in hot if b < pool and b != local][: want - 1]
            rest = np.setdiff1d(np.arange(pool), chosen)
            chosen += rng.permutation(rest)[: want - len(chosen)].tolist()
            out[t, h, : len(chosen)] = np.sort(chosen)
    return out


def f32_to_bf16_bits(x):
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_bits_to_f32(bits):
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def cast(x, kind):
    """``(what the kernel gets, the same values in float32)`` for an input array."""
    x32 = np.asarray(x, np.float32)
    if kind == "bfloat16":
        bits = f32_to_bf16_bits(x32)
        return bits, bf16_bits_to_f32(bits)
    if kind == "float16":
        x16 = x32.astype(np.float16)
        return x16, x16.astype(np.float32)
    return x32, x32


def as_float(o, kind):
    o = to_numpy(o)
    return bf16_bits_to_f32(o) if kind == "bfloat16" else np.asarray(o, np.float32)


def p_floor(p_kind, version, v, oracle, bf16_partials=False):
    """``floor_ulps`` (in units of float32 eps x max|oracle|) covering K1 v2/v3's 16-bit P and
    bf16 partials.

    ``|sum_j p_j d_j v_j| / l <= u max|v|`` for relative roundings ``|d_j| <= u`` (``u`` the
    unit roundoff of ``p_kind``), and likewise ``|sum_s w_s d_s O_s| <= u_bf16 max|v|`` for
    partials stored in bf16; the floor allows twice the sum. Version 1 keeps P in float32.
    """
    finite = np.isfinite(oracle)
    scale = float(np.abs(oracle[finite]).max()) if finite.any() else 0.0
    u = U16.get(p_kind, 0.0) if version >= 2 else 0.0
    u += U16["bfloat16"] if bf16_partials else 0.0
    if scale == 0 or u == 0:
        return 4.0
    return max(4.0, 2 * u * float(np.abs(v).max()) / (scale * np.finfo(np.float32).eps))


def check_o_lse(o, lse, oracle, baseline, kind, version, v32, factor=2.0, name="", p_kind=None,
                bf16_partials=False):
    """Compare ``(o, lse)`` (kernel, any library) with the reference's oracle and baseline.

    ``kind``: how ``o`` is stored (bf16 bits are decoded); ``p_kind``: the inputs' kind, which
    sets the rounding of P in version 2 (default ``kind``).
    """
    o_ref, lse_ref = (np.asarray(x, np.float64) for x in oracle)
    o_base, lse_base = (np.asarray(x, np.float32) for x in baseline)
    o = as_float(o, kind)
    floor = p_floor(p_kind or kind, version, v32, o_ref, bf16_partials)
    # ex2.approx / expf on the GPU are 2 ulp functions, the reference's exp 1 ulp: factor 4 there.
    lse_factor = factor if SIMULATOR else max(factor, 4.0)
    assert_close_to_oracle(to_numpy(lse), lse_ref, lse_base, name=f"lse{name}", factor=lse_factor)
    assert_close_to_oracle(o, o_ref, o_base, name=f"o{name}", factor=factor, floor_ulps=floor,
                           dtype=np.float32)
    assert np.all(o[np.isneginf(lse_ref)] == 0)


def problem(lq, lk, hq, hkv, d, bk, topk, seed=0, **sel):
    p = make_problem(lk, lq, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, index_dim=8,
                     block_size=bk, topk=topk, seed=seed)
    I = selection(p.cu_seqlens_q, p.cu_seqlens_k, hkv, topk, bk, seed, **sel)
    return p, I


# --- K1 on its own: exact slots, O_s and L_s ----------------------------------------------------

def run_k1(p, I, kind, version, *, chunk_size=8, pad=0, tile_rows=None, groups=None):
    cu_q, cu_k, bk, topk = p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, I.shape[2]
    row_ptr, q_indices, slots = build_csr(I, cu_q, cu_k, bk)
    work = build_schedule(row_ptr, cu_k, bk, chunk_size)
    (q, q32), (k, k32), (v, v32) = cast(p.q, kind), cast(p.k, kind), cast(p.v, kind)
    oracle, baseline = oracle_and_baseline(ref.attention_partials, q32, k32, v32, work, q_indices,
                                           slots, cu_q, cu_k, bk, topk)
    # A device-built schedule pads its work array with -1 rows: they must do nothing.
    padded = np.concatenate([work, np.full((pad, 6), -1, np.int32)])
    o_part, lse_part = gpu.attention_partials(q, k, v, padded, q_indices, slots, cu_q, cu_k, bk,
                                              topk, version=version, tile_rows=tile_rows,
                                              groups=groups)
    o_part, lse_part = to_numpy(o_part), to_numpy(lse_part)
    assert o_part.dtype == lse_part.dtype == np.float32
    assert o_part.shape == (topk, *q.shape) and lse_part.shape == (topk, *q.shape[:2])
    check_o_lse(o_part, lse_part, oracle, baseline, "float32", version, v32, p_kind=kind)
    return o_part, lse_part


K1_CASES = [
    # id, seq_lens_q, seq_lens_k, Hq, Hkv, D, Bk, K, selection kwargs, chunk_size, pad
    ("one-seq-chunks-of-3", [19], [37], 4, 2, 16, 16, 3, {}, 3, 2),
    ("varlen-empty-Lq<Lk", [9, 0, 14], [20, 6, 40], 2, 1, 16, 16, 2, dict(fill=False), 5, 0),
    ("future-blocks-decode", [1, 2], [50, 33], 4, 1, 16, 16, 4, dict(future=True), 8, 1),
    ("G=16-hot-block", [9], [40], 16, 1, 16, 16, 3, dict(hot=(0,)), 6, 0),
]


# K1 v4 (wgmma) runs on a GPU of compute capability 9.0 only: no simulator twin
V4 = pytest.param(4, marks=pytest.mark.skipif(SIMULATOR, reason="wgmma: GPU only"))
V4_FP16 = pytest.param(4, "float16", marks=pytest.mark.skipif(SIMULATOR, reason="wgmma: GPU only"))


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


def test_k1_bf16(bf16_as_uint16):
    p, I = problem([21], [30], 4, 2, 16, 16, 2, seed=4)
    if not SIMULATOR:
        run_k1(p, I, "bfloat16", 4)
    run_k1(p, I, "bfloat16", 3)
    run_k1(p, I, "bfloat16", 2)
    run_k1(p, I, "bfloat16", 1)


@pytest.mark.parametrize("o_parts", [1, 2])
def test_k1_v3_several_fragments(o_parts, monkeypatch):
    """D = Bk = 32 on two warps: two k-steps and two n-tile pairs in both mma stages (the
    unrolled register indexing), and O in one or two column parts."""
    monkeypatch.setattr(gpu, "_v3_o_parts", lambda d: o_parts)
    p, I = problem([20], [45], 2, 1, 32, 32, 2, seed=5)
    run_k1(p, I, "float16", 3, chunk_size=16, tile_rows=32)


def test_k1_v3_unaligned_inputs_use_plain_loads(monkeypatch):
    """Inputs not 16-byte aligned take the plain-load copy instead of ``cp.async``."""
    seen = []
    real = gpu._k1_kernel_reg

    def spy(*args):
        seen.append(args[6])  # use_async
        return real(*args)

    monkeypatch.setattr(gpu, "is_aligned16", lambda x: False)
    monkeypatch.setattr(gpu, "_k1_kernel_reg", spy)
    p, I = problem([9], [21], 4, 1, 16, 16, 2, seed=6)
    run_k1(p, I, "float16", 3, chunk_size=4)
    assert seen and not any(seen)


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
    """K1 v4 (wgmma) needs a GPU of compute capability 9.0 and 64-row tiles: anything else is a
    ValueError naming the reason and the versions that do run, before any launch."""
    spec = gpu._Spec(np.zeros((4, 16, 128), np.float16), np.zeros((4, 1, 128), np.float16),
                     np.zeros((4, 1, 128), np.float16))
    if SIMULATOR:
        with pytest.raises(ValueError, match="simulator.*version=1 or 2 or 3"):
            gpu._K1Plan(spec, 128, 4, None, None)
    elif gpu._wgmma.why_not_available() is None:
        assert gpu._K1Plan(spec, 128, 4, None, None).rows == 64
    with pytest.raises(ValueError, match="version=4"):
        gpu._K1Plan(spec, 128, 4, 32, None)
    spec32 = gpu._Spec(np.zeros((4, 16, 128), np.float32), np.zeros((4, 1, 128), np.float32),
                       np.zeros((4, 1, 128), np.float32))
    with pytest.raises(ValueError, match="float32"):
        gpu._K1Plan(spec32, 128, 4, None, None)


def test_k1_default_groups_keep_a_cta_at_12_warps_or_fewer(monkeypatch):
    """The GPU default (3 warp groups) applies to tiles of up to 4 warps only, where launch
    bounds leave 168 registers a thread; 128-row tiles (8 warps) keep one group; an explicit
    ``groups`` is taken as given, and other versions have one."""
    monkeypatch.setattr(gpu, "DEFAULT_V3_GROUPS", 3)
    spec = gpu._Spec(np.zeros((4, 16, 128), np.float16), np.zeros((4, 1, 128), np.float16),
                     np.zeros((4, 1, 128), np.float16))
    assert gpu._K1Plan(spec, 128, 3, 64, None).groups == 3
    assert gpu._K1Plan(spec, 128, 3, 16, None).groups == 3
    assert gpu._K1Plan(spec, 128, 3, 128, None).groups == 1
    assert gpu._K1Plan(spec, 128, 3, 128, 2).groups == 2
    assert gpu._K1Plan(spec, 128, 2, None, None).groups == 1


# --- K1 + K2: sparse attention end to end -------------------------------------------------------

def run_sparse(p, I, kind, version, factor=2.0, **kw):
    cu_q, cu_k, bk = p.cu_seqlens_q, p.cu_seqlens_k, p.block_size
    (q, q32), (k, k32), (v, v32) = cast(p.q, kind), cast(p.k, kind), cast(p.v, kind)
    oracle, baseline = oracle_and_baseline(ref.sparse_attention, q32, k32, v32, I, cu_q, cu_k, bk)
    o, lse = gpu.sparse_attention(q, k, v, I, cu_q, cu_k, bk, version=version, **kw)
    assert to_numpy(lse).dtype == np.float32
    assert to_numpy(o).dtype == (np.uint16 if kind == "bfloat16" else np.dtype(kind))
    if kind == "float16":  # the output is rounded to q's dtype: so is the baseline
        baseline = (baseline[0].astype(np.float16), baseline[1])
    elif kind == "bfloat16":
        baseline = (bf16_bits_to_f32(f32_to_bf16_bits(baseline[0])), baseline[1])
    partials = kw.get("partial_dtype") or ("bfloat16" if kind == "bfloat16" else "float32")
    check_o_lse(o, lse, oracle, baseline, kind, version, v32, factor=factor,
                bf16_partials=partials == "bfloat16")
    return to_numpy(o), to_numpy(lse)


SPARSE_CASES = [
    # id, seq_lens_q, seq_lens_k, Hq, Hkv, D, Bk, K, selection kwargs
    ("T=1", [1], [1], 2, 1, 16, 16, 1, {}),
    ("Lk-not-multiple-of-Bk", [37], [37], 4, 2, 16, 16, 2, {}),
    ("NB<K", [20], [20], 2, 2, 16, 16, 4, {}),
    ("G=1", [18], [18], 2, 2, 16, 16, 2, dict(fill=False)),
    ("G=16", [10], [26], 16, 1, 16, 16, 2, {}),
    ("many-seqs-empty-Lq<Lk", [5, 0, 12, 3], [5, 3, 30, 19], 4, 2, 16, 16, 3, dict(fill=False)),
    ("decode-future-blocks", [1, 1], [70, 33], 2, 1, 16, 16, 3, dict(future=True)),
    ("skewed-sink", [33], [33], 4, 1, 16, 16, 3, dict(hot=(0,))),
    ("Tq=0", [0], [9], 2, 1, 16, 16, 2, {}),
]
V2_CASES = {"T=1", "NB<K", "G=16", "many-seqs-empty-Lq<Lk", "skewed-sink"}


@pytest.mark.parametrize("lq,lk,hq,hkv,d,bk,topk,sel", [c[1:] for c in SPARSE_CASES],
                         ids=[c[0] for c in SPARSE_CASES])
def test_sparse_v1_matches_reference(lq, lk, hq, hkv, d, bk, topk, sel):
    p, I = problem(lq, lk, hq, hkv, d, bk, topk, seed=sum(lk), **sel)
    run_sparse(p, I, "float32", 1)


@pytest.mark.parametrize("lq,lk,hq,hkv,d,bk,topk,sel",
                         [c[1:] for c in SPARSE_CASES if c[0] in V2_CASES],
                         ids=[c[0] for c in SPARSE_CASES if c[0] in V2_CASES])
@pytest.mark.parametrize("version", [pytest.param(2, marks=pytest.mark.sim_heavy), 3, V4])
def test_sparse_tensor_cores_match_reference(lq, lk, hq, hkv, d, bk, topk, sel, version):
    p, I = problem(lq, lk, hq, hkv, d, bk, topk, seed=sum(lk), **sel)
    run_sparse(p, I, "float16", version)


@pytest.mark.parametrize("version", [2, 3, V4])
def test_sparse_bf16(bf16_as_uint16, version):
    p, I = problem([12, 9], [20, 9], 4, 2, 16, 16, 2, seed=8)
    run_sparse(p, I, "bfloat16", version)


@pytest.mark.parametrize("kind,version,partials", [("float16", 2, "bfloat16"),
                                                   ("float16", 3, "bfloat16"),
                                                   ("float32", 1, "bfloat16"),
                                                   ("bfloat16", 2, "float32"),
                                                   ("bfloat16", 3, "float32"),
                                                   pytest.param("bfloat16", 4, "float32",
                                                                marks=V4.marks),
                                                   pytest.param("float16", 4, "bfloat16",
                                                                marks=V4.marks)])
def test_sparse_partial_dtypes(kind, version, partials, request):
    """bf16 partials (half the bytes between K1 and K2) for any input, fp32 ones for bf16."""
    if kind == "bfloat16":
        request.getfixturevalue("bf16_as_uint16")
    p, I = problem([15], [22], 4, 2, 16, 16, 2, seed=13)
    run_sparse(p, I, kind, version, partial_dtype=partials)


# the simulator runs one part of 4 n-tiles and one of 8 (the shapes the other two repeat)
@pytest.mark.parametrize("d,o_parts", [(32, 1), pytest.param(64, 2, marks=pytest.mark.sim_heavy),
                                       (64, 1), pytest.param(128, 2, marks=pytest.mark.sim_heavy)])
def test_k1_v3_vector_stores_of_bf16_partials(d, o_parts, monkeypatch):
    """With bf16 partials K1 v3 transposes O_s across each quad and stores 16 bytes a lane
    (n-tiles in groups of four: D = 32 in one part, D = 64 in two of 4 n-tiles or, as on the
    GPU, one of 8, D = 128 in two of 8 as on the GPU); the result is bitwise that of the
    4-byte stores it takes when o_part is not 16-byte aligned."""
    monkeypatch.setattr(gpu, "_v3_o_parts", lambda _: o_parts)
    seen = []
    real = gpu._k1_kernel_reg

    def spy(*args):
        seen.append(args[9])  # vector_stores
        return real(*args)

    monkeypatch.setattr(gpu, "_k1_kernel_reg", spy)
    p, I = problem([14], [30], 4, 2, d, 16, 2, seed=d)
    vec = run_sparse(p, I, "float16", 3, partial_dtype="bfloat16")
    monkeypatch.setattr(gpu, "is_aligned16", lambda x: False)
    plain = run_sparse(p, I, "float16", 3, partial_dtype="bfloat16")
    assert seen[0] and not seen[-1]
    for a, b in zip(vec, plain):
        assert a.tobytes() == b.tobytes()


def test_quad_transpose():
    @cuda.jit
    def kernel(out):
        lane = cuda.threadIdx.x
        x0, x1, x2, x3 = gpu._quad_transpose(lane % 4, uint32(4 * lane), uint32(4 * lane + 1),
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
    from msa.cuda._core.memops import store_u32x4

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


def test_sparse_fp16_on_cuda_cores():
    p, I = problem([14], [14], 2, 1, 8, 4, 2, seed=9)
    run_sparse(p, I, "float16", 1)


def test_sparse_with_every_block_equals_dense():
    """K >= NB selects every visible block: eq 8 reduces to eq 1 (dense causal attention)."""
    p, I = problem([13, 20], [30, 20], 2, 1, 8, 8, 4, seed=10)
    assert (I >= 0).sum(axis=2).min() >= 1
    q, k, v = (x.astype(np.float32) for x in (p.q, p.k, p.v))
    oracle, baseline = oracle_and_baseline(ref.dense_attention, q, k, v, p.cu_seqlens_q,
                                           p.cu_seqlens_k)
    o, lse = gpu.sparse_attention(q, k, v, I, p.cu_seqlens_q, p.cu_seqlens_k, 8, version=1)
    check_o_lse(o, lse, oracle, baseline, "float32", 1, v)


def test_default_partial_bytes_is_an_eighth_of_the_gpu_clamped():
    """The forward's default partial budget: 4 GiB in the simulator; on a GPU an eighth of its
    memory, clamped to [4, 16] GiB (the chunks it gives are bitwise invisible, below)."""
    got = gpu.default_partial_bytes()
    if SIMULATOR:
        assert got == gpu.MAX_PARTIAL_BYTES == 4 << 30
    else:
        from numba import cuda

        total = cuda.current_context().get_memory_info()[1]
        assert got == min(max(total // 8, 4 << 30), 16 << 30)


def test_query_chunks_and_work_chunks_are_bitwise_invisible():
    """Query chunking (``max_partial_bytes``) and the scheduler's chunk size change the order of
    the work, not one bit of the result; neither do reruns."""
    p, I = problem([13, 9], [13, 30], 2, 1, 16, 16, 2, seed=11)
    q, k, v = (x.astype(np.float16) for x in (p.q, p.k, p.v))
    args = (q, k, v, I, p.cu_seqlens_q, p.cu_seqlens_k, 16)
    per_query = 2 * 2 * 16 * 4  # K * Hq * D * 4 bytes
    o1, l1 = (to_numpy(x).copy() for x in gpu.sparse_attention(*args))
    o2, l2 = (to_numpy(x).copy() for x in gpu.sparse_attention(*args, max_partial_bytes=7 * per_query,
                                                              chunk_size=3))
    o3, l3 = (to_numpy(x) for x in gpu.sparse_attention(*args))
    for a, b in ((o1, o2), (l1, l2), (o1, o3), (l1, l3)):
        assert a.tobytes() == b.tobytes()


def test_query_chunks_keep_positions():
    """Every chunk is a problem of the Lq < Lk kind whose queries keep their key positions."""
    cu_q, cu_k = cu([3, 0, 5, 4]), cu([6, 2, 5, 9])
    _, pos = query_positions(cu_q, cu_k, 12, 22)
    seen = []
    for t0, t1, k_lo, k_hi, cq, ck in gpu.query_chunks(cu_q, cu_k, 5):
        _, pos_c = query_positions(cq, ck, t1 - t0, k_hi - k_lo)
        np.testing.assert_array_equal(pos_c, pos[t0:t1])
        seen.append((t0, t1))
    assert seen == [(0, 5), (5, 10), (10, 12)]


shapes = st.fixed_dictionaries(dict(
    g=st.sampled_from([1, 2, 4, 8, 16]), hkv=st.integers(1, 2), d=st.sampled_from([4, 8, 16]),
    bk=st.sampled_from([4, 8, 16]), topk=st.integers(1, 4),
    lens=st.lists(st.tuples(st.integers(0, 16), st.integers(0, 16)), min_size=1, max_size=3),
    fill=st.booleans(), future=st.booleans(), seed=st.integers(0, 2**31 - 1)))


def _draw_problem(s, *, d=None, bk=None):
    lk = [a + b for a, b in s["lens"]]
    lq = [b for _, b in s["lens"]]
    return problem(lq, lk, s["g"] * s["hkv"], s["hkv"], d or s["d"], bk or s["bk"], s["topk"],
                   seed=s["seed"], fill=s["fill"], future=s["future"])


@fewer_in_simulator(4)  # seconds per example in the simulator (the whole pipeline, v1 kernels)
@given(s=shapes)
@example(s=dict(g=16, hkv=1, d=4, bk=4, topk=3, lens=[(0, 1), (5, 0), (3, 9)], fill=False,
                future=True, seed=1))
def test_sparse_v1_property(s):
    p, I = _draw_problem(s)
    run_sparse(p, I, "float32", 1)


small_shapes = st.fixed_dictionaries(dict(
    g=st.sampled_from([1, 2, 4, 16]), hkv=st.just(1), d=st.just(16), bk=st.just(16),
    topk=st.integers(1, 3),
    lens=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 12)), min_size=1, max_size=2),
    fill=st.booleans(), future=st.booleans(), seed=st.integers(0, 2**31 - 1)))


@fewer_in_simulator(3)  # the twin mma costs two simulator barriers per call
@given(s=small_shapes)
def test_sparse_v2_property(s):
    p, I = _draw_problem(s)
    run_sparse(p, I, "float16", 2)


@fewer_in_simulator(3)  # the twin mma and ldmatrix cost simulator barriers per call
@given(s=small_shapes)
def test_sparse_v3_property(s):
    p, I = _draw_problem(s)
    run_sparse(p, I, "float16", 3)


# --- the backward of eq 8 ----------------------------------------------------------------------

def rounding_bounds(q, k, v, o, lse, do, I, cu_q, cu_k, bk):
    """What backward version 2's 16-bit roundings of P and dS may change, elementwise and to
    first order in the unit roundoff: ``(s |dS| |K|, s |dS|ᵀ |Q|, Pᵀ |dO|)`` (float64, from P
    on eq 8's supports, summed as the reference's backward sums dq, dk, dv), with ``|dS|``
    taken as the size of its terms, ``P (|dO| |V|ᵀ + |D|)``: dS = P (dO Vᵀ - D) may cancel
    (to 0 where a query sees one key), and the kernel's fp32 dP and D, summed in different
    orders, then differ by ~D eps32 times that size, far below the 16-bit rounding."""
    q, k, v, o, do = (np.asarray(x, np.float64) for x in (q, k, v, o, do))
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g, s = hq // hkv, 1.0 / np.sqrt(d)
    bq, bk_, bv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(k)
    delta = np.einsum("thd,thd->th", do, o)
    for t0, t1, r, visible, keys in _supports(I, cu_q, cu_k, tq, k.shape[0], hkv, g, bk):
        c, heads = t1 - t0, slice(r * g, (r + 1) * g)
        q_c = np.abs(q[t0:t1, heads]).reshape(c * g, d) * s
        do_c = do[t0:t1, heads].reshape(c * g, d)
        k_r, v_r = k[keys, r], v[keys, r]
        l_c = lse[t0:t1, heads, None].astype(np.float64)
        live = visible[:, None, :] & np.isfinite(l_c)
        sc = (q[t0:t1, heads].reshape(c * g, d) * s @ k_r.T).reshape(c, g, -1)
        p = np.exp(np.where(live, sc - l_c, -np.inf))
        ds = p * ((np.abs(do_c) @ np.abs(v_r).T).reshape(c, g, -1)
                  + np.abs(delta[t0:t1, heads, None]))
        bq[t0:t1, heads] = s * (ds @ np.abs(k_r))
        np.add.at(bk_[:, r], keys, ds.reshape(c * g, -1).T @ q_c)
        np.add.at(bv[:, r], keys, p.reshape(c * g, -1).T @ np.abs(do_c))
    return bq, bk_, bv


def check_backward(got, oracle, baseline, factor, bounds, u=0.0):
    """(dq, dk, dv) against the float64 oracle: within ``factor`` x the float32 reference's
    error (``assert_close_to_oracle``) plus twice the rounding bound ``u * bounds`` elementwise
    (``rounding_bounds``; ``u`` = 0 for float32 arithmetic, version 1): the kernel's error minus
    that allowance, where positive, must pass the float32 check, whose floor is 4 ulps of the
    size of the terms (``max bounds``: dS = P (dP - D) cancels, to 0 where a query sees one key,
    and a kernel summing dP and D in other orders than the reference keeps ~ulps of the terms)."""
    for name, x, want, base, bound in zip(("dq", "dk", "dv"), got, oracle, baseline, bounds):
        x = to_numpy(x)
        assert x.dtype == np.float32, name
        err = x.astype(np.float64) - want
        excess = np.sign(err) * np.maximum(np.abs(err) - 2 * u * bound, 0.0)
        x = want + excess  # the error left once the rounding allowance is spent
        scale = max(float(np.abs(want).max(initial=0.0)), float(bound.max(initial=0.0)))
        assert_close_to_oracle(x, want, base, name=name, factor=factor, dtype=np.float32,
                               scale=scale)


def run_backward(p, I, kind, factor=2.0, **kw):
    """The kernel's (dq, dk, dv) against the reference's (float64 oracle, float32 baseline) on
    the values the kernel gets: q, k, v, o, dO in ``kind``, the forward's float32 lse. Version
    2 (the default for 16-bit inputs) also gets its rounding allowance (``check_backward``)."""
    cu_q, cu_k, bk = p.cu_seqlens_q, p.cu_seqlens_k, p.block_size
    (q, q32), (k, k32), (v, v32) = cast(p.q, kind), cast(p.k, kind), cast(p.v, kind)
    o_f, lse = ref.sparse_attention(q32, k32, v32, I, cu_q, cu_k, bk)
    (o, o32), (do, do32) = cast(o_f, kind), cast(
        np.random.default_rng(3).standard_normal(o_f.shape), kind)
    oracle, baseline = oracle_and_baseline(ref.sparse_attention_backward, q32, k32, v32, o32,
                                           lse, do32, I, cu_q, cu_k, bk)
    got = gpu.sparse_attention_backward(q, k, v, o, lse, do, I, cu_q, cu_k, bk, **kw)
    factor = factor if SIMULATOR else max(factor, 4.0)  # expf on the GPU: 2 ulp
    bounds = rounding_bounds(q32, k32, v32, o32, lse, do32, I, cu_q, cu_k, bk)
    version = kw.get("version") or gpu.default_backward_version(q, k, v, bk)
    check_backward(got, oracle, baseline, factor, bounds, U16[kind] if version == 2 else 0.0)
    return tuple(to_numpy(x) for x in got)


@pytest.mark.parametrize("lq,lk,hq,hkv,d,bk,topk,sel", [c[1:] for c in SPARSE_CASES],
                         ids=[c[0] for c in SPARSE_CASES])
def test_backward_matches_reference(lq, lk, hq, hkv, d, bk, topk, sel):
    p, I = problem(lq, lk, hq, hkv, d, bk, topk, seed=sum(lk) + 1, **sel)
    run_backward(p, I, "float32")


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_backward_half_precision_inputs(kind, bf16_as_uint16):
    """Version 1 on 16-bit inputs (Bk = 8: version 2 needs multiples of 16)."""
    p, I = problem([13, 9], [21, 30], 8, 2, 16, 8, 3, seed=4, fill=False, future=True)
    run_backward(p, I, kind)


@pytest.mark.parametrize("kind", [pytest.param("float16", marks=pytest.mark.sim_heavy),
                                  "bfloat16"])
@pytest.mark.parametrize("lq,lk,hq,hkv,d,bk,topk,sel",
                         [c[1:] for c in SPARSE_CASES if c[0] in V2_CASES | {"decode-future-blocks"}],
                         ids=[c[0] for c in SPARSE_CASES if c[0] in V2_CASES | {"decode-future-blocks"}])
def test_backward_v2_matches_reference(lq, lk, hq, hkv, d, bk, topk, sel, kind, bf16_as_uint16):
    """The tensor-core backward (the default for 16-bit inputs): the reference's gradient up to
    the roundings of P and dS to 16 bits."""
    p, I = problem(lq, lk, hq, hkv, d, bk, topk, seed=sum(lk) + 3, **sel)
    run_backward(p, I, kind, version=2)


@pytest.mark.sim_heavy  # ~7 min in the simulator
def test_backward_v2_two_warps_chunks_and_parts(bf16_as_uint16):
    """Bk = 32 (two warps of keys), D = 32, G = 4, query chunks of 7 (the dQ partials of 7
    queries: ``max_partial_bytes``), hot rows in parts of 2: bitwise the same on a rerun, and
    the same up to the parts' sum order as one chunk of whole rows."""
    p, I = problem([20, 9], [40, 30], 8, 2, 32, 32, 3, seed=11, hot=(0,))
    budget = 3 * 7 * 8 * 32 * 4  # K x 7 queries x Hq x D float32
    a = run_backward(p, I, "bfloat16", version=2, max_partial_bytes=budget, part_size=2)
    b = run_backward(p, I, "bfloat16", version=2, max_partial_bytes=budget, part_size=2)
    for x, y in zip(a, b):
        assert x.tobytes() == y.tobytes()
    c = run_backward(p, I, "bfloat16", version=2)
    assert a[0].tobytes() == c[0].tobytes()  # dQ: the same slots, summed in slot order


def test_backward_v2_empty_supports_give_zero(bf16_as_uint16):
    p, _ = problem([20], [20], 4, 2, 16, 16, 2, seed=6)
    I = np.full((20, 2, 2), -1, dtype=np.int32)
    I[:, 1, 0] = 1  # group 1 sees block 1 (positions 16..19) from query 16 on; group 0 nothing
    dq, dk, dv = run_backward(p, I, "float16", version=2)
    assert (dq[:, :2] == 0).all() and (dq[:16, 2:] == 0).all() and (dq[16:, 2:] != 0).any()
    assert (dk[:, 0] == 0).all() and (dv[:, 0] == 0).all() and (dv[:16, 1] == 0).all()


def test_default_backward_version(bf16_as_uint16):
    """Version 2 for 16-bit inputs with D and Bk multiples of 16 up to 128, else version 1."""
    def inputs(kind, d, g=2):
        q = np.zeros((3, 2 * g, d), np.float32)
        k = np.zeros((5, 2, d), np.float32)
        return (cast(x, kind)[0] for x in (q, k, k))

    assert gpu.default_backward_version(*inputs("float32", 16), 16) == 1
    assert gpu.default_backward_version(*inputs("float16", 16), 16) == 2
    assert gpu.default_backward_version(*inputs("bfloat16", 128), 128) == 2
    assert gpu.default_backward_version(*inputs("float16", 16), 8) == 1  # Bk not a multiple of 16
    assert gpu.default_backward_version(*inputs("float16", 16), 256) == 1  # Bk > 128
    assert gpu.default_backward_version(*inputs("float16", 24), 16) == 1  # D not a multiple of 16
    assert gpu.default_backward_version(*inputs("float16", 256), 16) == 1  # D > 128


@pytest.mark.parametrize("why", ["float32", "block_size", "version"])
def test_backward_version_errors_name_the_reason(why):
    p, I = problem([9], [9], 2, 1, 16, 8, 2, seed=1)
    kind = "float32" if why == "float32" else "float16"
    q, k, v = (cast(x, kind)[0] for x in (p.q, p.k, p.v))
    o, lse = ref.sparse_attention(p.q, p.k, p.v, I, p.cu_seqlens_q, p.cu_seqlens_k, 8)
    o = cast(o, kind)[0]
    version, match = (7, "version") if why == "version" else (2, {"float32": "float32",
                                                                  "block_size": "block_size=8"}[why])
    with pytest.raises(ValueError, match=match):
        gpu.sparse_attention_backward(q, k, v, o, lse.astype(np.float32), o.copy(), I,
                                      p.cu_seqlens_q, p.cu_seqlens_k, 8, version=version)


@fewer_in_simulator(3)
@given(s=shapes, part_size=st.sampled_from([None, 1, 4]))
def test_backward_property(s, part_size):
    p, I = _draw_problem(s)
    run_backward(p, I, "float32", part_size=part_size)


@fewer_in_simulator(2)  # the twin mma and ldmatrix cost simulator barriers per call
@given(s=small_shapes, part_size=st.sampled_from([None, 1, 3]), chunk=st.sampled_from([None, 5]))
def test_backward_v2_property(s, part_size, chunk):
    """Version 2 on drawn problems (G, varlen, empty and future selections), hot rows in parts
    and query chunks of 5 (``max_partial_bytes``)."""
    p, I = _draw_problem(s)
    budget = None if chunk is None else chunk * I.shape[2] * p.q.shape[1] * p.q.shape[2] * 4
    run_backward(p, I, "float16", version=2, part_size=part_size, max_partial_bytes=budget)


def test_backward_reruns_are_bitwise_identical_and_empty_supports_give_zero():
    """Deterministic (no atomics); a query group that sees nothing (lse = -inf) gets dq = 0 and
    gives its keys nothing."""
    p, _ = problem([20], [20], 4, 2, 16, 4, 2, seed=6)
    I = np.full((20, 2, 2), -1, dtype=np.int32)
    I[:, 1, 0] = 4  # group 1 sees block 4 (positions 16..19) from query 16 on; group 0 nothing
    a = run_backward(p, I, "float32")
    b = run_backward(p, I, "float32")
    for x, y in zip(a, b):
        assert x.tobytes() == y.tobytes()
    dq, dk, dv = a
    assert (dq[:, :2] == 0).all() and (dq[:16, 2:] == 0).all() and (dq[16:, 2:] != 0).any()
    assert (dk[:, 0] == 0).all() and (dv[:, 0] == 0).all() and (dv[:16, 1] == 0).all()


# In the simulator part size 3 on the skewed and varlen cases (G = 16 has its own backward test)
@pytest.mark.parametrize("case,part_size", [
    pytest.param(case, part_size, id=f"{case}-{part_size}",
                 marks=() if part_size == 3 and case != "G=16" else pytest.mark.sim_heavy)
    for part_size in (1, 3, 7) for case in ("skewed-sink", "many-seqs-empty-Lq<Lk", "G=16")])
def test_backward_hot_rows_cut_into_parts(case, part_size):
    """Rows longer than ``part_size`` queries are cut into parts (one CTA each) whose dK/dV sums
    are added in part order: still the reference's gradient, and bitwise the same on a rerun."""
    lq, lk, hq, hkv, d, bk, topk, sel = next(c[1:] for c in SPARSE_CASES if c[0] == case)
    p, I = problem(lq, lk, hq, hkv, d, bk, topk, seed=sum(lk) + 2, **sel)
    a = run_backward(p, I, "float32", part_size=part_size)
    b = run_backward(p, I, "float32", part_size=part_size)
    for x, y in zip(a, b):
        assert x.tobytes() == y.tobytes()


@pytest.mark.parametrize("how", ["past-the-end", "below-minus-one", "duplicates", "holes"])
def test_backward_unvalidated_bad_indices_stay_in_bounds(how):
    """With ``validate=False`` a malformed selection gives an unspecified but finite result and
    no out-of-bounds access (the simulator raises IndexError on one)."""
    p, I = problem([12, 7], [20, 9], 4, 2, 16, 4, 3, seed=8)
    I = I.copy()
    if how == "past-the-end":
        I[::2, :, -1] = 40
    elif how == "below-minus-one":
        I[1::3, 0, 0] = -7
    elif how == "duplicates":
        I[:, 1, 1] = I[:, 1, 0]
    else:
        I[::2, :, 0] = -1
    q, k, v = (x.astype(np.float32) for x in (p.q, p.k, p.v))
    o = np.random.default_rng(0).standard_normal(q.shape).astype(np.float32)
    lse = np.full(q.shape[:2], 1.0, np.float32)
    grads = gpu.sparse_attention_backward(q, k, v, o, lse, o.copy(), I, p.cu_seqlens_q,
                                          p.cu_seqlens_k, 4, validate=False)
    assert all(np.isfinite(to_numpy(g)).all() for g in grads)
    with pytest.raises(ValueError, match="block_indices"):
        gpu.sparse_attention_backward(q, k, v, o, lse, o.copy(), I, p.cu_seqlens_q,
                                      p.cu_seqlens_k, 4)


@pytest.mark.parametrize("bad", ["o_shape", "do_dtype", "lse_dtype", "lse_shape", "I_shape",
                                 "smem", "part_size"])
def test_backward_bad_input_names_the_argument(bad):
    p, I = problem([9], [9], 2, 1, 16, 8, 2, seed=1)
    q, k, v = (x.astype(np.float32) for x in (p.q, p.k, p.v))
    o, lse = ref.sparse_attention(q, k, v, I, p.cu_seqlens_q, p.cu_seqlens_k, 8)
    args = dict(o=o, lse=lse.astype(np.float32), do=o.copy(), I=I, bk=8)
    if bad == "part_size":
        with pytest.raises(ValueError, match="part_size"):
            gpu.sparse_attention_backward(q, k, v, o, lse.astype(np.float32), o.copy(), I,
                                          p.cu_seqlens_q, p.cu_seqlens_k, 8, part_size=0)
        return
    name, change = {"o_shape": ("o", o[:, :1]), "do_dtype": ("do", o.astype(np.float64)),
                    "lse_dtype": ("lse", lse.astype(np.float64)), "lse_shape": ("lse", lse[:-1]),
                    "I_shape": ("I", I[:, :, :0]), "smem": ("bk", 4096)}[bad]
    args[name] = change
    match = {"I": "block_indices", "bk": "block_size"}.get(name, name)
    with pytest.raises((TypeError, ValueError), match=match):
        gpu.sparse_attention_backward(q, k, v, args["o"], args["lse"], args["do"], args["I"],
                                      p.cu_seqlens_q, p.cu_seqlens_k, args["bk"])


@functools.lru_cache(maxsize=1)
def _paper_config_backward_4k():
    """The 4K paper-configuration backward problem in bf16, its reference oracle and baseline
    and version 2's rounding bounds (shared by both versions' tests)."""
    q, k, v, I, cu_q, cu_k = _big_problem([4096], [4096], 64, 4, 128, 128, 16, seed=5)
    q32, k32, v32 = (bf16_bits_to_f32(f32_to_bf16_bits(x)) for x in (q, k, v))
    o_f, lse = ref.sparse_attention(q32, k32, v32, I, cu_q, cu_k, 128)
    o32 = bf16_bits_to_f32(f32_to_bf16_bits(o_f))
    do32 = bf16_bits_to_f32(f32_to_bf16_bits(np.random.default_rng(3).standard_normal(o_f.shape)))
    inputs = (q32, k32, v32, o32, lse, do32, I, cu_q, cu_k)
    oracle, baseline = oracle_and_baseline(ref.sparse_attention_backward, *inputs, 128)
    return inputs, oracle, baseline, rounding_bounds(*inputs, 128)


@pytest.mark.big
@pytest.mark.parametrize("version", [1, 2])
def test_big_backward_paper_configuration(version):
    """Hq=64, Hkv=4, D=128, Bk=128, K=16, one 4K sequence, bf16 (torch), sink + random; and a
    rerun bitwise equal. Version 2 also in query chunks of 1000 (dQ partials of 1000 queries),
    which must give the same dq bitwise and dk, dv within the same bounds."""
    torch = pytest.importorskip("torch")
    (q32, k32, v32, o32, lse, do32, I, cu_q, cu_k), oracle, baseline, bounds = (
        _paper_config_backward_4k())
    args = (*(_torch_bf16(x) for x in (q32, k32, v32, o32)), torch.from_numpy(lse).cuda(),
            _torch_bf16(do32), torch.from_numpy(I).cuda(), cu_q, cu_k, 128)
    got = gpu.sparse_attention_backward(*args, version=version, validate=False)
    check_backward([x.cpu().numpy() for x in got], oracle, baseline, 4.0, bounds,
                   U16["bfloat16"] if version == 2 else 0.0)
    again = gpu.sparse_attention_backward(*args, version=version, validate=False)
    for x, y in zip(got, again):
        assert torch.equal(x, y)
    if version == 2:
        chunked = gpu.sparse_attention_backward(*args, version=2, validate=False,
                                                max_partial_bytes=16 * 1000 * 64 * 128 * 4)
        assert torch.equal(chunked[0], got[0])
        check_backward([x.cpu().numpy() for x in chunked], oracle, baseline, 4.0, bounds,
                       U16["bfloat16"])


# --- the MSA prefill: index + top-k + sparse attention --------------------------------------------

def test_msa_prefill_matches_reference_pipeline():
    pytest.importorskip("msa.cuda.select")
    from msa.reference.index import block_scores
    from msa.reference.select import select_blocks

    p = make_problem((24, 16), (24, 9), num_q_heads=4, num_kv_heads=2, head_dim=16,
                     index_dim=16, block_size=8, topk=3, seed=12)
    q, k, v, q_idx, k_idx = (x.astype(np.float32) for x in (p.q, p.k, p.v, p.q_idx, p.k_idx))
    o, lse, I = gpu.msa_prefill(q, k, v, q_idx, k_idx, p.cu_seqlens_q, p.cu_seqlens_k, 8, 3,
                                version=1)
    I = to_numpy(I)
    M = block_scores(q_idx.astype(np.float64), k_idx.astype(np.float64), p.cu_seqlens_q,
                     p.cu_seqlens_k, 8)
    I_ref = select_blocks(M, p.cu_seqlens_q, p.cu_seqlens_k, 3, 8)
    np.testing.assert_array_equal(I, I_ref)
    oracle, baseline = oracle_and_baseline(ref.sparse_attention, q, k, v, I, p.cu_seqlens_q,
                                           p.cu_seqlens_k, 8)
    check_o_lse(o, lse, oracle, baseline, "float32", 1, v)


# --- bad input --------------------------------------------------------------------------------

def _bad_input_problem():
    p, I = problem([6], [6], 4, 2, 16, 4, 2, seed=0)
    return p, I, (p.q.astype(np.float32), p.k.astype(np.float32), p.v.astype(np.float32))


@pytest.mark.parametrize("case", ["q-rank", "k-v-shape", "k-dtype", "q-float64", "G=3", "G=32",
                                  "Hkv-not-dividing", "D=0", "D=512", "k-head-dim",
                                  "block-indices-shape", "block-indices-float",
                                  "block-indices-range", "version-2-float32", "version-3-float32",
                                  "version-3-D=256", "version-4",
                                  "tile-rows", "block-size", "scale", "cu-seqlens",
                                  "shared-memory", "partial-dtype", "groups-v2", "groups-0",
                                  "groups-too-many"])
def test_sparse_attention_rejects_bad_inputs(case):
    p, I, (q, k, v) = _bad_input_problem()
    cq, ck = p.cu_seqlens_q, p.cu_seqlens_k
    args = dict(q=q, k=k, v=v, block_indices=I, cu_seqlens_q=cq, cu_seqlens_k=ck, block_size=4)
    kw = {}
    half = dict(q=q.astype(np.float16), k=k.astype(np.float16), v=v.astype(np.float16),
                block_size=16, block_indices=np.zeros((6, 2, 1), np.int32))
    expect = {
        "q-rank": (ValueError, "q", dict(q=q[0])),
        "k-v-shape": (ValueError, "v", dict(v=v[:, :1])),
        "k-dtype": (TypeError, "k", dict(k=k.astype(np.float16))),
        "q-float64": (TypeError, "q", dict(q=q.astype(np.float64), k=k.astype(np.float64),
                                          v=v.astype(np.float64))),
        "G=3": (ValueError, "G", dict(q=np.zeros((6, 6, 16), np.float32))),
        "G=32": (ValueError, "G", dict(q=np.zeros((6, 64, 16), np.float32))),
        "Hkv-not-dividing": (ValueError, "Hkv", dict(q=np.zeros((6, 5, 16), np.float32))),
        "D=0": (ValueError, "D", dict(q=q[..., :0], k=k[..., :0], v=v[..., :0])),
        "D=512": (ValueError, "D", dict(q=np.zeros((6, 4, 512), np.float32),
                                        k=np.zeros((6, 2, 512), np.float32),
                                        v=np.zeros((6, 2, 512), np.float32))),
        "k-head-dim": (ValueError, "k", dict(k=k[..., :8], v=v[..., :8])),
        "block-indices-shape": (ValueError, "block_indices", dict(block_indices=I[:, :1])),
        "block-indices-float": (TypeError, "block_indices",
                                dict(block_indices=I.astype(np.float32))),
        "block-indices-range": (ValueError, "block_indices", dict(block_indices=I + 5)),
        "version-2-float32": (ValueError, "version", {}),
        "version-3-float32": (ValueError, "version", {}),
        # v3 keeps O in registers: D <= 128 (v2 takes D = 256)
        "version-3-D=256": (ValueError, "version", dict(
            q=np.zeros((6, 4, 256), np.float16), k=np.zeros((6, 2, 256), np.float16),
            v=np.zeros((6, 2, 256), np.float16), block_size=16,
            block_indices=np.zeros((6, 2, 1), np.int32))),
        "version-4": (ValueError, "version", {}),
        "tile-rows": (ValueError, "tile_rows", {}),
        # warp groups: a fp16 problem that version 2 and 3 take, so that groups is the fault
        "groups-v2": (ValueError, "groups", half),
        "groups-0": (ValueError, "groups", half),
        "groups-too-many": (ValueError, "groups", half),
        "block-size": (ValueError, "block_size", dict(block_size=0)),
        "scale": (ValueError, "scale", {}),
        "partial-dtype": (ValueError, "partial_dtype", {}),
        "cu-seqlens": (ValueError, "cu_seqlens", dict(cu_seqlens_q=np.array([0, 5], np.int32))),
        # K and V of one 512-key block at D=256 do not fit a CTA's shared memory
        "shared-memory": (ValueError, "block_size", dict(
            q=np.zeros((6, 4, 256), np.float32), k=np.zeros((6, 2, 256), np.float32),
            v=np.zeros((6, 2, 256), np.float32), block_size=512,
            block_indices=np.zeros((6, 2, 1), np.int32))),
    }[case]
    err, match, override = expect
    args.update(override)
    if case == "version-2-float32":
        kw = dict(version=2)
    elif case in ("version-3-float32", "version-3-D=256"):
        kw = dict(version=3)
    elif case == "version-4":
        kw = dict(version=4)
    elif case == "tile-rows":
        kw = dict(version=1, tile_rows=500)
    elif case == "groups-v2":
        kw = dict(version=2, groups=2)
    elif case == "groups-0":
        kw = dict(version=3, groups=0)
    elif case == "groups-too-many":  # 16-row tiles are one warp: at most 15 groups (bar ids)
        kw = dict(version=3, tile_rows=16, groups=16)
    elif case == "scale":
        kw = dict(scale=-1.0)
    elif case == "partial-dtype":
        kw = dict(partial_dtype=np.float16)
    with pytest.raises(err, match=match):
        gpu.sparse_attention(**args, **kw)


def test_attention_partials_rejects_bad_work():
    p, I, (q, k, v) = _bad_input_problem()
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
    p, I, (q, k, v) = _bad_input_problem()
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


# --- the mma shim against NumPy -----------------------------------------------------------------

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


@functools.lru_cache(maxsize=None)
def _ldmatrix_kernel(trans):
    from msa.cuda._core.memops import ldmatrix_x4, ldmatrix_x4_trans

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


# --- big: the paper configuration on a real GPU -------------------------------------------------

def _big_problem(lq, lk, hq, hkv, d, bk, topk, seed):
    rng = np.random.default_rng(seed)
    cu_q, cu_k = cu(lq), cu(lk)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q = rng.standard_normal((tq, hq, d), dtype=np.float32)
    k = rng.standard_normal((tk, hkv, d), dtype=np.float32)
    v = rng.standard_normal((tk, hkv, d), dtype=np.float32)
    I = selection(cu_q, cu_k, hkv, topk, bk, seed, hot=(0,), fill=True)
    return q, k, v, I, cu_q, cu_k


def _torch_bf16(x):
    torch = pytest.importorskip("torch")
    return torch.from_numpy(x).to("cuda", torch.bfloat16)


@functools.lru_cache(maxsize=1)
def _paper_config_8k():
    """The 8K paper-configuration problem in bf16 and its reference oracle and baseline (the
    reference takes ~10-30 s here, so both versions share one computation)."""
    q, k, v, I, cu_q, cu_k = _big_problem([8192], [8192], 64, 4, 128, 128, 16, seed=0)
    q32, k32, v32 = (bf16_bits_to_f32(f32_to_bf16_bits(x)) for x in (q, k, v))
    oracle, baseline = oracle_and_baseline(ref.sparse_attention, q32, k32, v32, I, cu_q, cu_k, 128)
    baseline = (bf16_bits_to_f32(f32_to_bf16_bits(baseline[0])), baseline[1])
    return (q32, k32, v32, I, cu_q, cu_k), oracle, baseline


@pytest.mark.big
@pytest.mark.parametrize("version", [4, 3, 2, 1])
def test_big_paper_configuration_8k(version):
    """Hq=64, Hkv=4, D=128, Bk=128, K=16, one 8K sequence, bf16 (torch), sink + random."""
    torch = pytest.importorskip("torch")
    (q32, k32, v32, I, cu_q, cu_k), oracle, baseline = _paper_config_8k()
    tq, tk, tv = (torch.from_numpy(x).to("cuda", torch.bfloat16) for x in (q32, k32, v32))
    o, lse = gpu.sparse_attention(tq, tk, tv, torch.from_numpy(I).cuda(), cu_q, cu_k, 128,
                                  version=version, validate=False)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    o_bits = o.view(torch.int16).cpu().numpy().view(np.uint16)
    check_o_lse(o_bits, lse.cpu().numpy(), oracle, baseline, "bfloat16", version, v32, factor=4.0)


@pytest.mark.big
def test_big_varlen_g8_d64_fp16():
    """Three sequences (one with Lq < Lk), G=8, D=64, K=8, fp16, every version, and the query
    chunking path (several chunks) bitwise equal to one chunk (versions 2 and 3)."""
    q, k, v, I, cu_q, cu_k = _big_problem([3000, 1500, 2048], [3000, 4000, 2048], 32, 4, 64, 128,
                                          8, seed=1)
    q16, k16, v16 = (x.astype(np.float16) for x in (q, k, v))
    q32, k32, v32 = (x.astype(np.float32) for x in (q16, k16, v16))
    oracle, baseline = oracle_and_baseline(ref.sparse_attention, q32, k32, v32, I, cu_q, cu_k, 128)
    baseline = (baseline[0].astype(np.float16), baseline[1])
    outs = {}
    for version in (4, 3, 2, 1):
        o, lse = gpu.sparse_attention(q16, k16, v16, I, cu_q, cu_k, 128, version=version)
        check_o_lse(o, lse, oracle, baseline, "float16", version, v32, factor=4.0,
                    name=f" v{version}")
        outs[version] = (o, lse)
    for version in (4, 3, 2):
        o2, lse2 = gpu.sparse_attention(q16, k16, v16, I, cu_q, cu_k, 128, version=version,
                                        max_partial_bytes=8 * 32 * 64 * 4 * 1000, validate=False)
        assert o2.tobytes() == outs[version][0].tobytes()
        assert lse2.tobytes() == outs[version][1].tobytes()


@pytest.mark.big
@pytest.mark.parametrize("version,d,bk,tile_rows", [
    (v, d, bk, t) for v in (3, 2) for d, bk, t in ((64, 32, 128), (64, 64, 64), (128, 64, 32),
                                                   (32, 16, 16))]
    + [(4, d, bk, 64) for d, bk in ((64, 32), (128, 64), (32, 16), (128, 128))])
def test_big_tensor_core_shapes(version, d, bk, tile_rows):
    """The other D, Bk and tile sizes of the tensor-core kernels (D = 64 at Bk = 32 once failed
    to launch: static + dynamic shared memory past 48 KB), bf16, G = 16 with bf16 partials."""
    torch = pytest.importorskip("torch")
    q, k, v, I, cu_q, cu_k = _big_problem([1500, 700], [1500, 2100], 32, 2, d, bk, 8, seed=3)
    q32, k32, v32 = (bf16_bits_to_f32(f32_to_bf16_bits(x)) for x in (q, k, v))
    oracle, baseline = oracle_and_baseline(ref.sparse_attention, q32, k32, v32, I, cu_q, cu_k, bk)
    baseline = (bf16_bits_to_f32(f32_to_bf16_bits(baseline[0])), baseline[1])
    tq, tk, tv = (torch.from_numpy(x).to("cuda", torch.bfloat16) for x in (q32, k32, v32))
    o, lse = gpu.sparse_attention(tq, tk, tv, torch.from_numpy(I).cuda(), cu_q, cu_k, bk,
                                  version=version, tile_rows=tile_rows, validate=False)
    o_bits = o.view(torch.int16).cpu().numpy().view(np.uint16)
    check_o_lse(o_bits, lse.cpu().numpy(), oracle, baseline, "bfloat16", version, v32,
                factor=4.0, bf16_partials=True)


@pytest.mark.big
def test_big_warp_groups_bitwise_equal_one_group():
    """The paper configuration at 4K: K1 v3 with 2 and 3 warp groups per CTA (launch bounds
    capping the registers, no barrier across warps after the K/V load) gives bitwise the output
    of one group."""
    torch = pytest.importorskip("torch")
    q, k, v, I, cu_q, cu_k = _big_problem([4096], [4096], 64, 4, 128, 128, 16, seed=4)
    args = (_torch_bf16(q), _torch_bf16(k), _torch_bf16(v), torch.from_numpy(I).cuda(), cu_q,
            cu_k, 128)
    o1, l1 = gpu.sparse_attention(*args, version=3, groups=1, validate=False)
    for groups in (2, 3):
        o2, l2 = gpu.sparse_attention(*args, version=3, groups=groups, validate=False)
        assert torch.equal(o1.view(torch.int16), o2.view(torch.int16)), groups
        assert torch.equal(l1, l2), groups


@pytest.mark.big
@pytest.mark.parametrize("version", [None, 4, 3])
def test_big_reruns_bitwise_identical(version):
    torch = pytest.importorskip("torch")
    q, k, v, I, cu_q, cu_k = _big_problem([4096], [4096], 64, 4, 128, 128, 16, seed=2)
    args = (_torch_bf16(q), _torch_bf16(k), _torch_bf16(v), torch.from_numpy(I).cuda(), cu_q,
            cu_k, 128)
    o1, l1 = gpu.sparse_attention(*args, version=version, validate=False)
    o2, l2 = gpu.sparse_attention(*args, version=version, validate=False)
    assert torch.equal(o1.view(torch.int16), o2.view(torch.int16)) and torch.equal(l1, l2)


# --- offline compile checks (a GPU or NVVM; not the simulator) -----------------------------------

@pytest.mark.skipif(SIMULATOR, reason="compiles PTX for sm_90: not in the simulator")
@pytest.mark.parametrize("kernel", ["k1-v2-bf16", "k1-v2-bf16-partials", "k1-v2-fp16-D64",
                                    "k1-v3-bf16", "k1-v3-bf16-partials", "k1-v3-fp16-D64-plain",
                                    "k1-v3-bf16-partials-groups3", "k1-v4-bf16-partials-groups3",
                                    "k1-v4-fp16-D64",
                                    "k1-v1-bf16", "k2-bf16-out", "k2-v2-bf16-out", "bwd-dq-bf16",
                                    "bwd-dq-bf16-uint16-int64", "bwd-delta-bf16",
                                    "bwd-dkdv-bf16", "bwd-dkdv-sum", "bwd-tc-bf16",
                                    "bwd-tc-fp16-G1", "bwd-dq-sum-int64"])
def test_kernels_compile_for_sm90_without_f64_or_local_memory(kernel):
    """The production kernels compile for sm_90 with no float64 instruction (a bare float
    literal would drag expressions to f64) and no local memory (register arrays spilled)."""
    from numba import types

    from msa.cuda.combine import _V2_WARPS, _combine_kernel_vec, _combine_kernel_warp, _v2_unroll

    i32 = types.int32
    words = types.uint32[:, :, ::1]
    parts = (types.float32[:, :, :, ::1], types.float32[:, :, ::1])
    index = (i32[:, ::1], i32[:, ::1], i32[:, ::1], i32[::1], i32[::1], types.float32)
    if kernel == "k1-v2-bf16":
        fn = gpu._k1_kernel_mma(128, 128, 16, 8, True)
        sig = (words, words, words, *index, *parts, i32, i32)
    elif kernel == "k1-v2-bf16-partials":
        fn = gpu._k1_kernel_mma(128, 128, 16, 8, True, True)
        sig = (words, words, words, *index, types.uint32[:, :, :, ::1], parts[1], i32, i32)
    elif kernel == "k1-v2-fp16-D64":
        fn = gpu._k1_kernel_mma(128, 64, 4, 32, False)
        sig = (words, words, words, *index, *parts, i32, i32)
    elif kernel == "k1-v3-bf16":  # v3 takes o_part flat
        fn = gpu._k1_kernel_reg(128, 128, 16, 8, True, False, True, gpu._v3_o_parts(128))
        sig = (words, words, words, *index, types.float32[::1], parts[1])
    elif kernel == "k1-v3-bf16-partials":
        fn = gpu._k1_kernel_reg(128, 128, 16, 8, True, True, True, gpu._v3_o_parts(128))
        sig = (words, words, words, *index, types.uint32[::1], parts[1])
    elif kernel == "k1-v3-bf16-partials-groups3":
        fn = gpu._k1_kernel_reg(128, 128, 16, 4, True, True, True, gpu._v3_o_parts(128), 3,
                                True)  # the production kernel: 16-byte stores of O_s
        sig = (words, words, words, *index, types.uint32[::1], parts[1])
    elif kernel == "k1-v4-bf16-partials-groups3":
        fn = gpu._k1_kernel_reg(128, 128, 16, 4, True, True, True, gpu._v3_o_parts(128), 3,
                                True, True)
        sig = (words, words, words, *index, types.uint32[::1], parts[1])
    elif kernel == "k1-v4-fp16-D64":
        fn = gpu._k1_kernel_reg(128, 64, 8, 8, False, False, True, gpu._v3_o_parts(64), 1,
                                False, True)
        sig = (words, words, words, *index, types.float32[::1], parts[1])
    elif kernel == "k1-v3-fp16-D64-plain":
        fn = gpu._k1_kernel_reg(32, 64, 4, 32, False, False, False, gpu._v3_o_parts(64))
        sig = (words, words, words, *index, types.float32[::1], parts[1])
    elif kernel == "bwd-dq-bf16":
        fn = gpu._bwd_kernels(128, 128, 16, True, 128)[1]
        e16 = types.int16[:, :, ::1]
        sig = (e16, e16, e16, e16, types.float32[:, ::1], types.float32[:, ::1],
               types.int32[:, :, ::1], i32[::1], i32[::1], types.float32, types.float32[:, :, ::1])
    elif kernel == "bwd-dq-bf16-uint16-int64":  # the launcher's own views, torch's int64 I
        fn = gpu._bwd_kernels(128, 128, 16, True, 128)[1]
        u16 = types.uint16[:, :, ::1]
        sig = (u16, u16, u16, u16, types.float32[:, ::1], types.float32[:, ::1],
               types.int64[:, :, ::1], i32[::1], i32[::1], types.float32, types.float32[:, :, ::1])
    elif kernel == "bwd-delta-bf16":
        fn = gpu._bwd_kernels(128, 128, 16, True, 128)[0]
        sig = (types.uint16[:, :, ::1], types.uint16[:, :, ::1], types.float32[:, ::1])
    elif kernel == "bwd-dkdv-bf16":
        fn = gpu._bwd_kernels(128, 128, 16, True, 128)[2]
        e16 = types.int16[:, :, ::1]
        sig = (e16, e16, e16, e16, types.float32[:, ::1], types.float32[:, ::1], i32[:, ::1],
               i32[:, ::1], i32[::1], i32[::1], i32[::1], types.float32, i32[:, ::1], types.int64,
               types.float32[:, :, ::1], types.float32[:, :, ::1], types.float32[:, ::1],
               types.float32[:, ::1])
    elif kernel == "bwd-dkdv-sum":
        fn = gpu._bwd_kernels(128, 128, 16, True, 128)[3]
        sig = (i32[:, ::1], i32[::1], i32[::1], types.float32[:, ::1], types.float32[:, ::1],
               types.float32[:, :, ::1], types.float32[:, :, ::1])
    elif kernel in ("bwd-tc-bf16", "bwd-tc-fp16-G1"):
        g = 16 if kernel == "bwd-tc-bf16" else 1
        fn = gpu._bwd_tc_kernel(128, 128, g, 64, g == 16, True)
        f32 = types.float32
        sig = (words, words, words, words, f32[:, ::1], f32[:, ::1], i32[:, ::1], i32[:, ::1],
               i32[:, ::1], i32[::1], i32[::1], i32[::1], f32, f32, i32[:, ::1], types.int64,
               f32[:, :, ::1], f32[:, :, ::1], f32[:, ::1], f32[:, ::1], f32[:, :, :, ::1])
    elif kernel == "bwd-dq-sum-int64":
        fn = gpu._bwd_dq_sum_kernel(128, 16)
        sig = (types.int64[:, :, ::1], i32[::1], i32[::1], types.float32[:, :, :, ::1],
               types.float32, types.float32[:, :, ::1])
    elif kernel == "k1-v1-bf16":
        fn = gpu._k1_kernel_simple(128, 128, 16, 4, 128, True)
        elems = types.int16[:, :, ::1]
        sig = (elems, elems, elems, *index, *parts)
    elif kernel == "k2-bf16-out":
        fn = _combine_kernel_warp(128, 32, 4, True, True)
        sig = (types.int16[:, :, :, ::1], parts[1], types.int16[:, :, ::1], types.float32[:, ::1])
    else:
        fn = _combine_kernel_vec(128, True, "bf16", False, _V2_WARPS, _v2_unroll(128, True))
        sig = (types.uint32[:, :, :, ::1], parts[1], types.uint32[:, :, ::1], types.float32[:, ::1])
    ptx = sm90_ptx(fn, sig)
    assert_no_f64_or_local(ptx)
    if kernel.startswith(("k1-v2", "k1-v3", "bwd-tc")) and _mma.MMA_BACKEND == "ptx":
        assert "mma.sync.aligned.m16n8k16" in ptx
    if kernel.startswith(("k1-v3", "bwd-tc")):
        assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx
    if kernel.startswith("k1-v4"):
        assert "wgmma.mma_async.sync.aligned" in ptx and "mma.sync" not in ptx
