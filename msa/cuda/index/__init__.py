"""Paper §3.1, eq 6 on the GPU: causal block-pooled index scores ``M [Hkv, Tq, NB]``.

``block_scores`` is ``msa.reference.index.block_scores`` on a GPU: ``M[r, t, b]`` is the maximum
(or, with ``pool="mean"``, the mean) over the keys ``j`` of block ``b`` with ``j <= pos_t`` of
``scale * (q_idx[t, r] . k_idx[j])``, ``-inf`` where no key of the block is visible. Dot
products accumulate in float32 (float64 for float64 inputs); the scale multiplies the pooled
value, which for the max gives exactly the max of the scaled scores (``x -> x * scale`` is
monotone, also after rounding).

The kernels (``version=``; every one tested against the reference; the default is the
fastest that applies). Times: H200, 128K tokens, the paper's index (Hkv = 4, Didx = 128,
Bk = 128, bf16); "fused" is the kernel with the top-k epilogue (``select_blocks_fused``).

===  =================  =====================================  ================================
v    idea (file)        default where                          verdict
===  =================  =====================================  ================================
1    CUDA cores, one    float32/float64 inputs; bf16/fp16      the rung to read: every score
     thread a score     where no tensor-core rung applies      reads 2 Didx values from global
     (v1_cuda_cores)    (Didx % 16 != 0, Bk % 8 != 0)          memory (not timed at 128K)
2    tensor cores,      bf16/fp16 where v3 does not apply:     M 105.6 ms, fused 102.3 ms
     tiles of (query,   Bk % 16 != 0, k_idx not 16-byte        (84-88 TFLOP/s): chunks copied
     group) rows        aligned, v3's buffers over 48 KB       through registers, fragments
     (v2_tensor_cores)                                         word by word
3    v2 + cp.async      bf16/fp16, Didx % 16 == 0,             fused 23.9-24.4 ms (361-368
     double buffer,     Bk % 16 == 0, aligned k_idx (the       TFLOP/s), 1.57 s at 1M; M 30.2
     ldmatrix, two      paper's configuration)                 ms. Bit for bit v2's results
     m-tiles a warp
     (v3_pipelined)
===  =================  =====================================  ================================

Older names (benchmark results before the stage folders): ``v1`` is 1, ``tc`` is 2, ``tc3``
is 3; ``tc2`` (v2's double buffer and ldmatrix, one m-tile a warp) and ``tc4`` (v3 on
Hopper's wgmma) were dropped (docs/performance.md).

Tensor cores are reached through ``msa.cuda._core.mma`` (inline PTX ``mma.sync``; under the
simulator, or with ``MSA_MMA=twin``, its pure-Numba twin with the same per-lane contract);
``cp.async`` and ``ldmatrix`` through ``msa.cuda._core.memops`` (simulator twins alike).

For the select stage: ``IndexPlan.of`` validates the inputs once, ``launch_block_scores``
fills a caller's buffer with the scores of a range of queries and ``launch_fused_topk`` runs
a tensor-core rung with its top-k epilogue; both check nothing.

Sequence positions follow ``msa.reference.blocks``: query ``t`` of sequence ``s`` sits at key
position ``Lk - Lq + (t - cu_seqlens_q[s])`` and sees the keys ``0..pos`` of its sequence.
"""

from __future__ import annotations

import numpy as np

from .._core.arrays import POISON, device_constant
from .._core.heap import heap_capacity
from .._core.streams import stream
from . import v1_cuda_cores, v2_tensor_cores, v3_pipelined
from ._plan import POOLS, VERSIONS, IndexPlan, tiles

__all__ = ["block_scores", "IndexPlan", "launch_block_scores", "launch_fused_topk", "VERSIONS",
           "POOLS"]

_TC_KERNELS = {2: v2_tensor_cores.block_scores_kernel, 3: v3_pipelined.block_scores_kernel}


def launch_block_scores(plan: IndexPlan, M, t0: int, t1: int) -> None:
    """Fill ``M [Hkv, t1 - t0, NB]`` (a kernel argument, ``plan.out_dtype``) with the block
    scores of queries ``[t0, t1)`` by ``plan.version``'s kernel. Checks nothing."""
    if (t1 - t0) * plan.hkv * plan.nb == 0:
        return
    if plan.version == 1:
        v1_cuda_cores.launch(plan, M, t0, t1)
        return
    _launch_tc(plan, t0, t1, 0, M, 0, _dummy(plan, np.int32))


