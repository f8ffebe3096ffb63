"""Paper §4.1 and eq 7 on the GPU: the exp-free warp top-k with a forced local block.

``select_blocks`` is ``msa.reference.select.select_blocks`` on a GPU, equal to it bit for bit
(integers): per (query ``t``, group ``r``) row, the local block ``L = floor(pos_t / Bk)``, the
``K - 1`` best candidates ``b < L`` by ``(score, -b)`` (a higher score first, ties to the smaller
block id), ascending, ``-1`` padded. A candidate's score is read as given and neither ``-inf`` nor
NaN; the scores of blocks ``b >= L`` are never used (v3 may load some of them with the 128-bit
loads of its group of 4, never past the row's end). ``select_blocks_fused`` runs the index
branch end to end, ``block_scores`` then ``select_blocks``, without ever holding the whole
``M [Hkv, Tq, NB]``.

``select_blocks`` kernels (``version=``; every one tested against the reference). Times: H200,
fp32 ``M [4, 65536, NB]``, K = 16, against ``torch.topk``'s 7.51 ms (NB = 1024) and 28.95 ms
(NB = 8192):

===  =====================================  ==============  =================================
v    idea (file)                            default where   verdict
===  =====================================  ==============  =================================
1    one thread a row, a sorted array       nowhere (the    7.11 / 21.8 ms: one thread's
     kept by insertion (v1_sorted)          simple rung)    serial scan
2    paper §4.1: a warp a row, a (K-1)-     nowhere (the    8.91 / 28.2 ms (7% of HBM): each
     entry heap a lane, shuffle merge       paper's rung)   lane's chain of dependent loads
     (v2_warp_heap)                                         and compares, heap in local memory
3    a warp a row, one warp-wide sorted     everywhere      1.05 / 2.64 ms: 7.2x / 11.0x
     list, a shared threshold seeded by                     torch.topk (76% of the copy
     the lanes' bests, 128-bit loads                        bandwidth at NB = 8192)
     (v3_warp_list)
===  =====================================  ==============  =================================

``select_blocks_fused`` versions (``version=``): the index kernels of ``msa.cuda.index``
(``block_scores``' versions) with the top-k; times at 128K tokens, the paper's index:

===  ======================================================  ============  ====================
v    idea                                                    default       verdict
===  ======================================================  ============  ====================
1    the queries in chunks sized to a memory budget: the     fp32/fp64,    37.1 ms at 128K with
     chunk's block scores (``block_scores``' default)        and bf16/     the scores of index
     into one reused buffer, then ``select_blocks`` v3       fp16 where    ``tc2`` (M written
                                                             2, 3 do not   and read again)
2    one kernel: index v2 (tensor cores) with a top-k        bf16/fp16     102.3 ms
     epilogue: each block maximum straight into the row's    where 3 does
     (K-1)-entry heap (§4.1), owned by one thread; no M      not apply
3    the same on index v3 (cp.async, ldmatrix, two           bf16/fp16     23.9-24.4 ms; 1.57 s
     m-tiles a warp)                                         (the paper's  at 1M tokens
                                                             setting)
===  ======================================================  ============  ====================

Older names (benchmark results before the stage folders): ``select_blocks`` ``v1`` is 1,
``warp`` 2, ``warp3`` 3 (``warp2``, the warp-wide list without the seed, was dropped);
``select_blocks_fused`` ``chunked`` is 1, ``heap`` 2, ``heap3`` 3 (``heap2`` on index ``tc2``
and ``heap4`` on ``tc4`` were dropped). See docs/performance.md.
"""

from __future__ import annotations

import numpy as np

from ..._batch import Batch
from ..._checks import check_array, check_positive_int, check_version, unsupported
from .._core.arrays import POISON, ArrayContext, device_offsets, float_kind
from .._core.heap import MAX_TOPK, heap_capacity
from ..index import IndexPlan, launch_block_scores, launch_fused_topk
from . import v1_sorted, v2_warp_heap, v3_warp_list

__all__ = ["select_blocks", "select_blocks_fused", "launch_select_blocks", "check_topk",
           "VERSIONS", "DEFAULT_VERSION", "FUSED_VERSIONS", "MAX_TOPK", "FUSED_MEMORY_BUDGET"]

VERSIONS = (1, 2, 3)
DEFAULT_VERSION = 3
FUSED_VERSIONS = (1, 2, 3)
# Default memory for one chunk's block scores in select_blocks_fused version 1 (bytes).
FUSED_MEMORY_BUDGET = 4 << 30


