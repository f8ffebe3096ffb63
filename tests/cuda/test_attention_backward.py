"""msa.cuda.attention.sparse_attention_backward (versions 1, 2 and 3) against
msa.reference.attention.sparse_attention_backward (the gradient of eq 8).

Version 1 computes in float32: within the float32 reference's error of the float64 oracle.
Versions 2 and 3 round P and dS to the inputs' 16-bit type before their products, as
FlashAttention's backward does; ``rounding_bounds`` gives what that may change elementwise, and
``check_backward`` allows twice it before the float32 check (``attention_cases`` has the
problems). Version 3 (``wgmma``; its twins in the simulator) gives version 2's bits in the
simulator, where both multiply with the same arithmetic.

Masking by selection (docs/design.md §3): a query's dq does not depend on a key it cannot see
(its K and V NaN, ±inf or huge leave dq bitwise unchanged), nor on another query's D; where it
sees a non-finite key its dq is NaN exactly where the reference's is.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from msa.cuda import attention as gpu
from msa.cuda._core.arrays import SIMULATOR
from msa.cuda._core.wgmma import why_not_available
from msa.cuda._core.memops import store_f32x2
from msa.cuda.attention._backward import (_sparse_attention_backward, backward_version,
                                          default_part_size)
from msa.cuda.attention._plan import Spec
from msa.reference import attention as ref
from msa.reference.attention import _supports
from msa.reference.blocks import key_positions, query_positions
from msa.testing.backends import to_numpy
from msa.testing.strategies import fewer_in_simulator
from msa.testing.tolerance import assert_close_to_oracle, oracle_and_baseline

from .attention_cases import (SPARSE_CASES, U16, V2_CASES, bf16_bits_to_f32, big_problem, cast,
                              draw_problem, f32_to_bf16_bits, problem, shapes, small_shapes,
                              torch_bf16)


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


def bf16_partial_bounds(bounds, kind):
    """``rounding_bounds`` with bf16 dQ partials (``partial_dtype="bfloat16"``): each (query,
    head, slot) share ``sum_j dS_j K_j`` is rounded once more, by at most bf16's unit roundoff
    times ``sum_j |dS_j| |K_j|``, whose sum over the slots is dq's bound; ``check_backward``
    allows ``2 u`` times a bound, so dq's grows by ``U16[bf16] / (2 u)``."""
    bq, bk_, bv = bounds
    return bq * (1.0 + U16["bfloat16"] / (2 * U16[kind])), bk_, bv


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
    bf16 = kind == "bfloat16"
    got = _sparse_attention_backward(q, k, v, o, lse, do, I, cu_q, cu_k, bk, bf16_bits=bf16,
                                     **kw)
    factor = factor if SIMULATOR else max(factor, 4.0)  # expf on the GPU: 2 ulp
    bounds = rounding_bounds(q32, k32, v32, o32, lse, do32, I, cu_q, cu_k, bk)
    if kw.get("partial_dtype") == "bfloat16":
        bounds = bf16_partial_bounds(bounds, kind)
    version = kw.get("version") or backward_version(Spec(q, k, v, bf16_bits=bf16), bk)
    check_backward(got, oracle, baseline, factor, bounds, U16[kind] if version >= 2 else 0.0)
    return tuple(to_numpy(x) for x in got)


@pytest.mark.parametrize("lq,lk,hq,hkv,d,bk,topk,sel", [c[1:] for c in SPARSE_CASES],
                         ids=[c[0] for c in SPARSE_CASES])
def test_backward_matches_reference(lq, lk, hq, hkv, d, bk, topk, sel):
    p, I = problem(lq, lk, hq, hkv, d, bk, topk, seed=sum(lk) + 1, **sel)
    run_backward(p, I, "float32")


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_backward_half_precision_inputs(kind):
    """Version 1 on 16-bit inputs (Bk = 8: version 2 needs multiples of 16); G = 2 in the
    simulator (a Python thread per CUDA thread: its time grows with the heads), G = 4 on a GPU."""
    hq = 4 if SIMULATOR else 8
    p, I = problem([13, 9], [21, 30], hq, 2, 16, 8, 3, seed=4, fill=False, future=True)
    run_backward(p, I, kind)


