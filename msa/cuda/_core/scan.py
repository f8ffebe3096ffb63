"""Prefix sums on the GPU, shared by the CSR build and the scheduler (paper §4.2).

Every version computes, for each segment ``s`` of counts ``>= 0``, the exclusive scan
``dst[s, 0] = 0``, ``dst[s, i+1] = dst[s, i] + src[s, i]``, in int64, clamped to int32:

===  ======================================  =================================================
v    idea                                    where it runs; verdict
===  ======================================  =================================================
1    one thread per segment walks it         ``exclusive_prefix_sum(version=1)``: the teaching
     (``_scan_kernel_serial``)               rung, serial in the row length
2    reduce-then-scan: per-block sums, one   ``exclusive_prefix_sum``'s default (it also flags
     CTA per segment scans them, add back    negative counts and overflow); three launches
3    look-back: the tile scan and the        ``build_csr`` and ``build_schedule``: one launch;
     prefix sum in ONE launch                at 128K 0.11 ms against 0.24 ms for the tile scan
     (``_scan_kernel_lookback``)             + v2's three launches it replaced (H200; the
                                             same 0.20 ms at 1M)
===  ======================================  =================================================

``launch_scan`` launches v1 or v2 on ``src [S, n]`` into ``dst [S, n+1]``; ``lookback_scan``
launches v3 on per-tile counts ``[ntiles, S, n]``: it sums each column over the tiles (and, in
place, rewrites it as the exclusive scan over tiles: each tile's start inside its row) and
writes the prefix sum of the column totals into ``dst``.

Look-back (v3). CTA ``b`` of segment ``s`` publishes its own total (flag 1), waits for the
earlier CTAs' words, adding totals until it meets an inclusive prefix (flag 2), then publishes
its own inclusive prefix. ``(b, s)`` is not the CTA's ``blockIdx`` but a ticket it draws when it
starts (an atomic counter, as CUB does), so every CTA it waits for has already started: it
cannot deadlock whatever order the hardware starts CTAs in. Status words ``epoch << 34 | flag
<< 32 | sum`` live in one int64 buffer per device and launch stream (``streams``) kept between
calls; each launch has a new epoch and ignores older words, so the buffer is zeroed once, never
per call. Launches on one stream run one after the other, so they never share words; replaying
them in a captured CUDA graph (which would reuse an epoch) is not supported. The sums are of
non-negative counts below 2**31 (the CSR launcher checked ``Tq*K``), so the 32-bit field cannot
overflow; the result does not depend on timing: integer sums of fixed groups.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np
from numba import cuda, int32, int64

from .arrays import INT32_MAX, SIMULATOR
from .launch import THREADS, dev, karg, launch
from .streams import launch_handle, stream
from .diskcache import kernel_jit

_SCAN_ITEMS = 4  # counts per thread in the block scans
_SCAN_THREADS = 8 if SIMULATOR else 256  # threads per CTA of the block scans (a power of two)
_LOOKBACK_SHIFT = 34  # status word: epoch << 34 | flag << 32 | value (value < 2**32)
_EPOCH_LIMIT = 1 << 29  # epochs stay below this, so a status word stays positive


class _LookbackState:
    """Status words of the look-back scans, kept between calls (one buffer per device and
    launch stream: scans queued on two streams may run at once).

    Each launch gets a new epoch, and a block's status counts only with the current epoch, so
    the buffer never needs clearing between launches.
    """

    def __init__(self):
        self.buffers = {}
        self.epochs = itertools.count(1)

    def get(self, size):
        """``(status, epoch)``: a zeroed-once int64 buffer of at least ``size`` words."""
        epoch = next(self.epochs)
        handle = 0 if SIMULATOR else launch_handle()
        # handle 2 is the per-thread default stream: every thread's own, under one value
        key = 0 if SIMULATOR else (cuda.get_current_device().id, handle,
                                   threading.get_ident() if handle == 2 else 0)
        buf = self.buffers.get(key)
        if buf is None or buf[1] < size or epoch >= _EPOCH_LIMIT:
            if epoch >= _EPOCH_LIMIT:
                self.epochs = itertools.count(2)
                epoch = 1
                self.buffers.clear()  # every device's words would see old epochs come round
            n = max(size, 4096, 2 * (buf[1] if buf is not None else 0))
            zeros = np.zeros(n, np.int64)
            arr = zeros if SIMULATOR else cuda.to_device(zeros, stream=stream())
            buf = self.buffers[key] = (dev(arr), n)
        return buf[0], epoch


_lookback = _LookbackState()


@cuda.jit(device=True)
def block_inclusive_scan(sh, tid, nt):
    """In-place inclusive scan of ``sh[0:nt]`` by the ``nt`` threads of a CTA (Hillis-Steele)."""
    d = 1
    while d < nt:
        x = int64(0)
        if tid >= d:
            x = sh[tid - d]
        cuda.syncthreads()
        sh[tid] += x
        cuda.syncthreads()
        d *= 2


@cuda.jit(device=True)
def clamp_i32(x):
    return int32(min(x, INT32_MAX))


# --- exclusive prefix sum ----------------------------------------------------------------------

@kernel_jit
def _scan_kernel_serial(src, dst, flag):
    """v1: thread s walks segment s: ``dst[s, i+1] = dst[s, i] + src[s, i]``."""
    s = cuda.grid(1)
    if s < src.shape[0]:
        acc = int64(0)
        for i in range(src.shape[1]):
            v = int64(src[s, i])
            if v < 0:
                cuda.atomic.or_(flag, 0, 1)
            dst[s, i] = clamp_i32(acc)
            acc += v
        if acc > INT32_MAX:
            cuda.atomic.or_(flag, 0, 2)
        dst[s, src.shape[1]] = clamp_i32(acc)


@kernel_jit
def _scan_kernel_reduce(src, block_sums, flag):
    """v2 step 1: CTA (b, s) sums ``src[s, b*tile : (b+1)*tile]`` into ``block_sums[s, b]``."""
    sh = cuda.shared.array(1024, int64)
    b = cuda.blockIdx.x
    s = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    n = src.shape[1]
    first = int64(b) * nt * _SCAN_ITEMS + tid * _SCAN_ITEMS
    acc = int64(0)
    for k in range(_SCAN_ITEMS):
        i = first + k
        if i < n:
            v = int64(src[s, i])
            if v < 0:
                cuda.atomic.or_(flag, 0, 1)
            acc += v
    sh[tid] = acc
    cuda.syncthreads()
    half = nt // 2
    while half > 0:
        if tid < half:
            sh[tid] += sh[tid + half]
        cuda.syncthreads()
        half //= 2
    if tid == 0:
        block_sums[s, b] = sh[0]


@kernel_jit
def _scan_kernel_block_sums(block_sums, block_offsets, dst, flag):
    """v2 step 2: CTA s scans ``block_sums[s]`` (exclusive); the total goes to ``dst[s, -1]``."""
    sh = cuda.shared.array(1024, int64)
    s = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    nb = block_sums.shape[1]
    carry = int64(0)
    for start in range(0, nb, nt):
        i = start + tid
        v = int64(0)
        if i < nb:
            v = block_sums[s, i]
        sh[tid] = v
        cuda.syncthreads()
        block_inclusive_scan(sh, tid, nt)
        if i < nb:
            block_offsets[s, i] = carry + sh[tid] - v
        carry += sh[nt - 1]
        cuda.syncthreads()  # everyone has read sh[nt-1] before the next round overwrites it
    if tid == 0:
        if carry > INT32_MAX:
            cuda.atomic.or_(flag, 0, 2)
        dst[s, dst.shape[1] - 1] = clamp_i32(carry)


@kernel_jit
def _scan_kernel_add_back(src, block_offsets, dst):
    """v2 step 3: CTA (b, s) scans its tile again, adds ``block_offsets[s, b]``, writes ``dst``."""
    sh = cuda.shared.array(1024, int64)
    b = cuda.blockIdx.x
    s = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    n = src.shape[1]
    first = int64(b) * nt * _SCAN_ITEMS + tid * _SCAN_ITEMS
    mine = int64(0)
    for k in range(_SCAN_ITEMS):
        if first + k < n:
            mine += src[s, first + k]
    sh[tid] = mine
    cuda.syncthreads()
    block_inclusive_scan(sh, tid, nt)
    run = block_offsets[s, b] + sh[tid] - mine  # exclusive prefix of this thread's first item
    for k in range(_SCAN_ITEMS):
        i = first + k
        if i < n:
            dst[s, i] = clamp_i32(run)
            run += src[s, i]


@cuda.jit(device=True)
def _pack_status(epoch, flag, value):
    return (int64(epoch) << _LOOKBACK_SHIFT) | (int64(flag) << 32) | min(max(value, int64(0)),
                                                                          int64(0xFFFFFFFF))


@kernel_jit
def _scan_kernel_lookback(tile_counts, in_place, status, epoch, dst):
    """v3: tile scan and prefix sum in one launch (decoupled look-back), for counts >= 0.

    ``tile_counts`` int32 [ntiles, S, n]; CTA (b, s) owns entries ``[b*nt, (b+1)*nt)`` of
    segment s, one per thread. A thread sums its column over the tiles (and, if ``in_place``,
    rewrites it as an exclusive scan: each tile's start inside the row); the CTA scans the
    column totals; then it learns the total of all earlier CTAs of its segment from their
    status words (``status[1 + s*nb + b]``: flag 1 = own total, 2 = inclusive prefix, tagged with
    this launch's ``epoch``), waiting only on CTAs that started before it; it writes
    ``dst[s, i] = prefix + local exclusive`` and the last CTA ``dst[s, n]``. Sums saturate at
    ``2**32-1`` in a status word and are clamped to int32 in ``dst``.
    """
    sh = cuda.shared.array(1024, int64)
    prefix_sh = cuda.shared.array(1, int64)
    nb = cuda.gridDim.x
    tid = cuda.threadIdx.x
    if tid == 0:
        # Draw this CTA's place (word 0 of ``status``: epoch << 34 | tickets drawn so far).
        ticket = int64(0)
        drawn = False
        while not drawn:
            old = cuda.atomic.or_(status, 0, 0)
            new = old + 1
            ticket = old & 0xFFFFFFFF
            if (old >> _LOOKBACK_SHIFT) != epoch:
                new = _pack_status(epoch, 0, 1)
                ticket = int64(0)
            drawn = cuda.atomic.cas(status, 0, old, new) == old
        prefix_sh[0] = ticket
    cuda.syncthreads()
    b = int32(prefix_sh[0] % nb)
    s = int32(prefix_sh[0] // nb)
    cuda.syncthreads()  # everyone has read the ticket before prefix_sh is reused
    if s >= cuda.gridDim.y:
        return  # only if launches overlapped on the status buffer (see the module docstring)
    nt = cuda.blockDim.x
    ntiles = tile_counts.shape[0]
    n = tile_counts.shape[2]
    i = int64(b) * nt + tid
    total = int64(0)
    if i < n:
        col = tile_counts[:, s, i]
        k = 0
        if in_place:
            while k + 4 <= ntiles:  # four loads in flight before their stores
                c0 = col[k]
                c1 = col[k + 1]
                c2 = col[k + 2]
                c3 = col[k + 3]
                col[k] = clamp_i32(total)
                total += max(c0, 0)
                col[k + 1] = clamp_i32(total)
                total += max(c1, 0)
                col[k + 2] = clamp_i32(total)
                total += max(c2, 0)
                col[k + 3] = clamp_i32(total)
                total += max(c3, 0)
                k += 4
            while k < ntiles:
                c0 = col[k]
                col[k] = clamp_i32(total)
                total += max(c0, 0)
                k += 1
        else:
            while k < ntiles:
                total += max(col[k], 0)
                k += 1
    sh[tid] = total
    cuda.syncthreads()
    block_inclusive_scan(sh, tid, nt)
    if tid == 0:
        aggregate = sh[nt - 1]
        me = 1 + int64(s) * nb + b  # word 0 is the ticket counter
        prefix = int64(0)
        if b == 0:
            cuda.atomic.exch(status, me, _pack_status(epoch, 2, aggregate))
        else:
            cuda.atomic.exch(status, me, _pack_status(epoch, 1, aggregate))
            j = int64(b) - 1
            while j >= 0:
                word = cuda.atomic.or_(status, me - b + j, 0)  # an L2 read, never a stale copy
                if (word >> _LOOKBACK_SHIFT) == epoch:
                    prefix += word & 0xFFFFFFFF
                    if ((word >> 32) & 3) == 2:
                        j = -1
                    else:
                        j -= 1
            cuda.atomic.exch(status, me, _pack_status(epoch, 2, prefix + aggregate))
        prefix_sh[0] = prefix
    cuda.syncthreads()
    prefix = prefix_sh[0]
    if i < n:
        dst[s, i] = clamp_i32(prefix + sh[tid] - total)
    if b == nb - 1 and tid == nt - 1:
        dst[s, n] = clamp_i32(prefix + sh[tid])


def lookback_scan(tile_counts, dst, in_place=True, threads=None):
    """Launch ``_scan_kernel_lookback`` on kernel arguments ``tile_counts [ntiles, S, n]`` and
    ``dst [S, n+1]`` (``dev`` arrays)."""
    _, segments, n = tile_counts.shape
    if segments == 0:
        return
    nt = threads or _SCAN_THREADS
    nb = max(1, -(-n // nt))
    status, epoch = _lookback.get(1 + segments * nb)
    launch(_scan_kernel_lookback, (nb, segments), nt, tile_counts, int(bool(in_place)), status,
            epoch, dst)


def launch_scan(ctx, src, dst, flag, version, threads=None):
    """Exclusive scan of every row of ``src [S, n]`` into ``dst [S, n+1]`` (kernel arguments).

    ``flag[0]`` gets bit 1 for a negative entry and bit 2 for a total above int32.
    """
    segments, n = src.shape
    if segments == 0:
        return
    if version == 1:
        launch(_scan_kernel_serial, (segments + THREADS - 1) // THREADS, THREADS, src, dst,
                flag)
        return
    nt = threads or _SCAN_THREADS
    nb = -(-n // (nt * _SCAN_ITEMS))
    block_sums = ctx.empty((segments, max(nb, 1)), np.int64)
    block_offsets = ctx.empty((segments, max(nb, 1)), np.int64)
    if nb:
        launch(_scan_kernel_reduce, (nb, segments), nt, src, karg(ctx, block_sums), flag)
    launch(_scan_kernel_block_sums, segments, nt, karg(ctx, block_sums[:, :nb]),
            karg(ctx, block_offsets), dst, flag)
    if nb:
        launch(_scan_kernel_add_back, (nb, segments), nt, src, karg(ctx, block_offsets), dst)
