"""msa.cuda.combine (K2) against msa.reference.combine: exact LSE merge of the KV-outer partials.

Floats compare with ``msa.testing.tolerance``: the oracle is the reference on float64 copies of
the partials, the baseline the reference on the float32 partials the kernel gets. Outputs the
launcher allocates start as NaN, and unused slots hold NaN partials, so a row the kernel forgets,
or an unused slot it reads, cannot pass. Every test runs each kernel version (``VERSIONS``); v2's
16-byte-load path and its fallback to v1 are pinned by the version ``launch_combine`` says ran.

v1 and v2 sum in different orders (v2: slot groups met by a butterfly, the LSE sum by a warp
butterfly), so they agree up to float32 rounding, and bit for bit when K = 1.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from msa.cuda import combine as gpu
from msa.cuda._core.arrays import SIMULATOR, ArrayContext
from msa.cuda._core.memops import is_aligned16
from msa.reference import combine as ref
from msa.testing.backends import to_numpy
from msa.testing.tolerance import assert_close_to_oracle, oracle_and_baseline

VERSIONS = pytest.mark.parametrize("version", gpu.VERSIONS, ids=[f"v{v}" for v in gpu.VERSIONS])


def partials(num_slots, tq, hq, d, seed, *, unused=0.3, empty_rows=0.1, spread=4.0):
    """Random ``(o_part, lse_part)`` float32: a fraction of slots unused (-inf, NaN partial),
    a fraction of (query, head) rows with every slot unused, LSEs spread over ``spread``."""
    rng = np.random.default_rng(seed)
    o = rng.standard_normal((num_slots, tq, hq, d)).astype(np.float32)
    lse = (rng.standard_normal((num_slots, tq, hq)) * spread).astype(np.float32)
    off = rng.random((num_slots, tq, hq)) < unused
    off |= (rng.random((tq, hq)) < empty_rows)[None]
    lse[off] = -np.inf
    o[off] = np.nan  # an unused slot's O_s must never be read
    return o, lse


def bf16_bits_to_f32(bits):
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x):
    """Round to nearest even, as cvt.rn.bf16.f32 (finite inputs)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def check_against_reference(o_part, lse_part, out_dtype=None, version=gpu.DEFAULT_VERSION):
    o, lse = gpu.combine_partials(o_part, lse_part, out_dtype=out_dtype, version=version)
    return compare_to_reference(to_numpy(o), to_numpy(lse), o_part, lse_part, out_dtype)


def lse_term_scale(lse_part):
    """What a float32 ``L = a + log(total)`` rounds at: ``|a| + log(total) + 1`` at worst over the
    rows, ``a = max_s L_s``, ``total = sum_s exp(L_s - a)`` in ``[1, K]`` (its own rounding, a
    relative error of a few eps, is an absolute one in ``log(total)``: the ``+ 1``). A kernel
    that sums ``total`` in another order than the reference may be that far off when ``a`` and
    ``log(total)`` nearly cancel, even where the reference happens to be exact. Found by the
    thorough profile: ``a = -0.230``, ``log(total) = 0.256``, ``L = 0.0258``, kernel 9.2e-8 off,
    reference 3.3e-9."""
    ls = np.asarray(lse_part, dtype=np.float64)  # [K, Tq, Hq]
    used = np.isfinite(ls).any(axis=0)  # [Tq, Hq]
    if not used.any():
        return 0.0
    a = np.where(used, np.max(np.where(np.isfinite(ls), ls, -np.inf), axis=0), 0.0)
    total = np.sum(np.where(np.isfinite(ls), np.exp(ls - a), 0.0), axis=0)
    return float(np.max(np.where(used, np.abs(a) + np.log(np.maximum(total, 1.0)) + 1.0, 0.0)))


