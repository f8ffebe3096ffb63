"""What both backward rungs share: ``D = rowsum(dO O)`` and the hot rows cut into parts.

``dK, dV`` are KV-outer in both versions: a CTA per part of a k2q CSR row (at most
``part_size`` queries). ``parts_kernel`` counts the parts of every row (a row has one unless it
holds more than ``part_size`` queries: a hot row, e.g. a sink block every query picks), one scan
(``msa.cuda.csr.exclusive_prefix_sum``) turns the counts into each head's part offsets and the
hot rows' scratch slots, ``bwd_part`` tells a CTA which part it takes, and ``dkdv_sum_kernel``
adds a hot row's parts in part order (no atomics: bitwise identical reruns). ``delta_kernel``
computes FlashAttention's ``D_t = rowsum(dO_t * O_t)``, a warp per (t, h).
"""

from __future__ import annotations

import functools

from numba import cuda, float32, int64

from .._core.arrays import SIMULATOR
from .._core.memops import load_f32x4
from .._core.mma import bf16_to_f32
from .._core.packed import last_le
from .._core.diskcache import kernel_jit

# threads per CTA (the simulator runs each thread as a Python thread: fewer there, same kernels)
THREADS = 32 if SIMULATOR else 128


def _identity_f32(x):
    return float32(x)


@cuda.jit(device=True)
def split_slot(part_ptr, hkv, r, row):
    """First scratch slot of row ``row`` of head ``r`` (a row of several parts): the scratch
    slots of the heads before ``r``, then of the rows before ``row`` (``part_ptr``'s rows
    ``Hkv ..``: per-head offsets of the split rows' parts)."""
    rows = part_ptr.shape[1] - 1
    slot = part_ptr[hkv + r, row]
    for h in range(r):
        slot += part_ptr[hkv + h, rows]
    return slot