def check_topk(topk, *, name: str = "topk", high: int | None = None) -> int:
    """msa.cuda's ``topk`` of a selection: ``[1, MAX_TOPK]`` (the kernels' heaps hold
    ``K - 1 <= 63`` entries a lane); the error for more says that the reference takes it.
    ``high``: the reference's own bound, checked first (a plain range error above it)."""
    topk = check_positive_int(name, topk, high=high)
    if topk > MAX_TOPK:
        raise unsupported(name, topk, "msa.cuda", f"{name} <= {MAX_TOPK}",
                          why="a lane's heap holds K - 1 entries")
    return topk


def launch_select_blocks(M, batch: Batch, t0: int, topk: int, out, *,
                         version: int = DEFAULT_VERSION) -> None:
    """The top-k of the rows of ``M [Hkv, c, NB]`` (a kernel argument: the block scores of
    queries ``t0 .. t0 + c - 1`` of ``batch``) into ``out [Tq, Hkv, K]`` (a kernel argument).
    Checks nothing."""
    if int(M.shape[0]) * int(M.shape[1]) == 0:
        return
    cu_q, cu_k = device_offsets(batch)
    wide = np.dtype(M.dtype) == np.float64
    args = (M, cu_q, cu_k, t0, topk, batch.block_size, out)
    if version == 1:
        v1_sorted.launch(*args, heap_capacity(topk), wide)
    elif version == 2:
        v2_warp_heap.launch(*args, heap_capacity(topk), wide)
    else:
        v3_warp_list.launch(*args, wide)


def select_blocks(block_scores, cu_seqlens_q, cu_seqlens_k, block_size: int, topk: int, *,
                  version=None):
    """Paper eq 7 (§3.2 final recipe) with a warp top-k (§4.1): forced local block + top-(K-1).

    Args:
        block_scores: M [Hkv, Tq, NB] float16/32/64, C-contiguous, on the GPU (CuPy, torch, Numba;
            NumPy under the simulator or with a copy each way), ``NB = ceil(max Lk / Bk)``.
        cu_seqlens_q, cu_seqlens_k: [B+1] int prefix sums, any library (``Lq <= Lk``;
            bottom-right alignment), read on the host once: NumPy arrays spare a
            device-to-host read.
        block_size: ``Bk`` >= 1.
        topk: ``K`` in ``[1, 64]``, blocks per row, the local block included.
        version: a kernel of ``VERSIONS`` (the table above; default ``DEFAULT_VERSION``).

    Returns:
        I [Tq, Hkv, K] int32 in the caller's library, equal to
        ``msa.reference.select.select_blocks``: row ``I[t, r]`` holds, ascending, the ``K - 1``
        best candidates ``b < L = floor(pos_t / Bk)`` by ``(score, -b)`` (scores compared as
        given; ``-inf`` and NaN are not candidates; ``+inf`` is a top score), then ``L``, then
        ``-1`` padding when there are fewer than ``K - 1`` candidates. Scores of blocks
        ``b >= L`` are never used.

    Raises:
        ValueError/TypeError before any launch: wrong rank or dtype, ``K`` outside ``[1, 64]``,
        ``block_size < 1``, bad ``cu_seqlens``, ``NB`` not ``ceil(max Lk / Bk)``, an array
        that is not contiguous.
    """
    version = check_version("version", version, VERSIONS) or DEFAULT_VERSION
    topk = check_topk(topk)
    check_array("block_scores", block_scores, ndim=3)
    float_kind("block_scores", block_scores, ("float16", "float32", "float64"))
    hkv, tq, nb = (int(s) for s in block_scores.shape)
    if hkv < 1:
        raise ValueError(
            f"block_scores must have Hkv >= 1 rows, got shape {tuple(block_scores.shape)}")
    batch = Batch.of(cu_seqlens_q, cu_seqlens_k, block_size, total_q=tq)
    if nb != batch.nb:
        raise ValueError(
            f"block_scores must have NB = ceil(max Lk / block_size) = {batch.nb} columns "
            f"(block_size={batch.block_size}), got shape {tuple(block_scores.shape)}")
    ctx = ArrayContext(block_scores=block_scores)
    M = ctx.input("block_scores", block_scores)
    out = ctx.empty((tq, hkv, topk), np.int32, fill=np.iinfo(np.int32).min if POISON else None)
    launch_select_blocks(M, batch, 0, topk, ctx.arg(out), version=version)
    return ctx.output(out)


def launch_select_blocks_fused(q_idx, k_idx, batch: Batch, topk: int, *, scale=None,
                               version=None):
    """``select_blocks_fused`` on a ``Batch`` a caller validated (``msa_prefill``): the offsets
    are not checked again; ``q_idx``, ``k_idx``, ``topk`` and the knobs are."""
    return _select_blocks_fused(q_idx, k_idx, None, None, None, topk, scale=scale,
                                version=version, batch=batch)


