"""Warp operations: the same kernels on a real GPU and under the simulator (``msa.cuda._core.simwarp``).

Every kernel here is valid CUDA and is compared exactly with a NumPy model of the CUDA semantics
(integers, or floats holding small integers). Tests marked ``simulator`` check the add-on's own
behaviour (errors instead of deadlocks, poison on undefined reads) and are skipped on a GPU.
"""

import threading

import numpy as np
import pytest
from numba import cuda, float32, int32

from msa.cuda._core import simwarp as _simwarp
from msa.cuda._core.warp import warp_inclusive_sum, warp_max, warp_min, warp_sort_desc, warp_sum

FULL = 0xFFFFFFFF
LANES = np.arange(32)


def _warps(a):
    """[n] -> [n/32, 32]: one row per warp of a 1D launch whose size is a multiple of 32."""
    return np.asarray(a).reshape(-1, 32)


def _model_shfl(v, mode, b):
    """Per-warp rows ``v`` [W, 32]: what each lane reads (PTX shfl.sync with Numba's clamps)."""
    b &= 31
    src = {
        "idx": np.full(32, b),
        "up": np.where(LANES >= b, LANES - b, LANES),
        "down": np.where(LANES + b < 32, LANES + b, LANES),
        "xor": LANES ^ b,
    }[mode]
    return v[:, src]


# -- kernels ------------------------------------------------------------------------------------