@pytest.mark.parametrize("kind", [pytest.param("float16", marks=pytest.mark.sim_heavy),
                                  "bfloat16"])
@pytest.mark.parametrize("lq,lk,hq,hkv,d,bk,topk,sel",
                         [c[1:] for c in SPARSE_CASES if c[0] in V2_CASES | {"decode-future-blocks"}],
                         ids=[c[0] for c in SPARSE_CASES if c[0] in V2_CASES | {"decode-future-blocks"}])
def test_backward_v2_matches_reference(lq, lk, hq, hkv, d, bk, topk, sel, kind):
    """The tensor-core backward (the default for 16-bit inputs): the reference's gradient up to
    the roundings of P and dS to 16 bits."""
    p, I = problem(lq, lk, hq, hkv, d, bk, topk, seed=sum(lk) + 3, **sel)
    run_backward(p, I, kind, version=2)


@pytest.mark.parametrize("d", [32, 48])
def test_backward_v2_stages_rows_of_several_pieces(d):
    """Version 2 stages a row of Q and dO with ``TPR`` threads of ``PPT`` 16-byte pieces each
    (D = 32: 4 threads of one piece; D = 48: 2 threads of 3; the other cases have D = 16, 2 of
    1): the reference's gradient up to the roundings of P and dS."""
    p, I = problem([20], [20], 2, 1, d, 16, 2, seed=d)
    run_backward(p, I, "bfloat16", version=2)


# the simulator runs Bk = 128 (both warpgroups; Bk = 64 is one of them), a GPU all three
@pytest.mark.parametrize("case", [pytest.param("G=2-D=16", marks=pytest.mark.sim_heavy), "Bk=128",
                                  pytest.param("G=16-hot-parts-chunks",
                                               marks=pytest.mark.sim_heavy)])
def test_backward_v3_matches_reference_and_version_2(case):
    """Version 3 (Bk = 64: one warpgroup; D = 16, G = 2, 64-row tiles of 32 positions; Bk =
    128: two warpgroups, each dQ's half of D over both groups' dSᵀ) against the reference, and
    in the simulator bitwise version 2's gradient; on a GPU also with G = 16, D = 32, two
    sequences, a hot row in parts of 3 and query chunks of 9."""
    if case == "G=2-D=16":
        p, I = problem([20], [130], 4, 2, 16, 64, 2, seed=12)
        kw = {}
    elif case == "Bk=128":
        p, I = problem([12], [140], 4, 2, 16, 128, 2, seed=7)
        kw = {}
    else:
        p, I = problem([30, 7], [200, 90], 16, 1, 32, 64, 3, seed=5, hot=(0,))
        kw = dict(part_size=3, max_partial_bytes=3 * 9 * 16 * 32 * 4)
    a = run_backward(p, I, "bfloat16", version=3, **kw)
    b = run_backward(p, I, "bfloat16", version=2, **kw)
    if SIMULATOR:
        for x, y in zip(a, b):
            assert x.tobytes() == y.tobytes()


# [2-float16] runs on a GPU (and with MSA_SIM_FULL=1): the same version 2 kernel and roundings
# as [2-bfloat16], whose float16 loads the visible non-finite and NaN-delta tests' [float16-2]
# cases run in the simulator
@pytest.mark.parametrize("version,kind", [(2, "bfloat16"),
                                          pytest.param(2, "float16", marks=pytest.mark.sim_heavy),
                                          pytest.param(3, "bfloat16",
                                                       marks=pytest.mark.sim_heavy)])