@cuda.jit(device=True)
def bwd_part(row_ptr, part_ptr, row_offsets, cu_k, part_size, num_entries, block_size):
    """The part of a k2q CSR row that this CTA of a backward dK/dV kernel takes (CTA
    ``r * per_head + pid``: part ``pid`` of KV head ``r``). Returns ``(r, row, part, nparts, b,
    j, lk, nk, e0, e1)``: sequence ``b`` (``lk`` keys), its block ``j`` (``nk`` keys), and the
    CSR entries ``e0 .. e1-1``; ``e1 <= e0`` when the CTA adds nothing (past the head's parts,
    or an empty or malformed range). Every read stays in bounds for any ``part_ptr`` row."""
    hkv = row_ptr.shape[0]
    nrows = row_ptr.shape[1] - 1
    per_head = cuda.gridDim.x // hkv
    r = int64(cuda.blockIdx.x // per_head)
    pid = int64(cuda.blockIdx.x % per_head)  # this head's part number
    row = int64(last_le(part_ptr[r], pid))  # the row holding part pid
    part = pid - part_ptr[r, row]
    nparts = int64(part_ptr[r, row + 1] - part_ptr[r, row])
    b = int64(last_le(row_offsets, row))
    j = row - row_offsets[b]
    lk = int64(cu_k[b + 1] - cu_k[b])
    nk = min(int64(block_size), lk - j * block_size)
    e0 = int64(row_ptr[r, row]) + part * part_size
    e1 = min(int64(row_ptr[r, row + 1]), e0 + part_size)
    if pid >= part_ptr[r, nrows] or nk <= 0 or e0 < 0 or e1 > num_entries:
        e1 = e0
    return r, row, part, nparts, b, j, lk, nk, e0, e1


@functools.lru_cache(maxsize=None)
def delta_kernel(head_dim: int, bf16_in: bool):
    """``delta [Tq, Hq] = rowsum(dO * O)`` for ``o, do [Tq, Hq, D]`` (one value an element,
    bf16 as its bits), specialised for D and the input kind."""
    D = head_dim
    to_f32 = bf16_to_f32 if bf16_in else cuda.jit(device=True)(_identity_f32)

    @kernel_jit
    def _attention_bwd_kernel_delta(o, do, delta):
        """A warp per (t, h) row: lane l sums dims l, l + 32, ... (coalesced reads), then the
        warp's partial sums meet by shuffles. (A thread per row, its reads strided by a row,
        took 43 ms at 128K in the paper configuration.)"""
        i = cuda.grid(1)
        row = i // 32
        lane = i % 32
        hq = o.shape[1]
        if row >= o.shape[0] * hq:
            return  # the whole warp: rows are warp-uniform
        t = row // hq
        h = row % hq
        acc = float32(0.0)
        for d in range(lane, D, 32):
            acc += to_f32(do[t, h, d]) * to_f32(o[t, h, d])
        for width in (16, 8, 4, 2, 1):
            acc += cuda.shfl_xor_sync(0xFFFFFFFF, acc, width)
        if lane == 0:
            delta[t, h] = acc

    return _attention_bwd_kernel_delta


SUM_PARTS = 4  # parts whose loads a thread of dkdv_sum_kernel has in flight at once


@functools.lru_cache(maxsize=None)
def dkdv_sum_kernel(block_size: int, head_dim: int, threads: int):
    """dK, dV of the rows cut into several parts: the parts' scratch slots ``dk_part,
    dv_part [slots, Bk*D]`` added to ``dk, dv [Tk, Hkv, D]`` in part order; a CTA of
    ``threads`` per (head, row). Where ``D % 4 == 0`` a thread takes four elements of a key at
    a time (16-byte loads), ``SUM_PARTS`` parts' loads issued before any is added (one part
    at a time, the sums at 32K took 1.5 ms of an H100's backward: a chunk's first rows hold
    many parts); the additions keep part order either way (the same bits)."""
    Bk, D, NT, U = block_size, head_dim, threads, SUM_PARTS
    VEC = D % 4 == 0
    UV = 8 * U  # (a local array's size must be a plain constant)

    @kernel_jit
    def _attention_bwd_kernel_dkdv_sum(part_ptr, row_offsets, cu_k, dk_part, dv_part, dk, dv):
        """dK, dV of a row cut into several parts: their sums added in part order."""
        vals = cuda.local.array(UV, float32)
        hkv = part_ptr.shape[0] // 2
        rows = part_ptr.shape[1] - 1
        r = cuda.blockIdx.x // rows
        row = cuda.blockIdx.x % rows
        nparts = part_ptr[r, row + 1] - part_ptr[r, row]
        if nparts <= 1:
            return
        b = last_le(row_offsets, row)
        j = row - row_offsets[b]
        key_base = cu_k[b] + j * Bk
        nk = min(Bk, cu_k[b + 1] - cu_k[b] - j * Bk)
        slot0 = split_slot(part_ptr, hkv, r, row)
        if not VEC:
            for i in range(cuda.threadIdx.x, nk * D, NT):
                ak = float32(0.0)
                av = float32(0.0)
                for part in range(nparts):
                    ak += dk_part[slot0 + part, i]
                    av += dv_part[slot0 + part, i]
                dk[key_base + i // D, r, i % D] += ak  # dk, dv start at 0; chunks add up
                dv[key_base + i // D, r, i % D] += av
            return
        stride = int64(Bk * D)  # elements from one slot to the next
        base = int64(slot0) * stride
        for i4 in range(cuda.threadIdx.x, nk * (D // 4), NT):
            i = 4 * i4
            ak0 = ak1 = ak2 = ak3 = float32(0.0)
            av0 = av1 = av2 = av3 = float32(0.0)
            for p0 in range(0, nparts, U):
                for u in range(U):
                    if p0 + u < nparts:
                        at = base + (p0 + u) * stride + i
                        x0, x1, x2, x3 = load_f32x4(dk_part, at)
                        vals[8 * u] = x0
                        vals[8 * u + 1] = x1
                        vals[8 * u + 2] = x2
                        vals[8 * u + 3] = x3
                        x0, x1, x2, x3 = load_f32x4(dv_part, at)
                        vals[8 * u + 4] = x0
                        vals[8 * u + 5] = x1
                        vals[8 * u + 6] = x2
                        vals[8 * u + 7] = x3
                for u in range(U):
                    if p0 + u < nparts:
                        ak0 += vals[8 * u]
                        ak1 += vals[8 * u + 1]
                        ak2 += vals[8 * u + 2]
                        ak3 += vals[8 * u + 3]
                        av0 += vals[8 * u + 4]
                        av1 += vals[8 * u + 5]
                        av2 += vals[8 * u + 6]
                        av3 += vals[8 * u + 7]
            key = key_base + i // D
            d = i % D
            dk[key, r, d] += ak0
            dk[key, r, d + 1] += ak1
            dk[key, r, d + 2] += ak2
            dk[key, r, d + 3] += ak3
            dv[key, r, d] += av0
            dv[key, r, d + 1] += av1
            dv[key, r, d + 2] += av2
            dv[key, r, d + 3] += av3

    return _attention_bwd_kernel_dkdv_sum


@kernel_jit
def parts_kernel(row_ptr, part_size, parts):
    """``parts [2 Hkv, rows]``: ``parts[r, row] = ceil(count / part_size)`` and
    ``parts[Hkv + r, row]`` the same where it is > 1 (scratch slots), else 0."""
    i = cuda.grid(1)
    hkv = row_ptr.shape[0]
    rows = row_ptr.shape[1] - 1
    if i >= hkv * rows:
        return
    r = i // rows
    row = i % rows
    count = max(0, row_ptr[r, row + 1] - row_ptr[r, row])
    n = (count + part_size - 1) // part_size
    parts[r, row] = n
    parts[hkv + r, row] = n if n > 1 else 0