def compare_to_reference(o, lse, o_part, lse_part, out_dtype=None):
    """``o``/``lse`` (host) against the float64 reference on the float32 ``o_part``/``lse_part``;
    returns ``o`` widened to float32 and ``lse``."""
    (o_ref, lse_ref), (o_base, lse_base) = oracle_and_baseline(ref.combine_partials, o_part, lse_part)
    assert lse.dtype == np.float32
    assert_close_to_oracle(lse, lse_ref, lse_base, name="lse", scale=lse_term_scale(lse_part))
    empty = np.isneginf(lse_ref)
    if out_dtype == "bfloat16":
        assert o.dtype == np.uint16
        # baseline: the float32 result rounded to bf16, what any float32 kernel would store
        assert_close_to_oracle(bf16_bits_to_f32(o), o_ref, bf16_bits_to_f32(f32_to_bf16_bits(o_base)),
                               name="o (bf16)")
        o = bf16_bits_to_f32(o)
    elif out_dtype is not None:
        assert o.dtype == np.dtype(out_dtype)
        assert_close_to_oracle(o, o_ref, o_base.astype(out_dtype), name="o")
    else:
        assert o.dtype == np.float32
        assert_close_to_oracle(o, o_ref, o_base, name="o")
    # A (query, head) with no used slot: O = 0 exactly, LSE = -inf (checked above), no NaN.
    assert np.all(o[empty] == 0)
    return o, lse


# --- hostile shapes ---------------------------------------------------------------------------

SHAPES = [
    # id, K, Tq, Hq, D, partials kwargs
    ("K=1", 1, 5, 2, 8, {}),
    ("T=1-H=1-D=1", 3, 1, 1, 1, {}),
    ("D-not-multiple-of-lanes", 4, 3, 2, 13, {}),
    ("D=64-wide-lanes", 2, 2, 3, 64, {}),
    ("every-slot-used", 5, 4, 2, 8, dict(unused=0.0, empty_rows=0.0)),
    ("every-row-empty", 3, 4, 2, 8, dict(unused=1.0)),
    ("far-apart-lse", 4, 6, 2, 8, dict(spread=60.0)),
    ("Tq=0", 2, 0, 2, 8, {}),
]


@VERSIONS
@pytest.mark.parametrize("num_slots,tq,hq,d,kw", [s[1:] for s in SHAPES], ids=[s[0] for s in SHAPES])
def test_combine_matches_reference(num_slots, tq, hq, d, kw, version):
    o_part, lse_part = partials(num_slots, tq, hq, d, seed=num_slots * 100 + tq, **kw)
    check_against_reference(o_part, lse_part, version=version)


@VERSIONS
@pytest.mark.parametrize("d", [12, 16], ids=["D=12", "D=16"])
@pytest.mark.parametrize("out_dtype", [np.float32, np.float16, "bfloat16"],
                         ids=["float32", "float16", "bfloat16"])
def test_combine_out_dtypes(out_dtype, d, version):
    o_part, lse_part = partials(3, 7, 2, d, seed=5)
    check_against_reference(o_part, lse_part, out_dtype, version=version)


def launch_bf16_partials(bits, lse_part, out_kind, version):
    """``launch_combine`` on bf16 partials (``bits`` uint16 [K, Tq, Hq, D]); host ``(o, lse)``."""
    _, tq, hq, d = bits.shape
    ctx = ArrayContext(bits)
    out = ctx.empty((tq, hq, d), out_kind)
    lse = ctx.empty((tq, hq), np.float32)
    gpu.launch_combine(bits, lse_part, out, lse, head_dim=d, bf16_part=True,
                       bf16_out=out_kind == "bfloat16", version=version)
    return to_numpy(out), to_numpy(lse)


@VERSIONS
@pytest.mark.parametrize("d", [8, 16, 24, 32], ids=lambda d: f"D={d}")
@pytest.mark.parametrize("out_kind", [np.float32, "bfloat16"], ids=["out-float32", "out-bfloat16"])
def test_combine_bf16_partials_in(d, out_kind, version):
    """bf16 partials (``o_part`` as bf16 bits) are widened exactly before the merge; NaN bits in
    unused slots are never read. D=8: one lane a slot (32 slots in flight); D=24: 3 vectors
    padded to 4 lanes; D=32: 4 lanes a slot."""
    o_part, lse_part = partials(5, 4, 3, d, seed=9 + d, unused=0.3, empty_rows=0.1)
    bits = aligned(f32_to_bf16_bits(np.nan_to_num(o_part)))
    bits[np.isneginf(lse_part)] = 0x7FC0  # bf16 NaN where the slot is unused
    o, lse = launch_bf16_partials(bits, lse_part, out_kind, version)
    compare_to_reference(o, lse, bf16_bits_to_f32(bits), lse_part,
                         None if out_kind == np.float32 else out_kind)