def test_backward_bf16_dq_partials(version, kind):
    """``partial_dtype="bfloat16"``: dq within the reference's error plus one bf16 rounding of
    each slot's share (``bf16_partial_bounds``), not float32's dq bit for bit (the roundings
    happen), and dk, dv bitwise float32 partials' (one chunk either way: the same sums). Version
    3 in the simulator: bitwise version 2's."""
    p, I = problem([20, 9], [40, 30], 4, 2, 16, 16 if version == 2 else 64, 3, seed=21,
                   hot=(0,))
    half = run_backward(p, I, kind, version=version, partial_dtype="bfloat16", part_size=2)
    full = run_backward(p, I, kind, version=version, partial_dtype="float32", part_size=2)
    assert half[0].tobytes() != full[0].tobytes()
    for x, y in zip(half[1:], full[1:]):
        assert x.tobytes() == y.tobytes()
    if version == 3 and SIMULATOR:
        v2 = run_backward(p, I, kind, version=2, partial_dtype="bfloat16", part_size=2)
        for x, y in zip(half, v2):
            assert x.tobytes() == y.tobytes()


@pytest.mark.parametrize("partial_dtype,version,kind,match", [
    ("float16", 2, np.float16, "partial_dtype must be float32 or bfloat16"),
    ("bfloat16", 1, np.float16, "partial_dtype='bfloat16' needs version 2 or 3 .* here version=1"),
    ("bfloat16", None, np.float32, "needs version 2 or 3 .* version 2 does not support float32")])
def test_backward_partial_dtype_errors(partial_dtype, version, kind, match):
    p, I = problem([9], [9], 2, 1, 16, 16, 2, seed=1)
    q, k, v = (x.astype(kind) for x in (p.q, p.k, p.v))
    o, lse = ref.sparse_attention(p.q, p.k, p.v, I, p.cu_seqlens_q, p.cu_seqlens_k, 16)
    with pytest.raises(ValueError, match=match):
        gpu.sparse_attention_backward(q, k, v, o.astype(kind), lse.astype(np.float32),
                                      o.astype(kind), I, p.cu_seqlens_q, p.cu_seqlens_k,
                                      16, version=version, partial_dtype=partial_dtype)


@pytest.mark.sim_heavy  # ~7 min in the simulator
def test_backward_v2_two_warps_chunks_and_parts():
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


def test_backward_v2_empty_supports_give_zero():
    p, _ = problem([20], [20], 4, 2, 16, 16, 2, seed=6)
    I = np.full((20, 2, 2), -1, dtype=np.int32)
    I[:, 1, 0] = 1  # group 1 sees block 1 (positions 16..19) from query 16 on; group 0 nothing
    dq, dk, dv = run_backward(p, I, "float16", version=2)
    assert (dq[:, :2] == 0).all() and (dq[:16, 2:] == 0).all() and (dq[16:, 2:] != 0).any()
    assert (dk[:, 0] == 0).all() and (dv[:, 0] == 0).all() and (dv[:16, 1] == 0).all()


def test_default_backward_version():
    """Version 3 on a GPU of compute capability 9.0 for 16-bit inputs with D a multiple of 16
    up to 128 and Bk 64 or 128, else version 2 for D and Bk multiples of 16 up to 128, else
    version 1; version 2 in the simulator."""
    def spec(kind, d, g=2):
        q = np.zeros((3, 2 * g, d), np.float32)
        k = np.zeros((5, 2, d), np.float32)
        return Spec(*(cast(x, kind)[0] for x in (q, k, k)), bf16_bits=True)

    assert gpu.default_backward_version(*(np.zeros((3, 4, 16), np.float16),) * 3, 16) == 2
    assert backward_version(spec("float32", 16), 16) == 1
    assert backward_version(spec("float16", 16), 16) == 2
    v3 = not SIMULATOR and why_not_available() is None
    assert backward_version(spec("bfloat16", 128), 128) == (3 if v3 else 2)
    assert backward_version(spec("float16", 32), 64) == (3 if v3 else 2)
    assert backward_version(spec("float16", 16), 8) == 1  # Bk not a multiple of 16
    assert backward_version(spec("float16", 16), 256) == 1  # Bk > 128
    assert backward_version(spec("float16", 24), 16) == 1  # D not a multiple of 16
    assert backward_version(spec("float16", 256), 16) == 1  # D > 128


