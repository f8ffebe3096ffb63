"""K2 version 1: one warp of lanes per (query, head), the slots in order.

Every lane reduces the K slot LSEs itself (K broadcast loads, no shuffles), then the lanes split
``D`` and accumulate ``w_s * O_s`` slot by slot in registers, in slot order (deterministic, no
atomics); unused slots (``L_s = -inf``) are skipped, so whatever their ``O_s`` holds (NaN,
garbage) never reaches the output. A NaN ``L_s`` gives ``O = NaN, L = NaN``, else a ``+inf``
one ``O = NaN, L = +inf`` (what eq 8 gives for such scores; ``msa.reference.combine``). Any
``D``, any partial alignment, any K.

Where it runs: the simulator's default (4 lanes a row there: 8x fewer Python threads than
version 2's warp), and on a GPU wherever version 2's 16-byte loads do not apply.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32

from .._core.arrays import SIMULATOR
from .._core.mma import bf16_to_f32, f32_to_bf16
from .._core.diskcache import kernel_jit
from .._core.streams import stream

# Lanes per (query, head) and rows per CTA. The simulator runs every thread as a Python thread,
# so it gets fewer, wider lanes (the kernel is the same; only the constants change).
LANES = 4 if SIMULATOR else 32
ROWS_PER_CTA = 4
_NEG_INF = float32(-math.inf)
_POS_INF = float32(math.inf)
_NAN = float32(math.nan)


def _identity_f32(x):
    return float32(x)


@functools.lru_cache(maxsize=None)
def combine_kernel_v1(head_dim: int, lanes: int, rows_per_cta: int, bf16_part: bool,
                      bf16_out: bool):
    """K2 v1 specialised for ``D`` (so each lane's accumulators are a fixed register array).

    Arguments: ``o_part [K, Tq, Hq, D]`` float32 or bf16 bits, ``lse_part [K, Tq, Hq]``,
    ``out [Tq, Hq, D]`` float32, float16 or bf16 bits, ``lse_out [Tq, Hq]``."""
    per_lane = -(-head_dim // lanes)
    load = cuda.jit(device=True)(_identity_f32) if not bf16_part else bf16_to_f32
    store = f32_to_bf16 if bf16_out else cuda.jit(device=True)(_identity_f32)

    @kernel_jit
    def _combine_kernel_v1(o_part, lse_part, out, lse_out):
        num_slots = lse_part.shape[0]
        num_q = lse_part.shape[1]
        num_heads = lse_part.shape[2]
        row = cuda.blockIdx.x * rows_per_cta + cuda.threadIdx.x // lanes
        lane = cuda.threadIdx.x % lanes
        if row >= num_q * num_heads:
            return
        t = row // num_heads
        h = row % num_heads
        # a = max_s L_s (unused slots are -inf and never win)
        a = _NEG_INF
        any_nan = False
        for s in range(num_slots):
            l_s = lse_part[s, t, h]
            any_nan |= l_s != l_s
            if l_s > a:
                a = l_s
        acc = cuda.local.array(per_lane, float32)
        for i in range(per_lane):
            acc[i] = float32(0.0)
        lse = _NEG_INF
        if any_nan or a == _POS_INF:  # a NaN or +inf slot: O = NaN, L = NaN or +inf
            for i in range(per_lane):
                acc[i] = _NAN
            lse = _NAN if any_nan else _POS_INF
        elif a > _NEG_INF:
            # L = a + log sum_s exp(L_s - a); the sum is >= 1, so the log is finite
            total = float32(0.0)
            for s in range(num_slots):
                l_s = lse_part[s, t, h]
                if l_s > _NEG_INF:
                    total += math.exp(l_s - a)
            lse = a + math.log(total)
            inv_total = float32(1.0) / total
            # O = sum_s exp(L_s - L) O_s, slot by slot in a fixed order, with
            # exp(L_s - L) = exp(L_s - a) / total (the package docstring says why)
            for s in range(num_slots):
                l_s = lse_part[s, t, h]
                if l_s > _NEG_INF:
                    w = float32(math.exp(l_s - a)) * inv_total
                    for i in range(per_lane):
                        d = lane + i * lanes
                        if d < head_dim:
                            acc[i] += w * load(o_part[s, t, h, d])
        for i in range(per_lane):
            d = lane + i * lanes
            if d < head_dim:
                out[t, h, d] = store(acc[i])
        if lane == 0:
            lse_out[t, h] = lse

    return _combine_kernel_v1


def launch_v1(o_part, lse_part, out, lse_out, *, head_dim, bf16_part, bf16_out):
    """K2 v1 over every (query, head) row of ``lse_part``; checks nothing."""
    rows = int(lse_part.shape[1]) * int(lse_part.shape[2])
    kernel = combine_kernel_v1(int(head_dim), LANES, ROWS_PER_CTA, bool(bf16_part),
                               bool(bf16_out))
    grid = -(-rows // ROWS_PER_CTA)
    kernel[grid, LANES * ROWS_PER_CTA, stream()](o_part, lse_part, out, lse_out)
