"""K1 version 1: CUDA cores, fp32 tiles in shared memory (the teaching rung).

One CTA per work item ``[kv_head, row, q_begin, q_count, batch, kv_block]``: load block
``kv_block`` of sequence ``batch``, KV head ``r``, into shared memory once (converted to fp32);
walk the item's CSR entries in tiles of ``P`` query positions x ``G`` heads; per tile one thread
per score ``S = (Q s) Kᵀ`` under the token-level causal mask, then one thread per row for the
block-local softmax ``m = rowmax(S)``, ``P = exp(S - m)``, ``l = rowsum(P)``, then one thread per
output element ``O_s = P V / l``, ``L_s = m + log l`` into the slot the CSR assigned. The sum
of ``P V`` runs over the row's visible keys only (masking by selection, docs/design.md §3: a NaN
or an infinity in V at a key the row cannot see never reaches it, and one it sees gives the
reference's NaN or infinity; no cost: the loop is shorter). Any dtype (fp32/fp16/bf16), any
``D <= 256`` and ``Bk`` that fit shared memory (the planner halves ``P`` until they do).

Where it runs: fp32 inputs (the tensor cores take 16-bit ones), and 16-bit inputs whose ``D`` or
``Bk`` is not a multiple of 16. Verdict: the tested fallback; slow (one thread per dot
product, nothing shared between a row's scores).
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, int32

from .._core.arrays import SIMULATOR
from .._core.mma import bf16_to_f32, f32_to_bf16
from .._core.packed import item_reader, row_query
from .._core.diskcache import kernel_jit

THREADS = 32 if SIMULATOR else 128
_NEG_INF = float32(-math.inf)
_POS_INF = float32(math.inf)


def _identity_f32(x):
    return float32(x)


def layout(block_size, head_dim, rows):
    """Float offsets of sK [Bk, D+1], sV [Bk, D], sQ [R, D], sS [R, Bk+1]; total bytes."""
    off_v = block_size * (head_dim + 1)
    off_q = off_v + block_size * head_dim
    off_s = off_q + rows * head_dim
    total = off_s + rows * (block_size + 1)
    return off_v, off_q, off_s, 4 * total


@functools.lru_cache(maxsize=None)
def k1_kernel_v1(block_size: int, head_dim: int, group: int, positions: int, threads: int,
                 bf16_in: bool, bf16_partials: bool = False, paged: bool = False):
    """K1 v1 specialised for (Bk, D, G, P, threads, input kind, fp32 or bf16 partials, K/V
    packed or in pages).

    Arguments: q [Tq, Hq, D], k, v [Tk, Hkv, D] one value an element (bf16 as its bits);
    ``work`` int [W, 6] items ``[kv_head, row, q_begin, q_count, batch, kv_block]``,
    ``q_indices``, ``slots`` int [Hkv, nnz] the k2q CSR entries and their slots, ``cu_q``,
    ``cu_k`` int32 [B+1]; ``scale``; ``o_part [K, Tq, Hq, D]`` float32 or bf16 bits,
    ``lse_part`` float32 [K, Tq, Hq]. ``paged``: k, v are the caches ``[P, Hkv, Bk, D]`` viewed
    as ``[P*Hkv*Bk, 1, D]``, each item's page in its ``row`` column (``_core.packed.item_reader``)."""
    Bk, D, G, P, NT = block_size, head_dim, group, positions, threads
    read_item = item_reader(paged)
    R = P * G
    LDK = D + 1  # odd stride: threads reading consecutive keys hit different banks
    LDS = Bk + 1
    OFF_V, OFF_Q, OFF_S, _ = layout(Bk, D, R)
    to_f32 = bf16_to_f32 if bf16_in else cuda.jit(device=True)(_identity_f32)
    store = f32_to_bf16 if bf16_partials else cuda.jit(device=True)(_identity_f32)

    @kernel_jit
    def _k1_kernel_v1(q, k, v, work, q_indices, slots, cu_q, cu_k, scale, o_part, lse_part):
        smem = cuda.shared.array(0, float32)
        row_t = cuda.shared.array(R, int32)
        row_slot = cuda.shared.array(R, int32)
        row_pos = cuda.shared.array(R, int32)
        row_m = cuda.shared.array(R, float32)
        row_l = cuda.shared.array(R, float32)
        tid = cuda.threadIdx.x
        topk = o_part.shape[0]
        h, q_begin, q_count, b, j, key0, nk, kv_h = read_item(
            work, cuda.blockIdx.x, q_indices, cu_k, k, Bk)
        if q_count <= 0:
            return  # the whole CTA: padding item
        key_pos0 = j * Bk

        # Load the K/V block once (fp32; keys past the end of the sequence are zero).
        for i in range(tid, Bk * D, NT):
            c = i // D
            d = i % D
            kv_k = float32(0.0)
            kv_v = float32(0.0)
            if c < nk:
                kv_k = to_f32(k[key0 + c, kv_h, d])
                kv_v = to_f32(v[key0 + c, kv_h, d])
            smem[c * LDK + d] = kv_k
            smem[OFF_V + c * D + d] = kv_v

        for tile in range((q_count + P - 1) // P):
            cuda.syncthreads()  # the previous tile is done with sQ, sS and the row table
            # Gather: row r = (position p, head g) of the tile.
            for r in range(tid, R, NT):
                p = r // G
                t = -1
                s = 0
                pos = -1
                if tile * P + p < q_count:
                    t, s, pos = row_query(q_indices, slots, cu_q, cu_k, h, b,
                                           q_begin + tile * P + p, topk)
                row_t[r] = t
                row_slot[r] = s
                row_pos[r] = pos
            cuda.syncthreads()
            for i in range(tid, R * D, NT):
                r = i // D
                d = i % D
                t = row_t[r]
                x = float32(0.0)
                if t >= 0:
                    x = to_f32(q[t, h * G + r % G, d]) * scale
                smem[OFF_Q + i] = x
            cuda.syncthreads()
            # S = (Q * scale) Kᵀ, -inf where the key is past the query (or past the sequence)
            for i in range(tid, R * Bk, NT):
                r = i // Bk
                c = i % Bk
                s_rc = _NEG_INF
                if c < nk and key_pos0 + c <= row_pos[r]:
                    acc = float32(0.0)
                    for d in range(D):
                        acc += smem[OFF_Q + r * D + d] * smem[c * LDK + d]
                    s_rc = acc
                smem[OFF_S + r * LDS + c] = s_rc
            cuda.syncthreads()
            # Block-local softmax: m = rowmax(S), P = exp(S - m), l = rowsum(P)
            for r in range(tid, R, NT):
                m = _NEG_INF
                for c in range(nk):
                    m = max(m, smem[OFF_S + r * LDS + c])
                # As the reference: m = 0 where it is not finite (nothing visible: S - m stays
                # -inf, P = 0; a +inf score: P = inf there, so l = L_s = +inf), and a NaN score
                # (the max passes over it) gives P = NaN, so l = L_s = NaN.
                m_use = m if m > _NEG_INF and m < _POS_INF else float32(0.0)
                l = float32(0.0)
                for c in range(nk):
                    e_rc = smem[OFF_S + r * LDS + c]
                    p_rc = float32(0.0)
                    if e_rc != _NEG_INF:
                        p_rc = math.exp(e_rc - m_use)
                    smem[OFF_S + r * LDS + c] = p_rc
                    l += p_rc
                row_m[r] = m_use
                row_l[r] = l
            cuda.syncthreads()
            # O_s = P V / l, L_s = m + log l (0 and -inf when nothing is visible: l = 0; NaN and
            # +inf L_s where l is). The sum runs over the row's visible keys only (masking by
            # selection: P = 0 at a later key would multiply its V, and 0 * NaN or 0 * inf is
            # NaN).
            for i in range(tid, R * D, NT):
                r = i // D
                d = i % D
                t = row_t[r]
                if t >= 0:
                    l = row_l[r]
                    acc = float32(0.0)
                    if l != float32(0.0):
                        for c in range(min(nk, row_pos[r] - key_pos0 + 1)):
                            acc += smem[OFF_S + r * LDS + c] * smem[OFF_V + c * D + d]
                        acc = acc / l
                    o_part[row_slot[r], t, h * G + r % G, d] = store(acc)
            for r in range(tid, R, NT):
                t = row_t[r]
                if t >= 0:
                    l = row_l[r]
                    lse = _NEG_INF
                    if l != float32(0.0):
                        lse = row_m[r] + math.log(l)
                    lse_part[row_slot[r], t, h * G + r % G] = lse

    return _k1_kernel_v1
