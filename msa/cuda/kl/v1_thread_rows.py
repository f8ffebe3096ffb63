"""KL v1: one thread per (query, group) for ``kl``, ``LSE^idx``, ``dq_idx`` and ``dS``; one thread
per key for ``dk_idx`` (CUDA cores, inputs read from global memory).

The readable rung: each kernel is the reference's loop over a support, with the online state of
``msa.cuda.kl._state`` (one Kahan-compensated run per slot, the slots' states merged in slot
order). The backward's first kernel writes ``dS`` of every selected block into the buffer
``[Tq, Hkv, K, Bk]`` and sums ``dq_idx`` in key order; the second sums each key's ``dk_idx``
over the queries of its CSR row (the warmup: over every later query of its sequence, ``dS``
recomputed), in runs of ``FOLD`` terms folded into a compensated sum.

Non-finite keys (docs/design.md §3): every loop runs over the keys its query sees only, so a
key it cannot see is never read; a visible NaN or infinity gives the reference's NaN, +inf or
-inf through the state functions of ``msa.cuda.kl._state`` (a compare a key, no other cost).

Default nowhere (``version=1``): the teaching rung, and the one the simulator runs fastest (no
barriers). Not timed at the benchmark sizes (``bench_kl --v1-max-n``, default 0): every thread
reads its ``G`` query heads and the keys from global memory once per key.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32

from ._state import (FOLD, NEG_INF, accumulate, block_range, finish, finite_or_zero,
                     fold_every, kahan_add, loader, merge, query_row, sequence_of, student_lse)
from .._core.diskcache import kernel_jit

@functools.lru_cache(maxsize=None)
def global_score_fns(kind: str, group: int, head_dim: int, index_dim: int):
    """``teacher(q, t, r, lse, k, j, scale)`` = ``P_j`` and ``student(q_idx, t, r, k_idx, j,
    index_scale)`` = ``S^idx_j`` of one key for one (query, group), reading global memory."""
    G, D, DI = group, head_dim, index_dim
    to_f32 = loader(kind)
    inv_g = float32(1.0 / G)

    @cuda.jit(device=True)
    def teacher(q, t, r, lse, k, j, scale):
        s = cuda.local.array(G, float32)
        for h in range(G):
            s[h] = float32(0.0)
        for d in range(D):
            kd = to_f32(k[j, r, d])
            for h in range(G):
                s[h] += to_f32(q[t, r * G + h, d]) * kd
        # P_j = (1/G) sum_h exp(S_h - LSE_h)
        p = float32(0.0)
        for h in range(G):
            p += math.exp(s[h] * scale - finite_or_zero(lse[t, r * G + h]))
        return p * inv_g

    @cuda.jit(device=True)
    def student(q_idx, t, r, k_idx, j, index_scale):
        s = float32(0.0)
        for d in range(DI):
            s += to_f32(q_idx[t, r, d]) * to_f32(k_idx[j, d])
        return s * index_scale

    return teacher, student


@functools.lru_cache(maxsize=None)
def kl_kernel_thread_rows(kind: str, group: int, head_dim: int, index_dim: int):
    """v1 forward: ``kl[t, r]``, one thread per (query, group)."""
    teacher, student = global_score_fns(kind, group, head_dim, index_dim)

    @kernel_jit
    def _kl_kernel_thread_rows_v1(q, k, q_idx, k_idx, I, lse, cu_q, cu_k, block_size, warmup,
                                  scale, index_scale, kl):
        hkv = kl.shape[1]
        i = cuda.grid(1)
        if i >= kl.shape[0] * hkv:
            return
        t = i // hkv
        r = i % hkv
        key0, pos, _ = query_row(cu_q, cu_k, t)
        zero = float32(0.0)
        # one state per slot (its keys in a Kahan-compensated run), merged in slot order
        mt, lt, ct, kt = NEG_INF, zero, zero, zero
        nslots = pos // block_size + 1 if warmup else I.shape[2]
        for s in range(nslots):
            kk0, kk1 = block_range(I, t, r, s, warmup, block_size, pos)
            m, l, le, d, de, c, ce = NEG_INF, zero, zero, zero, zero, zero, zero
            for kp in range(kk0, kk1):
                j = key0 + kp
                m, l, le, d, de, c, ce = accumulate(
                    m, l, le, d, de, c, ce, teacher(q, t, r, lse, k, j, scale),
                    student(q_idx, t, r, k_idx, j, index_scale))
            m, l, c, kk = finish(m, l, le, d, de, c, ce)
            mt, lt, ct, kt = merge(mt, lt, ct, kt, m, l, c, kk)
        kl[t, r] = kt

    return _kl_kernel_thread_rows_v1


@functools.lru_cache(maxsize=None)
def kl_kernel_thread_rows_grad(kind: str, group: int, head_dim: int, index_dim: int):
    """v1 backward pass 1: ``lse_idx``, ``dq_idx`` and the dS buffer, one thread per (query,
    group) of queries ``[t0, t0 + count)``."""
    DI = index_dim
    teacher, student = global_score_fns(kind, group, head_dim, index_dim)
    to_f32 = loader(kind)

    @kernel_jit
    def _kl_kernel_thread_rows_grad_v1(q, k, q_idx, k_idx, I, lse, cu_q, cu_k, block_size,
                                       warmup, scale, index_scale, coef, t0, count, store_ds,
                                       lse_idx, dq, ds):
        hkv = dq.shape[1]
        i = cuda.grid(1)
        if i >= count * hkv:
            return
        t = t0 + i // hkv
        r = i % hkv
        key0, pos, lk = query_row(cu_q, cu_k, t)
        nslots = pos // block_size + 1 if warmup else I.shape[2]
        # LSE^idx over the support (index scores only; l Kahan-compensated)
        m = NEG_INF
        l = float32(0.0)
        le = float32(0.0)
        for s in range(nslots):
            kk0, kk1 = block_range(I, t, r, s, warmup, block_size, pos)
            for kp in range(kk0, kk1):
                x = student(q_idx, t, r, k_idx, key0 + kp, index_scale)
                if x > m:
                    if m > NEG_INF:
                        f = math.exp(m - x)
                        l *= f
                        le *= f
                    m = x
                if x != NEG_INF:  # a visible -inf logit adds nothing (m may be -inf)
                    l, le = kahan_add(l, le, math.exp(x - m))
        lse_i = student_lse(m, l - le)
        lse_idx[t, r] = lse_i
        # dS_j = coef (P_idx_j - P_j); dq_idx = index_scale sum_j dS_j k_idx_j, keys in order
        acc = cuda.local.array(DI, float32)
        for d in range(DI):
            acc[d] = float32(0.0)
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
            for kp in range(k_begin, k_end):
                dsv = float32(0.0)
                if kk0 <= kp < kk1:
                    j = key0 + kp
                    p = teacher(q, t, r, lse, k, j, scale)
                    dsv = coef * (math.exp(student(q_idx, t, r, k_idx, j, index_scale) - lse_i) - p)
                    for d in range(DI):
                        acc[d] += dsv * to_f32(k_idx[j, d])
                if write:
                    ds[t - t0, r, s, kp - k_begin] = dsv
        for d in range(DI):
            dq[t, r, d] = acc[d] * index_scale

    return _kl_kernel_thread_rows_grad_v1


@functools.lru_cache(maxsize=None)
def kl_kernel_thread_keys(kind: str, group: int, head_dim: int, index_dim: int, warmup: bool):
    """v1 backward pass 2: ``dk_idx[j] += index_scale sum_{r, t} dS q_idx``, one thread per key.

    Selected: the queries of the key's CSR row (per group, in CSR order), ``dS`` from the buffer.
    Warmup: every query of the sequence that sees the key, ``dS`` recomputed.
    """
    DI = index_dim
    DC = min(DI, 16)  # dims per chunk
    teacher, student = global_score_fns(kind, group, head_dim, index_dim)
    to_f32 = loader(kind)

    @kernel_jit
    def _kl_kernel_thread_keys_v1(q, k, q_idx, k_idx, lse, lse_idx, row_ptr, q_indices, slots, ds,
                                  cu_q, cu_k, row_offsets, block_size, scale, index_scale, coef,
                                  dk):
        j = cuda.grid(1)
        if j >= dk.shape[0]:
            return
        hkv = q_idx.shape[1]
        b = sequence_of(cu_k, j)
        key0 = int(cu_k[b])
        lk = int(cu_k[b + 1]) - key0
        kp = j - key0
        blk = kp // block_size
        jj = kp - blk * block_size
        row = int(row_offsets[b]) + blk
        q_lo = int(cu_q[b])
        q_hi = int(cu_q[b + 1])
        shift = lk - (q_hi - q_lo)  # query t sits at key position shift + t - q_lo
        # a key sums up to Tq Hkv terms: runs of FOLD entries, folded into a Kahan sum; DC
        # dims at a time keep the three sums in registers (the warmup recomputes dS per chunk)
        acc = cuda.local.array(DC, float32)
        comp = cuda.local.array(DC, float32)
        part = cuda.local.array(DC, float32)
        for d0 in range(0, DI, DC):
            for dd in range(DC):
                acc[dd] = float32(0.0)
                comp[dd] = float32(0.0)
                part[dd] = float32(0.0)
            n = 0
            for r in range(hkv):
                if warmup:
                    for t in range(q_lo + max(0, kp - shift), q_hi):
                        p = teacher(q, t, r, lse, k, j, scale)
                        x = student(q_idx, t, r, k_idx, j, index_scale)
                        dsv = coef * (math.exp(x - lse_idx[t, r]) - p)
                        for dd in range(DC):
                            part[dd] += dsv * to_f32(q_idx[t, r, min(d0 + dd, DI - 1)])
                        n = fold_every(acc, comp, part, n + 1)
                else:
                    for e in range(int(row_ptr[r, row]), int(row_ptr[r, row + 1])):
                        t = int(q_indices[r, e])
                        s = int(slots[r, e])
                        if 0 <= t < q_idx.shape[0] and 0 <= s < ds.shape[2]:
                            dsv = ds[t, r, s, jj]
                            for dd in range(DC):
                                part[dd] += dsv * to_f32(q_idx[t, r, min(d0 + dd, DI - 1)])
                            n = fold_every(acc, comp, part, n + 1)
            fold_every(acc, comp, part, FOLD)
            for dd in range(DC):
                if d0 + dd < DI:
                    dk[j, d0 + dd] += (acc[dd] - comp[dd]) * index_scale

    return _kl_kernel_thread_keys_v1