def test_backward_v3_says_why_it_cannot_run():
    """Version 3 needs Bk of 64 or 128 (and what version 2 needs): a ValueError naming the
    reason and the versions that run, before any launch."""
    p, I = problem([9], [9], 2, 1, 16, 16, 2, seed=1)
    q, k, v = (cast(x, "float16")[0] for x in (p.q, p.k, p.v))
    o, lse = ref.sparse_attention(p.q, p.k, p.v, I, p.cu_seqlens_q, p.cu_seqlens_k, 16)
    o = cast(o, "float16")[0]
    with pytest.raises(ValueError, match=r"version=3.*block_size=16 \(64 or 128.*version=1 or 2"):
        gpu.sparse_attention_backward(q, k, v, o, lse.astype(np.float32), o.copy(), I,
                                      p.cu_seqlens_q, p.cu_seqlens_k, 16, version=3)


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
    p, I = draw_problem(s)
    run_backward(p, I, "float32", part_size=part_size)


@fewer_in_simulator(2)  # the twin mma and ldmatrix cost simulator barriers per call
@given(s=small_shapes, part_size=st.sampled_from([None, 1, 3]), chunk=st.sampled_from([None, 5]))
def test_backward_v2_property(s, part_size, chunk):
    """Version 2 on drawn problems (G, varlen, empty and future selections), hot rows in parts
    and query chunks of 5 (``max_partial_bytes``)."""
    p, I = draw_problem(s)
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