@cuda.jit
def _shuffle_modes(x, deltas, up, down, xor, idx):
    i = cuda.grid(1)
    b = deltas[i // 32]
    v = x[i]
    up[i] = cuda.shfl_up_sync(FULL, v, b)
    down[i] = cuda.shfl_down_sync(FULL, v, b)
    xor[i] = cuda.shfl_xor_sync(FULL, v, b)
    idx[i] = cuda.shfl_sync(FULL, v, b)


@cuda.jit
def _reduce_down(x, out):
    i = cuda.grid(1)
    v = x[i]
    offset = 16
    while offset > 0:
        v += cuda.shfl_down_sync(FULL, v, offset)
        offset //= 2
    out[i] = v


@cuda.jit
def _reduce_xor_2d(x, total, hi, lo):
    # a 2D block: warps are 32 consecutive linear ids x + Dx*y
    t = cuda.threadIdx.x + cuda.blockDim.x * cuda.threadIdx.y
    i = cuda.blockIdx.x * cuda.blockDim.x * cuda.blockDim.y + t
    total[i] = warp_sum(x[i])
    hi[i] = warp_max(x[i])
    lo[i] = warp_min(x[i])


@cuda.jit
def _sort(keys, idx, out_keys, out_idx):
    i = cuda.grid(1)
    k, j = warp_sort_desc(keys[i], idx[i])
    out_keys[i] = k
    out_idx[i] = j


@cuda.jit
def _votes(pred, ballot_u32, ballot_i64, any_, all_, eq_, count, rank, bit, first):
    i = cuda.grid(1)
    lane = cuda.laneid
    p = pred[i] != 0
    b = cuda.ballot_sync(FULL, p)
    ballot_u32[i] = b
    ballot_i64[i] = b
    any_[i] = cuda.any_sync(FULL, p)
    all_[i] = cuda.all_sync(FULL, p)
    eq_[i] = cuda.eq_sync(FULL, p)
    count[i] = cuda.popc(b)
    rank[i] = cuda.popc(b & cuda.lanemask_lt())  # stream-compaction slot of this lane
    bit[i] = 1 if (b & (1 << lane)) != 0 else 0
    first[i] = cuda.ffs(b)


@cuda.jit
def _broadcast(x32, x64, f32, f64, src, o32, o64, of32, of64):
    i = cuda.grid(1)
    s = src[i // 32]
    o32[i] = cuda.shfl_sync(FULL, x32[i], s)
    o64[i] = cuda.shfl_sync(FULL, x64[i], s)
    of32[i] = cuda.shfl_sync(FULL, f32[i], s)
    of64[i] = cuda.shfl_sync(FULL, f64[i], s)


@cuda.jit
def _partial_warp(x, mask_out, ballot_out, scan_out, bcast_out):
    i = cuda.grid(1)
    m = cuda.activemask()
    mask_out[i] = m
    ballot_out[i] = cuda.ballot_sync(m, x[i] > 0)
    scan_out[i] = warp_inclusive_sum(m, x[i])
    bcast_out[i] = cuda.shfl_sync(m, x[i], 3)


@cuda.jit
def _after_exit(x, n, mask_out, ballot_out, scan_out, first_out):
    i = cuda.grid(1)
    if i >= n:
        return
    m = cuda.activemask()
    mask_out[i] = m
    ballot_out[i] = cuda.ballot_sync(FULL, True)  # exited lanes are left out of a full mask
    scan_out[i] = warp_inclusive_sum(m, x[i])
    first_out[i] = cuda.shfl_sync(FULL, x[i], 0)


@cuda.jit
def _divergent_activemask(masks, ballots):
    i = cuda.threadIdx.x
    lane = cuda.laneid
    if lane < 8:
        masks[i] = cuda.activemask()
    elif i < 32:
        ballots[i] = cuda.ballot_sync(0xFFFFFF00, True)
    # warp 1's lanes 8-31 are here while its lanes 0-7 ask for activemask
    cuda.syncthreads()


@cuda.jit
def _syncwarp_broadcast(out):
    buf = cuda.shared.array(4, int32)
    i = cuda.threadIdx.x
    w = i // 32
    if cuda.laneid == 0:
        buf[w] = 100 + w
    cuda.syncwarp(FULL)
    out[i] = buf[w]


@cuda.jit
def _independent_groups(out):
    i = cuda.threadIdx.x
    if i % 4 == 0:
        b = cuda.ballot_sync(0x11111111, True)
    elif i % 4 == 1:
        b = cuda.ballot_sync(0x22222222, True)
    elif i % 4 == 2:
        b = cuda.ballot_sync(0x44444444, True)
    else:
        b = cuda.ballot_sync(0x88888888, True)
    out[i] = b


@cuda.jit
def _match(x, any_out, all_out):
    i = cuda.grid(1)
    any_out[i] = cuda.match_any_sync(FULL, x[i])
    m, ok = cuda.match_all_sync(FULL, x[i])
    all_out[i] = m if ok else 0


# -- GPU and simulator --------------------------------------------------------------------------

def test_shuffle_modes_match_ptx_semantics():
    """up/down keep their own value out of range; every mode uses only the low 5 bits."""
    deltas = np.array([0, 1, 5, 16, 31, 32, 37], dtype=np.int32)
    n = 32 * deltas.size
    x = np.random.default_rng(1).integers(-1000, 1000, n).astype(np.int32)
    out = {m: np.zeros(n, np.int32) for m in ("up", "down", "xor", "idx")}
    _shuffle_modes[1, n](x, deltas, out["up"], out["down"], out["xor"], out["idx"])
    for w, b in enumerate(deltas.tolist()):
        for mode, got in out.items():
            want = _model_shfl(_warps(x)[w:w + 1], mode, b)[0]
            np.testing.assert_array_equal(_warps(got)[w], want, err_msg=f"shfl {mode} by {b}")


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.float64])
def test_reduce_with_shfl_down_every_lane(dtype):
    """Each lane's value after the tree, not just lane 0's: 3 blocks of 2 warps."""
    x = np.random.default_rng(2).integers(-50, 50, 192).astype(dtype)
    out = np.zeros_like(x)
    _reduce_down[3, 64](x, out)
    v = _warps(x).copy()
    for offset in (16, 8, 4, 2, 1):
        v = v + _model_shfl(v, "down", offset)
    np.testing.assert_array_equal(_warps(out), v)
    np.testing.assert_array_equal(_warps(out)[:, 0], _warps(x).sum(axis=1))


def test_butterfly_sum_max_min_in_2d_blocks():
    x = np.random.default_rng(3).integers(-99, 99, 2 * 64).astype(np.int32)
    total, hi, lo = (np.zeros_like(x) for _ in range(3))
    _reduce_xor_2d[2, (16, 4)](x, total, hi, lo)
    w = _warps(x)
    np.testing.assert_array_equal(_warps(total), np.repeat(w.sum(1, keepdims=True), 32, axis=1))
    np.testing.assert_array_equal(_warps(hi), np.repeat(w.max(1, keepdims=True), 32, axis=1))
    np.testing.assert_array_equal(_warps(lo), np.repeat(w.min(1, keepdims=True), 32, axis=1))


