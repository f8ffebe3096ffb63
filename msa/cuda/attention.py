"""Paper eq 8 and §4.2 on the GPU: KV-outer sparse attention (K1), combined by K2, and the prefill.

Same functions and arguments as ``msa.reference.attention`` (read its docstring for the
semantics), plus keyword-only knobs. ``attention_partials`` is K1; ``sparse_attention`` runs the
whole main branch in one call (CSR -> schedule -> K1 -> K2, ``msa.cuda.csr``/``schedule``/
``combine``); ``msa_prefill`` adds the index branch in front (``msa.cuda.select``, Algorithm 1
lines 3-5).

K1, one CTA per work item ``[kv_head, row, q_begin, q_count, batch, kv_block]``: load block
``kv_block`` of sequence ``batch``, KV head ``r``, into shared memory once; walk the item's CSR
entries in tiles of ``P = ceil(T/G)`` query positions x ``G`` heads (the paper's query
concatenation: ``T = 128`` rows = 8 positions x 16 heads at G = 16); per tile ``S = Q Kᵀ * scale``
under the token-level causal mask (key position <= query position: only the local block is
cut), the block-local softmax, ``O = P V``; write ``O_s`` and ``L_s`` into the slot the CSR
assigned. Items with ``q_count <= 0`` (the padding of a device-built schedule) do nothing. No
float atomics: every partial has its own slot, so reruns are bitwise identical.

Versions:

===  =========================================================================================
v    idea
===  =========================================================================================
1    CUDA cores, fp32 everywhere: K/V/Q tiles converted to fp32 in shared memory, one thread
     per score, then per row (softmax), then per output element. Any dtype (fp32/fp16/bf16),
     any ``D <= 256`` and ``Bk`` that fit shared memory. The tested fallback.
2    tensor cores: ``mma.sync.m16n8k16`` (bf16/fp16 in, fp32 accumulate, ``msa.cuda._core.mma``)
     on 16-row warp tiles: ``R = P*G`` rows (a multiple of 16, at most 128; 8 warps at
     R = 128) x ``Bk`` keys. K row-major and V transposed in shared memory (loaded once per
     item), S (fp32) and P (16-bit, unnormalised ``2**(S - m)``) through shared memory, softmax
     in base 2 (``ex2.approx``) by two threads per row, ``1/l`` applied to the fp32 accumulators.
     Pipelined across tiles: the CSR entries of tile i+2 load into registers and the query rows
     of tile i+1 are prefetched into L1 while tile i computes. fp16/bf16 only, ``D`` and ``Bk``
     multiples of 16 (up to 256). About 168 KB of dynamic shared memory at D = Bk = 128,
     R = 128 (one CTA of 8 warps per SM); 168 registers, no spills (sm_90, offline ptxas).
3    tensor cores with S, P and O in registers (FlashAttention-2 style): warp w owns rows
     16w..16w+15 of the tile and keeps their scores (``Bk/2`` fp32 per lane), computes the
     causal mask, the row max and sum (``shfl_xor`` over the quad that holds a row) and
     ``P = 2**(S scale log2 e - m)`` in registers; P packed to 16-bit pairs is already the A
     fragment of ``O = P V`` (the C layout of two n-tiles of S is the A layout of one k-step).
     K and V row-major in shared memory (B fragments by ``ldmatrix.x4``, V's by
     ``ldmatrix.x4.trans``), Q tiles gathered by ``cp.async`` into two buffers (tile i+1 lands
     while tile i computes; A fragments by ``ldmatrix.x4``); a warp copies and reads only its
     own 16 rows of each tile, so after one CTA barrier for K/V a tile needs only the warp's
     own ``cp.async`` wait and a ``syncwarp`` (no barrier across warps); O in
     registers, in two column halves at D = 128. fp16/bf16, D and Bk multiples of 16 up to
     128. 136 KB of dynamic shared memory at D = Bk = 128, R = 128 (one CTA of 8 warps per
     SM); 168 registers, no spills, at D = 128 with Bk = 128 (every D, Bk in {16, 32, 64, 128}
     at most 168; sm_90, offline ptxas). Inputs that are not 16-byte aligned are copied by
     plain loads instead of ``cp.async``. ``groups`` > 1 makes the CTA that many independent
     groups of tile warps over one shared K/V block (each group its own Q buffers; 3 groups of
     4 warps: 170 KB, 168 registers under launch bounds, no spills), so that more warps share
     each load of K/V.
4    version 3 on Hopper's warpgroup MMA (``msa.cuda._core.wgmma``; compute capability 9.0 only,
     no simulator twin): each 4-warp group of a 64-row tile is one warpgroup; ``S = Q Kᵀ`` is
     KS ``wgmma.m64n{Bk}k16`` with Q's A fragments in registers (``ldmatrix``) and K read by
     the tensor cores straight from shared memory, ``O = P V`` is KP ``wgmma.m64n{D/parts}k16``
     with P in registers and V from shared memory; K and V are stored as 8 x 8 core matrices
     (no ``ldmatrix`` for them at all). Mask, softmax, stores and warp groups are version 3's,
     and so are the results (bitwise, on the paper configuration at 128K). On an H200, paper
     configuration at 128K: K1 3.9-4.2 ms a 16K-query chunk against 4.6-5.0 for version 3.
===  =========================================================================================

``version=None`` takes ``DEFAULT_TC_VERSION`` (4) where it applies (16-bit inputs, D and Bk
multiples of 16 up to 128, 64-row tiles, compute capability 9.0), else version 3, version 2
for the other tensor-core shapes, else version 1.

Memory: ``O_part`` is ``K*Tq*Hq*D`` values (fp32: 16 GiB at 32K tokens, 64 GiB at 128K in the
paper configuration). ``sparse_attention`` therefore processes the queries in chunks whose
partials fit ``max_partial_bytes`` (default ``default_partial_bytes()``: an eighth of the
GPU's memory, between 4 and 16 GiB): each chunk is a smaller problem of the same
kind (its queries against all the keys they can see, the ``Lq < Lk`` path), with its own CSR,
schedule, K1 and K2 writing straight into its rows of the output. With bf16 inputs the partials
are bf16 by default (``partial_dtype``), which halves both that memory and the bytes K1 writes
and K2 reads (at 128K: 34 GB instead of 69 GB each way); the LSEs stay fp32.

Bad input raises before any launch (shapes, dtypes, devices, G, D, indices). With
``validate=False`` the host checks of big index arrays are skipped; the kernels still never
read or write out of bounds (work items, CSR entries and slots are range-checked in the kernel,
and bad ones are skipped), but the result of an invalid selection is then unspecified.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, int64, uint16, uint32, uint64

from .._checks import (GQA_GROUP_SIZES, check_array, check_cu_seqlens, check_gqa,
                       check_positive_int, check_scale, cu_to_host, dtype_of)
from ._core.arrays import SIMULATOR, ArrayContext, device_constant, fill, is_bf16
from ._core import mma as _mma, wgmma as _wgmma
from ._core.wgmma import core_word
from ._core.memops import (copy16_plain3, cp_async16, cp_async_commit, cp_async_wait_all,
                      is_aligned16, ldmatrix_x4, ldmatrix_x4_trans, no_op,
                      store_u32x4)
from ._core.mma import (_deal, bf16_to_f32, exp2, f32_to_bf16, load_a_frag, load_b_frag, make_mma_pair,
                   mma_bf16_m16n8k16, mma_f16_m16n8k16, pack_bf16x2, pack_f16x2, prefetch_l1)
from .combine import launch_combine
from ._core.arrays import INT32_MAX
from .csr import MAX_TOPK
from ._core.launch import kernel_array as _kernel_array
from ._core.launch import launch_smem as _launch_smem
from ._core.packed import LN2 as _LN2
from ._core.packed import LOG2E as _LOG2E
from ._core.packed import check_entry as _check_entry
from ._core.packed import edge_row as _edge_row
from ._core.packed import item_fields as _item_fields
from ._core.packed import last_le as _last_le
from ._core.packed import load_entry as _load_entry
from ._core.packed import row_query as _row_query

VERSIONS = (1, 2, 3, 4)
MAX_HEAD_DIM = 256
MAX_BLOCK_SIZE_V2 = 256
# The tensor-core version ``version=None`` picks where it applies (v3 falls back to v2 for
# D or Bk above 128).
DEFAULT_TC_VERSION = 4
# Budget for one query chunk's partials (bytes): the backward's default, and the least of the
# forward's (``default_partial_bytes``), which takes an eighth of the GPU's memory up to
# MAX_FORWARD_PARTIAL_BYTES: bigger chunks mean fewer K1/K2 launches and grid tails (H200,
# paper configuration at 128K: 42.0 ms with 16 GiB against 43.2-47.9 with 4 GiB).
MAX_PARTIAL_BYTES = 4 << 30
MAX_FORWARD_PARTIAL_BYTES = 16 << 30
# Tile rows T (query positions x G heads per tile): the paper's 128 on a GPU, except v3, whose
# 64-row tiles (4 warps, 104 KB of shared memory at D = Bk = 128, two CTAs per SM) measured
# 10% faster than 128 (H200, paper configuration: 7.32 vs 8.16 ms per 16K-query chunk; the
# outputs do not depend on T). The simulator runs every thread as a Python thread, so its tiles
# are as small as the kernels allow.
DEFAULT_TILE_ROWS = {1: 32 if SIMULATOR else 64, 2: 16 if SIMULATOR else 128,
                     3: 16 if SIMULATOR else 64, 4: 64}
# Warp groups per K1 v3 CTA (``groups``): independent groups of tiles sharing one K/V block.
# 3 groups of 4 warps (64-row tiles; 170 KB, 168 registers: one CTA of 12 warps per SM) against
# one group (two CTAs of 4 warps per SM): K1 3-4% faster at 32K and 128K, the whole sparse
# attention at 128K 2-6% faster on the three selections (H200, paper configuration; at 32K one
# selection of three was 7% slower). The default applies where the CTA stays at 12 warps or
# fewer (so launch bounds leave 168 registers a thread) and fits shared memory; else 1 group.
# The simulator runs one group (its tests run more explicitly).
DEFAULT_V3_GROUPS = 1 if SIMULATOR else 3
_V3_MAX_GROUP_WARPS = 12
_THREADS_V1 = 32 if SIMULATOR else 128
_NEG_INF = float32(-math.inf)

DTYPE_KINDS = ("float32", "float16", "bfloat16")



# K1 v1: CUDA cores, fp32 tiles

def _identity_f32(x):
    return float32(x)


def _v1_layout(block_size, head_dim, rows):
    """Float offsets of sK [Bk, D+1], sV [Bk, D], sQ [R, D], sS [R, Bk+1]; total bytes."""
    off_v = block_size * (head_dim + 1)
    off_q = off_v + block_size * head_dim
    off_s = off_q + rows * head_dim
    total = off_s + rows * (block_size + 1)
    return off_v, off_q, off_s, 4 * total


@functools.lru_cache(maxsize=None)
def _k1_kernel_simple(block_size: int, head_dim: int, group: int, positions: int, threads: int,
                      bf16_in: bool, bf16_partials: bool = False):
    """K1 v1 specialised for (Bk, D, G, P, threads, input kind); see the module docstring."""
    Bk, D, G, P, NT = block_size, head_dim, group, positions, threads
    R = P * G
    LDK = D + 1  # odd stride: threads reading consecutive keys hit different banks
    LDS = Bk + 1
    OFF_V, OFF_Q, OFF_S, _ = _v1_layout(Bk, D, R)
    to_f32 = bf16_to_f32 if bf16_in else cuda.jit(device=True)(_identity_f32)
    store = f32_to_bf16 if bf16_partials else cuda.jit(device=True)(_identity_f32)

    @cuda.jit
    def _k1_kernel_v1(q, k, v, work, q_indices, slots, cu_q, cu_k, scale, o_part, lse_part):
        smem = cuda.shared.array(0, float32)
        row_t = cuda.shared.array(R, int32)
        row_slot = cuda.shared.array(R, int32)
        row_pos = cuda.shared.array(R, int32)
        row_m = cuda.shared.array(R, float32)
        row_l = cuda.shared.array(R, float32)
        tid = cuda.threadIdx.x
        topk = o_part.shape[0]
        h, q_begin, q_count, b, j, key0, nk = _item_fields(
            work, cuda.blockIdx.x, q_indices, cu_k, k.shape[1], Bk)
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
                kv_k = to_f32(k[key0 + c, h, d])
                kv_v = to_f32(v[key0 + c, h, d])
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
                    t, s, pos = _row_query(q_indices, slots, cu_q, cu_k, h, b,
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
                l = float32(0.0)
                if m > _NEG_INF:
                    for c in range(nk):
                        e_rc = smem[OFF_S + r * LDS + c]
                        p_rc = float32(0.0)
                        if e_rc > _NEG_INF:
                            p_rc = math.exp(e_rc - m)
                        smem[OFF_S + r * LDS + c] = p_rc
                        l += p_rc
                row_m[r] = m
                row_l[r] = l
            cuda.syncthreads()
            # O_s = P V / l, L_s = m + log l (0 and -inf when nothing is visible)
            for i in range(tid, R * D, NT):
                r = i // D
                d = i % D
                t = row_t[r]
                if t >= 0:
                    l = row_l[r]
                    acc = float32(0.0)
                    if l > float32(0.0):
                        for c in range(nk):
                            acc += smem[OFF_S + r * LDS + c] * smem[OFF_V + c * D + d]
                        acc = acc / l
                    o_part[row_slot[r], t, h * G + r % G, d] = store(acc)
            for r in range(tid, R, NT):
                t = row_t[r]
                if t >= 0:
                    l = row_l[r]
                    lse = _NEG_INF
                    if l > float32(0.0):
                        lse = row_m[r] + math.log(l)
                    lse_part[row_slot[r], t, h * G + r % G] = lse

    return _k1_kernel_v1


# K1 v2: tensor cores (mma.sync m16n8k16), S and P through shared memory

def _v2_layout(block_size, head_dim, rows):
    """Word offsets and row strides (32-bit words) of sK, sVt, sQ/P, sS; total bytes.

    sK [Bk rows of D/2 words] (row-major K: the B operand of S = Q Kᵀ, stored as Bᵀ),
    sVt [D rows of Bk/2 words] (V transposed: the B operand of O = P V stored as Bᵀ),
    sQP [R rows]: Q for the score mma, then P (16-bit) for the value mma,
    sS [R rows of Bk fp32 scores].
    Strides of ``n/2 + 4`` words make the 8 rows x 4 words of a fragment load hit 32 banks.
    """
    ld_k = head_dim // 2 + 4
    ld_v = block_size // 2 + 4
    ld_qp = max(head_dim, block_size) // 2 + 4
    ld_s = block_size + 4
    off_v = block_size * ld_k
    off_qp = off_v + head_dim * ld_v
    off_s = off_qp + rows * ld_qp
    total = off_s + rows * ld_s
    return (ld_k, ld_v, ld_qp, ld_s), (off_v, off_qp, off_s), 4 * total


@functools.lru_cache(maxsize=None)
def _k1_kernel_mma(block_size: int, head_dim: int, group: int, positions: int, bf16_in: bool,
                   bf16_partials: bool = False):
    """K1 v2 specialised for (Bk, D, G, P, bf16 or fp16 in, fp32 or bf16 partials out).

    With ``bf16_partials`` ``o_part`` is a uint32 view ``[K, Tq, Hq, D/2]`` of bf16 partials
    (a lane's two neighbouring outputs are one word)."""
    Bk, D, G, P = block_size, head_dim, group, positions
    R = P * G
    NW = R // 16
    NT = 32 * NW
    R2 = 2 * R  # softmax: two threads per row
    assert R % 16 == 0 and NW <= _mma.MAX_WARPS and D % 16 == 0 and Bk % 16 == 0
    (LDK, LDV, LDQP, LDS), (OFF_V, OFF_QP, OFF_S), _ = _v2_layout(Bk, D, R)
    DW = D // 2  # words per row of Q/K/V
    NG_S = 4 if Bk % 32 == 0 else 2  # n-tiles (8 keys each) per A-fragment load in S = Q Kᵀ
    NG_O = 4 if D % 32 == 0 else 2  # n-tiles (8 dims each) per A-fragment load in O = P V
    ACC_S = 4 * NG_S  # accumulator registers per lane
    ACC_O = 4 * NG_O
    QW = D // 4  # Q words per thread and tile: R rows x D/2 words over 2R threads
    Q_BATCH = 4 if QW % 8 else 8
    KV_BATCH = 8
    mma = mma_bf16_m16n8k16 if bf16_in else mma_f16_m16n8k16
    pack = pack_bf16x2 if bf16_in else pack_f16x2
    BF16_PARTIALS = bf16_partials

    @cuda.jit
    def _k1_kernel_v2(q, k, v, work, q_indices, slots, cu_q, cu_k, scale, o_part, lse_part,
                      keys_rt, dw_rt):
        """q, k, v: uint32 views [T, H, D/2] of the 16-bit inputs. ``keys_rt = Bk`` and
        ``dw_rt = D/2`` repeat two constants as run-time values: as loop bounds they stop the
        compiler from unrolling the outer mma loops completely (which spills registers)."""
        smem = cuda.shared.array(0, uint32)
        sf = cuda.shared.array(0, float32)  # the same bytes, as float32 (for sS)
        sh = cuda.shared.array(0, uint16)  # the same bytes, as 16-bit halves (for sVt)
        # Row tables of two consecutive tiles (tile parity picks the half).
        row_t = cuda.shared.array(R2, int32)
        row_slot = cuda.shared.array(R2, int32)
        row_pos = cuda.shared.array(R2, int32)
        row_m = cuda.shared.array(R, float32)
        half_m = cuda.shared.array(R2, float32)
        half_l = cuda.shared.array(R2, float32)
        kv_k = cuda.local.array(KV_BATCH, uint32)
        kv_v = cuda.local.array(KV_BATCH, uint32)
        q_words = cuda.local.array(Q_BATCH, uint32)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g4 = lane // 4
        t4 = lane % 4
        topk = o_part.shape[0]
        h, q_begin, q_count, b, j, key0, nk = _item_fields(
            work, cuda.blockIdx.x, q_indices, cu_k, k.shape[1], Bk)
        if q_count <= 0:
            return  # the whole CTA: padding item
        key_pos0 = j * Bk
        scale_log2 = scale  # the launcher passes scale * log2(e): exp(x) = 2**(x log2 e)
        q_lo = int(cu_q[b])
        q_hi = int(cu_q[b + 1])
        pos0 = (int(cu_k[b + 1]) - int(cu_k[b])) - (q_hi - q_lo)  # Lk - Lq: bottom-right
        num_tiles = (q_count + P - 1) // P

        # Load the K/V block once: K row-major, V transposed (keys past the sequence: zero).
        # KV_BATCH loads are issued before the first store, so that they are in flight together.
        for base in range(0, Bk * DW, NT * KV_BATCH):
            for u in range(KV_BATCH):
                i = base + u * NT + tid
                kv_k[u] = uint32(0)
                kv_v[u] = uint32(0)
                if i < Bk * DW and i // DW < nk:
                    kv_k[u] = uint32(k[key0 + i // DW, h, i % DW])
                    kv_v[u] = uint32(v[key0 + i // DW, h, i % DW])
            for u in range(KV_BATCH):
                i = base + u * NT + tid
                if i < Bk * DW:
                    c = i // DW
                    w = i % DW
                    smem[c * LDK + w] = kv_k[u]
                    # V[c, 2w], V[c, 2w+1] go to rows 2w, 2w+1 of Vᵀ, column c (16-bit halves)
                    sh[2 * (OFF_V + 2 * w * LDV) + c] = uint16(kv_v[u] & uint32(0xFFFF))
                    sh[2 * (OFF_V + (2 * w + 1) * LDV) + c] = uint16(kv_v[u] >> uint32(16))

        # Pipeline: while tile i computes, the CSR entries of tile i+2 load into registers (row r
        # of the table is thread r's) and tile i+1's query rows are prefetched into L1.
        t_raw, s_raw = _load_entry(q_indices, slots, h, q_begin, q_count, 0, P, G, tid, R)
        if tid < R:
            t, s, pos = _check_entry(t_raw, s_raw, q_lo, q_hi, pos0, topk)
            row_t[tid] = t  # tile 0's table: the half its "cur" points to
            row_slot[tid] = s
            row_pos[tid] = pos
        t_raw, s_raw = _load_entry(q_indices, slots, h, q_begin, q_count, 1, P, G, tid, R)

        for tile in range(num_tiles):
            cur = (tile % 2) * R
            nxt = R - cur
            cuda.syncthreads()  # (A) the previous tile is done with sQP, sS and its row table
            # Gather the tile's queries (the G heads of a position are contiguous in q), in
            # batches of loads issued before their stores.
            for base in range(0, QW, Q_BATCH):
                for u in range(Q_BATCH):
                    i = (base + u) * NT + tid
                    r = i // DW
                    t = row_t[cur + r]
                    q_words[u] = uint32(q[t, h * G + r % G, i % DW]) if t >= 0 else uint32(0)
                for u in range(Q_BATCH):
                    i = (base + u) * NT + tid
                    smem[OFF_QP + (i // DW) * LDQP + i % DW] = q_words[u]
            if tid < R:
                t, s, pos = _check_entry(t_raw, s_raw, q_lo, q_hi, pos0, topk)
                row_t[nxt + tid] = t
                row_slot[nxt + tid] = s
                row_pos[nxt + tid] = pos
            cuda.syncthreads()  # (B)
            t_raw, s_raw = _load_entry(q_indices, slots, h, q_begin, q_count, tile + 2, P, G,
                                       tid, R)
            # two threads per row of the next tile, one half-row (D words / 2) each
            t_next = row_t[nxt + tid // 2]
            if t_next >= 0:
                prefetch_l1(q, t_next, h * G + (tid // 2) % G, (tid % 2) * (DW // 2))

            # S = Q Kᵀ on tensor cores; warp w owns rows 16w .. 16w+15.
            r_top = 16 * warp + g4
            r_bot = r_top + 8
            pos_top = row_pos[cur + r_top]
            pos_bot = row_pos[cur + r_bot]
            a_base = OFF_QP + 16 * warp * LDQP
            for n0 in range(0, keys_rt, 8 * NG_S):
                acc = cuda.local.array(ACC_S, float32)
                for i in range(ACC_S):
                    acc[i] = float32(0.0)
                for kk in range(0, dw_rt, 8):
                    a0, a1, a2, a3 = load_a_frag(smem, a_base + kk, LDQP)
                    for i in range(NG_S):
                        b0, b1 = load_b_frag(smem, (n0 + 8 * i) * LDK + kk, LDK)
                        d0, d1, d2, d3 = mma(a0, a1, a2, a3, b0, b1, acc[4 * i], acc[4 * i + 1],
                                             acc[4 * i + 2], acc[4 * i + 3])
                        acc[4 * i] = d0
                        acc[4 * i + 1] = d1
                        acc[4 * i + 2] = d2
                        acc[4 * i + 3] = d3
                # scale to base 2 and apply the token-level causal mask
                for i in range(NG_S):
                    c = n0 + 8 * i + 2 * t4
                    for e in range(2):
                        cc = c + e
                        visible = cc < nk
                        score_top = _NEG_INF
                        score_bot = _NEG_INF
                        if visible and key_pos0 + cc <= pos_top:
                            score_top = acc[4 * i + e] * scale_log2
                        if visible and key_pos0 + cc <= pos_bot:
                            score_bot = acc[4 * i + 2 + e] * scale_log2
                        sf[OFF_S + r_top * LDS + cc] = score_top
                        sf[OFF_S + r_bot * LDS + cc] = score_bot
            cuda.syncthreads()

            # Softmax, two threads per row (halves of the words of the row, interleaved):
            # m = rowmax(S); P = 2**(S - m) as 16-bit into sQP (Q is no longer needed); l = rowsum.
            r = tid // 2
            half = tid % 2
            m_local = _NEG_INF
            for w in range(half, Bk // 2, 2):
                m_local = max(m_local, max(sf[OFF_S + r * LDS + 2 * w],
                                           sf[OFF_S + r * LDS + 2 * w + 1]))
            half_m[tid] = m_local
            cuda.syncthreads()
            m = max(half_m[2 * r], half_m[2 * r + 1])
            # a row with nothing visible uses m = 0, so S - m stays -inf and P = 0 (no NaN)
            m_use = m if m > _NEG_INF else float32(0.0)
            l_local = float32(0.0)
            for w in range(half, Bk // 2, 2):
                p0 = exp2(sf[OFF_S + r * LDS + 2 * w] - m_use)
                p1 = exp2(sf[OFF_S + r * LDS + 2 * w + 1] - m_use)
                l_local += p0 + p1
                smem[OFF_QP + r * LDQP + w] = pack(p0, p1)
            half_l[tid] = l_local
            if half == 0:
                row_m[r] = m
            cuda.syncthreads()

            # O = P V on tensor cores, divided by l; write O_s and L_s into the row's slot.
            t_top = row_t[cur + r_top]
            t_bot = row_t[cur + r_bot]
            l_top = half_l[2 * r_top] + half_l[2 * r_top + 1]
            l_bot = half_l[2 * r_bot] + half_l[2 * r_bot + 1]
            inv_top = float32(1.0) / l_top if l_top > float32(0.0) else float32(0.0)
            inv_bot = float32(1.0) / l_bot if l_bot > float32(0.0) else float32(0.0)
            hq_top = h * G + r_top % G
            hq_bot = h * G + r_bot % G
            s_top = row_slot[cur + r_top]
            s_bot = row_slot[cur + r_bot]
            for n0 in range(0, 2 * dw_rt, 8 * NG_O):
                acc = cuda.local.array(ACC_O, float32)
                for i in range(ACC_O):
                    acc[i] = float32(0.0)
                for kk in range(0, keys_rt // 2, 8):
                    a0, a1, a2, a3 = load_a_frag(smem, a_base + kk, LDQP)
                    for i in range(NG_O):
                        b0, b1 = load_b_frag(smem, OFF_V + (n0 + 8 * i) * LDV + kk, LDV)
                        d0, d1, d2, d3 = mma(a0, a1, a2, a3, b0, b1, acc[4 * i], acc[4 * i + 1],
                                             acc[4 * i + 2], acc[4 * i + 3])
                        acc[4 * i] = d0
                        acc[4 * i + 1] = d1
                        acc[4 * i + 2] = d2
                        acc[4 * i + 3] = d3
                for i in range(NG_O):
                    d = n0 + 8 * i + 2 * t4
                    if BF16_PARTIALS:
                        if t_top >= 0:
                            o_part[s_top, t_top, hq_top, d // 2] = pack_bf16x2(
                                acc[4 * i] * inv_top, acc[4 * i + 1] * inv_top)
                        if t_bot >= 0:
                            o_part[s_bot, t_bot, hq_bot, d // 2] = pack_bf16x2(
                                acc[4 * i + 2] * inv_bot, acc[4 * i + 3] * inv_bot)
                    else:
                        if t_top >= 0:
                            o_part[s_top, t_top, hq_top, d] = acc[4 * i] * inv_top
                            o_part[s_top, t_top, hq_top, d + 1] = acc[4 * i + 1] * inv_top
                        if t_bot >= 0:
                            o_part[s_bot, t_bot, hq_bot, d] = acc[4 * i + 2] * inv_bot
                            o_part[s_bot, t_bot, hq_bot, d + 1] = acc[4 * i + 3] * inv_bot
            if t4 == 0:
                # L_s = ln 2 * (m + log2 l) (natural log; -inf when nothing is visible)
                if t_top >= 0:
                    lse = _NEG_INF
                    if l_top > float32(0.0):
                        lse = (row_m[r_top] + math.log2(l_top)) * float32(_LN2)
                    lse_part[s_top, t_top, hq_top] = lse
                if t_bot >= 0:
                    lse = _NEG_INF
                    if l_bot > float32(0.0):
                        lse = (row_m[r_bot] + math.log2(l_bot)) * float32(_LN2)
                    lse_part[s_bot, t_bot, hq_bot] = lse

    return _k1_kernel_v2


# K1 v3: tensor cores with S, P and O in registers (FlashAttention-2 style)

V3_MAX_HEAD_DIM = 128
V3_MAX_BLOCK_SIZE = 128


@cuda.jit(device=True, inline=True)
def _quad_transpose(t4, v0, v1, v2, v3):
    """4 x 4 transpose across the four lanes of a quad (``t4 = lane % 4``): lane ``t4`` gives
    ``v_j`` and receives, as ``u_k``, lane k's ``v_{t4}``. Two butterfly steps of two shuffles
    each; every lane of the warp must call it. Words travel as int32 (shuffles take no
    uint32)."""
    v0, v1, v2, v3 = int32(v0), int32(v1), int32(v2), int32(v3)
    odd = (t4 & 1) != 0
    r0 = cuda.shfl_xor_sync(0xFFFFFFFF, v0 if odd else v1, 1)
    r1 = cuda.shfl_xor_sync(0xFFFFFFFF, v2 if odd else v3, 1)
    w0 = r0 if odd else v0
    w1 = v1 if odd else r0
    w2 = r1 if odd else v2
    w3 = v3 if odd else r1
    high = (t4 & 2) != 0
    r0 = cuda.shfl_xor_sync(0xFFFFFFFF, w0 if high else w2, 2)
    r1 = cuda.shfl_xor_sync(0xFFFFFFFF, w1 if high else w3, 2)
    if high:
        return r0, r1, w2, w3
    return w0, w1, r0, r1


def _v3_layout(block_size, head_dim, rows, groups=1):
    """Row stride (32-bit words), word offsets of sV and sQ, and total bytes of K1 v3's shared
    memory: sK [Bk rows] and sV [Bk rows] row-major (V's B fragments come from
    ``ldmatrix.trans``), then for each of the CTA's ``groups`` warp groups two sQ buffers of R
    rows (tile i+1 is gathered while tile i computes).
    Rows of ``D/2 + 4`` words: 16-byte aligned for ``cp.async``, and the 8 rows x 16 bytes of
    an ``ldmatrix`` phase hit 32 different banks."""
    ld = head_dim // 2 + 4
    off_v = block_size * ld
    off_q = 2 * block_size * ld
    total = off_q + groups * 2 * rows * ld
    return ld, off_v, off_q, 4 * total


def _v3_o_parts(head_dim):
    """Column parts of O in K1 v3: two above D = 64 (at D = 128 all 64 accumulators at once
    take 255 registers on sm_90, in two parts of 32 the kernel takes 168; offline ptxas)."""
    return 2 if head_dim > 64 and (head_dim // 8) % 4 == 0 else 1


if SIMULATOR:  # the simulator takes no alignment argument (and needs none)
    @cuda.jit(device=True)
    def _v3_smem():
        return cuda.shared.array(0, uint32)
else:
    @cuda.jit(device=True, inline=True)
    def _v3_smem():
        """The dynamic shared memory, 16-byte aligned (``cp.async``, ``ldmatrix``)."""
        return cuda.shared.array(0, uint32, alignment=16)




@functools.lru_cache(maxsize=None)
def _k1_kernel_reg(block_size: int, head_dim: int, group: int, positions: int, bf16_in: bool,
                   bf16_partials: bool = False, use_async: bool = True, o_parts: int = 1,
                   groups: int = 1, vector_stores: bool = False, wgmma: bool = False):
    """K1 v3 specialised for (Bk, D, G, P, bf16 or fp16 in, fp32 or bf16 partials out, inputs
    copied by ``cp.async`` or by plain loads when they are not 16-byte aligned, warp groups,
    bf16 partials stored 16 bytes a lane when ``vector_stores`` (``o_part`` 16-byte aligned)
    and each of the ``o_parts`` holds a multiple of 4 n-tiles, e.g. D = 32, 64, 128; else 4-byte
    stores).

    Arguments as v2's kernel (uint32 views of q, k, v), except that ``o_part`` is flat: the
    C-order elements of ``[K, Tq, Hq, D]`` float32, or with ``bf16_partials`` of the uint32
    view ``[K, Tq, Hq, D/2]`` (shape from ``lse_part [K, Tq, Hq]``: plain index arithmetic per
    row and one add per store); and without the run-time constants: every loop over
    fragments here has a compile-time trip count and is unrolled, so that the accumulator
    arrays are registers.

    ``groups`` > 1: the CTA is that many independent groups of ``R/16`` warps sharing the K/V
    block in shared memory; group ``g`` takes tiles ``g, g + groups, ...`` with its own two Q
    buffers, so that more warps share one load of K/V. Each warp gathers and reads only its
    own 16 rows of a tile, so past the K/V load the warps need no barrier between them (one
    ``syncwarp`` a tile). The CTA needs ``groups`` times one group's registers: it is launched
    with bounds that cap them (168 a thread for 3 groups of 4 warps: 64K registers an SM).

    ``wgmma`` (K1 v4, Hopper only, 64-row tiles: a warp group is one warpgroup): ``S = Q Kᵀ``
    and ``O = P V`` by ``wgmma.mma_async`` (``msa.cuda._core.wgmma``) with A in registers (Q's
    fragments by ``ldmatrix``, P as in v3) and B straight from shared memory, where K and V
    are stored as 8 x 8 core matrices (``core_word``) instead of padded rows. The fragment
    layouts are those of ``mma.sync``, so the mask, softmax and stores are v3's."""
    Bk, D, G, P = block_size, head_dim, group, positions
    R = P * G
    NW = R // 16
    NT = 32 * NW
    NG = groups
    assert R % 16 == 0 and NW * NG <= _mma.MAX_WARPS and D % 16 == 0 and Bk % 16 == 0
    assert 1 <= NG <= 15
    WGMMA = wgmma
    assert not WGMMA or (R == 64 and _wgmma.AVAILABLE)
    CTA_THREADS = NG * NT
    # The twin mma on a GPU (MSA_MMA=twin) runs syncthreads inside: every group then walks the
    # same number of tiles (a group past the end computes on stale rows and stores nothing); the
    # simulator's twin, which meets only its warp, does the same so that both twins run one path.
    UNIFORM = _mma.MMA_BACKEND == "twin"
    LD, OFF_V, OFF_Q, _ = _v3_layout(Bk, D, R, NG)
    DW = D // 2  # words per row of Q/K/V
    QBUF = R * LD  # words per Q buffer
    PIECES = DW // 4  # 16-byte pieces per row
    HALF = PIECES // 2  # pieces a thread gathers: two threads per query row (NT = 2R)
    NS = Bk // 8  # n-tiles of S (8 keys each): 4 fp32 registers per lane each
    NO = D // 8  # n-tiles of O (8 dims each)
    KS = D // 16  # k-steps of S = Q Kᵀ
    KP = Bk // 16  # k-steps of O = P V
    NO_PART = NO // o_parts  # n-tiles of O per part (even: ldmatrix.x4.trans loads two)
    O_PARTS = o_parts
    assert NO_PART % 2 == 0 and NO_PART * o_parts == NO
    S_REGS, P_REGS, O_REGS = 4 * NS, 2 * NS, 4 * NO_PART  # register arrays (constant sizes)
    Q_REGS = 4 * KS if WGMMA else 1
    mma_pair = make_mma_pair(mma_bf16_m16n8k16 if bf16_in else mma_f16_m16n8k16)
    pack = pack_bf16x2 if bf16_in else pack_f16x2
    copy16 = cp_async16 if use_async else copy16_plain3
    commit = cp_async_commit if use_async else no_op
    wait_all = cp_async_wait_all if use_async else no_op
    BF16_PARTIALS = bf16_partials
    O_ROW = DW if bf16_partials else D  # elements of one O_s row in o_part
    # bf16 partials: a quad's lanes hold words t4, 4 + t4, ... of a row; transposed across the
    # quad in groups of four n-tiles, each lane stores 16 contiguous bytes (one st.global.v4
    # instead of four 4-byte stores a lane: a quarter of the scattered store instructions).
    STORE_V4 = bf16_partials and vector_stores and NO_PART % 4 == 0
    if WGMMA:
        ab = "bf16" if bf16_in else "f16"
        wg_s = _wgmma.make_wgmma_rs(Bk, ab, 0)  # S: B = Kᵀ, K-major
        wg_o = _wgmma.make_wgmma_rs(8 * NO_PART, ab, 1)  # O: B = V, N-major
        wait_s = _wgmma.make_wgmma_wait(S_REGS)
        wait_o = _wgmma.make_wgmma_wait(O_REGS)
    else:
        wg_s = wg_o = wait_s = wait_o = None
    # core-matrix descriptors of K (k: next 8 dims +128 B, n: next 8 keys +16 D B) and V (k:
    # next 8 keys, n: next 8 dims); a k-step of S moves 256 B, of O 32 D B (/16: descriptor)
    KV_GROUP_BYTES = 16 * D

    @cuda.jit(device=True, inline=True)
    def gather(smem, q, h, row, half, t, dst_buf):
        """Start copying this thread's half of query row ``row`` (token ``t``, zeros if -1)
        into the Q buffer at word ``dst_buf``."""
        src = ((t if t >= 0 else 0) * q.shape[1] + h * G + row % G) * DW + half * HALF * 4
        dst = dst_buf + row * LD + half * HALF * 4
        for u in range(HALF):
            copy16(smem, dst + 4 * u, q, src + 4 * u, 16 if t >= 0 else 0)

    jit = {} if SIMULATOR or NG == 1 else {"launch_bounds": (CTA_THREADS, 1)}

    @cuda.jit(**jit)
    def _k1_kernel_v3(q, k, v, work, q_indices, slots, cu_q, cu_k, scale, o_part, lse_part):
        smem = _v3_smem()
        s_acc = cuda.local.array(S_REGS, float32)
        p_frag = cuda.local.array(P_REGS, uint32)  # P as the A fragments of the P V mma
        o_acc = cuda.local.array(O_REGS, float32)
        q_frag = cuda.local.array(Q_REGS, uint32)  # Q's A fragments (wgmma)
        cta_tid = cuda.threadIdx.x
        grp = cta_tid // NT  # this thread's warp group ...
        tid = cta_tid % NT  # ... and its index in it
        warp = tid // 32
        lane = tid % 32
        g4 = lane // 4
        t4 = lane % 4
        q_buf0 = OFF_Q + 2 * grp * QBUF  # the group's two Q buffers
        topk = lse_part.shape[0]
        q_total = lse_part.shape[1]
        hq_total = lse_part.shape[2]
        col = int32(2 * t4)  # this lane's first key (S) or output column (O) in an n-tile
        lane_col = uint64(t4) if BF16_PARTIALS else uint64(col)  # ... as an o_part offset
        h, q_begin, q_count, b, j, key0, nk = _item_fields(
            work, cuda.blockIdx.x, q_indices, cu_k, k.shape[1], Bk)
        if q_count <= 0:
            return  # the whole CTA: padding item
        key_pos0 = j * Bk
        scale_log2 = scale  # the launcher passes scale * log2(e): exp(x) = 2**(x log2 e)
        q_lo = int(cu_q[b])
        q_hi = int(cu_q[b + 1])
        pos0 = (int(cu_k[b + 1]) - int(cu_k[b])) - (q_hi - q_lo)  # Lk - Lq: bottom-right
        num_tiles = (q_count + P - 1) // P
        hkv = k.shape[1]
        # the group's tiles: grp, grp + NG, ... (with UNIFORM every group walks as many steps)
        num_steps = (num_tiles + NG - 1 - (0 if UNIFORM else grp)) // NG

        # The K/V block (keys past the sequence: zeros, so that 0 * V stays 0).
        for e in range(cta_tid, Bk * PIECES, CTA_THREADS):
            c = e // PIECES
            w = (e % PIECES) * 4
            ok = c < nk
            src = ((key0 + (c if ok else 0)) * hkv + h) * DW + w
            dst = core_word(c, w, D) if WGMMA else c * LD + w
            copy16(smem, dst, k, src, 16 if ok else 0)
            copy16(smem, OFF_V + dst, v, src, 16 if ok else 0)
        # The group's first tile; thread tid gathers half of row tid // 2 of every tile.
        g_row = tid // 2
        g_half = tid % 2
        t_raw, s_raw = _load_entry(q_indices, slots, h, q_begin, q_count, grp, P, G, g_row, R)
        t_g, _, _ = _check_entry(t_raw, s_raw, q_lo, q_hi, pos0, topk)
        gather(smem, q, h, g_row, g_half, t_g, q_buf0)
        commit()
        t_raw, s_raw = _load_entry(q_indices, slots, h, q_begin, q_count, grp + NG, P, G, g_row,
                                   R)
        # K/V came from every thread of the CTA: one CTA barrier before the tiles. After it a
        # warp reads only Q rows it gathered itself (thread tid copies half of row tid // 2,
        # and warp w's A fragments are rows 16 w .. 16 w + 15), so a tile needs no barrier
        # across warps: each warp waits for its own copies and syncs its lanes.
        wait_all()
        if WGMMA:  # K/V came through the generic proxy; wgmma reads them through the async one
            _wgmma.fence_proxy_async()
        cuda.syncthreads()
        k_desc = uint64(0)
        v_desc = uint64(0)
        if WGMMA:
            k_desc = _wgmma.smem_desc(_wgmma.shared_address(smem, 0), 128, KV_GROUP_BYTES)
            v_desc = _wgmma.smem_desc(_wgmma.shared_address(smem, OFF_V), KV_GROUP_BYTES, 128)

        # This lane's rows in the mma layouts: r_top = 16 warp + g4 and r_bot = r_top + 8.
        r_top = 16 * warp + g4
        r_bot = r_top + 8
        tt_raw, st_raw = _load_entry(q_indices, slots, h, q_begin, q_count, grp, P, G, r_top, R)
        tb_raw, sb_raw = _load_entry(q_indices, slots, h, q_begin, q_count, grp, P, G, r_bot, R)
        # ldmatrix row addresses of this lane (matrix lane // 8, row lane % 8 of it): A of Q and
        # B of V (.trans) take matrices (rows 0-7, 8-15) x (words 0-3, 4-7); B of K takes
        # (words 0-3, 4-7) x (keys 0-7, 8-15), i.e. two n-tiles a load.
        l_rows = ((lane >> 3) & 1) * 8 + (lane & 7)
        a_lane = (16 * warp + l_rows) * LD + (lane >> 4) * 4
        k_lane = ((lane >> 4) * 8 + (lane & 7)) * LD + ((lane >> 3) & 1) * 4
        v_lane = OFF_V + l_rows * LD + (lane >> 4) * 4

        for step in range(num_steps):
            tile = step * NG + grp
            buf = step % 2
            wait_all()
            # the warp's rows of the tile landed, and its lanes are past their previous tile
            # (whose buffer the gather below overwrites)
            cuda.syncwarp()
            # The entries of the tiles ahead are loaded before the gather's copies, so that
            # those loads do not queue behind the copies; nothing reads them until next step.
            t_g, _, _ = _check_entry(t_raw, s_raw, q_lo, q_hi, pos0, topk)
            t_top, s_top, pos_top = _check_entry(tt_raw, st_raw, q_lo, q_hi, pos0, topk)
            t_bot, s_bot, pos_bot = _check_entry(tb_raw, sb_raw, q_lo, q_hi, pos0, topk)
            t_raw, s_raw = _load_entry(q_indices, slots, h, q_begin, q_count, tile + 2 * NG, P,
                                       G, g_row, R)
            tt_raw, st_raw = _load_entry(q_indices, slots, h, q_begin, q_count, tile + NG, P, G,
                                         r_top, R)
            tb_raw, sb_raw = _load_entry(q_indices, slots, h, q_begin, q_count, tile + NG, P, G,
                                         r_bot, R)
            if tile + NG < num_tiles:  # the buffer of the last tile is free: gather the next
                gather(smem, q, h, g_row, g_half, t_g, q_buf0 + (1 - buf) * QBUF)
            commit()

            # S = Q Kᵀ (raw scores, fp32 registers).
            qa = q_buf0 + buf * QBUF + a_lane
            if WGMMA:  # the warpgroup's 64 x Bk scores in KS wgmma, K from shared memory
                for ks in range(KS):
                    a0, a1, a2, a3 = ldmatrix_x4(smem, qa + 8 * ks)
                    q_frag[4 * ks] = a0
                    q_frag[4 * ks + 1] = a1
                    q_frag[4 * ks + 2] = a2
                    q_frag[4 * ks + 3] = a3
                _wgmma.wgmma_fence()
                for ks in range(KS):
                    wg_s(s_acc, q_frag[4 * ks], q_frag[4 * ks + 1], q_frag[4 * ks + 2],
                         q_frag[4 * ks + 3], k_desc + uint64(16 * ks), int32(ks > 0))
                _wgmma.wgmma_commit()
                wait_s(s_acc)
            else:
                for i in range(S_REGS):
                    s_acc[i] = float32(0.0)
                for ks in range(KS):
                    a0, a1, a2, a3 = ldmatrix_x4(smem, qa + 8 * ks)
                    for n2 in range(NS // 2):
                        b0, b1, b2, b3 = ldmatrix_x4(smem, k_lane + 16 * n2 * LD + 8 * ks)
                        n = 8 * n2
                        mma_pair(s_acc, n, a0, a1, a2, a3, b0, b1, b2, b3)

            # Token-level causal mask (and keys past the sequence): key c of the block is
            # visible to a row iff c <= lim; rows without a query have pos = -1: nothing.
            # Only a block that reaches past a row's position (its local block, or the last,
            # partial one) needs it: int32 compares, skipped when both rows see every key.
            lim_top = int32(min(pos_top - key_pos0, nk - 1))
            lim_bot = int32(min(pos_bot - key_pos0, nk - 1))
            if lim_top < Bk - 1 or lim_bot < Bk - 1:
                # key 8 i + e of this lane's n-tile i is col + 8 i + e: hidden iff
                # 8 i + e > lim - col, compared in float32 (exact: |lim - col| < 2**24)
                thr_top = float32(lim_top - col)
                thr_bot = float32(lim_bot - col)
                for i in range(NS):
                    for e in range(2):
                        if float32(8 * i + e) > thr_top:
                            s_acc[4 * i + e] = _NEG_INF
                        if float32(8 * i + e) > thr_bot:
                            s_acc[4 * i + 2 + e] = _NEG_INF
            m_top = _NEG_INF
            m_bot = _NEG_INF
            for i in range(NS):
                for e in range(2):
                    m_top = max(m_top, s_acc[4 * i + e])
                    m_bot = max(m_bot, s_acc[4 * i + 2 + e])
            # the quad's four lanes hold the row: combine their maxima
            m_top = max(m_top, cuda.shfl_xor_sync(0xFFFFFFFF, m_top, 1))
            m_bot = max(m_bot, cuda.shfl_xor_sync(0xFFFFFFFF, m_bot, 1))
            m_top = max(m_top, cuda.shfl_xor_sync(0xFFFFFFFF, m_top, 2))
            m_bot = max(m_bot, cuda.shfl_xor_sync(0xFFFFFFFF, m_bot, 2))
            # base-2 max; a row with nothing visible uses 0, so that P = 2**-inf = 0 (no NaN)
            mb_top = m_top * scale_log2 if m_top > _NEG_INF else float32(0.0)
            mb_bot = m_bot * scale_log2 if m_bot > _NEG_INF else float32(0.0)
            # P = 2**(S scale_log2 - m), packed to 16-bit pairs: the C layout of n-tiles 2j and
            # 2j+1 is the A layout of k-step j of P V.
            l_top = float32(0.0)
            l_bot = float32(0.0)
            for i in range(NS):  # one fused multiply-add a score
                p0 = exp2(cuda.fma(s_acc[4 * i], scale_log2, -mb_top))
                p1 = exp2(cuda.fma(s_acc[4 * i + 1], scale_log2, -mb_top))
                p2 = exp2(cuda.fma(s_acc[4 * i + 2], scale_log2, -mb_bot))
                p3 = exp2(cuda.fma(s_acc[4 * i + 3], scale_log2, -mb_bot))
                l_top += p0 + p1
                l_bot += p2 + p3
                p_frag[2 * i] = pack(p0, p1)
                p_frag[2 * i + 1] = pack(p2, p3)
            l_top += cuda.shfl_xor_sync(0xFFFFFFFF, l_top, 1)
            l_bot += cuda.shfl_xor_sync(0xFFFFFFFF, l_bot, 1)
            l_top += cuda.shfl_xor_sync(0xFFFFFFFF, l_top, 2)
            l_bot += cuda.shfl_xor_sync(0xFFFFFFFF, l_bot, 2)

            # O = P V (fp32 registers), B fragments of V by ldmatrix.trans; O_s = O / l into
            # the rows' slots (0 when nothing is visible). In O_PARTS column parts of D / O_PARTS
            # (fewer live accumulators; each V fragment is still loaded once).
            inv_top = float32(1.0) / l_top if l_top > float32(0.0) else float32(0.0)
            inv_bot = float32(1.0) / l_bot if l_bot > float32(0.0) else float32(0.0)
            hq_top = h * G + r_top % G
            hq_bot = h * G + r_bot % G
            # first element of each row's O_s in the flat o_part (0 for a row without a query:
            # not stored) plus this lane's first column (its word with bf16 partials), so
            # that a store adds only a constant; unsigned, so no negative-index checks
            at_top = lane_col
            at_bot = lane_col
            if t_top >= 0:
                at_top += uint64(((s_top * q_total + t_top) * hq_total + hq_top) * O_ROW)
            if t_bot >= 0:
                at_bot += uint64(((s_bot * q_total + t_bot) * hq_total + hq_bot) * O_ROW)
            for part in range(O_PARTS):
                if WGMMA:  # the part's 64 x 8 NO_PART outputs in KP wgmma, V from shared memory
                    _wgmma.wgmma_fence()
                    for kp in range(KP):
                        wg_o(o_acc, p_frag[4 * kp], p_frag[4 * kp + 1], p_frag[4 * kp + 2],
                             p_frag[4 * kp + 3],
                             v_desc + uint64((2 * kp * KV_GROUP_BYTES + part * NO_PART * 128)
                                             >> 4), int32(kp > 0))
                    _wgmma.wgmma_commit()
                    wait_o(o_acc)
                for i in range(0 if WGMMA else O_REGS):
                    o_acc[i] = float32(0.0)
                for kp in range(0 if WGMMA else KP):
                    a0 = p_frag[4 * kp]
                    a1 = p_frag[4 * kp + 1]
                    a2 = p_frag[4 * kp + 2]
                    a3 = p_frag[4 * kp + 3]
                    for n2 in range(NO_PART // 2):
                        b0, b1, b2, b3 = ldmatrix_x4_trans(
                            smem, v_lane + 16 * kp * LD + 8 * (part * (NO_PART // 2) + n2))
                        n = 8 * n2
                        mma_pair(o_acc, n, a0, a1, a2, a3, b0, b1, b2, b3)
                if STORE_V4:
                    for i4 in range(NO_PART // 4):
                        a = 16 * i4  # o_acc index of n-tile 4 i4 of this part
                        x0, x1, x2, x3 = _quad_transpose(
                            t4, pack_bf16x2(o_acc[a] * inv_top, o_acc[a + 1] * inv_top),
                            pack_bf16x2(o_acc[a + 4] * inv_top, o_acc[a + 5] * inv_top),
                            pack_bf16x2(o_acc[a + 8] * inv_top, o_acc[a + 9] * inv_top),
                            pack_bf16x2(o_acc[a + 12] * inv_top, o_acc[a + 13] * inv_top))
                        y0, y1, y2, y3 = _quad_transpose(
                            t4, pack_bf16x2(o_acc[a + 2] * inv_bot, o_acc[a + 3] * inv_bot),
                            pack_bf16x2(o_acc[a + 6] * inv_bot, o_acc[a + 7] * inv_bot),
                            pack_bf16x2(o_acc[a + 10] * inv_bot, o_acc[a + 11] * inv_bot),
                            pack_bf16x2(o_acc[a + 14] * inv_bot, o_acc[a + 15] * inv_bot))
                        # lane t4 stores n-tile 4 i4 + t4 of the part: words 4 (that n-tile)
                        # .. + 3 of the row, i.e. at_* - t4 + 4 (part NO_PART + 4 i4 + t4)
                        d = uint64(3 * t4 + 4 * (part * NO_PART + 4 * i4))
                        if t_top >= 0:
                            store_u32x4(o_part, at_top + d, x0, x1, x2, x3)
                        if t_bot >= 0:
                            store_u32x4(o_part, at_bot + d, y0, y1, y2, y3)
                    continue
                for i in range(NO_PART):
                    # output columns 8 (part NO_PART + i) + col and the next one
                    if BF16_PARTIALS:  # one word (two bf16) per column pair
                        d = uint64(4 * (part * NO_PART + i))
                        if t_top >= 0:
                            o_part[at_top + d] = pack_bf16x2(o_acc[4 * i] * inv_top,
                                                             o_acc[4 * i + 1] * inv_top)
                        if t_bot >= 0:
                            o_part[at_bot + d] = pack_bf16x2(o_acc[4 * i + 2] * inv_bot,
                                                             o_acc[4 * i + 3] * inv_bot)
                    else:
                        d = uint64(8 * (part * NO_PART + i))
                        if t_top >= 0:
                            o_part[at_top + d] = o_acc[4 * i] * inv_top
                            o_part[at_top + d + uint64(1)] = o_acc[4 * i + 1] * inv_top
                        if t_bot >= 0:
                            o_part[at_bot + d] = o_acc[4 * i + 2] * inv_bot
                            o_part[at_bot + d + uint64(1)] = o_acc[4 * i + 3] * inv_bot
            # L_s = ln 2 (m + log2 l) (natural log; -inf when nothing is visible)
            if t4 == 0:
                if t_top >= 0:
                    lse = _NEG_INF
                    if l_top > float32(0.0):
                        lse = (mb_top + math.log2(l_top)) * float32(_LN2)
                    lse_part[s_top, t_top, hq_top] = lse
                if t_bot >= 0:
                    lse = _NEG_INF
                    if l_bot > float32(0.0):
                        lse = (mb_bot + math.log2(l_bot)) * float32(_LN2)
                    lse_part[s_bot, t_bot, hq_bot] = lse

    return _k1_kernel_v3


def default_partial_bytes() -> int:
    """``sparse_attention``'s default ``max_partial_bytes``: an eighth of the current GPU's
    memory, at least ``MAX_PARTIAL_BYTES`` (4 GiB) and at most ``MAX_FORWARD_PARTIAL_BYTES``
    (16 GiB); 4 GiB under the simulator."""
    if SIMULATOR:
        return MAX_PARTIAL_BYTES
    return _partial_bytes_on(cuda.get_current_device().id)


@functools.lru_cache(maxsize=None)
def _partial_bytes_on(device_id: int) -> int:
    total = int(cuda.current_context().get_memory_info()[1])
    return int(min(max(total // 8, MAX_PARTIAL_BYTES), MAX_FORWARD_PARTIAL_BYTES))



def dtype_kind(x) -> str:
    """``'float32' | 'float16' | 'bfloat16'`` of an array, TypeError for anything else."""
    if is_bf16(x):
        return "bfloat16"
    dt = dtype_of(x)
    if dt == np.float32:
        return "float32"
    if dt == np.float16:
        return "float16"
    return str(dt)


class _Spec:
    """Validated shapes of ``q [Tq, Hq, D]``, ``k, v [Tk, Hkv, D]`` and their dtype kind."""

    def __init__(self, q, k, v):
        check_array("q", q, ndim=3)
        check_array("k", k, ndim=3)
        check_array("v", v, ndim=3, shape=tuple(int(s) for s in k.shape))
        self.kind = dtype_kind(q)
        if self.kind not in DTYPE_KINDS:
            raise TypeError(f"q must have dtype float32, float16 or bfloat16 on the GPU, "
                            f"got {self.kind}")
        for name, x in (("k", k), ("v", v)):
            if dtype_kind(x) != self.kind:
                raise TypeError(f"{name} must have the dtype of q ({self.kind}), got {dtype_kind(x)}")
        self.tq, self.hq, self.d = (int(s) for s in q.shape)
        self.tk, self.hkv = int(k.shape[0]), int(k.shape[1])
        if int(k.shape[2]) != self.d:
            raise ValueError(f"k must have head dim D={self.d} (q's), got shape {tuple(k.shape)}")
        if not 1 <= self.d <= MAX_HEAD_DIM:
            raise ValueError(f"q must have head dim D in [1, {MAX_HEAD_DIM}], got D={self.d}")
        self.g = check_gqa(self.hq, self.hkv, allowed=GQA_GROUP_SIZES)
        self.bf16 = self.kind == "bfloat16"


def _element_view(ctx, name, x, bf16):
    """A kernel view of ``x`` with one element per value: bf16 as its 16-bit patterns."""
    arr = ctx.input(name, x)
    if bf16 and str(arr.dtype) not in ("uint16", "int16"):
        arr = arr.view(np.uint16)
    return arr


class _K1Plan:
    """Kernel version, tile shape and shared memory of K1 for one problem."""

    def __init__(self, spec: _Spec, block_size: int, version, tile_rows, groups=None):
        d, g, bk = spec.d, spec.g, block_size
        why_not_v2 = None
        if spec.kind == "float32":
            why_not_v2 = "float32 inputs (tensor cores take float16/bfloat16)"
        elif d % 16:
            why_not_v2 = f"head dim D={d} (must be a multiple of 16)"
        elif bk % 16 or bk > MAX_BLOCK_SIZE_V2:
            why_not_v2 = f"block_size={bk} (must be a multiple of 16, at most {MAX_BLOCK_SIZE_V2})"
        why_not_v3 = why_not_v2
        if why_not_v3 is None and d > V3_MAX_HEAD_DIM:
            why_not_v3 = f"head dim D={d} (at most {V3_MAX_HEAD_DIM}: O lives in registers)"
        elif why_not_v3 is None and bk > V3_MAX_BLOCK_SIZE:
            why_not_v3 = f"block_size={bk} (at most {V3_MAX_BLOCK_SIZE}: S lives in registers)"
        why_not_v4 = why_not_v3
        if why_not_v4 is None:
            why_not_v4 = _wgmma.why_not_available()
        if why_not_v4 is None and tile_rows not in (None, 64):
            why_not_v4 = f"tile_rows={tile_rows} (a warpgroup's wgmma tile is 64 rows)"
        if version is None:
            if why_not_v2:
                version = 1
            elif DEFAULT_TC_VERSION == 4 and why_not_v4 is None:
                version = 4
            elif DEFAULT_TC_VERSION >= 3 and why_not_v3 is None:
                version = 3
            else:
                version = 2
        if version not in VERSIONS:
            raise ValueError(f"version must be one of {VERSIONS} or None, got {version!r}")
        why_not = {2: why_not_v2, 3: why_not_v3, 4: why_not_v4}.get(version)
        if why_not:
            raise ValueError(f"version={version} (tensor cores) does not support {why_not}; use "
                             f"version=1" + ("" if why_not_v2 else " or 2")
                             + ("" if why_not_v3 or version != 4 else " or 3"))
        if tile_rows is None:
            tile_rows = DEFAULT_TILE_ROWS[version]
        tile_rows = check_positive_int("tile_rows", tile_rows, high=128)
        if version >= 2 and tile_rows not in (16, 32, 64, 128):
            raise ValueError(f"tile_rows must be 16, 32, 64 or 128 for version={version}, got "
                             f"{tile_rows}")
        positions = -(-tile_rows // g)  # ceil(T / G) query positions x G heads per tile
        rows = positions * g
        if version < 3:
            if groups not in (None, 1):
                raise ValueError(f"groups must be None or 1 for version={version} (warp groups "
                                 f"are a version 3 option), got {groups!r}")
            groups = 1
        elif groups is None:
            groups = DEFAULT_V3_GROUPS
            if (rows // 16 * groups > _V3_MAX_GROUP_WARPS
                    or _v3_layout(bk, d, rows, groups)[3] > _mma.DYNAMIC_SMEM_LIMIT):
                groups = 1
        else:
            # at most MAX_WARPS warps a CTA, and barrier ids 1..15 for the groups
            groups = check_positive_int("groups", groups,
                                        high=min(15, _mma.MAX_WARPS // (rows // 16)))
        limit = _mma.DYNAMIC_SMEM_LIMIT
        if version == 1:
            while positions > 1 and _v1_layout(bk, d, positions * g)[3] > limit:
                positions //= 2
            smem = _v1_layout(bk, d, positions * g)[3]
        elif version == 2:
            smem = _v2_layout(bk, d, positions * g)[2]
        else:
            smem = _v3_layout(bk, d, rows, groups)[3]
        if smem > limit:
            raise ValueError(
                f"K1 v{version} needs {smem} bytes of shared memory for head dim D={d}, "
                f"block_size={bk}" + (f" and groups={groups}" if groups > 1 else "") +
                f", more than the {limit} it may use; use a smaller block_size"
                + (" or fewer groups" if groups > 1 else ""))
        assert version != 4 or rows == 64
        self.version, self.positions, self.rows, self.smem = version, positions, rows, smem
        self.groups = groups
        self.block_size = bk
        self.spec = spec

    def inputs(self, ctx, q, k, v):
        """Kernel views of q, k, v: uint32 word views for v2/v3, element views for v1."""
        if self.version >= 2:  # [T, H, D/2]: two 16-bit values per load
            return [ctx.input(name, x).view(np.uint32) for name, x in (("q", q), ("k", k), ("v", v))]
        return [_element_view(ctx, name, x, self.spec.bf16)
                for name, x in (("q", q), ("k", k), ("v", v))]

    def launch(self, q, k, v, work, q_indices, slots, cu_q, cu_k, scale, o_part, lse_part,
               bf16_partials=False):
        """K1 over ``work.shape[0]`` items (padding items exit at once). ``o_part``: float32
        ``[K, Tq, Hq, D]``, or its bf16 bits (uint16/int16) with ``bf16_partials``."""
        num_items = int(work.shape[0])
        if num_items == 0 or int(q.shape[0]) == 0:
            return
        spec = self.spec
        if self.version == 1:
            kernel = _k1_kernel_simple(self.block_size, spec.d, spec.g, self.positions,
                                       _THREADS_V1, spec.bf16, bf16_partials)
            _launch_smem(kernel, num_items, _THREADS_V1, self.smem, q, k, v, work, q_indices,
                        slots, cu_q, cu_k, np.float32(scale), o_part, lse_part)
        elif self.version in (3, 4):
            if bf16_partials:
                o_part = o_part.view(np.uint32)  # [K, Tq, Hq, D/2]: two bf16 per word
            o_part = o_part.reshape(o_part.size)  # the kernel indexes it flat
            # cp.async needs 16-byte aligned rows: D % 16 == 0 keeps slices of aligned arrays
            # aligned; an input that is not falls back to plain loads
            aligned = all(is_aligned16(x) for x in (q, k, v))
            # 16-byte stores of bf16 partials need o_part 16-byte aligned too (rows of D/2
            # words, D % 16 == 0, keep every row aligned then), and the kernel takes them only
            # where a part of O has a multiple of 4 n-tiles (STORE_V4); else 4-byte stores
            kernel = _k1_kernel_reg(self.block_size, spec.d, spec.g, self.positions, spec.bf16,
                                    bf16_partials, aligned, _v3_o_parts(spec.d), self.groups,
                                    bf16_partials and is_aligned16(o_part), self.version == 4)
            _launch_smem(kernel, num_items, 2 * self.rows * self.groups, self.smem, q, k, v, work,
                        q_indices,
                        slots, cu_q, cu_k, np.float32(scale * _LOG2E), o_part, lse_part)
        else:
            if bf16_partials:
                o_part = o_part.view(np.uint32)  # [K, Tq, Hq, D/2]: two bf16 per word
            kernel = _k1_kernel_mma(self.block_size, spec.d, spec.g, self.positions, spec.bf16,
                                    bf16_partials)
            _launch_smem(kernel, num_items, 2 * self.rows, self.smem, q, k, v, work, q_indices,
                        slots, cu_q, cu_k, np.float32(scale * _LOG2E), o_part, lse_part,
                        np.int32(self.block_size), np.int32(spec.d // 2))


def attention_partials(q, k, v, work, q_indices, partial_slots, cu_seqlens_q, cu_seqlens_k,
                       block_size, topk, scale=None, *, version=None, tile_rows=None,
                       groups=None, validate=True):
    """Paper §4.2 K1: KV-outer partial attention, one partial per (query, block), on the GPU.

    .. math::  L_s = \\log \\sum_{j \\in J_s} e^{S_j}, \\qquad O_s = \\sum_{j \\in J_s} e^{S_j - L_s} V_j

    One CTA per work item (see the module docstring); equal to
    ``msa.reference.attention.attention_partials`` up to float32 rounding (and the 16-bit
    rounding of P in versions 2 and 3).

    Args:
        q: [Tq, Hq, D] float32, float16 or bfloat16 (torch); k, v: [Tk, Hkv, D], same dtype.
            ``G = Hq/Hkv`` in {1, 2, 4, 8, 16}, ``1 <= D <= 256``.
        work: int [W, 6] work items ``[kv_head, row, q_begin, q_count, batch, kv_block]``
            (``schedule.build_schedule``); items with ``q_count <= 0`` are padding and skipped.
        q_indices, partial_slots: int [Hkv, nnz] k2q CSR entries and their slots (``csr.build_csr``).
        cu_seqlens_q, cu_seqlens_k: int [B+1] packed offsets, ``Lq <= Lk`` (read on the host).
        block_size: Bk >= 1. topk: K >= 1, the number of slots.
        scale: softmax scale; ``None`` gives ``1/sqrt(D)``.
        version: 1 (CUDA cores), 2 (tensor cores, fp16/bf16, D and Bk multiples of 16), 3
            (tensor cores, registers; also D, Bk <= 128) or 4 (version 3 on wgmma: also
            compute capability 9.0 and 64-row tiles); ``None`` picks ``DEFAULT_TC_VERSION``
            (4) when it applies, else 3, 2 or 1.
        tile_rows: rows T of a query tile (``ceil(T/G)`` positions x G heads); 16, 32, 64 or
            128 for versions 2 and 3, 64 for version 4; default on a GPU 128 for version 2, 64
            for the others.
        groups: versions 3 and 4: independent groups of ``T/16`` warps per CTA that share one
            K/V block, each walking its own tiles (``None``: ``DEFAULT_V3_GROUPS``). Each group
            adds two Q buffers of shared memory; the outputs do not depend on it.
        validate: check the work items against the CSR and the problem on host copies
            (``msa.reference.attention``'s checks: one device-to-host copy of ``work``,
            ``q_indices`` and ``partial_slots``). ``False`` skips that; bad entries are then
            skipped by the kernel, never read or written out of bounds.

    Returns:
        ``(o_part [K, Tq, Hq, D], lse_part [K, Tq, Hq])`` float32 in the caller's library. A
        slot no item writes keeps ``o = 0``, ``lse = -inf``; so does a partial whose block has
        no key visible to the query.

    Raises:
        TypeError: dtypes (q not float32/float16/bfloat16, k or v differing, non-integer
        indices), mixed array libraries. ValueError: shapes, G not in {1, 2, 4, 8, 16}, D out of
        range, bad ``cu_seqlens``, a version the inputs do not support, and with ``validate``
        any bad work item, CSR entry or slot.
    """
    spec = _Spec(q, k, v)
    block_size = check_positive_int("block_size", block_size)
    topk = check_positive_int("topk", topk)
    scale = check_scale("scale", scale, 1.0 / math.sqrt(spec.d))
    cu_q, cu_k = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, spec.tq, spec.tk)
    check_array("work", work, ndim=2, dtypes=("int",), shape=(None, 6))
    check_array("q_indices", q_indices, ndim=2, dtypes=("int",), shape=(spec.hkv, None))
    check_array("partial_slots", partial_slots, ndim=2, dtypes=("int",),
                shape=tuple(int(s) for s in q_indices.shape))
    plan = _K1Plan(spec, block_size, version, tile_rows, groups)
    if validate:
        _validate_work(work, q_indices, partial_slots, spec, topk, cu_q, cu_k, block_size)
    ctx = ArrayContext(q, k, v, work, q_indices, partial_slots)
    qa, ka, va = plan.inputs(ctx, q, k, v)
    o_part = ctx.empty((topk, spec.tq, spec.hq, spec.d), np.float32)
    lse_part = ctx.empty((topk, spec.tq, spec.hq), np.float32)
    o_arg, l_arg = ctx.arg(o_part), ctx.arg(lse_part)
    fill(o_arg, 0.0)
    fill(l_arg, -np.inf)
    plan.launch(qa, ka, va, ctx.input("work", work), ctx.input("q_indices", q_indices),
                ctx.input("partial_slots", partial_slots), device_constant(cu_q.astype(np.int32)),
                device_constant(cu_k.astype(np.int32)), scale, o_arg, l_arg)
    return ctx.output(o_part), ctx.output(lse_part)


def _validate_work(work, q_indices, partial_slots, spec, topk, cu_q, cu_k, block_size):
    """The reference's checks of K1's schedule, on host copies, ignoring padding items."""
    from ..reference.attention import check_work
    from ..reference.blocks import query_positions

    host_work = np.asarray(cu_to_host(work), dtype=np.int64)
    real = host_work[host_work[:, 3] > 0]  # [W', 6]: padding items (q_count <= 0) are skipped
    q_batch, _ = query_positions(cu_q, cu_k, spec.tq, spec.tk)
    check_work(real, cu_to_host(q_indices), cu_to_host(partial_slots), spec.hkv, topk, q_batch,
                cu_k, block_size)


# End to end: sparse attention (CSR + schedule + K1 + K2) and the MSA prefill

def query_chunks(cu_q, cu_k, chunk: int):
    """Cut a packed batch's queries into chunks of at most ``chunk``, each a problem of its own.

    A chunk ``[t0, t1)`` of packed queries becomes the sequences ``bf .. bl`` it touches, each
    keeping the keys its chunk queries can see: all of them except for ``bl``, whose keys end at
    its last chunk query (queries are the *last* ``Lq`` of their ``Lk`` keys, so cutting the
    later keys off keeps every position and every block id). Those keys are one contiguous range
    ``[k_lo, k_hi)`` of the packed keys.

    Yields ``(t0, t1, k_lo, k_hi, cu_q_chunk, cu_k_chunk)`` with int32 host offsets.
    """
    cu_q = np.asarray(cu_q, dtype=np.int64)
    cu_k = np.asarray(cu_k, dtype=np.int64)
    tq = int(cu_q[-1])
    for t0 in range(0, tq, chunk):
        t1 = min(t0 + chunk, tq)
        bf = int(np.searchsorted(cu_q, t0, side="right")) - 1
        bl = int(np.searchsorted(cu_q, t1 - 1, side="right")) - 1
        lq_bl = int(cu_q[bl + 1] - cu_q[bl])
        lk_bl = int(cu_k[bl + 1] - cu_k[bl])
        k_lo = int(cu_k[bf])
        k_hi = int(cu_k[bl]) + lk_bl - lq_bl + (t1 - int(cu_q[bl]))
        cu_q_c = np.clip(cu_q[bf:bl + 2], t0, t1) - t0
        cu_k_c = cu_k[bf:bl + 2] - k_lo
        cu_k_c[-1] = k_hi - k_lo
        yield t0, t1, k_lo, k_hi, cu_q_c.astype(np.int32), cu_k_c.astype(np.int32)


def _selection_args(spec, block_indices, cu_seqlens_q, cu_seqlens_k, block_size, scale):
    """The checks ``sparse_attention`` and its backward share: ``(block_size, scale, cu_q, cu_k,
    topk)`` with ``block_indices`` an int ``[Tq, Hkv, K]``, ``1 <= K <= MAX_TOPK``."""
    block_size = check_positive_int("block_size", block_size)
    scale = check_scale("scale", scale, 1.0 / math.sqrt(spec.d))
    cu_q, cu_k = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, spec.tq, spec.tk)
    check_array("block_indices", block_indices, ndim=3, dtypes=("int",),
                shape=(spec.tq, spec.hkv, None))
    topk = int(block_indices.shape[2])
    if not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"block_indices must have K in [1, {MAX_TOPK}] slots, got "
                         f"shape {tuple(block_indices.shape)}")
    return block_size, scale, cu_q, cu_k, topk


def sparse_attention(q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, block_size, scale=None,
                     *, version=None, tile_rows=None, groups=None, chunk_size=None,
                     max_partial_bytes=None, partial_dtype=None, validate=True):
    """Paper eq 8 on the GPU: attention over the causally visible keys of the selected blocks.

    .. math::  O_t^{(h)} = \\mathrm{softmax}\\big(Q_t^{(h)} K^{(r)}[\\mathcal{I}_t^{(r)}]^\\top s\\big)\\, V^{(r)}[\\mathcal{I}_t^{(r)}]

    The paper's KV-outer forward in one call, all on the device: ``msa.cuda.csr.build_csr``
    (k2q reverse index) -> ``msa.cuda.schedule.build_schedule`` (hot rows cut into chunks of at
    most ``chunk_size`` queries) -> K1 (``attention_partials``' kernel) -> K2
    (``msa.cuda.combine``). The queries are processed in chunks whose float32 partials
    (``K*chunk*Hq*D*4`` bytes) fit ``max_partial_bytes``; each chunk writes its rows of ``o``
    and ``lse`` directly. Only ``cu_seqlens`` is read on the host (plus ``validate``).

    Args:
        q: [Tq, Hq, D] float32, float16 or bfloat16 (torch); k, v: [Tk, Hkv, D], same dtype.
        block_indices: I int [Tq, Hkv, K], batch-local block ids, unique per row, -1 only at the
            tail; a block wholly after the query contributes nothing.
        cu_seqlens_q, cu_seqlens_k: int [B+1] packed offsets, ``Lq <= Lk`` per sequence,
            read on the host: pass NumPy arrays (a CUDA tensor costs a device-to-host read,
            i.e. a wait for the GPU's queued work, on every call).
        block_size: Bk >= 1.
        scale: softmax scale; ``None`` gives ``1/sqrt(D)``.
        version, tile_rows, groups: K1's kernel, tile and warp groups (see
            ``attention_partials``).
        chunk_size: most queries per work item (default ``2*K*Bk`` as in the paper, rounded up
            to whole tiles).
        max_partial_bytes: memory for one query chunk's partials (default
            ``default_partial_bytes()``: an eighth of the GPU's memory, 4 to 16 GiB).
        partial_dtype: ``"float32"`` or ``"bfloat16"`` partials ``O_s`` (the LSEs stay float32);
            default bfloat16 for bfloat16 inputs (half the bytes K1 writes and K2 reads, one
            more rounding of 2**-9 relative, below the output's own), float32 otherwise.
        validate: check ``block_indices`` on a host copy first
            (``msa.reference.select.check_block_indices``). ``False`` skips it; invalid entries
            are then skipped by the kernels (memory safe, result unspecified).

    Returns:
        ``(o [Tq, Hq, D] in q's dtype, lse float32 [Tq, Hq])`` in the caller's library; ``lse``
        in natural log over the support. A query whose support is empty gets ``o = 0``,
        ``lse = -inf``. Bitwise identical on reruns.

    Raises:
        TypeError/ValueError as ``attention_partials``, plus ``block_indices`` with a wrong shape
        or (with ``validate``) a bad entry.
    """
    from .csr import build_csr
    from .schedule import build_schedule, launch_rows

    spec = _Spec(q, k, v)
    block_size, scale, cu_q, cu_k, topk = _selection_args(spec, block_indices, cu_seqlens_q,
                                                          cu_seqlens_k, block_size, scale)
    plan = _K1Plan(spec, block_size, version, tile_rows, groups)
    if chunk_size is None:
        chunk_size = 2 * topk * block_size
    chunk_size = check_positive_int("chunk_size", chunk_size)
    chunk_size = -(-chunk_size // plan.positions) * plan.positions
    if max_partial_bytes is None:
        max_partial_bytes = default_partial_bytes()
    max_partial_bytes = check_positive_int("max_partial_bytes", max_partial_bytes)
    bf16_partials = _partials_are_bf16(partial_dtype, spec)
    if validate:
        from ..reference.select import check_block_indices

        check_block_indices(cu_to_host(block_indices), cu_q, cu_k, block_size)

    ctx = ArrayContext(q, k, v, block_indices)
    o = ctx.empty((spec.tq, spec.hq, spec.d), spec.kind)
    lse = ctx.empty((spec.tq, spec.hq), np.float32)
    if spec.tq == 0:
        return ctx.output(o), ctx.output(lse)
    qa, ka, va = plan.inputs(ctx, q, k, v)
    # The CSR and the schedule are allocated in the caller's library when it has a GPU one (so
    # that e.g. torch's allocator sees them); NumPy input goes to the device once.
    I = block_indices if ctx.lib in ("torch", "cupy") else ctx.input("block_indices",
                                                                      block_indices)
    o_arg, lse_arg = ctx.arg(o), ctx.arg(lse)

    per_query = topk * spec.hq * spec.d * (2 if bf16_partials else 4)
    q_chunk = max(1, min(spec.tq, max_partial_bytes // per_query))
    # One buffer for every chunk's partials, in the caller's library (so that e.g. torch's
    # allocator accounts for it).
    o_buf = ctx.arg(ctx.empty((topk * q_chunk * spec.hq * spec.d,),
                              "bfloat16" if bf16_partials else np.float32))
    l_buf = ctx.arg(ctx.empty((topk * q_chunk * spec.hq,), np.float32))
    # Every chunk's offsets go to the device before the first launch: a host-to-device copy
    # inside the loop would wait for the previous chunk's kernels.
    chunks = [(t0, t1, k_lo, k_hi, cq, ck, device_constant(cq), device_constant(ck))
              for t0, t1, k_lo, k_hi, cq, ck in query_chunks(cu_q, cu_k, q_chunk)]
    for t0, t1, k_lo, k_hi, cu_q_c, cu_k_c, d_cu_q, d_cu_k in chunks:
        tc = t1 - t0
        row_ptr, q_indices, slots = build_csr(I[t0:t1], cu_q_c, cu_k_c, block_size,
                                              validate=False)
        # padded work array (its -1 rows are skipped by K1): no host round trip
        work, num_items = build_schedule(row_ptr, cu_k_c, block_size, chunk_size,
                                         max_edges=tc * topk, validate=False)
        work = launch_rows(work, num_items)
        o_part = o_buf[:topk * tc * spec.hq * spec.d].reshape(topk, tc, spec.hq, spec.d)
        lse_part = l_buf[:topk * tc * spec.hq].reshape(topk, tc, spec.hq)
        # Only L_s needs a value in unused slots: K2 never reads O_s where L_s = -inf.
        fill(lse_part, -np.inf)
        plan.launch(qa[t0:t1], ka[k_lo:k_hi], va[k_lo:k_hi], _kernel_array(work),
                    _kernel_array(q_indices), _kernel_array(slots), d_cu_q, d_cu_k, scale,
                    o_part, lse_part, bf16_partials)
        launch_combine(ctx, o_part, lse_part, o_arg[t0:t1], lse_arg[t0:t1], head_dim=spec.d,
                       bf16_part=bf16_partials, bf16_out=spec.bf16)
    return ctx.output(o), ctx.output(lse)


def _partials_are_bf16(partial_dtype, spec) -> bool:
    """``partial_dtype`` (None, float32 or bfloat16, as a dtype or name) -> bf16 partials?"""
    if partial_dtype is None:
        return spec.bf16
    if "bfloat16" in str(partial_dtype):
        return True
    try:
        if np.dtype(partial_dtype) == np.float32:
            return False
    except TypeError:
        pass
    raise ValueError(f"partial_dtype must be float32 or bfloat16, got {partial_dtype!r}")



def msa_prefill(q, k, v, q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, block_size, topk, scale=None,
                index_scale=None, *, version=None, tile_rows=None, groups=None, chunk_size=None,
                max_partial_bytes=None, partial_dtype=None, index_version=None):
    """Paper Algorithm 1 lines 3-5 on the GPU: index branch, top-k, sparse attention in one call.

    ``I = msa.cuda.select.select_blocks_fused(q_idx, k_idx, ..., topk, block_size, index_scale)``
    (eq 5-7: block scores and the exp-free top-k with the local block forced, never holding the
    whole score matrix), then ``sparse_attention(q, k, v, I, ...)`` (eq 8). The selection is
    valid by construction, so it is not re-validated on the host.

    Args:
        q: [Tq, Hq, D]; k, v: [Tk, Hkv, D]; float32, float16 or bfloat16 (torch), one dtype.
        q_idx: [Tq, Hkv, Didx]; k_idx: [Tk, Didx]: the index branch's queries and shared key head.
        cu_seqlens_q, cu_seqlens_k: int [B+1] packed offsets, ``Lq <= Lk`` per sequence,
            read on the host: pass NumPy arrays (a CUDA tensor costs a device-to-host read,
            i.e. a wait for the GPU's queued work, on every call).
        block_size: Bk >= 1. topk: K in [1, 64].
        scale: attention softmax scale (default ``1/sqrt(D)``); index_scale: the index scores'
            scale (default ``1/sqrt(Didx)``).
        version, tile_rows, groups, chunk_size, max_partial_bytes, partial_dtype: as
            ``sparse_attention``.
        index_version: ``select_blocks_fused``'s ``version`` (default: its default).

    Returns:
        ``(o [Tq, Hq, D] in q's dtype, lse float32 [Tq, Hq], block_indices int32 [Tq, Hkv, K])``
        in the caller's library.
    """
    from .select import select_blocks_fused

    spec = _Spec(q, k, v)
    check_array("q_idx", q_idx, ndim=3, shape=(spec.tq, spec.hkv, None))
    check_array("k_idx", k_idx, ndim=2, shape=(spec.tk, None))
    block_indices = select_blocks_fused(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, block_size,
                                        topk, scale=index_scale, version=index_version)
    o, lse = sparse_attention(q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, block_size,
                              scale, version=version, tile_rows=tile_rows, groups=groups,
                              chunk_size=chunk_size, max_partial_bytes=max_partial_bytes,
                              partial_dtype=partial_dtype, validate=False)
    return o, lse, block_indices


# --- the backward of eq 8 (training the main branch) ----------------------------------------------
#
# Version 1, CUDA cores, deterministic (no atomics), FlashAttention's rule with the forward's LSE:
#   D_t = rowsum(dO_t * O_t)                      _attention_bwd_kernel_delta, a warp per (t, h)
#   dQ: a CTA per (query, KV head), Q-outer       _attention_bwd_kernel_dq
#       per selected block: dS [G, Bk] in shared memory, then dQ[g, :] += dS[g, :] K_block
#   dK, dV: a CTA per part of a k2q CSR row (at most part_size queries), KV-outer
#       _attention_bwd_kernel_dkdv: the part's queries in CSR order (ascending), QC at a time:
#       P, dS [QC*G, Bk], then dK[c, :] += dS[:, c]ᵀ (sQ), dV[c, :] += P[:, c]ᵀ dO in shared
#       memory. A row of one part writes dK/dV; a hot row's parts write scratch slots that
#       _attention_bwd_kernel_dkdv_sum adds in part order (no atomics, bitwise reruns).
# Every key belongs to one block, so every dK/dV row is written by one CTA; every dQ row by one.

# threads per CTA (the simulator runs each thread as a Python thread: fewer there, same kernels)
_BWD_THREADS = 32 if SIMULATOR else 128


def _bwd_rows(group: int) -> int:
    """(query, head) rows per round of the dK/dV kernel: 16 // G queries (at least one) x G."""
    return max(1, 16 // group) * group


def _bwd_dkdv_layout(block_size: int, head_dim: int, group: int):
    """Float32 word offsets of the dK/dV kernel's dynamic shared memory, and its bytes:
    acc_k, acc_v [Bk, D], then per round sQ, sdO [RW, D], sP, sdS [RW, Bk], sLSE, sDelta [RW].

    Returns ``(off_av, off_q, off_do, off_p, off_ds, off_l, off_dl, total_bytes)``."""
    rw = _bwd_rows(group)
    off_av = block_size * head_dim
    off_q = 2 * block_size * head_dim
    off_do = off_q + rw * head_dim
    off_p = off_do + rw * head_dim
    off_ds = off_p + rw * block_size
    off_l = off_ds + rw * block_size
    off_dl = off_l + rw
    return off_av, off_q, off_do, off_p, off_ds, off_l, off_dl, 4 * (off_dl + rw)


def _bwd_dq_smem(block_size: int, head_dim: int, group: int) -> int:
    """Bytes of the dQ kernel's static shared arrays (sQ, sdO, sAcc [G, D], sdS [G, Bk])."""
    return 4 * (3 * group * head_dim + group * block_size + 2 * group)


@cuda.jit(device=True)
def _split_slot(part_ptr, hkv, r, row):
    """First scratch slot of row ``row`` of head ``r`` (a row of several parts): the scratch
    slots of the heads before ``r``, then of the rows before ``row`` (``part_ptr``'s rows
    ``Hkv ..``: per-head offsets of the split rows' parts)."""
    rows = part_ptr.shape[1] - 1
    slot = part_ptr[hkv + r, row]
    for h in range(r):
        slot += part_ptr[hkv + h, rows]
    return slot


@cuda.jit(device=True)
def _bwd_part(row_ptr, part_ptr, row_offsets, cu_k, part_size, num_entries, block_size):
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
    row = int64(_last_le(part_ptr[r], pid))  # the row holding part pid
    part = pid - part_ptr[r, row]
    nparts = int64(part_ptr[r, row + 1] - part_ptr[r, row])
    b = int64(_last_le(row_offsets, row))
    j = row - row_offsets[b]
    lk = int64(cu_k[b + 1] - cu_k[b])
    nk = min(int64(block_size), lk - j * block_size)
    e0 = int64(row_ptr[r, row]) + part * part_size
    e1 = min(int64(row_ptr[r, row + 1]), e0 + part_size)
    if pid >= part_ptr[r, nrows] or nk <= 0 or e0 < 0 or e1 > num_entries:
        e1 = e0
    return r, row, part, nparts, b, j, lk, nk, e0, e1


@functools.lru_cache(maxsize=None)
def _bwd_kernels(block_size: int, head_dim: int, group: int, bf16_in: bool, threads: int):
    """The backward kernels specialised for (Bk, D, G, input kind, threads)."""
    Bk, D, G, NT = block_size, head_dim, group, threads
    RW = _bwd_rows(G)  # (query, head) rows per round of the dK/dV kernel ...
    QC = RW // G  # ... of QC queries
    OFF_AV, OFF_Q, OFF_DO, OFF_P, OFF_DS, OFF_L, OFF_DL, _ = _bwd_dkdv_layout(Bk, D, G)
    to_f32 = bf16_to_f32 if bf16_in else cuda.jit(device=True)(_identity_f32)
    neg_inf = float32(-math.inf)

    @cuda.jit
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

    @cuda.jit
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
        b = _last_le(cu_q, t)
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
                    ds = math.exp(sc - l) * (dp - sdelta[g])
                sds[g, c] = ds
            cuda.syncthreads()
            for i in range(tid, G * D, NT):  # each (g, d) has one owner thread throughout
                g = i // D
                d = i % D
                acc = float32(0.0)  # the block's sum, then added to the total: two levels
                for c in range(nk):
                    acc += sds[g, c] * to_f32(k[key_base + key0 + c, r, d])
                sacc[g, d] += acc
            cuda.syncthreads()  # sdS is rewritten by the next block
        for i in range(tid, G * D, NT):
            g = i // D
            d = i % D
            dq[t, r * G + g, d] = sacc[g, d] * scale

    @cuda.jit
    def _attention_bwd_kernel_dkdv(q, k, v, do, lse, delta, row_ptr, q_indices, row_offsets,
                                   cu_q, cu_k, scale, part_ptr, part_size, dk, dv, dk_part,
                                   dv_part):
        smem = cuda.shared.array(0, float32)
        s_t = cuda.shared.array(QC, int32)
        tid = cuda.threadIdx.x
        hkv = row_ptr.shape[0]
        r, row, part, nparts, b, j, lk, nk, e0, e1 = _bwd_part(
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
                    p = math.exp(sc - l)
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
            slot = _split_slot(part_ptr, hkv, r, row) + part
            for i in range(tid, nk * D, NT):
                dk_part[slot, i] = smem[i]
                dv_part[slot, i] = smem[OFF_AV + i]

    @cuda.jit
    def _attention_bwd_kernel_dkdv_sum(part_ptr, row_offsets, cu_k, dk_part, dv_part, dk, dv):
        """dK, dV of a row cut into several parts: their sums added in part order."""
        hkv = part_ptr.shape[0] // 2
        rows = part_ptr.shape[1] - 1
        r = cuda.blockIdx.x // rows
        row = cuda.blockIdx.x % rows
        nparts = part_ptr[r, row + 1] - part_ptr[r, row]
        if nparts <= 1:
            return
        b = _last_le(row_offsets, row)
        j = row - row_offsets[b]
        key_base = cu_k[b] + j * Bk
        nk = min(Bk, cu_k[b + 1] - cu_k[b] - j * Bk)
        slot0 = _split_slot(part_ptr, hkv, r, row)
        for i in range(cuda.threadIdx.x, nk * D, NT):
            ak = float32(0.0)
            av = float32(0.0)
            for part in range(nparts):
                ak += dk_part[slot0 + part, i]
                av += dv_part[slot0 + part, i]
            dk[key_base + i // D, r, i % D] += ak  # dk, dv start at 0; query chunks add up
            dv[key_base + i // D, r, i % D] += av

    @cuda.jit
    def _attention_bwd_kernel_parts(row_ptr, part_size, parts):
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

    return (_attention_bwd_kernel_delta, _attention_bwd_kernel_dq, _attention_bwd_kernel_dkdv,
            _attention_bwd_kernel_dkdv_sum, _attention_bwd_kernel_parts)


# --- the backward on tensor cores (version 2) ------------------------------------------------

# Tile rows of the tensor-core backward (query positions x G heads): 64 on a GPU (S^T and dP^T
# of a warp's 16 keys x 64 rows are 32 fp32 registers each, beside 128 of dK and dV); the
# simulator runs every thread in Python, so its tiles are as small as the mma allows.
_BWD_TC_ROWS = 16 if SIMULATOR else 64
BWD_VERSIONS = (1, 2)


def _bwd_tc_layout(block_size: int, head_dim: int, rows: int):
    """Row strides (32-bit words) and word offsets of the tensor-core backward's dynamic shared
    memory: sK, sV [Bk rows], two sQ and two sdO buffers [R rows] of ``D/2 + 4`` words (as K1
    v3: 16-byte aligned rows, conflict-free ``ldmatrix``; tile i+1 lands while tile i computes),
    then dSᵀ [Bk rows] of ``R/2 + 4`` words (16-bit pairs).

    Returns ``(ld, ld_ds, off_v, off_q, off_do, off_ds, total_bytes)``; buffer ``b`` of sQ
    starts at ``off_q + b R ld``, of sdO at ``off_do + b R ld``."""
    ld = head_dim // 2 + 4
    ld_ds = rows // 2 + 4
    off_v = block_size * ld
    off_q = 2 * block_size * ld
    off_do = off_q + 2 * rows * ld
    off_ds = off_do + 2 * rows * ld
    return ld, ld_ds, off_v, off_q, off_do, off_ds, 4 * (off_ds + block_size * ld_ds)


@functools.lru_cache(maxsize=None)
def _bwd_tc_kernel(block_size: int, head_dim: int, group: int, rows: int, bf16_in: bool,
                   use_async: bool):
    """The tensor-core dK/dV/dQ kernel (backward version 2) for (Bk, D, G, R, input kind,
    ``cp.async`` or plain loads).

    One CTA of ``Bk/16`` warps per part of a k2q CSR row (as version 1's dK/dV kernel); warp
    ``w`` owns keys ``16w .. 16w+15`` of the block and keeps their dK and dV (16 x D fp32) in
    registers across the part's query tiles. A tile is ``R = P*G`` rows (``P`` CSR entries x
    the G heads of the KV head); per tile, all with ``mma.sync.m16n8k16`` (fp32 accumulate):

    * ``Sᵀ = K_w Qᵀ`` and ``dPᵀ = V_w dOᵀ`` (16 keys x R rows in registers),
    * ``Pᵀ = 2**(Sᵀ s log2 e - LSE log2 e)`` under the causal mask, ``dSᵀ = Pᵀ (dPᵀ - D)``;
      both packed to 16-bit pairs are the A fragments of the next two products (the C layout
      of two n-tiles is the A layout of one k-step, as in K1 v3),
    * ``dV_w += Pᵀ dO`` and ``dK_w += dSᵀ Q`` (B fragments by ``ldmatrix.trans``),
    * dSᵀ goes to shared memory, and ``dQ_tile = dS K`` (A by ``ldmatrix.trans`` of dSᵀ, B by
      ``ldmatrix.trans`` of K) is written, unscaled, to the rows' partial slots
      ``dq_part[slot, t, h, :]`` (each (query, head, slot) has one writer: no atomics).

    The part's dK, dV (times ``scale``) are added to ``dk``, ``dv`` (a row of one part: several
    query chunks add in turn) or, for a hot row cut into parts, written to the part's scratch
    slot, which ``_attention_bwd_kernel_dkdv_sum`` adds in part order. P and dS are rounded to
    the inputs' 16-bit type before their products, as in FlashAttention's backward."""
    Bk, D, G, R = block_size, head_dim, group, rows
    NW = Bk // 16  # warps: 16 keys each
    NT = 32 * NW
    assert Bk % 16 == 0 and D % 16 == 0 and R % 16 == 0 and R % G == 0
    assert NW <= _mma.MAX_WARPS
    P = R // G  # CSR entries (query positions) per tile
    LD, LDS, OFF_V, OFF_Q, OFF_DO, OFF_DS, _ = _bwd_tc_layout(Bk, D, R)
    DW = D // 2  # words per row of Q/K/V/dO
    PIECES = D // 8  # 16-byte pieces per row
    NS = R // 8  # n-tiles of Sᵀ, dPᵀ (8 rows each)
    KS = D // 16  # k-steps of Sᵀ, dPᵀ
    KR = R // 16  # k-steps of dV, dK (16 rows each); also the m-tiles of dQ
    NO = D // 8  # n-tiles of dK, dV, dQ (8 dims each)
    KB = Bk // 16  # k-steps of dQ (16 keys each)
    PAIRS = KR * (NO // 2)  # (m-tile, n-tile pair) units of dQ, spread over the warps
    ROUNDS = -(-PAIRS // NW)
    S_REGS, F_REGS, O_REGS = 4 * NS, 2 * NS, 4 * NO
    mma = mma_bf16_m16n8k16 if bf16_in else mma_f16_m16n8k16
    mma_pair = make_mma_pair(mma)
    pack = pack_bf16x2 if bf16_in else pack_f16x2
    copy16 = cp_async16 if use_async else copy16_plain3
    commit = cp_async_commit if use_async else no_op
    wait_all = cp_async_wait_all if use_async else no_op
    log2e = float32(_LOG2E)
    QB = R * LD  # words per sQ / sdO buffer
    R2 = 2 * R  # rows of the two tiles' tables
    jit = {} if SIMULATOR else {"launch_bounds": (NT, 1)}

    @cuda.jit(device=True, inline=True)
    def stage(smem, s_t, s_slot, s_lim, s_l2, s_dl, q, do, lse, delta, q_indices, slots, r, c0,
              e1, buf, q_lo, q_hi, pos0, key_pos0, nk, topk, tid):
        """Start loading the tile of CSR entries ``c0 ..`` into buffer ``buf``: its row table
        (query or -1, slot, mask limit, LSE log2 e, D) by plain stores, its Q and dO rows
        (zeros for rows without a query) by ``cp.async`` (the caller commits)."""
        hq = q.shape[1]
        for w in range(tid, R, NT):
            t = -1
            s = 0
            if c0 + w // G < e1:
                t = q_indices[r, c0 + w // G]
                s = slots[r, c0 + w // G]
                if t < q_lo or t >= q_hi or s < 0 or s >= topk:
                    t = -1  # not a query of this sequence (unvalidated input): skipped
            lim = -1
            l2 = float32(0.0)
            dl = float32(0.0)
            if t >= 0:
                h = r * G + w % G
                lv = lse[t, h]
                if lv > _NEG_INF:  # else the query sees nothing: lim stays -1
                    lim = min(pos0 + t - key_pos0, nk - 1)
                    l2 = lv * log2e
                    dl = delta[t, h]
            s_t[buf * R + w] = t
            s_slot[buf * R + w] = s
            s_lim[buf * R + w] = lim
            s_l2[buf * R + w] = l2
            s_dl[buf * R + w] = dl
        for e in range(tid, R * PIECES, NT):
            w = e // PIECES
            piece = (e % PIECES) * 4
            t = -1
            if c0 + w // G < e1:
                t = q_indices[r, c0 + w // G]
                if t < q_lo or t >= q_hi:
                    t = -1
            src = (((t if t >= 0 else 0) * hq + r * G + w % G) * DW) + piece
            dst = buf * QB + w * LD + piece
            copy16(smem, OFF_Q + dst, q, src, 16 if t >= 0 else 0)
            copy16(smem, OFF_DO + dst, do, src, 16 if t >= 0 else 0)

    @cuda.jit(**jit)
    def _attention_bwd_kernel_tc(q, k, v, do, lse, delta, row_ptr, q_indices, slots,
                                 row_offsets, cu_q, cu_k, scale, scale_log2, part_ptr,
                                 part_size, dk, dv, dk_part, dv_part, dq_part):
        """q, k, v, do: uint32 views [T, H, D/2]; dq_part float32 [K, Tq, Hq, D];
        ``scale_log2 = scale log2 e``."""
        smem = _v3_smem()
        # the two tiles' rows: query (or -1), slot, mask limit, LSE log2 e, D = rowsum(dO O)
        s_t = cuda.shared.array(R2, int32)
        s_slot = cuda.shared.array(R2, int32)
        s_lim = cuda.shared.array(R2, int32)
        s_l2 = cuda.shared.array(R2, float32)
        s_dl = cuda.shared.array(R2, float32)
        s_acc = cuda.local.array(S_REGS, float32)  # Sᵀ, then Pᵀ
        dp_acc = cuda.local.array(S_REGS, float32)  # dPᵀ, then dSᵀ
        p_frag = cuda.local.array(F_REGS, uint32)
        ds_frag = cuda.local.array(F_REGS, uint32)
        dk_acc = cuda.local.array(O_REGS, float32)
        dv_acc = cuda.local.array(O_REGS, float32)
        q_acc = cuda.local.array(8, float32)
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g4 = lane // 4
        t4 = lane % 4
        hkv = row_ptr.shape[0]
        r, row, part, nparts, b, j, lk, nk, e0, e1 = _bwd_part(
            row_ptr, part_ptr, row_offsets, cu_k, part_size, q_indices.shape[1], Bk)
        if e1 <= e0:
            return  # this CTA adds nothing
        key_base = cu_k[b] + j * Bk
        topk = dq_part.shape[0]
        q_lo = cu_q[b]
        q_hi = cu_q[b + 1]
        pos0 = lk - (q_hi - q_lo) - q_lo  # a query t of the sequence sits at key position pos0 + t
        key_pos0 = j * Bk

        # The K/V block (keys past the sequence: zeros).
        for e in range(tid, Bk * PIECES, NT):
            c = e // PIECES
            w = (e % PIECES) * 4
            ok = c < nk
            src = ((key_base + (c if ok else 0)) * hkv + r) * DW + w
            copy16(smem, c * LD + w, k, src, 16 if ok else 0)
            copy16(smem, OFF_V + c * LD + w, v, src, 16 if ok else 0)
        for i in range(O_REGS):
            dk_acc[i] = float32(0.0)
            dv_acc[i] = float32(0.0)
        # ldmatrix row addresses of this lane (matrix lane // 8, row lane % 8 of it):
        # A of K_w / V_w: (rows 0-7, 8-15) x (words 0-3, 4-7); B of Qᵀ / dOᵀ: (words 0-3, 4-7) x
        # (rows 0-7, 8-15), two n-tiles a load; B of dO, Q, K by .trans: (rows 0-7, 8-15) x
        # (words 0-3, 4-7); A of dS from dSᵀ by .trans: (keys 0-7, 8-15) x (words 0-3, 4-7).
        l_rows = ((lane >> 3) & 1) * 8 + (lane & 7)
        a_lane = (16 * warp + l_rows) * LD + (lane >> 4) * 4
        b_lane = ((lane >> 4) * 8 + (lane & 7)) * LD + ((lane >> 3) & 1) * 4
        t_lane = l_rows * LD + (lane >> 4) * 4
        ds_lane = OFF_DS + ((lane >> 4) * 8 + (lane & 7)) * LDS + ((lane >> 3) & 1) * 4
        key_top = 16 * warp + g4  # this lane's keys in the C layout of Sᵀ
        key_bot = key_top + 8

        stage(smem, s_t, s_slot, s_lim, s_l2, s_dl, q, do, lse, delta, q_indices, slots, r, e0,
              e1, 0, q_lo, q_hi, pos0, key_pos0, nk, topk, tid)
        commit()
        for c0 in range(e0, e1, P):
            cur = ((c0 - e0) // P) % 2
            wait_all()
            # (A) this tile's rows (and K/V) landed; the previous tile is done with the other
            # buffer, its table and sdSᵀ
            cuda.syncthreads()
            if c0 + P < e1:
                stage(smem, s_t, s_slot, s_lim, s_l2, s_dl, q, do, lse, delta, q_indices, slots,
                      r, c0 + P, e1, 1 - cur, q_lo, q_hi, pos0, key_pos0, nk, topk, tid)
            commit()
            qo = OFF_Q + cur * QB
            doo = OFF_DO + cur * QB
            row0 = cur * R  # this tile's rows in the tables

            # Sᵀ = K_w Qᵀ and dPᵀ = V_w dOᵀ (16 keys x R rows, fp32 registers).
            for i in range(S_REGS):
                s_acc[i] = float32(0.0)
                dp_acc[i] = float32(0.0)
            for ks in range(KS):
                a0, a1, a2, a3 = ldmatrix_x4(smem, a_lane + 8 * ks)
                c0_, c1_, c2_, c3_ = ldmatrix_x4(smem, OFF_V + a_lane + 8 * ks)
                for n2 in range(NS // 2):
                    n = 8 * n2
                    b0, b1, b2, b3 = ldmatrix_x4(smem, qo + b_lane + 16 * n2 * LD + 8 * ks)
                    mma_pair(s_acc, n, a0, a1, a2, a3, b0, b1, b2, b3)
                    b0, b1, b2, b3 = ldmatrix_x4(smem, doo + b_lane + 16 * n2 * LD + 8 * ks)
                    mma_pair(dp_acc, n, c0_, c1_, c2_, c3_, b0, b1, b2, b3)

            # Pᵀ and dSᵀ: lane element (key_top or key_bot, row 8 i + 2 t4 + e); a key past a
            # row's limit (its position, the block's end, no query) gives P = 0.
            for i in range(NS):
                for e in range(2):
                    w = 8 * i + 2 * t4 + e
                    lim = s_lim[row0 + w]
                    l2 = s_l2[row0 + w]
                    dl = s_dl[row0 + w]
                    p0 = float32(0.0)
                    p1 = float32(0.0)
                    if key_top <= lim:
                        p0 = exp2(cuda.fma(s_acc[4 * i + e], scale_log2, -l2))
                    if key_bot <= lim:
                        p1 = exp2(cuda.fma(s_acc[4 * i + 2 + e], scale_log2, -l2))
                    s_acc[4 * i + e] = p0
                    s_acc[4 * i + 2 + e] = p1
                    dp_acc[4 * i + e] = p0 * (dp_acc[4 * i + e] - dl)
                    dp_acc[4 * i + 2 + e] = p1 * (dp_acc[4 * i + 2 + e] - dl)
                p_frag[2 * i] = pack(s_acc[4 * i], s_acc[4 * i + 1])
                p_frag[2 * i + 1] = pack(s_acc[4 * i + 2], s_acc[4 * i + 3])
                ds_frag[2 * i] = pack(dp_acc[4 * i], dp_acc[4 * i + 1])
                ds_frag[2 * i + 1] = pack(dp_acc[4 * i + 2], dp_acc[4 * i + 3])
                # dSᵀ rows key_top / key_bot, the word of rows 8 i + 2 t4 and the next
                smem[OFF_DS + key_top * LDS + 4 * i + t4] = ds_frag[2 * i]
                smem[OFF_DS + key_bot * LDS + 4 * i + t4] = ds_frag[2 * i + 1]

            # dV_w += Pᵀ dO, dK_w += dSᵀ Q (B fragments of dO and Q by ldmatrix.trans).
            for kr in range(KR):
                for n2 in range(NO // 2):
                    n = 8 * n2
                    b0, b1, b2, b3 = ldmatrix_x4_trans(smem, doo + t_lane + 16 * kr * LD
                                                       + 8 * n2)
                    mma_pair(dv_acc, n, p_frag[4 * kr], p_frag[4 * kr + 1],
                             p_frag[4 * kr + 2], p_frag[4 * kr + 3], b0, b1, b2, b3)
                    b0, b1, b2, b3 = ldmatrix_x4_trans(smem, qo + t_lane + 16 * kr * LD
                                                       + 8 * n2)
                    mma_pair(dk_acc, n, ds_frag[4 * kr], ds_frag[4 * kr + 1],
                             ds_frag[4 * kr + 2], ds_frag[4 * kr + 3], b0, b1, b2, b3)
            cuda.syncthreads()  # (C) dSᵀ complete

            # dQ_tile = dS K: units (m-tile, n-tile pair) dealt to the warps, ROUNDS each; a unit
            # past the last computes unit 0 again and stores nothing.
            for rnd in range(ROUNDS):
                real, m, n2 = _deal(warp, rnd, NW, PAIRS, NO // 2)
                for i in range(8):
                    q_acc[i] = float32(0.0)
                for kb in range(KB):
                    a0, a1, a2, a3 = ldmatrix_x4_trans(smem, ds_lane + 16 * kb * LDS + 8 * m)
                    b0, b1, b2, b3 = ldmatrix_x4_trans(smem, t_lane + 16 * kb * LD + 8 * n2)
                    x0, x1, x2, x3 = mma(a0, a1, a2, a3, b0, b1, q_acc[0], q_acc[1], q_acc[2],
                                         q_acc[3])
                    q_acc[0] = x0
                    q_acc[1] = x1
                    q_acc[2] = x2
                    q_acc[3] = x3
                    x0, x1, x2, x3 = mma(a0, a1, a2, a3, b2, b3, q_acc[4], q_acc[5], q_acc[6],
                                         q_acc[7])
                    q_acc[4] = x0
                    q_acc[5] = x1
                    q_acc[6] = x2
                    q_acc[7] = x3
                if real:
                    dcol = 16 * n2 + 2 * t4
                    for half in range(2):  # rows 16 m + g4 and 16 m + g4 + 8
                        w = 16 * m + g4 + 8 * half
                        t = s_t[row0 + w]
                        if t >= 0:
                            s = s_slot[row0 + w]
                            h = r * G + w % G
                            dq_part[s, t, h, dcol] = q_acc[2 * half]
                            dq_part[s, t, h, dcol + 1] = q_acc[2 * half + 1]
                            dq_part[s, t, h, dcol + 8] = q_acc[4 + 2 * half]
                            dq_part[s, t, h, dcol + 9] = q_acc[5 + 2 * half]

        # dK = s dSᵀ Q, dV = Pᵀ dO of this part: lane element (key_top / key_bot, dim 8 i + 2 t4 + e)
        if nparts == 1:
            for i in range(NO):
                for e in range(2):
                    d = 8 * i + 2 * t4 + e
                    if key_top < nk:
                        dk[key_base + key_top, r, d] += dk_acc[4 * i + e] * scale
                        dv[key_base + key_top, r, d] += dv_acc[4 * i + e]
                    if key_bot < nk:
                        dk[key_base + key_bot, r, d] += dk_acc[4 * i + 2 + e] * scale
                        dv[key_base + key_bot, r, d] += dv_acc[4 * i + 2 + e]
        else:  # a hot row: this part's sums go to its scratch slot, added in part order
            slot = _split_slot(part_ptr, hkv, r, row) + part
            for i in range(NO):
                for e in range(2):
                    d = 8 * i + 2 * t4 + e
                    if key_top < nk:
                        dk_part[slot, key_top * D + d] = dk_acc[4 * i + e] * scale
                        dv_part[slot, key_top * D + d] = dv_acc[4 * i + e]
                    if key_bot < nk:
                        dk_part[slot, key_bot * D + d] = dk_acc[4 * i + 2 + e] * scale
                        dv_part[slot, key_bot * D + d] = dv_acc[4 * i + 2 + e]

    return _attention_bwd_kernel_tc


@functools.lru_cache(maxsize=None)
def _bwd_dq_sum_kernel(head_dim: int, group: int):
    """``dq[t, h, :] = scale * sum_s dq_part[s, t, h, :]`` over the slots ``s`` that are CSR
    entries (``csr._edge_row``: the slots the tensor-core kernel wrote), in slot order."""

    D, G = head_dim, group
    NL = (D + 31) // 32  # dims a lane sums: l, l + 32, ...

    @cuda.jit
    def _attention_bwd_kernel_dq_sum(I, cu_q, row_offsets, dq_part, scale, dq):
        """A warp per (t, h) row: each slot's validity once per lane (not per element), its
        D values read as whole 128-byte lines."""
        acc = cuda.local.array(NL, float32)
        i = cuda.grid(1)
        row = i // 32
        lane = i % 32
        hq = dq.shape[1]
        if row >= dq.shape[0] * hq:
            return
        t = row // hq
        h = row % hq
        for u in range(NL):
            acc[u] = float32(0.0)
        for s in range(dq_part.shape[0]):
            if _edge_row(I, cu_q, row_offsets, t, h // G, s) >= 0:
                for u in range(NL):
                    if lane + 32 * u < D:
                        acc[u] += dq_part[s, t, h, lane + 32 * u]
        for u in range(NL):
            if lane + 32 * u < D:
                dq[t, h, lane + 32 * u] = acc[u] * scale

    return _attention_bwd_kernel_dq_sum



def _bwd_tc_support(spec, block_size):
    """Why the tensor-core backward cannot run this problem (``None`` if it can), its tile
    rows and its shared memory bytes."""
    d, g, bk = spec.d, spec.g, block_size
    rows = max(1, _BWD_TC_ROWS // g) * g
    smem = _bwd_tc_layout(bk, d, rows)[-1]
    if spec.kind == "float32":
        return "float32 inputs (tensor cores take float16/bfloat16)", rows, smem
    if d % 16 or d > 128:
        return f"head dim D={d} (a multiple of 16, at most 128: dK, dV live in registers)", rows, smem
    if bk % 16 or bk > 128:
        return (f"block_size={bk} (a multiple of 16, at most 128: a warp per 16 keys, 8 warps of "
                f"~220 registers)"), rows, smem
    if rows % 16:
        return f"G={g} (tiles of whole 16-row mma fragments)", rows, smem
    if smem > _mma.DYNAMIC_SMEM_LIMIT:
        return f"{smem} bytes of shared memory", rows, smem
    return None, rows, smem


def default_backward_version(q, k, v, block_size) -> int:
    """The version ``sparse_attention_backward(version=None)`` runs for these inputs: 2 (tensor
    cores) where it applies (float16/bfloat16, D and Bk multiples of 16 up to 128), else 1."""
    why_not, _, _ = _bwd_tc_support(_Spec(q, k, v), check_positive_int("block_size", block_size))
    return 1 if why_not else 2


def _bwd_parts(ctx, k_parts, row_ptr, hkv, rows, part_size, entries):
    """Cut the CSR rows into parts of at most ``part_size`` entries, without a host read:
    ``(part_ptr, per_head, num_split)``. One scan gives both the parts' offsets per head (rows
    0 .. Hkv-1 of ``part_ptr``) and the scratch slots of the rows with more than one part (rows
    Hkv ..). The grid and the scratch are sized by bounds, for heads of at most ``entries``
    entries: a head has ``sum ceil(c / part_size) <= rows + entries // part_size`` parts (CTAs
    past its last part exit at once), and its split rows (``c > part_size`` each) fewer than
    ``2 * entries / part_size`` parts, and at most ``entries``."""
    from .csr import exclusive_prefix_sum

    nt = _BWD_THREADS
    parts = ctx.empty((2 * hkv, rows), np.int32)
    k_parts[-(-(hkv * rows) // nt), nt](row_ptr, part_size, ctx.arg(parts))
    part_ptr = exclusive_prefix_sum(parts, validate=False)
    per_head = rows + entries // part_size
    num_split = hkv * min(entries, 2 * (entries // part_size))
    return _kernel_array(part_ptr), per_head, num_split


def sparse_attention_backward(q, k, v, o, lse, do, block_indices, cu_seqlens_q, cu_seqlens_k,
                              block_size, scale=None, *, version=None, part_size=None,
                              max_partial_bytes=None, validate=True):
    """The gradient of eq 8 on the GPU: ``(dq, dk, dv)`` given ``dO`` (the main branch's backward).

    Same function as ``msa.reference.attention.sparse_attention_backward`` (read it for the
    math), with ``P`` rebuilt from the forward's LSE and ``D = rowsum(dO * O)``. ``dK, dV`` are
    KV-outer: a CTA per part of a k2q CSR row (``msa.cuda.csr.build_csr``), walking the part's
    queries in ascending order. A row has one part unless it holds more than ``part_size``
    queries (a hot row: a sink block every query picks); a hot row's parts write scratch slots
    that a second kernel adds in part order. No atomics: bitwise identical on reruns.

    Versions:

    1. CUDA cores, float32 throughout (any dtype): ``dQ`` Q-outer (a CTA per query and KV
       head), ``dK, dV`` accumulated in shared memory. The tested fallback; slow.
    2. tensor cores (float16/bfloat16, ``D`` and ``Bk`` multiples of 16 up to 128; the
       default where it applies): one kernel does all five products per tile of
       ``64/G`` queries x G heads with ``mma.sync`` (``_bwd_tc_kernel``), dK and dV in
       registers, and writes each (query, head, slot)'s ``dQ`` share to a float32 partial
       that a second kernel sums in slot order (as K2 sums the forward's). The partials take
       ``K*Tq*Hq*D*4`` bytes, so the queries go in chunks of at most ``max_partial_bytes``
       (default 4 GiB), each with its own CSR, adding to ``dk, dv`` in turn. P and dS are
       rounded to the inputs' 16-bit type before their products (FlashAttention's backward).

    Args:
        q: [Tq, Hq, D] float32, float16 or bfloat16 (torch); k, v: [Tk, Hkv, D], same dtype.
        o: the forward's output [Tq, Hq, D] (q's dtype); lse: its float32 [Tq, Hq];
            do: ``dL/dO`` [Tq, Hq, D] (q's dtype).
        block_indices, cu_seqlens_q, cu_seqlens_k, block_size, scale: as ``sparse_attention``.
        version: 1, 2 or ``None`` (2 where it applies, else 1).
        part_size: most CSR entries (queries) one dK/dV CTA takes (default ``2*K*Bk``, the
            forward's hot-row cut); a row with more is split, and its parts' sums are added in
            a fixed order (so a different ``part_size`` may change the last bits).
        max_partial_bytes: version 2's memory for one query chunk's dQ partials.
        validate: check ``block_indices`` on a host copy first; ``False`` skips it (invalid
            entries are then skipped by the kernels: memory safe, result unspecified).

    Returns:
        ``(dq [Tq, Hq, D], dk [Tk, Hkv, D], dv [Tk, Hkv, D])``, float32, in the caller's library.
        Keys no query sees get 0; a query with an empty support (``lse = -inf``) gets ``dq = 0``.

    Raises:
        TypeError/ValueError as ``sparse_attention``, plus ``o``, ``do`` or ``lse`` of the wrong
        shape or dtype, ``version=2`` where it does not apply, and ``Bk``, ``D``, ``G`` too
        large for version 1's shared memory (the paper's Bk = D = 128, G = 16 fit; so does
        D = 256 with Bk = 64, G <= 8).
    """
    from ..reference.blocks import block_row_offsets
    from .csr import build_csr

    spec = _Spec(q, k, v)
    tq, hq, d, tk, hkv = spec.tq, spec.hq, spec.d, spec.tk, spec.hkv
    for name, x in (("o", o), ("do", do)):
        check_array(name, x, ndim=3, shape=(tq, hq, d))
        if dtype_kind(x) != spec.kind:
            raise TypeError(f"{name} must have the dtype of q ({spec.kind}), got {dtype_kind(x)}")
    check_array("lse", lse, ndim=2, shape=(tq, hq))
    if dtype_kind(lse) != "float32":
        raise TypeError(f"lse must be float32 (sparse_attention's), got {dtype_kind(lse)}")
    block_size, scale, cu_q, cu_k, topk = _selection_args(spec, block_indices, cu_seqlens_q,
                                                          cu_seqlens_k, block_size, scale)
    part_size = check_positive_int("part_size", 2 * topk * block_size if part_size is None
                                   else part_size, high=INT32_MAX)
    max_partial_bytes = check_positive_int(
        "max_partial_bytes", MAX_PARTIAL_BYTES if max_partial_bytes is None
        else max_partial_bytes)
    why_not, tc_rows, tc_smem = _bwd_tc_support(spec, block_size)
    if version is None:
        version = 1 if why_not else 2
    if version not in BWD_VERSIONS:
        raise ValueError(f"version must be one of {BWD_VERSIONS} or None, got {version!r}")
    if version == 2 and why_not:
        raise ValueError(f"version=2 (tensor cores) does not support {why_not}; use version=1")
    if version == 1:
        smem = _bwd_dkdv_layout(block_size, d, spec.g)[-1]
        for kernel, need, limit in (("dK/dV", smem, _mma.DYNAMIC_SMEM_LIMIT),
                                    ("dQ", _bwd_dq_smem(block_size, d, spec.g),
                                     _mma.STATIC_SMEM_LIMIT)):
            if need > limit:
                raise ValueError(f"block_size={block_size} with head dim D={d} and G={spec.g}: "
                                 f"the {kernel} kernel needs {need} bytes of shared memory, "
                                 f"more than {limit}")
    if validate:
        from ..reference.select import check_block_indices

        check_block_indices(cu_to_host(block_indices), cu_q, cu_k, block_size)

    ctx = ArrayContext(q, k, v, o, lse, do, block_indices)
    dq = ctx.empty((tq, hq, d), np.float32)
    dk = ctx.empty((tk, hkv, d), np.float32, fill=0)
    dv = ctx.empty((tk, hkv, d), np.float32, fill=0)
    if tq == 0 or tk == 0:
        return ctx.output(dq), ctx.output(dk), ctx.output(dv)
    oa, doa = (_element_view(ctx, name, x, spec.bf16) for name, x in (("o", o), ("do", do)))
    lse_a = ctx.input("lse", lse)
    I = block_indices if ctx.lib in ("torch", "cupy") else ctx.input("block_indices",
                                                                      block_indices)
    delta = ctx.empty((tq, hq), np.float32)
    dq_a, dk_a, dv_a, delta_a = (ctx.arg(x) for x in (dq, dk, dv, delta))
    k_delta, k_dq, k_dkdv, k_sum, k_parts = _bwd_kernels(block_size, d, spec.g, spec.bf16,
                                                         _BWD_THREADS)
    nt = _BWD_THREADS
    k_delta[-(-(tq * hq * 32) // nt), nt](oa, doa, delta_a)  # a warp per row
    if version == 1:
        qa, ka, va = (_element_view(ctx, name, x, spec.bf16)
                      for name, x in (("q", q), ("k", k), ("v", v)))
        d_cu_q, d_cu_k = (device_constant(x.astype(np.int32)) for x in (cu_q, cu_k))
        k_dq[tq * hkv, nt](qa, ka, va, doa, lse_a, delta_a, _kernel_array(I), d_cu_q, d_cu_k,
                           np.float32(scale), dq_a)
        row_ptr, q_indices, _ = build_csr(I, cu_q, cu_k, block_size, validate=False)
        row_offsets = block_row_offsets(cu_k, block_size)
        rows = int(row_offsets[-1])
        if rows == 0:
            return ctx.output(dq), ctx.output(dk), ctx.output(dv)
        d_row_ptr = _kernel_array(row_ptr)
        d_row_offsets = device_constant(row_offsets.astype(np.int32))
        part_ptr, per_head, num_split = _bwd_parts(ctx, k_parts, d_row_ptr, hkv, rows, part_size,
                                                   tq * topk)
        dk_part = ctx.arg(ctx.empty((max(num_split, 1), block_size * d), np.float32))
        dv_part = ctx.arg(ctx.empty((max(num_split, 1), block_size * d), np.float32))
        _launch_smem(k_dkdv, hkv * per_head, nt, smem, qa, ka, va, doa, lse_a, delta_a, d_row_ptr,
                    _kernel_array(q_indices), d_row_offsets, d_cu_q, d_cu_k, np.float32(scale),
                    part_ptr, part_size, dk_a, dv_a, dk_part, dv_part)
        k_sum[hkv * rows, nt](part_ptr, d_row_offsets, d_cu_k, dk_part, dv_part, dk_a, dv_a)
        return ctx.output(dq), ctx.output(dk), ctx.output(dv)

    # Version 2: query chunks whose dQ partials fit max_partial_bytes (as sparse_attention).
    qw, kw, vw, dow = (ctx.input(name, x).view(np.uint32)
                       for name, x in (("q", q), ("k", k), ("v", v), ("do", do)))
    aligned = all(is_aligned16(x) for x in (qw, kw, vw, dow))
    k_tc = _bwd_tc_kernel(block_size, d, spec.g, tc_rows, spec.bf16, aligned)
    k_dq_sum = _bwd_dq_sum_kernel(d, spec.g)
    q_chunk = max(1, min(tq, max_partial_bytes // (topk * hq * d * 4)))
    dq_buf = ctx.arg(ctx.empty((topk * q_chunk * hq * d,), np.float32))
    # Every chunk's offsets go to the device before the first launch (a host-to-device copy
    # inside the loop would wait for the previous chunk's kernels); no host read after that.
    chunks = []
    for t0, t1, k_lo, k_hi, cq, ck in query_chunks(cu_q, cu_k, q_chunk):
        row_offsets = block_row_offsets(ck, block_size)
        chunks.append((t0, t1, k_lo, k_hi, cq, ck, int(row_offsets[-1]),
                       *(device_constant(x.astype(np.int32)) for x in (row_offsets, cq, ck))))
    for t0, t1, k_lo, k_hi, cq, ck, rows, d_row_offsets, d_cu_q, d_cu_k in chunks:
        tc = t1 - t0
        I_c = I[t0:t1]
        dq_part = dq_buf[:topk * tc * hq * d].reshape(topk, tc, hq, d)
        if rows:
            row_ptr, q_indices, slots = build_csr(I_c, cq, ck, block_size, validate=False)
            d_row_ptr = _kernel_array(row_ptr)
            part_ptr, per_head, num_split = _bwd_parts(ctx, k_parts, d_row_ptr, hkv, rows,
                                                       part_size, tc * topk)
            dk_part = ctx.arg(ctx.empty((max(num_split, 1), block_size * d), np.float32))
            dv_part = ctx.arg(ctx.empty((max(num_split, 1), block_size * d), np.float32))
            dk_c, dv_c = dk_a[k_lo:k_hi], dv_a[k_lo:k_hi]
            _launch_smem(k_tc, hkv * per_head, 2 * block_size, tc_smem, qw[t0:t1],
                        kw[k_lo:k_hi], vw[k_lo:k_hi], dow[t0:t1], lse_a[t0:t1],
                        delta_a[t0:t1], d_row_ptr, _kernel_array(q_indices),
                        _kernel_array(slots), d_row_offsets, d_cu_q, d_cu_k,
                        np.float32(scale), np.float32(scale * _LOG2E), part_ptr, part_size,
                        dk_c, dv_c, dk_part, dv_part, dq_part)
            # rows of one part return at once
            k_sum[hkv * rows, nt](part_ptr, d_row_offsets, d_cu_k, dk_part, dv_part, dk_c, dv_c)
        # every (query, head) row of dq: the sum of the slots the kernel wrote (none: 0)
        k_dq_sum[-(-(tc * hq * 32) // nt), nt](_kernel_array(I_c), d_cu_q, d_row_offsets,
                                                dq_part, np.float32(scale), dq_a[t0:t1])
    return ctx.output(dq), ctx.output(dk), ctx.output(dv)