# In the simulator part size 3 on the varlen case, whose rows of up to 12 queries are cut into
# up to 4 parts (the skewed sink's uncut hot row: test_backward_matches_reference[skewed-sink];
# G = 16 has its own backward test)
@pytest.mark.parametrize("case,part_size", [
    pytest.param(case, part_size, id=f"{case}-{part_size}",
                 marks=() if part_size == 3 and case == "many-seqs-empty-Lq<Lk"
                 else pytest.mark.sim_heavy)
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


def test_backward_hot_rows_of_a_head_dim_not_a_multiple_of_4():
    """D = 6: the parts' sum one element at a time (``dkdv_sum_kernel`` takes four at a time
    where D is a multiple of 4): the reference's gradient, a sink row in parts of 2."""
    p, I = problem([21], [21], 2, 1, 6, 8, 2, seed=9, hot=(0,))
    run_backward(p, I, "float32", part_size=2)


@pytest.mark.parametrize("how", ["past-the-end", "below-minus-one", "duplicates", "holes"])
def test_backward_unvalidated_bad_indices_stay_in_bounds(how):
    """With ``validate=False`` a malformed selection gives an unspecified but finite result and
    no out-of-bounds access (the simulator raises IndexError on one). Fewer queries of the same
    sequences in the simulator (a Python thread per CUDA thread)."""
    p, I = problem([6, 4] if SIMULATOR else [12, 7], [20, 9], 4, 2, 16, 4, 3, seed=8)
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


@pytest.mark.parametrize("flat,ok", [(0, True), (22, True), (5, False)])
def test_store_f32x2_writes_two_floats_of_a_4d_array(flat, ok):
    """``store_f32x2`` (the dQ partials' stores) writes ``a.flat[flat:flat+2]`` of a C-contiguous
    4-D array from an unsigned offset; the simulator refuses an odd offset, which the GPU's
    ``st.global.v2`` would fault on."""
    from numba import cuda, float32, uint64

    @cuda.jit
    def kernel(a, flat):
        store_f32x2(a, uint64(flat), float32(1.5), float32(-2.0))

    if not ok and not SIMULATOR:
        pytest.skip("the GPU faults instead (misaligned address)")
    a = np.full((2, 3, 2, 4), np.nan, np.float32)  # every other element must stay NaN
    want = np.full(a.size, np.nan, np.float32)
    if ok:
        kernel[1, 1](a, flat)
        want[flat:flat + 2] = (1.5, -2.0)
        np.testing.assert_array_equal(bits(a.reshape(-1)), bits(want))
    else:
        with pytest.raises(AssertionError, match="8-byte boundary"):
            kernel[1, 1](a, flat)


@pytest.mark.parametrize("entries,topk,bk,want", [
    (8192 * 4 * 16, 16, 128, 512),  # the paper's 8K-query chunk (4 GiB of dQ partials): 1024 parts
    (8192 * 4 * 16 + 1, 16, 128, 1024),  # just past it: rounded up to the next power of two
    (1 << 30, 16, 128, 4096),  # capped at 2 K Bk, the forward's hot-row cut
    (1 << 30, 2, 8, 256),  # ... unless that is below the least part, 256 entries
    (1, 16, 128, 256), (0, 1, 1, 256),  # a tiny chunk: one part a row up to 256 entries
])
def test_default_part_size(entries, topk, bk, want):
    """The backward's default part: ~1024 parts a chunk, a power of two in [256, 2 K Bk]."""
    assert default_part_size(entries, topk, bk) == want


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
    q, k, v, I, cu_q, cu_k = big_problem([4096], [4096], 64, 4, 128, 128, 16, seed=5)
    q32, k32, v32 = (bf16_bits_to_f32(f32_to_bf16_bits(x)) for x in (q, k, v))
    o_f, lse = ref.sparse_attention(q32, k32, v32, I, cu_q, cu_k, 128)
    o32 = bf16_bits_to_f32(f32_to_bf16_bits(o_f))
    do32 = bf16_bits_to_f32(f32_to_bf16_bits(np.random.default_rng(3).standard_normal(o_f.shape)))
    inputs = (q32, k32, v32, o32, lse, do32, I, cu_q, cu_k)
    oracle, baseline = oracle_and_baseline(ref.sparse_attention_backward, *inputs, 128)
    return inputs, oracle, baseline, rounding_bounds(*inputs, 128)


@pytest.mark.big
@pytest.mark.parametrize("version", [1, 2, 3])
def test_big_backward_paper_configuration(version):
    """Hq=64, Hkv=4, D=128, Bk=128, K=16, one 4K sequence, bf16 (torch), sink + random; and a
    rerun bitwise equal. Versions 2 and 3 also in query chunks of 1000 (dQ partials of 1000 queries),
    which must give the same dq bitwise and dk, dv within the same bounds, and with bf16 dQ
    partials (dq within one more rounding, dk and dv bitwise)."""
    torch = pytest.importorskip("torch")
    (q32, k32, v32, o32, lse, do32, I, cu_q, cu_k), oracle, baseline, bounds = (
        _paper_config_backward_4k())
    args = (*(torch_bf16(x) for x in (q32, k32, v32, o32)), torch.from_numpy(lse).cuda(),
            torch_bf16(do32), torch.from_numpy(I).cuda(), cu_q, cu_k, 128)
    got = gpu.sparse_attention_backward(*args, version=version, validate=False)
    check_backward([x.cpu().numpy() for x in got], oracle, baseline, 4.0, bounds,
                   U16["bfloat16"] if version >= 2 else 0.0)
    again = gpu.sparse_attention_backward(*args, version=version, validate=False)
    for x, y in zip(got, again):
        assert torch.equal(x, y)
    if version >= 2:
        chunked = gpu.sparse_attention_backward(*args, version=version, validate=False,
                                                max_partial_bytes=16 * 1000 * 64 * 128 * 4)
        assert torch.equal(chunked[0], got[0])
        check_backward([x.cpu().numpy() for x in chunked], oracle, baseline, 4.0, bounds,
                       U16["bfloat16"])
        # bf16 dQ partials: one more rounding of dq's slot shares; dk, dv float32 partials'
        half = gpu.sparse_attention_backward(*args, version=version, validate=False,
                                             partial_dtype="bfloat16")
        check_backward([x.cpu().numpy() for x in half], oracle, baseline, 4.0,
                       bf16_partial_bounds(bounds, "bfloat16"), U16["bfloat16"])
        assert torch.equal(half[1], got[1]) and torch.equal(half[2], got[2])


# --- masking by selection ----------------------------------------------------------------------

POISONS = [float("nan"), float("inf"), float("-inf"), 1e30]


def bits(x):
    """The bit pattern of a float array (NaN == NaN of the same bits, -0.0 != 0.0)."""
    x = np.ascontiguousarray(to_numpy(x))
    return x.view(np.dtype(f"u{x.itemsize}"))


def blind_rows(p, I, j):
    """bool [Tq, Hq]: the (query, head) rows that cannot see packed key ``j`` (another sequence,
    a later position, or a block their group did not select; as tests/test_masked_keys.py)."""
    tq, tk = p.q.shape[0], p.k.shape[0]
    bq, pq = query_positions(p.cu_seqlens_q, p.cu_seqlens_k, tq, tk)
    bk_, pk = key_positions(p.cu_seqlens_k, tk)
    causal = (bq == bk_[j]) & (pk[j] <= pq)  # [Tq]
    selected = (np.asarray(I) == pk[j] // p.block_size).any(axis=-1)  # [Tq, Hkv]
    return np.repeat(~(causal[:, None] & selected), p.q.shape[1] // p.k.shape[1], axis=1)


@contextlib.contextmanager
def quiet():
    """NumPy's warnings off: the poisons make overflow and invalid-value warnings on purpose."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def poisoned_backward(p, I, kind, version, k_bad, v_bad, nan_o_query=None, grads=False):
    """dq of the kernel on the clean inputs and on ``k_bad``, ``v_bad`` (float32 arrays, the
    kernel gets them in ``kind``), both given the clean forward's o and lse (the reference's, as
    the backward contract asks) and the same dO; ``nan_o_query``: the second run's o is NaN
    for that query. Also the reference's dq on the second run's values. Returns ``(dq1, dq2,
    ref_dq2)``, or with ``grads`` the three ``(dq, dk, dv)`` triples."""
    cu_q, cu_k, bk = p.cu_seqlens_q, p.cu_seqlens_k, p.block_size
    (q, q32), (k, k32), (v, v32) = cast(p.q, kind), cast(p.k, kind), cast(p.v, kind)
    o_f, lse = ref.sparse_attention(q32, k32, v32, I, cu_q, cu_k, bk)
    (o, _), (do, do32) = cast(o_f, kind), cast(
        np.random.default_rng(5).standard_normal(o_f.shape), kind)
    with quiet():
        (k2, k2_32), (v2, v2_32) = cast(k_bad, kind), cast(v_bad, kind)
        o_bad = np.array(o_f, np.float32)
        if nan_o_query is not None:
            o_bad[nan_o_query] = np.nan
        o2, o2_32 = cast(o_bad, kind)
        bf16 = kind == "bfloat16"
        run = functools.partial(_sparse_attention_backward, bf16_bits=bf16, version=version)
        g1 = [to_numpy(x) for x in run(q, k, v, o, lse, do, I, cu_q, cu_k, bk)]
        g2 = [to_numpy(x) for x in run(q, k2, v2, o2, lse, do, I, cu_q, cu_k, bk)]
        ref_g2 = ref.sparse_attention_backward(q32, k2_32, v2_32, o2_32, lse, do32, I, cu_q,
                                               cu_k, bk)
    return (g1, g2, ref_g2) if grads else (g1[0], g2[0], ref_g2[0])


def assert_other_keys_unchanged(g1, g2, keys, what):
    """dk and dv of every key in ``keys`` (bool [Tk]) bitwise those of the clean run: given o,
    lse and dO, a key's own gradients read only its own scores and values."""
    for name, a, b in (("dk", g1[1], g2[1]), ("dv", g1[2], g2[2])):
        changed = keys & (bits(a) != bits(b)).reshape(len(keys), -1).any(-1)
        assert not changed.any(), f"{name} of keys {np.flatnonzero(changed)[:5]} changed ({what})"


def check_poisoned_key(p, I, kind, version, j, value):
    """Key ``j`` (its K and V, every head) set to ``value``: the dq of every row that cannot see
    it is bitwise unchanged, and the dq of the rows that do is NaN where the reference's is."""
    k_bad, v_bad = (np.array(x, np.float32) for x in (p.k, p.v))
    k_bad[j] = value
    v_bad[j] = value
    g1, g2, ref_g2 = poisoned_backward(p, I, kind, version, k_bad, v_bad, grads=True)
    (dq1, dq2, ref_dq2), blind = (g1[0], g2[0], ref_g2[0]), blind_rows(p, I, j)
    assert np.array_equal(bits(dq1)[blind], bits(dq2)[blind]), (
        f"dq of rows that cannot see key {j} = {value} changed: "
        f"{np.argwhere(blind & (bits(dq1) != bits(dq2)).any(-1))[:5].tolist()}")
    np.testing.assert_array_equal(np.isnan(dq2), np.isnan(ref_dq2))
    assert_other_keys_unchanged(g1, g2, np.arange(p.k.shape[0]) != j, f"key {j} = {value}")
    if blind.all():  # no row sees key j: its gradients are 0, whatever it holds
        assert not g2[1][j].any() and not g2[2][j].any()


def later_in_a_local_block(p):
    """The packed keys that sit after some query of their sequence inside that query's local
    block: the keys a tile holds for a query that cannot see them."""
    tq, tk = p.q.shape[0], p.k.shape[0]
    bq, pq = query_positions(p.cu_seqlens_q, p.cu_seqlens_k, tq, tk)
    bk_, pk = key_positions(p.cu_seqlens_k, tk)
    bs = p.block_size
    later = ((bq[:, None] == bk_[None, :]) & (pq[:, None] // bs == pk[None, :] // bs)
             & (pq[:, None] < pk[None, :]))  # [Tq, Tk]
    return np.flatnonzero(later.any(axis=0))


def masking_cases(shape_strategy):
    """``(problem, I, j, value)``: a drawn problem, a key and a poison. The key is, where there
    is one and half of the time, a key after a query of its local block (which the query's tile
    holds but it cannot see); else any key, counted from the end (the simplest example poisons
    the last key, which fewest queries see)."""
    @st.composite
    def draw(draw_):
        p, I = draw_problem(draw_(shape_strategy))
        assume(p.k.shape[0] > 0 and p.q.shape[0] > 0)
        later = later_in_a_local_block(p)
        if later.size and draw_(st.booleans()):
            j = int(later[draw_(st.integers(0, later.size - 1))])
        else:
            j = p.k.shape[0] - 1 - draw_(st.integers(0, p.k.shape[0] - 1))
        return p, I, j, draw_(st.sampled_from(POISONS))

    return draw()


# Two KV heads only with G <= 4 (at most 16 query heads): version 1 runs a thread a (query,
# head) row, and a drawn G = 16 x Hkv = 2 problem was 14 s of the test's 30 s in the simulator
@fewer_in_simulator(4)
@given(case=masking_cases(shapes.filter(lambda s: s["hkv"] == 1 or s["g"] <= 4)))
def test_backward_v1_dq_ignores_keys_it_cannot_see(case):
    """Version 1 (float32): a poisoned key (NaN, ±inf, 1e30 in K and V) moves no bit of the dq
    of a row that cannot see it (a later position in its local block, an unselected block,
    another sequence), nor of any other key's dk and dv."""
    check_poisoned_key(*case[:2], "float32", 1, *case[2:])


# float16 runs on a GPU (and with MSA_SIM_FULL=1): [bfloat16] draws the same problems and
# poisons through the same version 2 kernel (the float16 loads of poisons: the visible non-finite
# and NaN-delta tests' [float16-2] cases)
@pytest.mark.parametrize("kind", [pytest.param("float16", marks=pytest.mark.sim_heavy),
                                  "bfloat16"])
@fewer_in_simulator(4)
@given(case=masking_cases(small_shapes))
def test_backward_v2_dq_ignores_keys_it_cannot_see(kind, case):
    """Version 2 (D = Bk = 16): as version 1; 1e30 is +inf in float16, a finite value whose
    scores overflow in bfloat16."""
    check_poisoned_key(*case[:2], kind, 2, *case[2:])


# bfloat16 runs on a GPU (and with MSA_SIM_FULL=1): [float16-2] is the same problem through
# the same version 2 kernel (the bf16 loads of poisons: test_backward_v2_dq_ignores_keys_it_
# cannot_see[bfloat16])
@pytest.mark.parametrize("kind,version", [("float32", 1), ("float16", 2),
                                          pytest.param("bfloat16", 2, marks=pytest.mark.sim_heavy),
                                          ("bfloat16", 3)])
def test_backward_visible_nonfinite_keys_give_the_references_nans(kind, version):
    """Single non-finite K values (V finite) that some rows see: ``K[5, :, 3] = +inf``,
    ``K[17, :, 9] = -inf``, ``K[20, :, 0] = NaN``. In the reference a visible non-finite
    ``K[c, d]`` makes ``dq[t, d]`` NaN (its score is ±inf or NaN: dS is 0, giving 0 * inf, or
    non-finite), and the whole row NaN where dS is non-finite (times the key's zeroed row); the
    kernel's dq has the same NaNs and infinities, and the rows that see none are unchanged.
    Version 3 (one 64-key block) reads a cleaned copy of K for dQ in that block."""
    p, I = problem([24], [24], 4, 2, 16, 64 if version == 3 else 16, 2, seed=9)
    k_bad = np.array(p.k, np.float32)
    for c, d, x in ((5, 3, np.inf), (17, 9, -np.inf), (20, 0, np.nan)):
        k_bad[c, :, d] = x
    dq1, dq2, ref_dq2 = poisoned_backward(p, I, kind, version, k_bad, np.array(p.v, np.float32))
    np.testing.assert_array_equal(np.isnan(dq2), np.isnan(ref_dq2))
    np.testing.assert_array_equal(np.isinf(dq2), np.isinf(ref_dq2))
    whole = np.isnan(ref_dq2).all(-1)
    some = np.isnan(ref_dq2).any(-1) & ~whole
    assert whole.any() and some.any()  # both kinds of rows (a dS = 0 and a non-finite dS)
    blind = blind_rows(p, I, 5) & blind_rows(p, I, 17) & blind_rows(p, I, 20)
    assert blind.any()
    assert np.array_equal(bits(dq1)[blind], bits(dq2)[blind])
    finite = ~np.isnan(ref_dq2) & ~np.isinf(ref_dq2)
    np.testing.assert_allclose(dq2[finite], ref_dq2[finite], rtol=0.05, atol=0.05)


@pytest.mark.parametrize("kind,version", [("float32", 1), ("float16", 2)])
def test_backward_nan_delta_stays_in_its_query(kind, version):
    """A NaN in one query's o makes its D = rowsum(dO O) NaN: the dq of every other query is
    bitwise unchanged (D enters dS of its own rows only, and dS is 0 by selection elsewhere)."""
    p, I = problem([20], [20], 4, 2, 16, 16, 2, seed=6)
    g1, g2, _ = poisoned_backward(p, I, kind, version, np.array(p.k, np.float32),
                                  np.array(p.v, np.float32), nan_o_query=7, grads=True)
    dq1, dq2 = g1[0], g2[0]
    others = np.arange(dq1.shape[0]) != 7
    assert np.array_equal(bits(dq1)[others], bits(dq2)[others])
    assert np.isnan(dq2[7]).all()
    # dV = P^T dO reads no D: every key's unchanged; dK only of the keys query 7 cannot see
    np.testing.assert_array_equal(bits(g1[2]), bits(g2[2]))
    blind_to_7 = np.array([blind_rows(p, I, j)[7].all() for j in range(p.k.shape[0])])
    assert blind_to_7.any() and not blind_to_7.all()
    assert_other_keys_unchanged(g1, g2, blind_to_7, "a NaN o of query 7")
