"""Paper eq 8 and §4.2 on the GPU: KV-outer sparse attention (K1), combined by K2, its backward.

Same functions and arguments as ``msa.reference.attention`` (read its docstring for the
semantics), plus keyword-only knobs. ``attention_partials`` is K1; ``sparse_attention`` runs the
whole main branch in one call (CSR -> schedule -> K1 -> K2: ``msa.cuda.csr``, ``schedule``,
``combine``); ``msa_prefill`` adds the index branch in front (``msa.cuda.select``, Algorithm 1
lines 3-5); ``sparse_attention_backward`` is the main branch's gradient.

K1, one CTA per work item ``[kv_head, row, q_begin, q_count, batch, kv_block]``: load block
``kv_block`` of sequence ``batch``, KV head ``r``, into shared memory once; walk the item's CSR
entries in tiles of ``P = ceil(T/G)`` query positions x ``G`` heads (the paper's query
concatenation: ``T = 128`` rows = 8 positions x 16 heads at G = 16); per tile ``S = Q Kᵀ * scale``
under the token-level causal mask (key position <= query position: only the local block is
cut), the block-local softmax, ``O = P V``; write ``O_s`` and ``L_s`` into the slot the CSR
assigned. Items with ``q_count <= 0`` (the padding of a device-built schedule) do nothing. No
float atomics: every partial has its own slot, so reruns are bitwise identical.

K1 (``version=``; H200, paper configuration Bk = D = 128, G = 16, K = 16, bf16; one
16K-query chunk unless said otherwise):

===  ==========================================  ======================  ==========================
v    idea                                        default where           verdict
===  ==========================================  ======================  ==========================
1    CUDA cores, fp32 tiles in shared memory,    fp32 inputs; 16-bit     the tested fallback and
     a thread per score / row / output           ones with D or Bk not   the teaching rung; not
     (``v1_cuda_cores``)                         a multiple of 16        timed at this size
2    ``mma.sync`` on 16-row warp tiles, S and P  16-bit, D or Bk above   the sparse attention at
     through shared memory (``v2_mma``)          128 (v3 does not fit)   128K 216 ms against v3's
                                                                         51.8 (one run)
3    S, P, O in registers (FlashAttention-2),    16-bit, D, Bk <= 128,   K1 7.32 ms with 64-row
     ``ldmatrix`` + ``cp.async``, 64-row tiles,  GPUs without wgmma,     tiles (8.16 with 128); 3
     3 warp groups over one K/V block            and the simulator       groups 3-4% faster than 1;
     (``v3_registers``)                                                  4.6-5.0 ms after the
                                                                         16-byte stores
4    v3 on ``wgmma``: K and V read by the        compute capability 9.0  K1 3.9-4.2 ms; the sparse
     tensor cores from shared memory as 8 x 8    (H100, H200)            attention at 128K 41.4 ms,
     core matrices (``v4_wgmma``)                                        204 TFLOP/s; H100, the
                                                                         coalesced Q gather (O23):
                                                                         K1 3.14 ms at 32K, 39.4 ms
                                                                         at 128K, 2.40x fla-core
===  ==========================================  ======================  ==========================

v3 and v4 share their tile (``_tile``: the Q gather, the mask and the softmax in registers, the
``O_s`` / ``L_s`` stores); they differ in their mainloop (how ``S = Q Kᵀ`` and ``O = P V`` are
multiplied and how K and V sit in shared memory), and give bitwise the same results.

Backward (``sparse_attention_backward(version=)``, paper configuration, bf16):

===  ==========================================  ======================  ==========================
v    idea                                        default where           verdict
===  ==========================================  ======================  ==========================
1    CUDA cores, fp32: dQ Q-outer, dK/dV         fp32; 16-bit shapes v2  8K: 3218 ms, 0.36 TFLOP/s
     KV-outer per part of a CSR row              does not take
     (``v1_backward_cuda_cores``)
2    one tensor-core kernel per part: S, dP,     16-bit, D and Bk        H200 (1d9bdca): 128K 159.6
     dV, dK and the tile's dQ; dQ shares summed  multiples of 16 up to   ms, 132.5 TFLOP/s, 1.16x
     in slot order                               128, where v3 is not    fla-core, 8.42x dense
     (``v2_backward_tensor_cores``)                                      SDPA's backward
3    version 2's tile on ``wgmma``: each         cc 9.0, 16-bit, D a     H100 (O27, 1ca7558): 128K
     product's B read once a warpgroup; K, V,    multiple of 16 up to    123.2 ms, 171.7 TFLOP/s,
     Q, dO as core matrices                      128, Bk 64 or 128       1.54x fla-core (v2 145.9
     (``v3_backward_wgmma``)                                             ms, bitwise the same)
===  ==========================================  ======================  ==========================

All three share ``_backward_parts`` (``D = rowsum(dO O)``, the hot rows cut into parts, their sums
in part order), and v2 and v3 their tile (``_backward_tile``: the staging of a tile's Q and dO,
the masks, ``P`` and ``dS``, the non-finite K rules, the dK/dV stores) as K1 v3 and v4 share
``_tile``; the launcher is ``_backward``. The version numbers are those of older results;
at 426fbbf the kernels were ``_k1_kernel_simple``, ``_k1_kernel_mma``, ``_k1_kernel_reg`` (v3,
and v4 by its ``wgmma`` flag), ``_bwd_kernels`` and ``_bwd_tc_kernel`` in
``msa/cuda/attention.py``.

Memory: ``O_part`` is ``K*Tq*Hq*D`` values (fp32: 16 GiB at 32K tokens, 64 GiB at 128K in the
paper configuration). ``sparse_attention`` therefore processes the queries in chunks whose
partials fit ``max_partial_bytes`` (default ``default_partial_bytes()``: an eighth of the GPU's
memory, between 4 and 16 GiB): each chunk is a smaller problem of the same kind (its queries
against all the keys they can see, the ``Lq < Lk`` path, ``msa._batch.Batch.chunks``), with its
own CSR, schedule, K1 and K2 writing straight into its rows of the output. With bf16 inputs the
partials are bf16 by default (``partial_dtype``), which halves both that memory and the bytes
K1 writes and K2 reads (at 128K: 34 GB instead of 69 GB each way); the LSEs stay fp32. The
backward's dQ partials (versions 2 and 3, ``K*Tq*Hq*D`` values too, summed by ``dq_sum``) are
fp32 by default; ``sparse_attention_backward(..., partial_dtype="bfloat16")`` halves them the
same way (16% of the backward at 32K and 128K on an H100, for one more bf16 rounding of each
slot's share of dq: docs/performance.md).

K and V in pages: ``sparse_attention(..., block_table=...)`` takes them as the pages of a KV
cache, ``[P, Hkv, Bk, D]`` (docs/design.md §8), read where they lie. Every rung has the option
(its factory's ``paged``): viewed as ``[P*Hkv*Bk, 1, D]``, the Bk rows of head h in page p are
one run, like a packed block's, so K1 changes only where an item's block starts; the schedule
is the packed one, and ``_paged`` writes each item's page into its ``row`` column
(``_core.packed.item_reader``). Chunked prefill into the cache (``msa.cuda.decode``) runs on it.

Validation once: a public function checks shapes, dtypes, devices, G, D, the knobs and the
packed batch (``Batch.of``) before any launch, and with ``validate=True`` the selection or the
schedule on a host copy; nothing below re-checks. With ``validate=False`` the kernels still
never read or write out of bounds (work items, CSR entries and slots are range-checked in the
kernel, and bad ones are skipped), but the result of an invalid selection is then unspecified.
"""

