"""msa.cuda.attention.sparse_attention_backward (versions 1 and 2) against
msa.reference.attention.sparse_attention_backward (the gradient of eq 8).

Version 1 computes in float32: within the float32 reference's error of the float64 oracle.
Version 2 rounds P and dS to the inputs' 16-bit type before their products, as FlashAttention's
backward does; ``rounding_bounds`` gives what that may change elementwise, and ``check_backward``
allows twice it before the float32 check (``attention_cases`` has the problems).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from msa.cuda import attention as gpu
from msa.cuda._core.arrays import SIMULATOR
from msa.cuda.attention._backward import _sparse_attention_backward, backward_version
from msa.cuda.attention._plan import Spec
from msa.reference import attention as ref
from msa.reference.attention import _supports
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
    version = kw.get("version") or backward_version(Spec(q, k, v, bf16_bits=bf16), bk)
    check_backward(got, oracle, baseline, factor, bounds, U16[kind] if version == 2 else 0.0)
    return tuple(to_numpy(x) for x in got)


@pytest.mark.parametrize("lq,lk,hq,hkv,d,bk,topk,sel", [c[1:] for c in SPARSE_CASES],
                         ids=[c[0] for c in SPARSE_CASES])
def test_backward_matches_reference(lq, lk, hq, hkv, d, bk, topk, sel):
    p, I = problem(lq, lk, hq, hkv, d, bk, topk, seed=sum(lk) + 1, **sel)
    run_backward(p, I, "float32")


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_backward_half_precision_inputs(kind):
    """Version 1 on 16-bit inputs (Bk = 8: version 2 needs multiples of 16)."""
    p, I = problem([13, 9], [21, 30], 8, 2, 16, 8, 3, seed=4, fill=False, future=True)
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
    """Version 2 for 16-bit inputs with D and Bk multiples of 16 up to 128, else version 1."""
    def spec(kind, d, g=2):
        q = np.zeros((3, 2 * g, d), np.float32)
        k = np.zeros((5, 2, d), np.float32)
        return Spec(*(cast(x, kind)[0] for x in (q, k, k)), bf16_bits=True)

    assert gpu.default_backward_version(*(np.zeros((3, 4, 16), np.float16),) * 3, 16) == 2
    assert backward_version(spec("float32", 16), 16) == 1
    assert backward_version(spec("float16", 16), 16) == 2
    assert backward_version(spec("bfloat16", 128), 128) == 2
    assert backward_version(spec("float16", 16), 8) == 1  # Bk not a multiple of 16
    assert backward_version(spec("float16", 16), 256) == 1  # Bk > 128
    assert backward_version(spec("float16", 24), 16) == 1  # D not a multiple of 16
    assert backward_version(spec("float16", 256), 16) == 1  # D > 128


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
    q, k, v, I, cu_q, cu_k = big_problem([4096], [4096], 64, 4, 128, 128, 16, seed=5)
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
    args = (*(torch_bf16(x) for x in (q32, k32, v32, o32)), torch.from_numpy(lse).cuda(),
            torch_bf16(do32), torch.from_numpy(I).cuda(), cu_q, cu_k, 128)
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
