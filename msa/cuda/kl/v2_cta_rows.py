"""KL v2: one CTA per (query, group) and per key block, the queries staged in shared memory
(CUDA cores).

Over v1: a (query, group)'s ``G`` heads, its index query and the heads' LSEs are staged in
shared memory (float32) once, and the CTA's threads share its keys (one key per thread, ``G``
dot products of ``D`` and one of ``Didx``); the threads' states merge in a fixed tree
(``tree_merge``), and ``dq_idx`` is summed from ``dS`` staged in shared memory. ``dk_idx``: one
CTA per key block (CSR row), the row's queries and their ``dS`` rows staged ``KEY_ENTRIES`` at a
time, each thread a register tile of ``KEY_TILE`` keys x dims. Any dtype and size.

Non-finite keys (docs/design.md §3): each thread sums the keys of the query it sees only (and
``dq_idx`` the chunk's visible keys), so a key the query cannot see is never read; a visible
NaN or infinity gives the reference's classes through ``msa.cuda.kl._state`` (a compare a key).

Default for what the tensor cores (v3) do not take: float32 inputs, the warmup (no selection),
``D``, ``Didx`` or ``Bk`` not multiples of 16, ``Bk > 256``, ``G`` not in 1, 2, 4, 8, 16, or
tensor-core tiles that do not fit shared memory; its ``dk_idx`` kernel also runs for v3 where
v3's own does not apply (fp16, ``Bk > 128``). Measured on the H200 (ff049cb, the paper
configuration in bf16, N = 32K): ``kl_loss_and_backward`` 811 ms, 28x v3 (29.0 ms, f4aaa47).
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, int32

from .._core.arrays import SIMULATOR
from ._state import (NEG_INF, accumulate, block_range, finish, finite_or_zero, kahan_add,
                     loader, merge, query_row, sequence_of, student_lse)
from .._core.diskcache import kernel_jit

# The simulator runs every thread as a Python thread and every barrier costs milliseconds there,
# so it gets smaller tiles; the kernels are the same.
KEY_TILE = (4, 4) if SIMULATOR else (8, 8)  # dk: keys x dims per thread
# dk: CSR entries (queries) staged in shared memory per step, and the float budget of the
# warmup's staged query heads (G*D floats per entry).
KEY_ENTRIES = 16
KEY_STAGE_FLOATS = 8192

@functools.lru_cache(maxsize=None)
def shared_score_fns(kind: str, group: int, head_dim: int, index_dim: int):
    """``teacher(sq, q_off, slse, l_off, k, j, r, scale)`` = ``P_j`` with the ``G`` query heads at
    ``sq[q_off + h*D + d]`` and their (finite) LSEs at ``slse[l_off + h]`` (float32, shared),
    and ``student(sqi, qi_off, k_idx, j, index_scale)`` = ``S^idx_j``."""
    G, D, DI = group, head_dim, index_dim
    to_f32 = loader(kind)
    inv_g = float32(1.0 / G)

    @cuda.jit(device=True)
    def teacher(sq, q_off, slse, l_off, k, j, r, scale):
        s = cuda.local.array(G, float32)
        for h in range(G):
            s[h] = float32(0.0)
        for d in range(D):
            kd = to_f32(k[j, r, d])  # one load of K for the G heads
            for h in range(G):
                s[h] += sq[q_off + h * D + d] * kd
        p = float32(0.0)
        for h in range(G):
            p += math.exp(s[h] * scale - slse[l_off + h])
        return p * inv_g

    @cuda.jit(device=True)
    def student(sqi, qi_off, k_idx, j, index_scale):
        s = float32(0.0)
        for d in range(DI):
            s += sqi[qi_off + d] * to_f32(k_idx[j, d])
        return s * index_scale

    return teacher, student


@functools.lru_cache(maxsize=None)
def row_loads(kind: str, group: int, head_dim: int, index_dim: int, threads: int):
    """Device function staging a (query, group)'s float32 heads, index query and finite LSEs."""
    G, D, DI, NT = group, head_dim, index_dim, threads
    to_f32 = loader(kind)

    @cuda.jit(device=True)
    def load(q, q_idx, lse, t, r, tid, sq, sqi, slse):
        for i in range(tid, G * D, NT):
            sq[i] = to_f32(q[t, r * G + i // D, i % D])
        for d in range(tid, DI, NT):
            sqi[d] = to_f32(q_idx[t, r, d])
        for h in range(tid, G, NT):
            slse[h] = finite_or_zero(lse[t, r * G + h])

    return load


@cuda.jit(device=True)
def tree_merge(red, tid, nt, m, l, c, k):
    """Merge the CTA's per-thread states ``(m, l, C, K)`` in a fixed tree (``nt`` a power of
    two); every thread gets the total. ``red``: shared float32 [4, nt]."""
    red[0, tid] = m
    red[1, tid] = l
    red[2, tid] = c
    red[3, tid] = k
    cuda.syncthreads()
    stride = nt // 2
    while stride > 0:
        if tid < stride:
            m, l, c, k = merge(red[0, tid], red[1, tid], red[2, tid], red[3, tid],
                                red[0, tid + stride], red[1, tid + stride],
                                red[2, tid + stride], red[3, tid + stride])
            red[0, tid] = m
            red[1, tid] = l
            red[2, tid] = c
            red[3, tid] = k
        cuda.syncthreads()
        stride //= 2
    m = red[0, 0]
    l = red[1, 0]
    c = red[2, 0]
    k = red[3, 0]
    cuda.syncthreads()  # red may be reused
    return m, l, c, k


@functools.lru_cache(maxsize=None)
def kl_kernel_cta_rows(kind: str, group: int, head_dim: int, index_dim: int, threads: int):
    """v2 forward: ``kl[t, r]``, one CTA of ``threads`` per (query, group), one thread per key."""
    G, D, DI, NT = group, head_dim, index_dim, threads
    GD = G * D  # shared array sizes must be compile-time constants
    teacher, student = shared_score_fns(kind, G, D, DI)
    load = row_loads(kind, G, D, DI, NT)

    @kernel_jit
    def _kl_kernel_cta_rows_v2(q, k, q_idx, k_idx, I, lse, cu_q, cu_k, block_size, warmup, scale,
                               index_scale, kl):
        sq = cuda.shared.array(GD, float32)
        sqi = cuda.shared.array(DI, float32)
        slse = cuda.shared.array(G, float32)
        red = cuda.shared.array((4, NT), float32)
        tid = cuda.threadIdx.x
        hkv = kl.shape[1]
        t = cuda.blockIdx.x // hkv
        r = cuda.blockIdx.x % hkv
        key0, pos, _ = query_row(cu_q, cu_k, t)
        load(q, q_idx, lse, t, r, tid, sq, sqi, slse)
        cuda.syncthreads()
        zero = float32(0.0)
        # each thread's keys in one Kahan-compensated run, then the states in a fixed tree
        m, l, le, d, de, c, ce = NEG_INF, zero, zero, zero, zero, zero, zero
        nslots = pos // block_size + 1 if warmup else I.shape[2]
        for s in range(nslots):
            kk0, kk1 = block_range(I, t, r, s, warmup, block_size, pos)
            for kp in range(kk0 + tid, kk1, NT):
                j = key0 + kp
                m, l, le, d, de, c, ce = accumulate(
                    m, l, le, d, de, c, ce, teacher(sq, 0, slse, 0, k, j, r, scale),
                    student(sqi, 0, k_idx, j, index_scale))
        m, l, c, kk = finish(m, l, le, d, de, c, ce)
        m, l, c, kk = tree_merge(red, tid, NT, m, l, c, kk)
        if tid == 0:
            kl[t, r] = kk

    return _kl_kernel_cta_rows_v2


@functools.lru_cache(maxsize=None)
def kl_kernel_cta_rows_grad(kind: str, group: int, head_dim: int, index_dim: int,
                            threads: int):
    """v2 backward pass 1: ``lse_idx``, ``dq_idx`` and the dS buffer, one CTA per (query, group)
    of queries ``[t0, t0 + count)``."""
    G, D, DI, NT = group, head_dim, index_dim, threads
    GD = G * D
    PER = -(-DI // NT)  # dq_idx dims per thread
    teacher, student = shared_score_fns(kind, G, D, DI)
    load = row_loads(kind, G, D, DI, NT)
    to_f32 = loader(kind)

    @kernel_jit
    def _kl_kernel_cta_rows_grad_v2(q, k, q_idx, k_idx, I, lse, cu_q, cu_k, block_size, warmup,
                                    scale, index_scale, coef, t0, count, store_ds, lse_idx, dq,
                                    ds):
        sq = cuda.shared.array(GD, float32)
        sqi = cuda.shared.array(DI, float32)
        slse = cuda.shared.array(G, float32)
        red = cuda.shared.array((4, NT), float32)
        sds = cuda.shared.array(NT, float32)
        tid = cuda.threadIdx.x
        hkv = dq.shape[1]
        t = t0 + cuda.blockIdx.x // hkv
        r = cuda.blockIdx.x % hkv
        key0, pos, lk = query_row(cu_q, cu_k, t)
        load(q, q_idx, lse, t, r, tid, sq, sqi, slse)
        cuda.syncthreads()
        nslots = pos // block_size + 1 if warmup else I.shape[2]
        zero = float32(0.0)

        # LSE^idx over the support (index scores only, l Kahan-compensated per thread)
        m = NEG_INF
        l = zero
        le = zero
        for s in range(nslots):
            kk0, kk1 = block_range(I, t, r, s, warmup, block_size, pos)
            for kp in range(kk0 + tid, kk1, NT):
                x = student(sqi, 0, k_idx, key0 + kp, index_scale)
                if x > m:
                    if m > NEG_INF:
                        f = math.exp(m - x)
                        l *= f
                        le *= f
                    m = x
                if x != NEG_INF:  # a visible -inf logit adds nothing (m may be -inf)
                    l, le = kahan_add(l, le, math.exp(x - m))
        m, l, _, _ = tree_merge(red, tid, NT, m, l - le, zero, zero)
        lse_i = student_lse(m, l)
        if tid == 0:
            lse_idx[t, r] = lse_i

        # dS_j = coef (P_idx_j - P_j), NT keys at a time through shared memory;
        # dq_idx += dS_j k_idx_j in key order, threads over Didx.
        acc = cuda.local.array(PER, float32)
        for i in range(PER):
            acc[i] = zero
        nblocks = (lk + block_size - 1) // block_size
        for s in range(nslots):
            kk0, kk1 = block_range(I, t, r, s, warmup, block_size, pos)
            k_begin = kk0
            k_end = kk1
            write = False
            if store_ds:
                blk = int(I[t, r, s])
                # every valid block of the sequence is in the CSR: write all its Bk entries
                write = 0 <= blk < nblocks
                if write:
                    k_begin = blk * block_size
                    k_end = k_begin + block_size
            for c0 in range(k_begin, k_end, NT):
                kp = c0 + tid
                dsv = zero
                if kk0 <= kp < kk1:
                    j = key0 + kp
                    p = teacher(sq, 0, slse, 0, k, j, r, scale)
                    dsv = coef * (math.exp(student(sqi, 0, k_idx, j, index_scale) - lse_i) - p)
                if write and kp < k_end:
                    ds[t - t0, r, s, kp - k_begin] = dsv
                sds[tid] = dsv
                cuda.syncthreads()
                lo = max(kk0, c0)  # the chunk's visible keys: [lo, hi)
                hi = min(kk1, c0 + NT)
                for i in range(PER):
                    d = tid + i * NT
                    if d < DI:
                        x = acc[i]
                        for kp2 in range(lo, hi):
                            x += sds[kp2 - c0] * to_f32(k_idx[key0 + kp2, d])
                        acc[i] = x
                cuda.syncthreads()
        for i in range(PER):
            d = tid + i * NT
            if d < DI:
                dq[t, r, d] = acc[i] * index_scale

    return _kl_kernel_cta_rows_grad_v2


def key_tiles(block_size: int, index_dim: int):
    """``(TJ, TD, threads)`` of the v2 dk kernel: each thread owns a register tile of ``TJ``
    keys x ``TD`` dims of the block's ``Bk x Didx`` outputs (8 x 8 on a GPU, 4 x 4 in the
    simulator; larger for huge blocks so that a CTA has at most 1024 threads)."""
    tj, td = KEY_TILE
    while True:
        threads = -(-block_size // tj) * -(-index_dim // td)
        if threads <= 1024:
            return tj, td, threads
        tj, td = 2 * tj, 2 * td


@functools.lru_cache(maxsize=None)
def kl_kernel_cta_keys(kind: str, group: int, head_dim: int, index_dim: int, block_size: int,
                       entries: int, warmup: bool):
    """v2 backward pass 2: ``dk_idx`` of one key block per CTA, a register tile of (keys, dims)
    per thread (``key_tiles``).

    Selected: the row's CSR entries ``(t, slot)`` of every group, ``dS`` read from the buffer.
    Warmup: every query of the sequence at or after the block's first key, ``dS`` recomputed.
    ``entries`` queries are staged in shared memory per step.
    """
    G, D, DI, Bk, EB = group, head_dim, index_dim, block_size, entries
    TJ, TD, NT = key_tiles(Bk, DI)
    NJ = -(-Bk // TJ)  # thread (a, c) owns keys a + NJ*u and dims c + ND*v
    ND = -(-DI // TD)
    TT = TJ * TD
    teacher, student = shared_score_fns(kind, G, D, DI)
    to_f32 = loader(kind)
    QW = G * D if warmup else 1  # staged query heads per entry (warmup only)
    GW = G if warmup else 1
    # shared array sizes must be compile-time constants
    E_DI, E_BK, E_QW, E_GW = EB * DI, EB * Bk, EB * QW, EB * GW
    # three register tiles (sum, compensation, batch partial): at 8 x 8 about 254 registers
    # (offline ptxas, sm_90), which 256 threads can have; more threads must spill to launch
    options = {}
    if NT > 256 and not SIMULATOR:
        options = {"max_registers": 65536 // NT // 8 * 8}

    @kernel_jit(**options)
    def _kl_kernel_cta_keys_v2(q, k, q_idx, k_idx, lse, lse_idx, row_ptr, q_indices, slots, ds,
                               cu_q, cu_k, row_offsets, block_size, scale, index_scale, coef, dk):
        sqi = cuda.shared.array(E_DI, float32)
        sds = cuda.shared.array(E_BK, float32)
        sq = cuda.shared.array(E_QW, float32)
        slse = cuda.shared.array(E_GW, float32)
        slse_i = cuda.shared.array(EB, float32)
        stok = cuda.shared.array(EB, int32)  # the entry's query (-1: none)
        saux = cuda.shared.array(EB, int32)  # its slot (selected) or key position (warmup)
        tid = cuda.threadIdx.x
        hkv = q_idx.shape[1]
        tq = q_idx.shape[0]
        topk = ds.shape[2]
        row = cuda.blockIdx.x
        b = sequence_of(row_offsets, row)
        kk0 = (row - int(row_offsets[b])) * Bk
        key0 = int(cu_k[b])
        lk = int(cu_k[b + 1]) - key0
        nk = min(Bk, lk - kk0)
        q_lo = int(cu_q[b])
        q_hi = int(cu_q[b + 1])
        shift = lk - (q_hi - q_lo)  # query t sits at key position shift + t - q_lo
        zero = float32(0.0)
        ta = tid // ND
        tc = tid % ND
        acc = cuda.local.array(TT, float32)  # Kahan sum (acc - comp) of the batches' partials
        comp = cuda.local.array(TT, float32)
        part = cuda.local.array(TT, float32)
        for i in range(TT):
            acc[i] = zero
            comp[i] = zero
        sj = cuda.local.array(TJ, float32)
        sd = cuda.local.array(TD, float32)
        for r in range(hkv):
            if warmup:
                first = q_lo + max(0, kk0 - shift)
                count = q_hi - first
            else:
                first = int(row_ptr[r, row])
                count = int(row_ptr[r, row + 1]) - first
            for e0 in range(0, count, EB):
                ne = min(EB, count - e0)
                # stage the entries' queries (and, selected, their dS rows)
                for e in range(tid, EB, NT):
                    t = -1
                    aux = 0
                    if e < ne:
                        if warmup:
                            t = first + e0 + e
                            aux = shift + t - q_lo
                            slse_i[e] = lse_idx[t, r]
                        else:
                            t = int(q_indices[r, first + e0 + e])
                            aux = int(slots[r, first + e0 + e])
                            if t < 0 or t >= tq or aux < 0 or aux >= topk:
                                t = -1  # never out of bounds, even for a foreign CSR
                    stok[e] = t
                    saux[e] = aux
                cuda.syncthreads()
                for i in range(tid, EB * DI, NT):
                    t = stok[i // DI]
                    sqi[i] = to_f32(q_idx[t, r, i % DI]) if t >= 0 else zero
                if warmup:
                    for i in range(tid, EB * QW, NT):
                        t = stok[i // QW]
                        x = zero
                        if t >= 0:
                            x = to_f32(q[t, r * G + (i % QW) // D, i % D])
                        sq[i] = x
                    for i in range(tid, EB * GW, NT):
                        t = stok[i // GW]
                        x = zero
                        if t >= 0:
                            x = finite_or_zero(lse[t, r * G + i % GW])
                        slse[i] = x
                else:
                    for i in range(tid, EB * Bk, NT):
                        e = i // Bk
                        t = stok[e]
                        x = zero
                        if t >= 0 and i % Bk < nk:
                            x = ds[t, r, saux[e], i % Bk]
                        sds[i] = x
                cuda.syncthreads()
                if warmup:
                    # dS of (entry, key), recomputed as in pass 1
                    for i in range(tid, EB * Bk, NT):
                        e = i // Bk
                        jj = i % Bk
                        t = stok[e]
                        x = zero
                        if t >= 0 and jj < nk and kk0 + jj <= saux[e]:
                            j = key0 + kk0 + jj
                            p = teacher(sq, e * QW, slse, e * GW, k, j, r, scale)
                            s_idx = student(sqi, e * DI, k_idx, j, index_scale)
                            x = coef * (math.exp(s_idx - slse_i[e]) - p)
                        sds[i] = x
                    cuda.syncthreads()
                # dk_idx[key, d] += dS[e, key] q_idx[e, d], entries in CSR order; the batch's
                # partial folded into the compensated sum (a key block may have Tq Hkv entries)
                for i in range(TT):
                    part[i] = zero
                for e in range(ne):
                    for u in range(TJ):
                        sj[u] = sds[e * Bk + min(ta + NJ * u, Bk - 1)]
                    for v in range(TD):
                        sd[v] = sqi[e * DI + min(tc + ND * v, DI - 1)]
                    for u in range(TJ):
                        for v in range(TD):
                            part[u * TD + v] += sj[u] * sd[v]
                for i in range(TT):
                    acc[i], comp[i] = kahan_add(acc[i], comp[i], part[i])
                cuda.syncthreads()
        for u in range(TJ):
            jj = ta + NJ * u
            for v in range(TD):
                d = tc + ND * v
                if jj < nk and d < DI:
                    i = u * TD + v
                    dk[key0 + kk0 + jj, d] += (acc[i] - comp[i]) * index_scale

    return _kl_kernel_cta_keys_v2

