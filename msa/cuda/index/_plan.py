"""Host planning of the index stage: the inputs validated once, the kernel chosen, the tiles cut.

``IndexPlan.of(...)`` is the one place where eq 6's inputs are checked (shapes, dtypes, the
packed batch, the scale, the pool, the kernel version); what it returns holds kernel-ready
views of ``q_idx`` / ``k_idx``, the validated ``msa._batch.Batch`` and the kernel choice, and
every launcher below takes it as it is.
"""

from __future__ import annotations

import copy
import math

import numpy as np

from ..._batch import Batch
from ..._checks import check_array, check_scale, check_version
from .._core.arrays import SIMULATOR, ArrayContext, device_offsets, float_kind
from .._core.memops import is_aligned16
from .._core.mma import STATIC_SMEM_LIMIT

VERSIONS = (1, 2, 3)
POOLS = ("max", "mean")
# Warps per CTA of the tensor-core kernels (16 (query, group) rows each, 32 in v3). The
# simulator runs every thread as a Python thread, so it uses the smallest tile; same kernels.
TC_WARPS = 2 if SIMULATOR else 8
FLUSH = 8  # blocks of M staged in shared memory per store (8 floats: one 32-byte sector)


def key_chunk(block_size: int) -> int:
    """Keys per shared-memory stage of the tensor-core kernels: 64, or the largest of 32/16/8
    dividing Bk."""
    for kc in (64, 32, 16, 8):
        if block_size % kc == 0:
            return kc
    raise ValueError(f"the tensor-core kernels need block_size % 8 == 0, got {block_size}")