@VERSIONS
def test_combine_is_order_independent(version):
    """Permuting the slots permutes nothing in the result (up to float32 rounding)."""
    o_part, lse_part = partials(6, 5, 3, 8, seed=11)
    perm = np.random.default_rng(0).permutation(6)
    _, lse1 = check_against_reference(o_part, lse_part, version=version)
    o2, lse2 = check_against_reference(o_part[perm].copy(), lse_part[perm].copy(), version=version)
    (o_ref, _), (o_base, _) = oracle_and_baseline(ref.combine_partials, o_part, lse_part)
    assert_close_to_oracle(o2, o_ref, o_base, name="o (permuted slots)")
    np.testing.assert_array_equal(np.isneginf(lse1), np.isneginf(lse2))


@VERSIONS
@pytest.mark.parametrize("num_slots,d", [(4, 8), (17, 16), (3, 13)],
                         ids=["K=4-D=8", "K=17-D=16", "K=3-D=13-fallback"])
def test_combine_reruns_are_bitwise_identical(num_slots, d, version):
    o_part, lse_part = partials(num_slots, 6, 2, d, seed=3)
    o1, lse1 = (to_numpy(x).copy() for x in gpu.combine_partials(o_part, lse_part, version=version))
    o2, lse2 = (to_numpy(x) for x in gpu.combine_partials(o_part, lse_part, version=version))
    assert o1.tobytes() == o2.tobytes() and lse1.tobytes() == lse2.tobytes()


@VERSIONS
@given(num_slots=st.integers(1, 6), tq=st.integers(0, 6), hq=st.integers(1, 3),
       d=st.integers(1, 20), unused=st.floats(0, 1), seed=st.integers(0, 2**31 - 1))
# Found by the thorough profile: L = 13.29 with one dominant slot. Weights exp(L_s - L) from a
# float32 L were 8 ulps off; exp(L_s - a) / sum is within the bound.
@example(num_slots=5, tq=1, hq=1, d=1, unused=0.0, seed=3)
# Also found by it: a = -0.230 and log(total) = 0.256 nearly cancel (L = 0.0258); the kernel's
# warp-order sum is 9.2e-8 off, the reference by luck 3.3e-9 (lse_term_scale).
@example(num_slots=5, tq=1, hq=2, d=19, unused=0.25, seed=65109)
def test_combine_property(num_slots, tq, hq, d, unused, seed, version):
    o_part, lse_part = partials(num_slots, tq, hq, d, seed, unused=unused)
    check_against_reference(o_part, lse_part, version=version)


@VERSIONS
@pytest.mark.parametrize("offset", [0.0, 40.0, -60.0, 300.0])
def test_combine_weights_keep_their_accuracy_at_large_lse(offset, version):
    """Shifting every L_s by the same offset changes no weight: O must stay as accurate (and
    here, with offsets that are exact in float32 sums, bitwise the same) whatever |L| is."""
    o_part, lse_part = partials(6, 5, 2, 16, seed=11, unused=0.0, empty_rows=0.0, spread=2.0)
    lse_part = np.round(lse_part * 64) / 64  # multiples of 2**-6: adding the offset is exact
    o0, lse0 = check_against_reference(o_part, lse_part, version=version)
    o1, lse1 = check_against_reference(o_part, (lse_part + np.float32(offset)).astype(np.float32),
                                       version=version)
    np.testing.assert_array_equal(o1, o0)


# --- v2: the 16-byte-load path and its fallback ---------------------------------------------