def test_bitonic_sort_desc_ties_to_smaller_index():
    rng = np.random.default_rng(4)
    cases = [
        rng.permutation(32) - 16.0,                  # distinct
        rng.integers(0, 3, 32).astype(np.float64),   # heavy ties
        np.zeros(32),                                # all equal
        np.where(rng.random(32) < 0.5, -np.inf, rng.integers(0, 4, 32)),  # -inf (invisible blocks)
        np.arange(32.0)[::-1].copy(),                # already sorted
        np.arange(32.0),                             # reversed
    ]
    keys = np.concatenate(cases).astype(np.float32)
    idx = np.concatenate([rng.permutation(32) for _ in cases]).astype(np.int32)
    out_keys, out_idx = np.zeros_like(keys), np.zeros_like(idx)
    _sort[2, 96](keys, idx, out_keys, out_idx)
    for w, (k, j) in enumerate(zip(_warps(keys), _warps(idx))):
        order = np.lexsort((j, -k))
        np.testing.assert_array_equal(_warps(out_keys)[w], k[order], err_msg=f"warp {w}")
        np.testing.assert_array_equal(_warps(out_idx)[w], j[order], err_msg=f"warp {w}")


def test_votes_ballot_popc_and_lane_ranks():
    rng = np.random.default_rng(5)
    pred = np.stack([
        np.ones(32), np.zeros(32), rng.integers(0, 2, 32),
        LANES == 31, LANES == 0, LANES % 2,
    ]).astype(np.int32).reshape(-1)
    n = pred.size
    ballot_u32 = np.zeros(n, np.uint32)
    ballot_i64, any_, all_, eq_, count, rank, bit, first = (np.zeros(n, np.int64) for _ in range(8))
    _votes[2, 96](pred, ballot_u32, ballot_i64, any_, all_, eq_, count, rank, bit, first)
    p = _warps(pred).astype(bool)
    bits = (p.astype(np.uint64) << LANES.astype(np.uint64)).sum(1).astype(np.uint32)  # [W]
    rep = lambda a: np.repeat(np.asarray(a)[:, None], 32, axis=1)  # noqa: E731
    np.testing.assert_array_equal(_warps(ballot_u32), rep(bits))
    # ballot_sync returns int32: 0x80000000 is negative when widened to int64
    np.testing.assert_array_equal(_warps(ballot_i64), rep(bits.view(np.int32).astype(np.int64)))
    np.testing.assert_array_equal(_warps(any_), rep(p.any(1)))
    np.testing.assert_array_equal(_warps(all_), rep(p.all(1)))
    np.testing.assert_array_equal(_warps(eq_), rep(p.all(1) | ~p.any(1)))
    np.testing.assert_array_equal(_warps(count), rep(p.sum(1)))
    np.testing.assert_array_equal(_warps(rank), np.cumsum(p, axis=1) - p)
    np.testing.assert_array_equal(_warps(bit), p)
    lowest = np.where(p.any(1), p.argmax(1) + 1, 0)
    np.testing.assert_array_equal(_warps(first), rep(lowest))