def v2_static_smem(d_idx: int, block_size: int, warps: int) -> int:
    """Bytes of v2's static shared memory: one key chunk of padded rows and the four staged
    partial maxima of each of its ``16 * warps`` rows."""
    return 4 * (key_chunk(block_size) * (d_idx // 2 + 4) + 16 * warps * (4 * FLUSH + 4))


def v3_static_smem(d_idx: int, block_size: int, warps: int) -> int:
    """Bytes of v3's static shared memory: two key chunks of padded rows and the staged maxima
    of its ``32 * warps`` rows."""
    kc = key_chunk(block_size)
    return 4 * (2 * kc * (d_idx // 2 + 4) + 32 * warps * (FLUSH + 1))


class IndexPlan:
    """Eq 6's inputs, validated, and the kernel that computes them.

    Build it with ``IndexPlan.of(...)`` (which checks everything); the launchers
    ``launch_block_scores`` and ``launch_fused_topk`` take it and check nothing.

    Attributes:
        ctx: the callers' ``ArrayContext``. q_in, k_in: kernel-ready ``q_idx [Tq, Hkv, Didx]``
            and ``k_idx [Tk, Didx]``; q, k: what the kernel of ``version`` takes (for versions
            2 and 3 uint32 words of two 16-bit values: ``[Tq, Hkv, Didx/2]``, ``[Tk, Didx/2]``).
        batch: the validated ``msa._batch.Batch``; cu_q, cu_k: its int32 device offsets.
        tq, tk, hkv, d_idx, nb, block_size: sizes. kind: ``'bfloat16' | 'float16' |
            'float32' | 'float64'``. scale: the kernel's scale (float32, float64 for float64).
        out_dtype: M's dtype. mean: ``pool == "mean"``. version: the kernel (1, 2 or 3).
        warps: warps a CTA of the tensor-core kernels. tile_queries: queries a CTA of them.
    """

    __slots__ = ("ctx", "q_in", "k_in", "q", "k", "batch", "cu_q", "cu_k", "tq", "tk", "hkv",
                 "d_idx", "nb", "block_size", "kind", "scale", "out_dtype", "mean", "version",
                 "warps", "tile_queries", "_why_not")

    @classmethod
    def of(cls, q_idx, k_idx, cu_seqlens_q, cu_seqlens_k, block_size, scale=None, *,
           pool="max", version=None, bf16_bits=False, warps=None, batch=None) -> IndexPlan:
        """Check eq 6's inputs (errors name the argument) and choose the kernel.

        ``version``: 1, 2, 3 or None (the fastest that applies). ``bf16_bits``: int16/uint16
        inputs hold bf16 bit patterns (the simulator's stand-in). ``warps``: warps a CTA of
        the tensor-core kernels (default ``TC_WARPS``; tests run the GPU's 8 in the simulator).
        ``batch``: the ``msa._batch.Batch`` a caller already validated (then ``cu_seqlens_q``,
        ``cu_seqlens_k`` and ``block_size`` are not looked at again).
        """
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
        check_version("version", version, VERSIONS)
        check_array("q_idx", q_idx, ndim=3)
        check_array("k_idx", k_idx, ndim=2)
        kind = float_kind("q_idx", q_idx, bf16_bits=bf16_bits)
        k_kind = float_kind("k_idx", k_idx, bf16_bits=bf16_bits)
        if k_kind != kind:
            raise TypeError(f"k_idx must have the dtype of q_idx ({kind}), got {k_kind}")
        tq, hkv, d_idx = (int(s) for s in q_idx.shape)
        if hkv < 1 or d_idx < 1:
            raise ValueError(
                f"q_idx must have shape [Tq, Hkv >= 1, Didx >= 1], got {tuple(q_idx.shape)}")
        check_array("k_idx", k_idx, shape=(None, d_idx))
        tk = int(k_idx.shape[0])
        # offsets from any library, read on the host once
        if batch is None:
            batch = Batch.of(cu_seqlens_q, cu_seqlens_k, block_size, total_q=tq, total_k=tk)
        elif (batch.tq, batch.tk) != (tq, tk):
            raise ValueError(f"q_idx and k_idx must have the batch's Tq={batch.tq} and "
                             f"Tk={batch.tk} rows, got {tq} and {tk}")
        scale = check_scale("scale", scale, 1.0 / math.sqrt(d_idx))
        ctx = ArrayContext(q_idx=q_idx, k_idx=k_idx)
        p = cls()
        p.ctx, p.batch = ctx, batch
        p.q_in, p.k_in = ctx.input("q_idx", q_idx), ctx.input("k_idx", k_idx)
        p.tq, p.tk, p.hkv, p.d_idx = tq, tk, hkv, d_idx
        p.nb, p.block_size, p.kind = batch.nb, batch.block_size, kind
        wide = kind == "float64"
        p.scale = np.float64(scale) if wide else np.float32(scale)
        p.out_dtype = np.float64 if wide else np.float32
        p.mean = pool == "mean"
        p.warps = TC_WARPS if warps is None else warps
        p._why_not = {1: None, 2: p._why_not_v2(), 3: None}
        p._why_not[3] = p._why_not[2] or p._why_not_v3()
        p.cu_q, p.cu_k = device_offsets(batch)
        if version is None:  # the fastest that applies
            version = 3 if p._why_not[3] is None else 2 if p._why_not[2] is None else 1
        elif p._why_not[version]:
            raise ValueError(f"block_scores version {version} cannot run: {p._why_not[version]}")
        return p.with_version(version)

    def why_not(self, version: int) -> str | None:
        """Why kernel ``version`` cannot run on these inputs, or None when it can."""
        return self._why_not[version]

    def with_version(self, version: int) -> IndexPlan:
        """This plan with kernel ``version`` (one that ``why_not`` lets run)."""
        p = copy.copy(self)
        p.version = int(version)
        p.q, p.k = self.q_in, self.k_in
        if version >= 2:  # two 16-bit values per word
            p.q, p.k = self.q_in.view(np.uint32), self.k_in.view(np.uint32)
        rows = 16 * (2 if version == 3 else 1) * self.warps
        p.tile_queries = max(1, rows // self.hkv)
        return p

    def _why_not_v2(self):
        if self.kind not in ("bfloat16", "float16"):
            return f"it needs bfloat16 or float16 inputs, got {self.kind}"
        if self.d_idx % 16 or self.block_size % 8:
            return (f"it needs Didx % 16 == 0 and block_size % 8 == 0, got Didx={self.d_idx}, "
                    f"block_size={self.block_size}")
        if self.hkv > 16 * self.warps:
            return f"it needs Hkv <= {16 * self.warps}, got {self.hkv}"
        smem = v2_static_smem(self.d_idx, self.block_size, self.warps)
        if smem > STATIC_SMEM_LIMIT:
            return (f"{smem} bytes of static shared memory at Didx={self.d_idx}, "
                    f"block_size={self.block_size}, more than {STATIC_SMEM_LIMIT}")
        return None

    def _why_not_v3(self):
        # v3 copies 16-byte pieces of k_idx rows with cp.async and loads two n-tiles per
        # ldmatrix; its two key buffers and staged maxima are static shared memory
        if self.block_size % 16:
            return f"it needs block_size % 16 == 0, got {self.block_size}"
        if not is_aligned16(self.k_in):
            return "k_idx's data is not 16-byte aligned (cp.async copies 16-byte pieces)"
        smem = v3_static_smem(self.d_idx, self.block_size, self.warps)
        if smem > STATIC_SMEM_LIMIT:
            return (f"{smem} bytes of static shared memory at Didx={self.d_idx}, "
                    f"block_size={self.block_size}, more than {STATIC_SMEM_LIMIT}")
        return None


def tiles(batch: Batch, t0: int, t1: int, tile_queries: int) -> np.ndarray:
    """int32 [n, 3] rows ``(sequence, ta, tb)``: queries ``[t0, t1)`` cut into tiles of at most
    ``tile_queries`` that never cross a sequence, the tiles with the most blocks first."""
    cu_q = batch.cu_q
    lo = np.maximum(cu_q[:-1], t0)
    hi = np.minimum(cu_q[1:], t1)
    seqs = np.nonzero(hi > lo)[0]
    parts = []
    for s in seqs:
        starts = np.arange(lo[s], hi[s], tile_queries, dtype=np.int64)
        ends = np.minimum(starts + tile_queries, hi[s])
        parts.append(np.stack([np.full_like(starts, s), starts, ends], axis=1))
    if not parts:
        return np.zeros((0, 3), np.int32)
    tiles = np.concatenate(parts)
    shift = batch.lk - batch.lq - cu_q[:-1]  # [B] pos = t + shift
    last_block = (tiles[:, 2] - 1 + shift[tiles[:, 0]]) // batch.block_size
    order = np.argsort(-last_block, kind="stable")
    return np.ascontiguousarray(tiles[order].astype(np.int32))
