"""Problems, selections and checks shared by the attention tests (``test_attention_*.py``: K1's
partials, the sparse attention, its backward, the prefill).

The reference's CSR and schedule are fed to K1 (docs/design.md §5: test selection on its own, then feed
its indices), so that only the attention arithmetic is compared. Floats use
``msa.testing.tolerance``: the oracle is the reference in float64 on the exact values the kernel
got (16-bit inputs widened), the baseline the reference in float32. The tensor-core versions
also round the probabilities P to the input's 16-bit type before ``P V``, as FlashAttention
does; that adds at most ``u * max|v|`` (``u`` the 16-bit unit roundoff) to ``o``, which its
bound allows for explicitly (``p_floor``). bf16 inputs are NumPy uint16 bit patterns here
(``bf16_bits=True`` of the private entry points); on a GPU the public functions take torch
bf16 tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import strategies as st

from msa.cuda import attention
from msa.cuda._core.arrays import SIMULATOR
from msa.problems import make_problem
from msa.reference import attention as ref
from msa.reference.blocks import query_positions
from msa.reference.csr import build_csr
from msa.reference.schedule import build_schedule
from msa.testing.backends import to_numpy
from msa.testing.strategies import offsets as cu
from msa.testing.tolerance import assert_close_to_oracle, oracle_and_baseline

U16 = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}  # unit roundoff of P in versions 2 to 4


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


def bad_input_problem():
    """A small valid float32 problem whose arguments the bad-input tests spoil one at a time:
    ``(p, I, (q, k, v))``."""
    p, I = problem([6], [6], 4, 2, 16, 4, 2, seed=0)
    return p, I, (p.q.astype(np.float32), p.k.astype(np.float32), p.v.astype(np.float32))


def run_k1(p, I, kind, version, *, chunk_size=8, pad=0, tile_rows=None, groups=None, **knobs):
    """K1 on the reference's CSR and schedule (``pad`` rows of -1 appended to the work, as a
    device-built schedule has), against the reference's partials; ``knobs``: the private
    ones of ``_attention_partials`` (``o_parts``, ``assume_unaligned``)."""
    cu_q, cu_k, bk, topk = p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, I.shape[2]
    row_ptr, q_indices, slots = build_csr(I, cu_q, cu_k, bk)
    work = build_schedule(row_ptr, cu_k, bk, chunk_size)
    (q, q32), (k, k32), (v, v32) = cast(p.q, kind), cast(p.k, kind), cast(p.v, kind)
    oracle, baseline = oracle_and_baseline(ref.attention_partials, q32, k32, v32, work, q_indices,
                                           slots, cu_q, cu_k, bk, topk)
    # A device-built schedule pads its work array with -1 rows: they must do nothing.
    padded = np.concatenate([work, np.full((pad, 6), -1, np.int32)])
    o_part, lse_part = attention._attention_partials(
        q, k, v, padded, q_indices, slots, cu_q, cu_k, bk, topk, version=version,
        tile_rows=tile_rows, groups=groups, bf16_bits=kind == "bfloat16", **knobs)
    o_part, lse_part = to_numpy(o_part), to_numpy(lse_part)
    assert o_part.dtype == lse_part.dtype == np.float32
    assert o_part.shape == (topk, *q.shape) and lse_part.shape == (topk, *q.shape[:2])
    check_o_lse(o_part, lse_part, oracle, baseline, "float32", version, v32, p_kind=kind)
    return o_part, lse_part


# K1 v4 (wgmma): the instruction on a GPU of compute capability 9.0, its twins in the simulator
V4 = 4
V4_FP16 = (4, "float16")


def run_sparse(p, I, kind, version, factor=2.0, **kw):
    """``sparse_attention`` (K1 + K2 end to end) against the reference; ``kw``: its knobs and
    the private ones of ``_sparse_attention``."""
    cu_q, cu_k, bk = p.cu_seqlens_q, p.cu_seqlens_k, p.block_size
    (q, q32), (k, k32), (v, v32) = cast(p.q, kind), cast(p.k, kind), cast(p.v, kind)
    oracle, baseline = oracle_and_baseline(ref.sparse_attention, q32, k32, v32, I, cu_q, cu_k, bk)
    o, lse = attention._sparse_attention(q, k, v, I, cu_q, cu_k, bk, version=version,
                                         bf16_bits=kind == "bfloat16", **kw)
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


shapes = st.fixed_dictionaries(dict(
    g=st.sampled_from([1, 2, 4, 8, 16]), hkv=st.integers(1, 2), d=st.sampled_from([4, 8, 16]),
    bk=st.sampled_from([4, 8, 16]), topk=st.integers(1, 4),
    lens=st.lists(st.tuples(st.integers(0, 16), st.integers(0, 16)), min_size=1, max_size=3),
    fill=st.booleans(), future=st.booleans(), seed=st.integers(0, 2**31 - 1)))


def draw_problem(s, *, d=None, bk=None):
    lk = [a + b for a, b in s["lens"]]
    lq = [b for _, b in s["lens"]]
    return problem(lq, lk, s["g"] * s["hkv"], s["hkv"], d or s["d"], bk or s["bk"], s["topk"],
                   seed=s["seed"], fill=s["fill"], future=s["future"])


small_shapes = st.fixed_dictionaries(dict(
    g=st.sampled_from([1, 2, 4, 16]), hkv=st.just(1), d=st.just(16), bk=st.just(16),
    topk=st.integers(1, 3),
    lens=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 12)), min_size=1, max_size=2),
    fill=st.booleans(), future=st.booleans(), seed=st.integers(0, 2**31 - 1)))


def big_problem(lq, lk, hq, hkv, d, bk, topk, seed):
    rng = np.random.default_rng(seed)
    cu_q, cu_k = cu(lq), cu(lk)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q = rng.standard_normal((tq, hq, d), dtype=np.float32)
    k = rng.standard_normal((tk, hkv, d), dtype=np.float32)
    v = rng.standard_normal((tk, hkv, d), dtype=np.float32)
    I = selection(cu_q, cu_k, hkv, topk, bk, seed, hot=(0,), fill=True)
    return q, k, v, I, cu_q, cu_k


def torch_bf16(x):
    torch = pytest.importorskip("torch")
    return torch.from_numpy(x).to("cuda", torch.bfloat16)