def test_broadcast_32_and_64_bit_values():
    rng = np.random.default_rng(6)
    src = np.array([0, 7, 31, 35], dtype=np.int32)  # 35 & 31 = 3
    n = 32 * src.size
    x32 = rng.integers(-2**31, 2**31 - 1, n).astype(np.int32)
    x64 = rng.integers(-2**62, 2**62, n).astype(np.int64)
    f32 = rng.standard_normal(n).astype(np.float32)
    f32[::5] = -np.inf
    f64 = rng.standard_normal(n)
    outs = [np.zeros_like(a) for a in (x32, x64, f32, f64)]
    _broadcast[2, n // 2](x32, x64, f32, f64, src, *outs)
    for a, got in zip((x32, x64, f32, f64), outs):
        want = np.repeat(_warps(a)[np.arange(src.size), src & 31][:, None], 32, axis=1)
        np.testing.assert_array_equal(_warps(got), want, err_msg=str(a.dtype))


def test_partial_last_warp_with_activemask():
    """blockDim 48: warp 1 of each block has lanes 0-15 only."""
    rng = np.random.default_rng(7)
    x = rng.integers(-9, 9, 96).astype(np.int32)
    mask_out = np.zeros(96, np.uint32)
    ballot_out, scan_out, bcast_out = (np.zeros(96, np.int64) for _ in range(3))
    _partial_warp[2, 48](x, mask_out, ballot_out, scan_out, bcast_out)
    for block in range(2):
        for w, lanes in ((0, 32), (1, 16)):
            sl = slice(block * 48 + 32 * w, block * 48 + 32 * w + lanes)
            xs = x[sl]
            mask = (1 << lanes) - 1
            assert (mask_out[sl] == mask).all()
            ballot = sum(1 << int(lane) for lane in np.flatnonzero(xs > 0))
            assert (ballot_out[sl].astype(np.uint32) == ballot).all()
            np.testing.assert_array_equal(scan_out[sl], np.cumsum(xs))
            np.testing.assert_array_equal(bcast_out[sl], np.full(lanes, xs[3]))


def test_exited_lanes_leave_warp_operations():
    n = 40  # warp 1 keeps lanes 0-7
    x = np.arange(1, 65, dtype=np.int32)
    mask_out = np.zeros(64, np.uint32)
    ballot_out, scan_out, first_out = (np.full(64, -7, np.int64) for _ in range(3))
    _after_exit[1, 64](x, n, mask_out, ballot_out, scan_out, first_out)
    want_mask = np.r_[np.full(32, 0xFFFFFFFF), np.full(8, 0xFF)]
    np.testing.assert_array_equal(mask_out[:n], want_mask)
    np.testing.assert_array_equal(ballot_out[:n].astype(np.uint32), want_mask)
    np.testing.assert_array_equal(scan_out[:n], np.r_[np.cumsum(x[:32]), np.cumsum(x[32:n])])
    np.testing.assert_array_equal(first_out[:n], np.r_[np.full(32, x[0]), np.full(8, x[32])])
    assert (scan_out[n:] == -7).all() and (mask_out[n:] == 0).all()


def test_activemask_in_a_divergent_branch():
    """Lanes waiting in syncthreads or in another warp operation are not converged with it."""
    masks, ballots = np.zeros(64, np.uint32), np.zeros(64, np.uint32)
    _divergent_activemask[1, 64](masks, ballots)
    np.testing.assert_array_equal(_warps(masks)[:, :8], np.full((2, 8), 0xFF))
    np.testing.assert_array_equal(ballots[8:32], np.full(24, 0xFFFFFF00))


def test_syncwarp_orders_shared_memory():
    out = np.zeros(128, np.int32)
    _syncwarp_broadcast[1, 128](out)
    np.testing.assert_array_equal(_warps(out), np.repeat([[100], [101], [102], [103]], 32, axis=1))


def test_independent_groups_with_disjoint_masks():
    out = np.zeros(32, np.uint32)
    _independent_groups[1, 32](out)
    np.testing.assert_array_equal(out, np.array([0x11111111, 0x22222222, 0x44444444, 0x88888888],
                                                dtype=np.uint32)[LANES % 4])


def test_match_any_and_all():
    x = np.r_[LANES % 3, np.full(32, 5)].astype(np.int32)
    any_out, all_out = np.zeros(64, np.uint32), np.zeros(64, np.uint32)
    _match[1, 64](x, any_out, all_out)
    groups = [sum(1 << int(j) for j in np.flatnonzero(LANES % 3 == c)) for c in range(3)]
    np.testing.assert_array_equal(any_out[:32], np.array(groups, dtype=np.uint32)[LANES % 3])
    np.testing.assert_array_equal(any_out[32:], np.full(32, FULL, np.uint32))
    np.testing.assert_array_equal(all_out, np.r_[np.zeros(32), np.full(32, FULL)].astype(np.uint32))


# -- the simulator add-on itself ----------------------------------------------------------------

sim = pytest.mark.simulator


@cuda.jit
def _xor16(x, out):
    i = cuda.grid(1)
    out[i] = cuda.shfl_xor_sync(FULL, x[i], 16)


@sim
@pytest.mark.parametrize("dtype, poison", [(np.float32, np.nan),
                                           (np.int32, np.iinfo(np.int32).min)])
def test_read_of_missing_lane_is_poison(dtype, poison):
    """blockDim 48: lanes 0-15 of warp 1 read lanes 16-31, which do not exist (undefined)."""
    x = np.arange(48).astype(dtype)
    out = np.zeros_like(x)
    _xor16[1, 48](x, out)
    np.testing.assert_array_equal(out[:32], x[:32][LANES ^ 16])
    np.testing.assert_array_equal(out[32:], np.full(16, poison, dtype))


@sim
def test_strict_mode_raises_on_undefined_read():
    before = _simwarp.settings()["strict"]
    _simwarp.install(strict=True)
    try:
        with pytest.raises(_simwarp.WarpUsageError,
                           match=r"reads lane (1[6-9]|2\d|3[01]), which does not take part"):
            _xor16[1, 48](np.zeros(48, np.float32), np.zeros(48, np.float32))
    finally:
        _simwarp.install(strict=before)


@cuda.jit
def _shfl_vs_syncthreads(out):
    i = cuda.threadIdx.x
    if i < 16:
        out[i] = cuda.shfl_sync(FULL, i, 0)
    else:
        cuda.syncthreads()
        out[i] = i


@sim
def test_full_mask_reached_by_half_warp_is_a_deadlock_error():
    with pytest.raises(_simwarp.WarpDeadlockError,
                       match=r"shfl_sync\(mask=0xffffffff\).*needs lanes 16-31, which have not "
                             r"arrived, and lanes [-, \d]+ of them wait in cuda.syncthreads"):
        _shfl_vs_syncthreads[1, 32](np.zeros(32, np.int32))


_release = threading.Event()


def _hold():
    _release.wait(10)


@cuda.jit
def _late_lane(out):
    i = cuda.threadIdx.x
    if i == 31:
        _hold()  # a lane that neither arrives nor exits (simulator-only kernel)
    out[i] = cuda.shfl_sync(FULL, i, 0)


@sim
def test_lane_that_never_arrives_times_out_with_a_message():
    before = _simwarp.settings()["timeout"]
    _release.clear()
    _simwarp.install(timeout=0.3)
    try:
        with pytest.raises(_simwarp.WarpDeadlockError,
                           match=r"lanes 31 named in the mask did not arrive within 0.3 s "
                                 r"\(lanes 0-\d+ waited; lanes 31: (running|not started yet)\)"):
            _late_lane[1, 32](np.zeros(32, np.int32))
    finally:
        _release.set()
        _simwarp.install(timeout=before)


@cuda.jit
def _own_lane_missing(out):
    out[cuda.threadIdx.x] = cuda.shfl_sync(0x1, 1, 0)


@cuda.jit
def _shfl_vs_ballot(out):
    i = cuda.threadIdx.x
    if i < 16:
        out[i] = cuda.shfl_sync(FULL, i, 0)
    else:
        out[i] = cuda.ballot_sync(FULL, True)


@cuda.jit
def _two_masks(out):
    i = cuda.threadIdx.x
    if i < 16:
        out[i] = cuda.shfl_sync(FULL, i, 0)
    else:
        out[i] = cuda.shfl_sync(0xFFFFFFFE, i, 1)


@sim
@pytest.mark.parametrize("kernel, match", [
    (_own_lane_missing, "whose own bit is not in the mask"),
    (_shfl_vs_ballot, "must reach the same kind of warp operation"),
    (_two_masks, "must all use the same mask"),
], ids=["own-lane", "shfl-vs-ballot", "two-masks"])
def test_undefined_uses_raise(kernel, match):
    with pytest.raises(_simwarp.WarpUsageError, match=match):
        kernel[1, 32](np.zeros(32, np.int64))


@cuda.jit
def _shfl_value(values, out):
    i = cuda.threadIdx.x
    out[i] = cuda.shfl_sync(FULL, values[i], 0)


@cuda.jit
def _vote_float(values, out):
    i = cuda.threadIdx.x
    out[i] = cuda.any_sync(FULL, values[i])


@sim
@pytest.mark.parametrize("kernel, values, match", [
    (_shfl_value, np.ones(32, np.bool_), "32- and 64-bit ints and floats"),
    (_shfl_value, np.ones(32, np.float16), "32- and 64-bit ints and floats"),
    (_shfl_value, np.ones(32, np.uint32), "32- and 64-bit ints and floats"),
    (_vote_float, np.ones(32, np.float32), "predicate must be an integer or boolean"),
], ids=["shfl-bool", "shfl-fp16", "shfl-uint32", "vote-float"])
def test_types_numba_rejects_are_rejected(kernel, values, match):
    with pytest.raises(TypeError, match=match):
        kernel[1, 32](values, np.zeros(32, np.float64))


@sim
def test_outside_a_kernel_is_an_error():
    with pytest.raises(RuntimeError, match="outside a simulated CUDA kernel"):
        _simwarp.shfl_sync(FULL, 1, 0)


@sim
def test_install_is_idempotent_and_kernels_without_warp_ops_still_run():
    from numba.cuda.simulator import kernel, kernelapi

    run = kernel.BlockThread.run
    assert _simwarp.install() and _simwarp.install()
    assert kernel.BlockThread.run is run
    assert kernelapi.FakeCUDAModule.shfl_sync is _simwarp.shfl_sync

    @cuda.jit
    def block_sum(x, out):
        buf = cuda.shared.array(64, int32)
        i = cuda.threadIdx.x
        buf[i] = x[i]
        cuda.syncthreads()
        if i == 0:
            s = 0
            for j in range(64):
                s += buf[j]
            out[0] = s

    x = np.arange(64, dtype=np.int32)
    out = np.zeros(1, np.int32)
    block_sum[1, 64](x, out)
    assert out[0] == x.sum()


@sim
def test_bit_intrinsics_know_the_width():
    from numba.cuda.simulator.kernelapi import FakeCUDAModule as m

    assert m.popc(np.int32(-1)) == 32 and m.popc(np.int64(-1)) == 64 and m.popc(5) == 2
    assert m.clz(np.int32(1)) == 31 and m.clz(np.int64(1)) == 63 and m.clz(np.int32(-1)) == 0
    assert m.ffs(np.int32(-2**31)) == 32 and m.ffs(0) == 0 and m.ffs(12) == 3
    assert m.brev(np.uint32(1)) == 0x80000000 and m.brev(np.uint64(1)) == 1 << 63


@cuda.jit
def _sum_of_a_shared_array(out):
    buf = cuda.shared.array(32, int32)
    tid = cuda.threadIdx.x
    buf[tid] = tid + 1
    cuda.syncthreads()
    s = 0
    for i in range(32):
        s += buf[i]
    out[tid] = s


@pytest.mark.simulator
def test_static_shared_array_is_one_array_per_block(monkeypatch):
    """The simulator allocates a static shared array on first use with no lock; a thread switch
    in that window used to give some threads private copies (a correct kernel failing now and
    then). ``np.empty`` is slowed inside the window here so that the switch happens every time."""
    import time

    from numba.cuda.simulator import kernelapi

    real_np = np

    class SlowEmpty:
        def __getattr__(self, name):
            return getattr(real_np, name)

        @staticmethod
        def empty(*args, **kwargs):
            time.sleep(0.005)
            return real_np.empty(*args, **kwargs)

    monkeypatch.setattr(_simwarp, "np", SlowEmpty())  # the locked allocation's module
    monkeypatch.setattr(kernelapi, "np", SlowEmpty())  # the simulator's, if it were used
    out = np.zeros(32, np.int64)
    _sum_of_a_shared_array[1, 32](out)
    np.testing.assert_array_equal(out, np.full(32, 32 * 33 // 2))



def _sleep(seconds):
    import time

    time.sleep(seconds)



def _late_failure():
    raise RuntimeError("the later failure")


@cuda.jit
def _two_failures(out, early):
    if cuda.threadIdx.x == early:
        _sleep(0.05)  # simulator-only kernel: the manager's first poll passes while both sleep
        out[1] = 1  # out of bounds: an IndexError in the simulator
    else:
        _sleep(3.0)
        _late_failure()


@pytest.mark.simulator
@pytest.mark.parametrize("early", [0, 1])
def test_first_failure_is_reported_at_once_even_if_its_thread_ends_between_two_polls(
        monkeypatch, early):
    """The simulator polls ``thread.exception`` and then drops the threads no longer alive; a
    thread that failed and ended between the two was only found by the final check, after every
    other thread had ended, and that check reports whichever failed thread comes first in a set
    (seen in CI: a deadlock error replaced by a late lane's failure on poison, 10 s later).
    ``is_alive`` is slowed here so that the early thread fails and ends in that window every
    time; the block loop that ``install()`` puts in place checks an ended thread for an exception
    before dropping it, so the launch reports the early thread's error at once, not 3 s later."""
    import time

    from numba.cuda.simulator import kernel

    real = kernel.BlockThread.is_alive

    def slow_is_alive(self):
        time.sleep(0.1)
        return real(self)

    monkeypatch.setattr(kernel.BlockThread, "is_alive", slow_is_alive)
    start = time.monotonic()
    with pytest.raises(IndexError, match=rf"tid=\[{early}, 0, 0\]"):
        _two_failures[1, 2](np.zeros(1, np.int32), early)
    assert time.monotonic() - start < 1.5


@cuda.jit
def _activemask_after_barriers(partial, rounds):
    i = cuda.threadIdx.x
    for _ in range(rounds):
        cuda.syncthreads()
        if cuda.activemask() != FULL:
            partial[i] += 1


@pytest.mark.simulator
def test_a_barrier_releases_every_thread_before_any_runs_on(monkeypatch):
    """After ``syncthreads`` the whole warp is converged, so ``activemask()`` is full. The block
    loop used to clear one thread's "waiting in syncthreads" flag and wake it, then the next: a
    woken lane that got the GIL first saw siblings still flagged, so ``activemask()`` left them
    out and a full-mask operation took them for a deadlock (seen in CI on a loaded machine:
    ``match_any_sync`` in scatter v3 at 512 threads). Here every wake-up hands the GIL over, which
    makes that window certain; the block loop that ``install()`` puts in place lowers every flag
    before it wakes anyone."""
    import time

    from numba.cuda.simulator import kernel

    class HandOverEvent(threading.Event):
        def set(self):
            super().set()
            time.sleep(0.002)  # let the woken thread run before the loop goes on

    real_init = kernel.BlockThread.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.syncthreads_event = HandOverEvent()

    monkeypatch.setattr(kernel.BlockThread, "__init__", init)
    partial = np.zeros(64, np.int32)
    _activemask_after_barriers[1, 64](partial, 6)
    np.testing.assert_array_equal(partial, np.zeros(64, np.int32))


@cuda.jit
def _read_unwritten_shared(out, ints):
    """Each block reads shared memory it never writes (undefined on a GPU): a static float32
    array, a static int32 array and the dynamic buffer, after the first block wrote them all."""
    s = cuda.shared.array(4, float32)
    n = cuda.shared.array(4, int32)
    d = cuda.shared.array(0, float32)
    b = cuda.blockIdx.x
    i = cuda.threadIdx.x
    cuda.syncthreads()
    out[b, 0, i] = s[i]
    out[b, 1, i] = d[i]
    ints[b, i] = n[i]
    cuda.syncthreads()
    if b == 0:  # values a later block could pick up where the simulator carries them over
        s[i] = 1.0
        d[i] = 2.0
        n[i] = 3


@sim
def test_poisoned_shared_memory_makes_unwritten_reads_visible():
    """With ``poison_shared`` every block starts from 0xFF bytes, the first block and those after
    one that wrote values alike; without it the simulator gives the dynamic buffer as zeros and
    then carries the first block's values over to the next."""
    before = _simwarp.settings()["poison_shared"]
    try:
        _simwarp.install(poison_shared=True)
        out = np.zeros((2, 2, 4), np.float32)
        ints = np.zeros((2, 4), np.int32)
        _read_unwritten_shared[2, 4, 0, 16](out, ints)
        assert np.isnan(out).all()
        np.testing.assert_array_equal(ints, -1)
        _simwarp.install(poison_shared=False)
        _read_unwritten_shared[2, 4, 0, 16](out, ints)
        np.testing.assert_array_equal(out[0, 1], 0.0)  # the dynamic buffer starts zeroed
        np.testing.assert_array_equal(out[1], [[1.0] * 4, [2.0] * 4])  # carried over
        np.testing.assert_array_equal(ints[1], 3)
    finally:
        _simwarp.install(poison_shared=before)
