"""Backward version 1: CUDA cores, float32 throughout (the teaching rung and the fp32 path).

FlashAttention's rule with the forward's LSE, deterministic (no atomics):

* ``D_t = rowsum(dO_t * O_t)`` (``_backward_parts.delta_kernel``, a warp per (t, h));
* dQ, Q-outer: a CTA per (query, KV head); per selected block ``dS [G, Bk]`` in shared memory,
  then ``dQ[g, :] += dS[g, :] K_block`` over the keys the query sees (``dq_kernel``);
* dK, dV, KV-outer: a CTA per part of a k2q CSR row (at most ``part_size`` queries,
  ``_backward_parts``), the part's queries in CSR order (ascending), ``QC`` at a time: ``P``,
  ``dS [QC*G, Bk]``, then ``dK[c, :] += dS[:, c]ᵀ (s Q)``, ``dV[c, :] += P[:, c]ᵀ dO`` in shared
  memory (``dkdv_kernel``). A row of one part writes dK/dV; a hot row's parts write scratch
  slots that ``_backward_parts.dkdv_sum_kernel`` adds in part order.

Every key belongs to one block, so every dK/dV row is written by one CTA; every dQ row by one.
Any dtype; ``Bk``, ``D``, ``G`` within shared memory (the paper's Bk = D = 128, G = 16 fit; so
does D = 256 with Bk = 64, G <= 8).

Masking by selection (docs/design.md §3): dS is computed on the keys a row sees only (0
elsewhere, never ``0 * dP``), and ``dQ`` sums ``dS K`` over those keys only, so a NaN or an
infinity in K, V or another row's D cannot reach a row that does not see it. Where a row sees a
key whose K row holds a non-finite value, its dS (±inf, NaN, or 0 from a score of -inf) is
what IEEE arithmetic gives, and an infinite dS there becomes NaN: the reference multiplies dS
by that key's zeroed row and adds the product back (``msa.reference._mask.attend``), so its dq
row is NaN, and ``0 * inf`` makes it NaN in the non-finite columns when dS = 0. Cost on finite
inputs: the dQ loop runs over fewer keys, and one ``isinf`` test per (row, key); the row check
runs only where dS is infinite.

Where it runs: float32 inputs, and 16-bit inputs version 2 does not take (D or Bk not a multiple
of 16, or above 128). Verdict (H200, paper configuration, 8K tokens): 3218 ms, 0.36 TFLOP/s,
against version 2's 20.0 ms; the tested fallback (scalar FMAs, each dS read from shared memory
D times).
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, int32

from .._core.arrays import SIMULATOR
from .._core.mma import bf16_to_f32
from .._core.packed import last_le
from ._backward_parts import bwd_part, split_slot
from .._core.diskcache import kernel_jit


def _identity_f32(x):
    return float32(x)


if SIMULATOR:
    @cuda.jit(device=True)
    def _exp(x):
        """Simulator twin of the GPU's ``expf``: +inf past the range of a float (Python's
        ``math.exp`` raises there; a score 1e30 above the LSE gets P = inf on a GPU)."""
        if x > 700.0:
            return math.inf
        return math.exp(x)
else:
    _exp = math.exp


def rows_per_round(group: int) -> int:
    """(query, head) rows per round of the dK/dV kernel: 16 // G queries (at least one) x G."""
    return max(1, 16 // group) * group


def dkdv_layout(block_size: int, head_dim: int, group: int):
    """Float32 word offsets of the dK/dV kernel's dynamic shared memory, and its bytes:
    acc_k, acc_v [Bk, D], then per round sQ, sdO [RW, D], sP, sdS [RW, Bk], sLSE, sDelta [RW].

    Returns ``(off_av, off_q, off_do, off_p, off_ds, off_l, off_dl, total_bytes)``."""
    rw = rows_per_round(group)
    off_av = block_size * head_dim
    off_q = 2 * block_size * head_dim
    off_do = off_q + rw * head_dim
    off_p = off_do + rw * head_dim
    off_ds = off_p + rw * block_size
    off_l = off_ds + rw * block_size
    off_dl = off_l + rw
    return off_av, off_q, off_do, off_p, off_ds, off_l, off_dl, 4 * (off_dl + rw)


def dq_smem(block_size: int, head_dim: int, group: int) -> int:
    """Bytes of the dQ kernel's static shared arrays (sQ, sdO, sAcc [G, D], sdS [G, Bk])."""
    return 4 * (3 * group * head_dim + group * block_size + 2 * group)


@functools.lru_cache(maxsize=None)
def dq_kernel(block_size: int, head_dim: int, group: int, bf16_in: bool, threads: int):
    """dQ of version 1 for (Bk, D, G, input kind, threads): a CTA per (query, KV head) walks
    the query's selected blocks; ``dq [Tq, Hq, D]`` float32 (scaled)."""
    Bk, D, G, NT = block_size, head_dim, group, threads
    to_f32 = bf16_to_f32 if bf16_in else cuda.jit(device=True)(_identity_f32)
    neg_inf = float32(-math.inf)
    nan = float32(math.nan)

    @cuda.jit(device=True)
    def finite_row(k, key, r):
        """Whether every value of ``k[key, r, :]`` is finite."""
        ok = True
        for d in range(D):
            x = to_f32(k[key, r, d])
            ok = ok and not (math.isinf(x) or math.isnan(x))
        return ok

    @kernel_jit
    def _attention_bwd_kernel_dq(q, k, v, do, lse, delta, I, cu_q, cu_k, scale, dq):
        sq = cuda.shared.array((G, D), float32)  # s * q of the group's heads
        sdo = cuda.shared.array((G, D), float32)
        sacc = cuda.shared.array((G, D), float32)
        sds = cuda.shared.array((G, Bk), float32)
        slse = cuda.shared.array(G, float32)
        sdelta = cuda.shared.array(G, float32)
        tid = cuda.threadIdx.x
        hkv = k.shape[1]
        t = cuda.blockIdx.x // hkv
        r = cuda.blockIdx.x % hkv
        b = last_le(cu_q, t)
        key_base = cu_k[b]
        lk = cu_k[b + 1] - key_base
        pos = lk - (cu_q[b + 1] - cu_q[b]) + (t - cu_q[b])  # bottom-right causal alignment
        nblocks = (lk + Bk - 1) // Bk
        for i in range(tid, G * D, NT):
            g = i // D
            d = i % D
            sq[g, d] = to_f32(q[t, r * G + g, d]) * scale
            sdo[g, d] = to_f32(do[t, r * G + g, d])
            sacc[g, d] = float32(0.0)
        for g in range(tid, G, NT):
            slse[g] = lse[t, r * G + g]
            sdelta[g] = delta[t, r * G + g]
        cuda.syncthreads()
        for s in range(I.shape[2]):
            j = I[t, r, s]
            if j < 0 or j >= nblocks:
                continue  # the same for every thread of the CTA
            key0 = j * Bk
            nk = min(Bk, lk - key0)
            for i in range(tid, G * Bk, NT):  # dS[g, c]
                g = i // Bk
                c = i % Bk
                ds = float32(0.0)
                l = slse[g]
                if c < nk and key0 + c <= pos and l > neg_inf:
                    key = key_base + key0 + c
                    sc = float32(0.0)
                    dp = float32(0.0)
                    for d in range(D):
                        sc += sq[g, d] * to_f32(k[key, r, d])
                        dp += sdo[g, d] * to_f32(v[key, r, d])
                    ds = _exp(sc - l) * (dp - sdelta[g])
                    if math.isinf(ds) and not finite_row(k, key, r):
                        ds = nan  # the reference: dS times the key's zeroed row (inf * 0)
                sds[g, c] = ds
            cuda.syncthreads()
            # the keys query t sees in this block: c < nv (none after the query or past the
            # block's end, none where its support is empty); the others are never read
            nv = max(0, min(nk, pos - key0 + 1))
            for i in range(tid, G * D, NT):  # each (g, d) has one owner thread throughout
                g = i // D
                d = i % D
                acc = float32(0.0)  # the block's sum, then added to the total: two levels
                for c in range(nv if slse[g] > neg_inf else 0):
                    acc += sds[g, c] * to_f32(k[key_base + key0 + c, r, d])
                sacc[g, d] += acc
            cuda.syncthreads()  # sdS is rewritten by the next block
        for i in range(tid, G * D, NT):
            g = i // D
            d = i % D
            dq[t, r * G + g, d] = sacc[g, d] * scale

    return _attention_bwd_kernel_dq


@functools.lru_cache(maxsize=None)
def dkdv_kernel(block_size: int, head_dim: int, group: int, bf16_in: bool, threads: int):
    """dK, dV of version 1 for (Bk, D, G, input kind, threads): a CTA per part of a CSR row,
    ``dkdv_layout`` bytes of dynamic shared memory."""
    Bk, D, G, NT = block_size, head_dim, group, threads
    RW = rows_per_round(G)  # (query, head) rows per round ...
    QC = RW // G  # ... of QC queries
    OFF_AV, OFF_Q, OFF_DO, OFF_P, OFF_DS, OFF_L, OFF_DL, _ = dkdv_layout(Bk, D, G)
    to_f32 = bf16_to_f32 if bf16_in else cuda.jit(device=True)(_identity_f32)
    neg_inf = float32(-math.inf)

    @kernel_jit
    def _attention_bwd_kernel_dkdv(q, k, v, do, lse, delta, row_ptr, q_indices, row_offsets,
                                   cu_q, cu_k, scale, part_ptr, part_size, dk, dv, dk_part,
                                   dv_part):
        smem = cuda.shared.array(0, float32)
        s_t = cuda.shared.array(QC, int32)
        tid = cuda.threadIdx.x
        hkv = row_ptr.shape[0]
        r, row, part, nparts, b, j, lk, nk, e0, e1 = bwd_part(
            row_ptr, part_ptr, row_offsets, cu_k, part_size, q_indices.shape[1], Bk)
        if e1 <= e0:
            return  # this CTA adds nothing (dK, dV of a block no query sees stay 0)
        key_base = cu_k[b] + j * Bk
        q_lo = cu_q[b]
        q_hi = cu_q[b + 1]
        pos0 = lk - (q_hi - q_lo) - q_lo  # a query t of the sequence sits at key position pos0 + t
        for i in range(tid, 2 * Bk * D, NT):
            smem[i] = float32(0.0)
        # No barrier is needed at the top of a round: the previous round read s_t before its
        # third barrier, and its accumulation (the last reader of the row tiles) ends before
        # every thread passes this round's first barrier, after which the tiles are rewritten.
        for c0 in range(e0, e1, QC):
            for x in range(tid, QC, NT):
                t = -1
                if c0 + x < e1:
                    t = q_indices[r, c0 + x]
                    if t < q_lo or t >= q_hi:
                        t = -1  # not a query of this sequence (unvalidated input): skipped
                s_t[x] = t
            cuda.syncthreads()
            for i in range(tid, RW * D, NT):
                w = i // D
                d = i % D
                t = s_t[w // G]
                xq = float32(0.0)
                xdo = float32(0.0)
                if t >= 0:
                    h = r * G + w % G
                    xq = to_f32(q[t, h, d]) * scale
                    xdo = to_f32(do[t, h, d])
                smem[OFF_Q + i] = xq
                smem[OFF_DO + i] = xdo
            for w in range(tid, RW, NT):
                t = s_t[w // G]
                l = neg_inf
                dl = float32(0.0)
                if t >= 0:
                    l = lse[t, r * G + w % G]
                    dl = delta[t, r * G + w % G]
                smem[OFF_L + w] = l
                smem[OFF_DL + w] = dl
            cuda.syncthreads()
            for i in range(tid, RW * Bk, NT):  # P[w, c], dS[w, c]
                w = i // Bk
                c = i % Bk
                t = s_t[w // G]
                p = float32(0.0)
                ds = float32(0.0)
                l = smem[OFF_L + w]
                if t >= 0 and c < nk and j * Bk + c <= pos0 + t and l > neg_inf:
                    sc = float32(0.0)
                    dp = float32(0.0)
                    for d in range(D):
                        sc += smem[OFF_Q + w * D + d] * to_f32(k[key_base + c, r, d])
                        dp += smem[OFF_DO + w * D + d] * to_f32(v[key_base + c, r, d])
                    p = _exp(sc - l)
                    ds = p * (dp - smem[OFF_DL + w])
                smem[OFF_P + i] = p
                smem[OFF_DS + i] = ds
            cuda.syncthreads()
            for i in range(tid, Bk * D, NT):  # each (c, d) has one owner thread throughout
                c = i // D
                d = i % D
                # The round's RW terms are summed on their own, then added to the part's total:
                # a hot row's part adds up to part_size * G terms, and one float32 chain that
                # long loses ~sqrt(RW) times more than these two levels (GPU test at 4K: the
                # chain's dK error was 10.8x the float32 reference's).
                ak = float32(0.0)
                av = float32(0.0)
                for w in range(RW):
                    ak += smem[OFF_DS + w * Bk + c] * smem[OFF_Q + w * D + d]
                    av += smem[OFF_P + w * Bk + c] * smem[OFF_DO + w * D + d]
                smem[i] += ak
                smem[OFF_AV + i] += av
        if nparts == 1:
            for i in range(tid, nk * D, NT):  # the owners of these words wrote them last
                c = i // D
                d = i % D
                dk[key_base + c, r, d] += smem[i]
                dv[key_base + c, r, d] += smem[OFF_AV + i]
        else:  # a hot row: this part's sums go to its scratch slot, summed in part order below
            slot = split_slot(part_ptr, hkv, r, row) + part
            for i in range(tid, nk * D, NT):
                dk_part[slot, i] = smem[i]
                dv_part[slot, i] = smem[OFF_AV + i]

    return _attention_bwd_kernel_dkdv
