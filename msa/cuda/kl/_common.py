"""The KL launchers' kernels that are no rung's own, on CUDA cores, one thread per output (the
mean: one CTA, a fixed tree): the teacher's own LSE (``lse=None``, every rung), the mean of
eq 10 (every rung), the slot-order combines of v3's per-slot partials, and the warmup's full
causal support written as a selection (v3's warmup)."""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, uint32

from ..csr import is_entry
from ._state import NEG_INF, block_range, loader, merge, query_row, student_lse
from .._core.diskcache import kernel_jit

@functools.lru_cache(maxsize=None)
def kl_kernel_teacher_lse(kind: str, group: int, head_dim: int):
    """``lse[t, h]`` over the support, one thread per (query, head): the ``lse=None`` path."""
    G, D = group, head_dim
    to_f32 = loader(kind)

    @kernel_jit
    def _kl_kernel_teacher_lse_rows(q, k, I, cu_q, cu_k, block_size, warmup, scale, lse):
        hq = lse.shape[1]
        i = cuda.grid(1)
        if i >= lse.shape[0] * hq:
            return
        t = i // hq
        h = i % hq
        r = h // G
        key0, pos, _ = query_row(cu_q, cu_k, t)
        m = NEG_INF
        l = float32(0.0)
        nslots = pos // block_size + 1 if warmup else I.shape[2]
        for s in range(nslots):
            kk0, kk1 = block_range(I, t, r, s, warmup, block_size, pos)
            for kp in range(kk0, kk1):
                x = float32(0.0)
                for d in range(D):
                    x += to_f32(q[t, h, d]) * to_f32(k[key0 + kp, r, d])
                x *= scale
                if x > m:
                    if m > NEG_INF:
                        l *= math.exp(m - x)
                    m = x
                l += math.exp(x - m)
        lse[t, h] = m + math.log(l) if l > float32(0.0) else NEG_INF

    return _kl_kernel_teacher_lse_rows


@functools.lru_cache(maxsize=None)
def kl_kernel_mean(threads: int):
    """eq 10: ``out[0] = sum(x) / n`` by one CTA: Kahan-compensated strided sums per thread, then
    a fixed tree (deterministic, no atomics)."""
    NT = threads

    @kernel_jit
    def _kl_kernel_mean_tree(x, out):
        red = cuda.shared.array(NT, float32)
        tid = cuda.threadIdx.x
        n = x.shape[0]
        total = float32(0.0)
        comp = float32(0.0)
        for i in range(tid, n, NT):
            y = x[i] - comp
            nxt = total + y
            comp = (nxt - total) - y
            total = nxt
        red[tid] = total
        cuda.syncthreads()
        stride = NT // 2
        while stride > 0:
            if tid < stride:
                red[tid] += red[tid + stride]
            cuda.syncthreads()
            stride //= 2
        if tid == 0:
            out[0] = red[0] / float32(n)

    return _kl_kernel_mean_tree


@kernel_jit
def kl_kernel_full_selection(cu_q, cu_k, block_size, I):
    """v3's warmup: ``I[t, r, s] = s`` for every block ``s`` up to query t's own, ``-1`` after
    (ascending, ``-1`` only at the tail): the full causal support as a selection of
    ``K = NB`` slots. One thread per (query, slot)."""
    nb = I.shape[2]
    i = cuda.grid(1)
    if i >= I.shape[0] * nb:
        return
    t = i // nb
    s = i % nb
    _, pos, _ = query_row(cu_q, cu_k, t)
    blk = s if s * block_size <= pos else -1
    for r in range(I.shape[1]):
        I[t, r, s] = blk


@kernel_jit
def kl_kernel_combine_states(part, mask, t0, want_kl, out):
    """v3: merge the per-slot states of (query t0 + i, group r) in slot order; ``out[t, r]`` =
    KL (``want_kl``) or the student's LSE. One thread per (query, group) of the chunk.

    ``mask``: the chunk's slot mask (``msa.cuda.csr.launch_slot_mask`` on its rows of ``I``
    and its offsets, those its CSR was built on): a slot that is no CSR entry (a block past
    the chunk's cut of its sequence, a repeat) no kernel wrote, whatever the whole batch's
    offsets allow (this kernel and the two below)."""
    hkv = out.shape[1]
    i = cuda.grid(1)
    if i >= part.shape[2] * hkv:
        return
    tl = i // hkv
    r = i % hkv
    m = NEG_INF
    l = float32(0.0)
    c = float32(0.0)
    k = float32(0.0)
    for s in range(part.shape[1]):
        if is_entry(mask, tl, r, s):
            m, l, c, k = merge(m, l, c, k, part[0, s, tl, r], part[1, s, tl, r],
                                part[2, s, tl, r], part[3, s, tl, r])
    if want_kl:
        out[t0 + tl, r] = k
    else:
        out[t0 + tl, r] = student_lse(m, l)


# Slots a combine thread loads before it adds them: a thread waited for each slot's load in
# turn, so combine_dq read its 4.3 GB of partials at 1.3 TB/s (H200, 128K: 3.2 ms).
SLOTS_IN_FLIGHT = 8  # divides 32: a batch of slots is one word of the mask


@kernel_jit
def kl_kernel_combine_dq(dq_part, mask, t0, dq):
    """v3: ``dq_idx[t, r, d] = sum_s dq_part[s, t, r, d]`` in slot order, one thread per
    element, ``SLOTS_IN_FLIGHT`` slots loaded before they are added (the same additions)."""
    hkv = dq.shape[1]
    di = dq.shape[2]
    i = cuda.grid(1)
    if i >= dq_part.shape[1] * hkv * di:
        return
    tl = i // (hkv * di)
    r = (i // di) % hkv
    d = i % di
    nslots = dq_part.shape[0]
    vals = cuda.local.array(SLOTS_IN_FLIGHT, float32)
    acc = float32(0.0)
    for s0 in range(0, nslots, SLOTS_IN_FLIGHT):
        word = uint32(mask[tl, r, s0 >> 5])  # is_entry's word, loaded once for the batch
        for j in range(SLOTS_IN_FLIGHT):
            vals[j] = float32(0.0)
            if s0 + j < nslots and (word >> uint32((s0 + j) & 31)) & uint32(1):
                vals[j] = dq_part[s0 + j, tl, r, d]
        for j in range(SLOTS_IN_FLIGHT):
            if s0 + j < nslots and (word >> uint32((s0 + j) & 31)) & uint32(1):
                acc += vals[j]
    dq[t0 + tl, r, d] = acc


@kernel_jit
def kl_kernel_combine_kl(part, mask, t0, kl):
    """v3 ``kl_loss_and_backward``: ``kl[t, r] = sum_s part[0, s, t, r]`` (the grad mode's
    per-slot KL terms) in slot order, one thread per (query, group) of the chunk."""
    hkv = kl.shape[1]
    i = cuda.grid(1)
    if i >= part.shape[2] * hkv:
        return
    tl = i // hkv
    r = i % hkv
    acc = float32(0.0)
    for s in range(part.shape[1]):
        if is_entry(mask, tl, r, s):
            acc += part[0, s, tl, r]
    kl[t0 + tl, r] = acc