def aligned(x, offset_bytes=0):
    """A C-contiguous copy of ``x`` whose data starts ``offset_bytes`` after a 16-byte boundary."""
    buf = np.empty(x.nbytes + 32, np.uint8)
    start = (-buf.ctypes.data) % 16 + offset_bytes
    out = buf[start:start + x.nbytes].view(x.dtype).reshape(x.shape)
    out[...] = x
    return out


def on_device(x):
    """``x`` where the kernel reads it, keeping its alignment: the NumPy array itself in the
    simulator; on a GPU a view at the same offset from a 16-byte boundary of a device copy."""
    if SIMULATOR:
        return x
    from numba import cuda

    off = x.ctypes.data % 16 // x.itemsize
    flat = np.zeros(x.size + off, x.dtype)
    flat[off:] = x.reshape(-1)
    return cuda.to_device(flat)[off:].reshape(x.shape)


def launch(o_part, lse_part, *, bf16_part=False, out_kind=np.float32, out_offset=0, ran=2):
    """``launch_combine`` v2 on ``o_part`` as given (alignment kept); host ``(o, lse)``.
    ``ran``: the version that must have run (2: the 16-byte loads; 1: v2's fallback)."""
    _, tq, hq, d = o_part.shape
    o_dev, l_dev = on_device(o_part), on_device(lse_part)
    ctx = ArrayContext(o_dev)
    out = ctx.empty((tq * hq * d + out_offset,), out_kind)[out_offset:].reshape(tq, hq, d)
    lse = ctx.empty((tq, hq), np.float32)
    assert gpu.launch_combine(o_dev, l_dev, out, lse, head_dim=d, bf16_part=bf16_part,
                              bf16_out=out_kind == "bfloat16", version=2) == ran
    return to_numpy(out), to_numpy(lse)


VECTOR_CASES = [
    # id, K, Tq, Hq, D: K around the 32-lane LSE split, slot groups of 1..8 lanes
    ("K=1", 1, 3, 2, 16),
    ("K=2", 2, 3, 2, 16),
    ("K=17", 17, 2, 2, 8),
    ("K=32", 32, 2, 1, 16),
    ("K=33", 33, 2, 1, 16),
    ("K=64", 64, 2, 2, 8),
    ("K=64-D=32", 64, 1, 1, 32),
    ("D=4-one-lane-a-slot", 5, 3, 2, 4),
    ("D=12-three-of-four-lanes", 7, 3, 2, 12),
]


@pytest.mark.parametrize("num_slots,tq,hq,d", [c[1:] for c in VECTOR_CASES],
                         ids=[c[0] for c in VECTOR_CASES])
def test_combine_v2_vector_path(num_slots, tq, hq, d):
    """float32 partials, D*4 a multiple of 16: v2's vector kernel runs."""
    o_part, lse_part = partials(num_slots, tq, hq, d, seed=num_slots + d)
    o_part = aligned(o_part)
    o, lse = launch(o_part, lse_part)
    compare_to_reference(o, lse, o_part, lse_part)


@pytest.mark.parametrize("num_slots,d", [(17, 16), (64, 8), (2, 24)],
                         ids=["K=17-D=16", "K=64-D=8", "K=2-D=24"])
def test_combine_v2_vector_path_bf16(num_slots, d):
    """bf16 partials, D % 8 == 0: 16-byte loads of eight bf16 values; bf16 out as uint32 pairs."""
    o_part, lse_part = partials(num_slots, 3, 2, d, seed=num_slots * d)
    bits = aligned(f32_to_bf16_bits(np.nan_to_num(o_part)))
    bits[np.isneginf(lse_part)] = 0x7FC0
    o, lse = launch(bits, lse_part, bf16_part=True, out_kind="bfloat16")
    compare_to_reference(o, lse, bf16_bits_to_f32(bits), lse_part, "bfloat16")