def launch_fused_topk(plan: IndexPlan, topk: int, out) -> None:
    """Eq 6-7 in one kernel: ``out [Tq, Hkv, K]`` int32 (a kernel argument) gets every query's
    selection, the local block forced and the ``K - 1`` best earlier blocks ascending, from
    ``plan.version``'s tensor-core kernel (2 or 3) with its top-k epilogue; M is never
    written. ``1 <= topk <= msa.cuda._core.heap.MAX_TOPK``, max pool. Checks nothing."""
    _launch_tc(plan, 0, plan.tq, heap_capacity(topk), _dummy(plan, np.float32), topk, out)


def _dummy(p, dtype):
    """A one-element stand-in for the output a tensor-core kernel variant does not write."""
    return p.ctx.arg(p.ctx.empty((1, 1, 1), dtype))


def _launch_tc(p, t0, t1, cap, M, topk, out):
    """A tensor-core kernel over the tiles of queries [t0, t1): M (cap = 0) or fused top-k."""
    tile_rows = tiles(p.batch, t0, t1, p.tile_queries)
    if tile_rows.shape[0] == 0:
        return
    kernel = _TC_KERNELS[p.version](p.d_idx, p.block_size, p.warps, p.kind == "bfloat16",
                                    p.mean, cap)
    kernel[tile_rows.shape[0], 32 * p.warps, stream()](p.q, p.k, p.cu_q, p.cu_k,
                                                      device_constant(tile_rows), t0, p.nb,
                                                      p.scale, M, topk, out)


def _block_scores(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, block_size, *, scale=None,
                  pool="max", version=None, bf16_bits=False, warps=None):
    """``block_scores`` with the plan's test knobs (bf16 bit patterns, warps a CTA)."""
    p = IndexPlan.of(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, block_size, scale, pool=pool,
                     version=version, bf16_bits=bf16_bits, warps=warps)
    out = p.ctx.empty((p.hkv, p.tq, p.nb), p.out_dtype, fill=np.nan if POISON else None)
    launch_block_scores(p, p.ctx.arg(out), 0, p.tq)
    return p.ctx.output(out)


def block_scores(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, block_size: int, *, scale=None,
                 pool="max", version=None):
    """Paper eq 6 (right): causal block pooling ``M[r, t, b] = max_{j in block b, j <= pos_t} S``.

    Args:
        q_idx: [Tq, Hkv, Didx] bf16 (torch), float16, float32 or float64 index queries,
            C-contiguous, on the GPU (CuPy, torch, Numba; NumPy under the simulator or with a
            copy each way).
        k_idx: [Tk, Didx], same dtype and library: the shared index key head.
        cu_seqlens_q, cu_seqlens_k: [B+1] int prefix sums, any library (``Lq <= Lk``;
            bottom-right alignment), read on the host once (validation and tile planning):
            NumPy arrays spare a device-to-host read.
        block_size: ``Bk`` >= 1; block ``b`` holds key positions ``[b*Bk, min((b+1)*Bk, Lk))``.
        scale: multiplies the dot products; default ``1 / sqrt(Didx)``.
        pool: ``"max"`` (the paper) or ``"mean"`` (mean over the visible keys of the block).
        version: a kernel of ``VERSIONS`` (the table above); default the fastest that applies
            (3 for bf16/fp16 with ``Didx % 16 == 0``, ``Bk % 16 == 0`` and 16-byte aligned
            ``k_idx`` data whose key chunks fit 48 KB of static shared memory; else 2 with
            ``Bk % 8 == 0``; else 1).

    Returns:
        M [Hkv, Tq, NB] float32 (float64 for float64 inputs) in the caller's library,
        ``NB = ceil(max Lk / Bk)``: ``-inf`` where no key of block ``b`` is visible to query
        ``t`` (blocks after its position, blocks past its sequence's end). Dot products
        accumulate in float32 (float64 for float64), on tensor cores for bf16/fp16.

    Raises:
        ValueError/TypeError before any launch: wrong rank, dtype or Didx, mixed dtypes or
        libraries, non-contiguous arrays, bad ``cu_seqlens``, ``block_size < 1``, a bad scale,
        a version that cannot run on these inputs.
    """
    return _block_scores(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, block_size, scale=scale,
                         pool=pool, version=version)