from __future__ import annotations

import math

import numpy as np

from ..._batch import Batch
from ..._checks import (check_array, check_flag, check_positive_int, check_scale, check_topk,
                        cu_to_host)
from ...reference.attention import check_work
from ...reference.decode import check_cache
from ...reference.select import check_block_indices
from .._core.arrays import ArrayContext, device_offsets, fill, index_dtype
from .._core.launch import kernel_array
from ..combine import launch_combine
from ..csr import launch_build_csr
from ..schedule import launch_rows, launch_schedule
from ..select import check_topk as check_select_topk, launch_select_blocks_fused
from ._backward import default_backward_version, sparse_attention_backward
from ._paged import launch_pages
from ._plan import (MAX_PARTIAL_BYTES, VERSIONS, K1Plan, Spec, default_partial_bytes,
                    partials_are_bf16, query_chunk, selection_args)

__all__ = ["VERSIONS", "MAX_PARTIAL_BYTES", "attention_partials", "default_backward_version",
           "default_partial_bytes", "msa_prefill", "sparse_attention",
           "sparse_attention_backward"]


def attention_partials(q, k, v, work, q_indices, partial_slots, cu_seqlens_q, cu_seqlens_k,
                       block_size, topk, *, scale=None, version=None, tile_rows=None,
                       groups=None, validate=True):
    """Paper §4.2 K1: KV-outer partial attention, one partial per (query, block), on the GPU.

    .. math::  L_s = \\log \\sum_{j \\in J_s} e^{S_j}, \\qquad O_s = \\sum_{j \\in J_s} e^{S_j - L_s} V_j

    One CTA per work item (see the package docstring); equal to
    ``msa.reference.attention.attention_partials`` up to float32 rounding (and the 16-bit
    rounding of P in versions 2 to 4).

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
            compute capability 9.0 and 64-row tiles); ``None`` picks 4 when it applies, else
            3, 2 or 1.
        tile_rows: rows T of a query tile (``ceil(T/G)`` positions x G heads); 16, 32, 64 or
            128 for versions 2 and 3, 64 for version 4; default on a GPU 128 for version 2, 64
            for the others.
        groups: versions 3 and 4: independent groups of ``T/16`` warps per CTA that share one
            K/V block, each walking its own tiles (``None``: 3 on a GPU where a CTA stays at
            12 warps, else 1). Each group adds two Q buffers of shared memory; the outputs do
            not depend on it.
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
    return _attention_partials(q, k, v, work, q_indices, partial_slots, cu_seqlens_q,
                               cu_seqlens_k, block_size, topk, scale, version=version,
                               tile_rows=tile_rows, groups=groups, validate=validate)


def _attention_partials(q, k, v, work, q_indices, partial_slots, cu_seqlens_q, cu_seqlens_k,
                        block_size, topk, scale=None, *, version=None, tile_rows=None,
                        groups=None, validate=True, bf16_bits=False, o_parts=None,
                        assume_unaligned=False):
    """``attention_partials``, with the tests' knobs: ``bf16_bits`` (int16/uint16 inputs hold
    bf16 bit patterns), ``o_parts`` and ``assume_unaligned`` (``K1Plan``'s)."""
    spec = Spec(q, k, v, bf16_bits=bf16_bits)
    batch = Batch.of(cu_seqlens_q, cu_seqlens_k, block_size, total_q=spec.tq, total_k=spec.tk)
    topk = check_topk(topk, batch.nb, batch.block_size)  # before o_part [K, Tq, Hq, D] exists
    scale = check_scale("scale", scale, 1.0 / math.sqrt(spec.d))
    check_array("work", work, ndim=2, dtypes=("int",), shape=(None, 6))
    check_array("q_indices", q_indices, ndim=2, dtypes=("int",), shape=(spec.hkv, None))
    check_array("partial_slots", partial_slots, ndim=2, dtypes=("int",),
                shape=tuple(int(s) for s in q_indices.shape))
    for name, x in (("work", work), ("q_indices", q_indices), ("partial_slots", partial_slots)):
        index_dtype(name, x)
    plan = K1Plan(spec, batch.block_size, version, tile_rows, groups, o_parts=o_parts,
                  assume_unaligned=assume_unaligned)
    if check_flag("validate", validate):
        host_work = np.asarray(cu_to_host(work), dtype=np.int64)
        real = host_work[host_work[:, 3] > 0]  # [W', 6]: padding items (q_count <= 0) skipped
        check_work(real, cu_to_host(q_indices), cu_to_host(partial_slots), spec.hkv, topk,
                   batch.query_batch, batch.cu_k, batch.block_size)
    ctx = ArrayContext(q=q, k=k, v=v, work=work, q_indices=q_indices,
                       partial_slots=partial_slots)
    qa, ka, va = plan.inputs(ctx, q, k, v)
    o_part = ctx.empty((topk, spec.tq, spec.hq, spec.d), np.float32)
    lse_part = ctx.empty((topk, spec.tq, spec.hq), np.float32)
    o_arg, l_arg = ctx.arg(o_part), ctx.arg(lse_part)
    fill(o_arg, 0.0)
    fill(l_arg, -np.inf)
    plan.launch(qa, ka, va, ctx.input("work", work), ctx.input("q_indices", q_indices),
                ctx.input("partial_slots", partial_slots), *device_offsets(batch), scale, o_arg,
                l_arg)
    return ctx.output(o_part), ctx.output(lse_part)


class _Forward:
    """``sparse_attention`` on a validated problem: the knobs checked, then ``run`` launches
    (per query chunk: CSR, schedule, K1, K2) and checks nothing."""

    def __init__(self, spec, batch, topk, version, tile_rows, groups, chunk_size,
                 max_partial_bytes, partial_dtype, **knobs):
        self.plan = K1Plan(spec, batch.block_size, version, tile_rows, groups, **knobs)
        if chunk_size is None:
            chunk_size = 2 * topk * batch.block_size
        chunk_size = check_positive_int("chunk_size", chunk_size)
        # whole tiles of query positions
        self.chunk_size = -(-chunk_size // self.plan.positions) * self.plan.positions
        if max_partial_bytes is None:
            max_partial_bytes = default_partial_bytes()
        self.max_partial_bytes = check_positive_int("max_partial_bytes", max_partial_bytes)
        self.bf16_partials = partials_are_bf16(partial_dtype, spec)
        self.spec, self.batch, self.topk = spec, batch, topk

    def run(self, q, k, v, block_indices, scale, block_table=None):
        """``(o, lse)``; ``block_table`` (with paged ``k, v``): the pages of each sequence's
        blocks, int32 ``[B, max_pages]``."""
        spec, batch, topk, plan = self.spec, self.batch, self.topk, self.plan
        bf16_partials = self.bf16_partials
        ctx = ArrayContext(q=q, k=k, v=v, block_indices=block_indices, block_table=block_table)
        o = ctx.empty((spec.tq, spec.hq, spec.d), spec.kind)
        lse = ctx.empty((spec.tq, spec.hq), np.float32)
        if spec.tq == 0:
            return ctx.output(o), ctx.output(lse)
        qa, ka, va = plan.inputs(ctx, q, k, v)
        table = None if block_table is None else kernel_array(ctx.input("block_table",
                                                                        block_table))
        # The CSR and the schedule are allocated in the caller's library when it has a GPU one
        # (so that e.g. torch's allocator sees them); NumPy input goes to the device once.
        I = block_indices if ctx.lib in ("torch", "cupy") else ctx.input("block_indices",
                                                                          block_indices)
        o_arg, lse_arg = ctx.arg(o), ctx.arg(lse)
        q_chunk = query_chunk(spec, topk, 2 if bf16_partials else 4, self.max_partial_bytes)
        # One buffer for every chunk's partials, in the caller's library (so that e.g. torch's
        # allocator accounts for it).
        o_buf = ctx.arg(ctx.empty((topk * q_chunk * spec.hq * spec.d,),
                                  "bfloat16" if bf16_partials else np.float32))
        l_buf = ctx.arg(ctx.empty((topk * q_chunk * spec.hq,), np.float32))
        # Every chunk's offsets go to the device before the first launch: a host-to-device copy
        # inside the loop would wait for the previous chunk's kernels.
        chunks = [(t0, t1, k_lo, k_hi, sub, *device_offsets(sub))
                  for t0, t1, k_lo, k_hi, sub in batch.chunks(q_chunk)]
        for t0, t1, k_lo, k_hi, sub, d_cu_q, d_cu_k in chunks:
            if table is not None:  # the whole cache; the chunk's sequences' rows of the table
                k_lo, k_hi = 0, int(ka.shape[0])
                first = int(np.searchsorted(batch.cu_q, t0, side="right")) - 1  # its first
                rows = table[first:first + sub.num_seqs]  # as Batch.chunks finds them
            tc = t1 - t0
            # the chunk's k2q CSR and hot-row schedule on its validated batch; the work array is
            # padded (its -1 rows are skipped by K1): no host round trip
            row_ptr, q_indices, slots = launch_build_csr(sub, I[t0:t1], ctx)
            work, num_items = launch_schedule(sub, row_ptr, self.chunk_size, tc * topk, ctx)
            work = launch_rows(work, num_items)
            if table is not None:
                launch_pages(kernel_array(work), rows)  # each item's page into its row column
            o_part = o_buf[:topk * tc * spec.hq * spec.d].reshape(topk, tc, spec.hq, spec.d)
            lse_part = l_buf[:topk * tc * spec.hq].reshape(topk, tc, spec.hq)
            # Only L_s needs a value in unused slots: K2 never reads O_s where L_s = -inf.
            fill(lse_part, -np.inf)
            plan.launch(qa[t0:t1], ka[k_lo:k_hi], va[k_lo:k_hi], kernel_array(work),
                        kernel_array(q_indices), kernel_array(slots), d_cu_q, d_cu_k, scale,
                        o_part, lse_part, bf16_partials)
            launch_combine(o_part, lse_part, o_arg[t0:t1], lse_arg[t0:t1], head_dim=spec.d,
                           bf16_part=bf16_partials, bf16_out=spec.bf16)
        return ctx.output(o), ctx.output(lse)


def sparse_attention(q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, block_size, *,
                     scale=None, version=None, tile_rows=None, groups=None, chunk_size=None,
                     max_partial_bytes=None, partial_dtype=None, block_table=None,
                     validate=True):
    """Paper eq 8 on the GPU: attention over the causally visible keys of the selected blocks.

    .. math::  O_t^{(h)} = \\mathrm{softmax}\\big(Q_t^{(h)} K^{(r)}[\\mathcal{I}_t^{(r)}]^\\top s\\big)\\, V^{(r)}[\\mathcal{I}_t^{(r)}]

    The paper's KV-outer forward in one call, all on the device: ``msa.cuda.csr.build_csr``
    (k2q reverse index) -> ``msa.cuda.schedule.build_schedule`` (hot rows cut into chunks of at
    most ``chunk_size`` queries) -> K1 (``attention_partials``' kernel) -> K2
    (``msa.cuda.combine``). The queries are processed in chunks whose partials
    (``K*chunk*Hq*D`` values) fit ``max_partial_bytes``; each chunk writes its rows of ``o``
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
        block_table: K and V in the pages of a KV cache (docs/design.md §8), read where they
            lie, with no copy: ``k, v`` are then ``[P, Hkv, Bk, D]`` with ``Bk = block_size``,
            and ``block_table`` int ``[B, max_pages]`` holds the page of block ``j`` of
            sequence ``b`` at ``[b, j]``; ``cu_seqlens_k`` still gives each sequence's length
            (its keys fill pages ``block_table[b, :ceil(Lk/Bk)]``). The result equals the packed
            call on the gathered sequences, bit for bit. ``msa.cuda.decode.prefill_chunk``
            runs on it.
        validate: check ``block_indices`` on a host copy first
            (``msa.reference.select.check_block_indices``), and with ``block_table`` its page
            ids (``msa.reference.decode.check_cache``). ``False`` skips both; invalid entries
            are then skipped by the kernels (memory safe, result unspecified).

    Returns:
        ``(o [Tq, Hq, D] in q's dtype, lse float32 [Tq, Hq])`` in the caller's library; ``lse``
        in natural log over the support. A query whose support is empty gets ``o = 0``,
        ``lse = -inf``. Bitwise identical on reruns.

    Raises:
        TypeError/ValueError as ``attention_partials``, plus ``block_indices`` with a wrong shape
        or (with ``validate``) a bad entry.
    """
    return _sparse_attention(q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, block_size,
                             scale, version=version, tile_rows=tile_rows, groups=groups,
                             chunk_size=chunk_size, max_partial_bytes=max_partial_bytes,
                             partial_dtype=partial_dtype, block_table=block_table,
                             validate=validate)


def _sparse_attention(q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, block_size,
                      scale=None, *, version=None, tile_rows=None, groups=None, chunk_size=None,
                      max_partial_bytes=None, partial_dtype=None, block_table=None,
                      validate=True, bf16_bits=False, o_parts=None, assume_unaligned=False):
    """``sparse_attention``, with the tests' knobs of ``_attention_partials``."""
    validate = check_flag("validate", validate)
    spec = Spec(q, k, v, bf16_bits=bf16_bits, paged=block_table is not None)
    batch, scale, topk = selection_args(spec, block_indices, cu_seqlens_q, cu_seqlens_k,
                                        block_size, scale)
    if spec.paged:
        _check_pages(k, v, block_table, batch, validate)
    forward = _Forward(spec, batch, topk, version, tile_rows, groups, chunk_size,
                       max_partial_bytes, partial_dtype, o_parts=o_parts,
                       assume_unaligned=assume_unaligned)
    if validate:
        check_block_indices(cu_to_host(block_indices), batch.cu_q, batch.cu_k, batch.block_size)
    return forward.run(q, k, v, block_indices, scale, block_table)


def _check_pages(k_cache, v_cache, block_table, batch, validate):
    """The paged forward's cache (``block_table`` given): ``[P, Hkv, Bk, D]`` pages of
    ``Bk = block_size`` slots, one row of ``block_table`` a sequence, and (``validate``) every
    page a sequence's length uses in ``[0, P)``."""
    check_array("block_table", block_table, ndim=2, dtypes=("int",))
    index_dtype("block_table", block_table)
    if int(block_table.shape[0]) != batch.num_seqs:
        raise ValueError(f"block_table must have a row per sequence of cu_seqlens_k (B = "
                         f"{batch.num_seqs}), got shape {tuple(block_table.shape)}")
    most = int(block_table.shape[1]) * batch.block_size
    if batch.num_seqs and int(batch.lk.max()) > most:
        b = int(np.argmax(batch.lk))
        raise ValueError(f"cu_seqlens_k: sequence {b} has Lk = {int(batch.lk[b])} keys, more "
                         f"than block_table's max_pages * Bk = {most} slots")
    check_cache(k_cache, v_cache, None, block_table, batch.lk, block_size=batch.block_size,
                dtypes=None, values=validate)


def msa_prefill(q, k, v, q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, block_size, topk, *,
                scale=None, index_scale=None, version=None, tile_rows=None, groups=None, chunk_size=None,
                max_partial_bytes=None, partial_dtype=None, index_version=None):
    """Paper Algorithm 1 lines 3-5 on the GPU: index branch, top-k, sparse attention in one call.

    ``I = msa.cuda.select.select_blocks_fused(q_idx, k_idx, ..., block_size, topk)``
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
    spec = Spec(q, k, v)
    check_array("q_idx", q_idx, ndim=3, shape=(spec.tq, spec.hkv, None))
    check_array("k_idx", k_idx, ndim=2, shape=(spec.tk, int(q_idx.shape[2])))
    for name, x in (("q_idx", q_idx), ("k_idx", k_idx)):
        spec.same_kind(name, x)
    batch = Batch.of(cu_seqlens_q, cu_seqlens_k, block_size, total_q=spec.tq, total_k=spec.tk)
    topk = check_select_topk(topk)
    scale = check_scale("scale", scale, 1.0 / math.sqrt(spec.d))
    index_scale = check_scale("index_scale", index_scale, 1.0 / math.sqrt(int(q_idx.shape[2])))
    forward = _Forward(spec, batch, topk, version, tile_rows, groups, chunk_size,
                       max_partial_bytes, partial_dtype)
    block_indices = launch_select_blocks_fused(q_idx, k_idx, batch, topk, scale=index_scale,
                                               version=index_version)
    o, lse = forward.run(q, k, v, block_indices, scale)
    return o, lse, block_indices