FALLBACKS = [
    # id, K, D, bf16 partials, partials' offset from 16 B, out offset (elements), out kind
    ("D=13", 3, 13, False, 0, 0, np.float32),
    ("bf16-D=12-not-multiple-of-8", 3, 12, True, 0, 0, np.float32),
    ("misaligned-partials", 3, 8, False, 4, 0, np.float32),
    ("misaligned-bf16-partials", 3, 16, True, 2, 0, "bfloat16"),
    ("bf16-out-not-4-byte-aligned", 3, 16, True, 0, 1, "bfloat16"),
    ("K=65", 65, 8, False, 0, 0, np.float32),
]


@pytest.mark.parametrize("num_slots,d,bf16_part,offset,out_offset,out_kind",
                         [c[1:] for c in FALLBACKS], ids=[c[0] for c in FALLBACKS])
def test_combine_v2_falls_back_to_v1(num_slots, d, bf16_part, offset, out_offset, out_kind):
    """Where 16-byte loads do not apply, v2 runs v1."""
    o_part, lse_part = partials(num_slots, 3, 2, d, seed=d + offset)
    if bf16_part:
        bits = f32_to_bf16_bits(np.nan_to_num(o_part))
        bits[np.isneginf(lse_part)] = 0x7FC0
        o_in, o_ref_in = aligned(bits, offset), bf16_bits_to_f32(bits)
    else:
        o_in, o_ref_in = aligned(o_part, offset), o_part
    assert is_aligned16(o_in) == (offset == 0)
    o, lse = launch(o_in, lse_part, bf16_part=bf16_part, out_kind=out_kind, out_offset=out_offset,
                    ran=1)
    compare_to_reference(o, lse, o_ref_in, lse_part, None if out_kind == np.float32 else out_kind)


@pytest.mark.parametrize("num_slots,d", [(1, 8), (1, 16), (5, 16), (17, 8), (64, 8)],
                         ids=["K=1-D=8", "K=1-D=16", "K=5", "K=17", "K=64"])
def test_combine_v1_and_v2_agree(num_slots, d):
    """v1 and v2 differ only in the float32 summation order: both are within the tolerance of
    the float64 oracle, -inf and zero rows coincide, and with K = 1 (nothing to reorder) they are
    bitwise equal."""
    o_part, lse_part = partials(num_slots, 4, 2, d, seed=num_slots + 7 * d, unused=0.2)
    o1, lse1 = check_against_reference(o_part, lse_part, version=1)
    o2, lse2 = check_against_reference(o_part, lse_part, version=2)
    np.testing.assert_array_equal(np.isneginf(lse1), np.isneginf(lse2))
    if num_slots == 1:
        assert o1.tobytes() == o2.tobytes() and lse1.tobytes() == lse2.tobytes()


def test_combine_all_rows_empty_v2_gives_zero_and_neg_inf():
    o_part, lse_part = partials(4, 3, 2, 16, seed=1, unused=1.0)
    o, lse = (to_numpy(x) for x in gpu.combine_partials(o_part, lse_part, version=2))
    assert np.all(np.isneginf(lse)) and np.all(o == 0) and not np.signbit(o).any()


@VERSIONS
@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "+inf"])
def test_combine_nan_or_inf_slot_as_the_reference(bad, version):
    """A NaN L_s gives o = NaN, lse = NaN; a +inf one o = NaN, lse = +inf (never skipped, as
    msa.reference.combine); -inf slots stay skipped and the other rows keep their bits."""
    o_part, lse_part = partials(5, 4, 2, 16, seed=3)
    clean = [to_numpy(x) for x in gpu.combine_partials(o_part, lse_part, version=version)]
    lse_part[1, 2, 0] = bad
    lse_part[3, 1, 1] = -np.inf
    o_part[3, 1, 1] = np.nan  # an unused slot's garbage
    o, lse = (to_numpy(x) for x in gpu.combine_partials(o_part, lse_part, version=version))
    want_o, want_lse = ref.combine_partials(o_part.astype(np.float64),
                                            lse_part.astype(np.float64))
    assert np.isnan(o[2, 0]).all() and np.array_equal(lse[2, 0], want_lse[2, 0], equal_nan=True)
    rest = np.ones((4, 2), bool)
    rest[2, 0] = rest[1, 1] = False
    np.testing.assert_array_equal(o[rest], clean[0][rest])
    np.testing.assert_array_equal(lse[rest], clean[1][rest])
    assert np.isfinite(o[1, 1]).all() and np.isfinite(lse[1, 1])
    lse_part[0, 2, 0] = np.nan  # NaN wins over +inf
    assert np.isnan(to_numpy(gpu.combine_partials(o_part, lse_part, version=version)[1])[2, 0])