def _select_blocks_fused(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, block_size, topk, *,
                         scale=None, version=None, memory_budget=None, warps=None, batch=None):
    """``select_blocks_fused`` with the index plan's ``warps`` (tests)."""
    version = check_version("version", version, FUSED_VERSIONS)
    topk = check_topk(topk)
    memory_budget = check_positive_int(
        "memory_budget", FUSED_MEMORY_BUDGET if memory_budget is None else memory_budget)
    p = IndexPlan.of(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, block_size, scale, pool="max",
                     warps=warps, batch=batch)
    if version is None:  # the fused kernel of the index's default, else the chunks
        version = p.version if p.version >= 2 else 1
    elif version >= 2:  # index version n with the top-k epilogue
        why_not = p.why_not(version)
        if why_not:
            raise ValueError(f"select_blocks_fused version {version} cannot run: {why_not}")
        p = p.with_version(version)
    ctx = p.ctx
    out = ctx.empty((p.tq, p.hkv, topk), np.int32,
                    fill=np.iinfo(np.int32).min if POISON else None)
    if p.tq == 0:
        return ctx.output(out)
    out_arg = ctx.arg(out)
    if version >= 2:  # one kernel: index scores with a top-k epilogue
        launch_fused_topk(p, topk, out_arg)
        return ctx.output(out)
    per_query = p.hkv * max(p.nb, 1) * np.dtype(p.out_dtype).itemsize
    chunk = min(max(p.tile_queries, memory_budget // per_query), p.tq)
    buf = ctx.arg(ctx.empty((p.hkv * chunk * p.nb,), p.out_dtype))
    for t0 in range(0, p.tq, chunk):
        t1 = min(t0 + chunk, p.tq)
        M = buf[: p.hkv * (t1 - t0) * p.nb].reshape(p.hkv, t1 - t0, p.nb)
        launch_block_scores(p, M, t0, t1)
        launch_select_blocks(M, p.batch, t0, topk, out_arg)
    return ctx.output(out)


def select_blocks_fused(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, block_size: int, topk: int,
                        *, scale=None, version=None, memory_budget: int | None = None):
    """Paper §3.1-§4.1, eq 6-7: the index branch end to end, ``block_scores`` then ``select_blocks``.

    Equal to ``select_blocks(block_scores(q_idx, k_idx, ...), ..., block_size, topk)`` but never
    holds the whole ``M [Hkv, Tq, NB]`` (128 GiB at 1M tokens, Hkv=4, Bk=128).

    Args:
        q_idx: [Tq, Hkv, Didx] bf16 (torch), float16, float32 or float64 index queries.
        k_idx: [Tk, Didx], same dtype: the shared index key head.
        cu_seqlens_q, cu_seqlens_k: [B+1] int prefix sums (``Lq <= Lk``; bottom-right alignment),
            any library, read on the host once: NumPy arrays spare a device-to-host read.
        block_size: ``Bk`` >= 1. topk: ``K`` in ``[1, 64]``.
        scale: multiplies the dot products; default ``1 / sqrt(Didx)``.
        version: one of ``FUSED_VERSIONS`` (the table above); default 3 where index v3 applies
            (bf16/fp16, ``Didx % 16 == 0``, ``Bk % 16 == 0``, 16-byte aligned ``k_idx``, key
            chunks within 48 KB of static shared memory), else 2 where index v2 applies
            (``Bk % 8 == 0``), else 1. Versions 2 and 3 stream the KV blocks of a tile of
            queries through tensor cores and offer each block maximum to the row's heap; M is
            never written. Version 1 computes the queries in chunks whose block scores fit
            ``memory_budget`` bytes (default ``FUSED_MEMORY_BUDGET`` = 4 GiB, at least one
            tile) in one reused buffer: ``block_scores``' default kernel, then
            ``select_blocks``' default, chunk by chunk.
        memory_budget: bytes for one chunk of block scores (version 1 only).

    Returns:
        I [Tq, Hkv, K] int32 in the caller's library, as ``select_blocks``. Scores are computed
        as in ``block_scores`` (fp32 accumulation; tensor cores for bf16/fp16), so two blocks
        whose scores differ by less than that rounding may swap against a float64 reference;
        every version computes the same block scores, hence the same selection.
    """
    return _select_blocks_fused(q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, block_size, topk,
                                scale=scale, version=version, memory_budget=memory_budget)