# --- production size (GPU) --------------------------------------------------------------------

@pytest.mark.big
@pytest.mark.parametrize("version", gpu.VERSIONS, ids=[f"v{v}" for v in gpu.VERSIONS])
def test_combine_paper_size_bf16_partials(version):
    """Paper configuration: K=16, Tq=16K, Hq=64, D=128, bf16 partials (4 GiB) and outputs.

    The whole chunk runs (2**31 partial values: index arithmetic past int32), is checked for
    NaN and the empty rows everywhere, and a sample of 512 queries against the float64
    reference. Prints the kernel's bandwidth (bytes read + written / time)."""
    torch = pytest.importorskip("torch")
    num_slots, tq, hq, d = 16, 16384, 64, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    o_part = torch.randn((num_slots, tq, hq, d), generator=gen, device="cuda",
                         dtype=torch.bfloat16)
    lse_part = torch.randn((num_slots, tq, hq), generator=gen, device="cuda") * 4
    unused = torch.rand((num_slots, tq, hq), generator=gen, device="cuda") < 0.2
    unused[:, ::97] = True  # whole queries with no used slot
    lse_part[unused] = -float("inf")
    o_part.masked_fill_(unused[..., None], float("nan"))
    o, lse = gpu.combine_partials(o_part, lse_part, version=version)  # compile + warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        o, lse = gpu.combine_partials(o_part, lse_part, version=version)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    moved = o_part.numel() * 2 + lse_part.numel() * 4 + o.numel() * 2 + lse.numel() * 4
    sec = sorted(times)[len(times) // 2]
    print(f"\nK2 v{version}: {sec * 1e3:.3f} ms, {moved / sec / 1e12:.2f} TB/s")
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    empty = unused.all(dim=0)
    assert torch.equal(torch.isinf(lse) & (lse < 0), empty) and not (o[empty] != 0).any()
    rows = torch.randperm(tq, generator=gen, device="cuda")[:512]
    o_in = o_part[:, rows].float().cpu().numpy()
    l_in = lse_part[:, rows].cpu().numpy()
    o_bits = f32_to_bf16_bits(to_numpy(o[rows]))  # bf16 widened exactly, back to its bits
    compare_to_reference(o_bits, to_numpy(lse[rows]), o_in, l_in, "bfloat16")


# --- bad input --------------------------------------------------------------------------------

def test_combine_rejects_bad_inputs():
    o_part, lse_part = partials(2, 3, 2, 4, seed=0)
    with pytest.raises(ValueError, match="o_part"):
        gpu.combine_partials(o_part[0], lse_part)
    with pytest.raises(ValueError, match="o_part"):
        gpu.combine_partials(o_part[:0], lse_part[:0])
    with pytest.raises(TypeError, match="o_part"):
        gpu.combine_partials(o_part.astype(np.float64), lse_part)
    with pytest.raises(ValueError, match="lse_part"):
        gpu.combine_partials(o_part, lse_part[:, :2])
    with pytest.raises(TypeError, match="lse_part"):
        gpu.combine_partials(o_part, lse_part.astype(np.float16))
    with pytest.raises(TypeError, match="out_dtype"):
        gpu.combine_partials(o_part, lse_part, out_dtype=np.int32)
    with pytest.raises(TypeError, match="out_dtype"):
        gpu.combine_partials(o_part, lse_part, out_dtype=np.float64)
    with pytest.raises(ValueError, match="version"):
        gpu.combine_partials(o_part, lse_part, version=7)
