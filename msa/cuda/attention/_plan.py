"""Host planning of the main branch on the GPU: shapes, K1's rung and tile, the query chunks.

``Spec`` checks ``q, k, v`` once (ranks, dtypes, D, G); ``K1Plan`` picks K1's version, tile and
warp groups for a problem and says why a version does not apply; ``partial_budget`` and
``query_chunk`` size the query chunks whose partials fit the memory budget. Nothing here
launches a kernel except ``K1Plan.launch`` (unchecked: the public entry checked everything).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from ..._batch import Batch
from ..._checks import (GQA_GROUP_SIZES, check_array, check_gqa, check_positive_int,
                        check_scale, check_version, unsupported)
from .._core import mma as _mma, wgmma as _wgmma
from .._core.arrays import SIMULATOR, float_kind, index_dtype, require_gpu
from .._core.launch import launch_smem
from .._core.memops import is_aligned16
from .._core.packed import LOG2E
from ..csr import MAX_TOPK
from . import _tile, v1_cuda_cores, v2_mma
from .v3_registers import k1_kernel_v3
from .v4_wgmma import k1_kernel_v4

DTYPE_KINDS = ("float32", "float16", "bfloat16")
VERSIONS = (1, 2, 3, 4)
MAX_HEAD_DIM = 256
# Budget for one query chunk's partials (bytes): the backward's default, and the least of the
# forward's (``default_partial_bytes``), which takes an eighth of the GPU's memory up to
# MAX_FORWARD_PARTIAL_BYTES: bigger chunks mean fewer K1/K2 launches and grid tails (H200,
# paper configuration at 128K: 42.0 ms with 16 GiB against 43.2-47.9 with 4 GiB).
MAX_PARTIAL_BYTES = 4 << 30
MAX_FORWARD_PARTIAL_BYTES = 16 << 30
# Tile rows T (query positions x G heads per tile): the paper's 128 on a GPU, except v3 and v4,
# whose 64-row tiles (4 warps, 104 KB of shared memory at D = Bk = 128, two CTAs per SM)
# measured 10% faster than 128 (H200, paper configuration: 7.32 vs 8.16 ms per 16K-query
# chunk; the outputs do not depend on T). The simulator runs every thread as a Python thread,
# so its tiles are as small as the kernels allow.
DEFAULT_TILE_ROWS = {1: 32 if SIMULATOR else 64, 2: 16 if SIMULATOR else 128,
                     3: 16 if SIMULATOR else 64, 4: 64}
# Warp groups per K1 v3/v4 CTA (``groups``): independent groups of tiles sharing one K/V block.
# 3 groups of 4 warps (64-row tiles; 170 KB, 168 registers: one CTA of 12 warps per SM) against
# one group (two CTAs of 4 warps per SM): K1 3-4% faster at 32K and 128K, the whole sparse
# attention at 128K 2-6% faster on the three selections (H200, paper configuration; at 32K one
# selection of three was 7% slower). The default applies where the CTA stays at 12 warps or
# fewer (so launch bounds leave 168 registers a thread) and fits shared memory; else 1 group.
# The simulator runs one group (its tests run more explicitly).
DEFAULT_GROUPS = 1 if SIMULATOR else 3
MAX_GROUP_WARPS = 12


class Spec:
    """Validated shapes of ``q [Tq, Hq, D]``, ``k, v [Tk, Hkv, D]`` and their dtype kind.

    ``bf16_bits``: int16/uint16 arrays hold bf16 bit patterns (the simulator's NumPy has no
    bf16); torch bf16 tensors are recognised by their dtype. ``paged``: k and v are the pages of
    a KV cache, ``[P, Hkv, Bk, D]`` (``tk`` is then None: the offsets give the keys)."""

    def __init__(self, q, k, v, *, bf16_bits: bool = False, paged: bool = False):
        check_array("q", q, ndim=3)
        check_array("k", k, ndim=4 if paged else 3)
        check_array("v", v, ndim=4 if paged else 3, shape=tuple(int(s) for s in k.shape))
        self.paged = paged
        self.kind = float_kind("q", q, DTYPE_KINDS, bf16_bits=bf16_bits)
        for name, x in (("k", k), ("v", v)):
            other = float_kind(name, x, DTYPE_KINDS, bf16_bits=bf16_bits)
            if other != self.kind:
                raise TypeError(f"{name} must have the dtype of q ({self.kind}), got {other}")
        self.bf16_bits = bf16_bits
        self.tq, self.hq, self.d = (int(s) for s in q.shape)
        self.tk, self.hkv = int(k.shape[0]), int(k.shape[1])
        if paged:  # the keys are the cache's pages: their number is cu_seqlens_k's
            self.tk = None
        if int(k.shape[-1]) != self.d:
            raise ValueError(f"k must have head dim D={self.d} (q's), got shape {tuple(k.shape)}")
        if self.d < 1:
            raise ValueError(f"q must have head dim D >= 1, got shape {tuple(q.shape)}")
        if self.d > MAX_HEAD_DIM:
            raise unsupported("q's head dim D", self.d, "msa.cuda", f"D <= {MAX_HEAD_DIM}")
        self.g = check_gqa(self.hq, self.hkv, allowed=GQA_GROUP_SIZES,
                           what="q's heads over k's, G = Hq/Hkv")
        self.bf16 = self.kind == "bfloat16"

    def same_kind(self, name, x):
        """Check that ``x`` (``o``, ``do``) has the inputs' dtype kind."""
        other = float_kind(name, x, DTYPE_KINDS, bf16_bits=self.bf16_bits)
        if other != self.kind:
            raise TypeError(f"{name} must have the dtype of q ({self.kind}), got {other}")


def selection_args(spec, block_indices, cu_seqlens_q, cu_seqlens_k, block_size, scale):
    """The checks ``sparse_attention`` and its backward share: ``(batch, scale, topk)``, the
    packed batch validated once (``Batch.of``), with ``block_indices`` an int ``[Tq, Hkv, K]``,
    ``1 <= K <= MAX_TOPK``."""
    batch = Batch.of(cu_seqlens_q, cu_seqlens_k, block_size, total_q=spec.tq, total_k=spec.tk)
    scale = check_scale("scale", scale, 1.0 / math.sqrt(spec.d))
    check_array("block_indices", block_indices, ndim=3, dtypes=("int",),
                shape=(spec.tq, spec.hkv, None))
    index_dtype("block_indices", block_indices)
    topk = int(block_indices.shape[2])
    if topk < 1:
        raise ValueError(f"block_indices must have K >= 1 slots, got shape "
                         f"{tuple(block_indices.shape)}")
    if topk > MAX_TOPK:
        raise unsupported("block_indices' K", topk, "msa.cuda", f"K <= {MAX_TOPK}",
                          why="the CSR scatter takes a thread per slot of a query")
    return batch, scale, topk


def element_view(ctx, name, x, bf16):
    """A kernel view of ``x`` with one element per value: bf16 as its 16-bit patterns."""
    arr = ctx.input(name, x)
    if bf16 and str(arr.dtype) not in ("uint16", "int16"):
        arr = arr.view(np.uint16)
    return arr


def _why_not(spec, block_size, tile_rows):
    """Why K1 versions 2, 3 and 4 cannot run this problem (None where they can)."""
    d, bk = spec.d, block_size
    why_not_v2 = None
    if spec.kind == "float32":
        why_not_v2 = "float32 inputs (tensor cores take float16/bfloat16)"
    elif d % 16:
        why_not_v2 = f"head dim D={d} (must be a multiple of 16)"
    elif bk % 16 or bk > v2_mma.MAX_BLOCK_SIZE:
        why_not_v2 = (f"block_size={bk} (must be a multiple of 16, at most "
                      f"{v2_mma.MAX_BLOCK_SIZE})")
    why_not_v3 = why_not_v2
    if why_not_v3 is None and d > _tile.MAX_HEAD_DIM:
        why_not_v3 = f"head dim D={d} (at most {_tile.MAX_HEAD_DIM}: O lives in registers)"
    elif why_not_v3 is None and bk > _tile.MAX_BLOCK_SIZE:
        why_not_v3 = f"block_size={bk} (at most {_tile.MAX_BLOCK_SIZE}: S lives in registers)"
    why_not_v4 = why_not_v3
    if why_not_v4 is None:
        why_not_v4 = _wgmma.why_not_available()
    if why_not_v4 is None and tile_rows not in (None, 64):
        why_not_v4 = f"tile_rows={tile_rows} (a warpgroup's wgmma tile is 64 rows)"
    return {2: why_not_v2, 3: why_not_v3, 4: why_not_v4}


class K1Plan:
    """Kernel version, tile shape, warp groups and shared memory of K1 for one problem.

    ``version=None`` takes 4 where it applies (16-bit inputs, D and Bk multiples of 16 up to
    128, 64-row tiles, compute capability 9.0), else 3, else 2 for the other tensor-core shapes
    (D or Bk above 128), else 1."""

    def __init__(self, spec: Spec, block_size: int, version, tile_rows, groups=None, *,
                 o_parts=None, assume_unaligned=False):
        """``o_parts`` (versions 3, 4: column parts of O, default ``_tile.o_parts(D)``) and
        ``assume_unaligned`` (plain loads and 4-byte stores, as for unaligned arrays) let the
        tests run the paths the paper configuration does not take at their small sizes."""
        d, g, bk = spec.d, spec.g, block_size
        why_not = _why_not(spec, bk, tile_rows)
        if version is None:  # (the simulator runs v4's wgmma twins when asked, not by default)
            version = next((v for v in ((3, 2) if SIMULATOR else (4, 3, 2))
                            if why_not[v] is None), 1)
        version = check_version("version", version, VERSIONS)
        if why_not.get(version):
            raise ValueError(f"version={version} (tensor cores) does not support "
                             f"{why_not[version]}; use version=1"
                             + ("" if why_not[2] else " or 2")
                             + ("" if why_not[3] or version != 4 else " or 3"))
        if tile_rows is None:
            tile_rows = DEFAULT_TILE_ROWS[version]
        tile_rows = check_positive_int("tile_rows", tile_rows, high=128)
        if version >= 2 and tile_rows not in (16, 32, 64, 128):
            raise ValueError(f"tile_rows must be 16, 32, 64 or 128 for version={version}, got "
                             f"{tile_rows}")
        positions = -(-tile_rows // g)  # ceil(T / G) query positions x G heads per tile
        rows = positions * g
        limit = _mma.DYNAMIC_SMEM_LIMIT
        if version < 3:
            if groups not in (None, 1):
                raise ValueError(f"groups must be None or 1 for version={version} (warp groups "
                                 f"are a version 3 and 4 option), got {groups!r}")
            groups = 1
        elif groups is None:
            groups = default_groups(rows, bk, d)
        else:
            # at most MAX_WARPS warps a CTA, and barrier ids 1..15 for the groups
            groups = check_positive_int("groups", groups,
                                        high=min(15, _mma.MAX_WARPS // (rows // 16)))
        if version == 1:
            while positions > 1 and v1_cuda_cores.layout(bk, d, positions * g)[3] > limit:
                positions //= 2
            smem = v1_cuda_cores.layout(bk, d, positions * g)[3]
        elif version == 2:
            smem = v2_mma.layout(bk, d, positions * g)[2]
        else:
            smem = _tile.layout(bk, d, rows, groups)[3]
        if smem > limit:
            raise unsupported(
                "block_size", bk, "msa.cuda", "sizes whose K/V tiles fit shared memory",
                why=f"K1 v{version} needs {smem} bytes of shared memory for head dim D={d}"
                + (f" and groups={groups}" if groups > 1 else "") +
                f", more than the {limit} it may use; a smaller block_size"
                + (" or fewer groups" if groups > 1 else "") + " fits")
        assert version != 4 or rows == 64
        self.version, self.positions, self.rows, self.smem = version, positions, rows, smem
        self.groups = groups
        self.block_size = bk
        self.spec = spec
        self.o_parts = _tile.o_parts(d) if o_parts is None else o_parts
        self.assume_unaligned = assume_unaligned

    def inputs(self, ctx, q, k, v):
        """Kernel views of q, k, v: uint32 word views for the tensor cores, element views for
        version 1. Paged k, v ``[P, Hkv, Bk, D]`` are viewed as ``[P*Hkv*Bk, 1, D]`` first: the
        rows of head h of page p are then one run of Bk rows (``_core.packed.item_reader``)."""
        if self.spec.paged:
            k, v = (x.reshape(-1, 1, x.shape[-1]) for x in (k, v))
        if self.version >= 2:  # [T, H, D/2]: two 16-bit values per load
            return [ctx.input(name, x).view(np.uint32)
                    for name, x in (("q", q), ("k", k), ("v", v))]
        return [element_view(ctx, name, x, self.spec.bf16)
                for name, x in (("q", q), ("k", k), ("v", v))]

    def launch(self, q, k, v, work, q_indices, slots, cu_q, cu_k, scale, o_part, lse_part,
               bf16_partials=False):
        """K1 over ``work.shape[0]`` items (padding items exit at once); checks nothing.

        ``q, k, v``: ``inputs``' views (a query chunk of them, the keys its queries see; paged:
        the whole cache, each work item's page in its ``row`` column, ``_paged.launch_pages``);
        ``work``, ``q_indices``, ``slots``: the chunk's schedule and k2q CSR (int32, on the
        device); ``cu_q``, ``cu_k``: its int32 device offsets; ``o_part``: float32
        ``[K, Tq, Hq, D]``, or its bf16 bits (uint16/int16) with ``bf16_partials``;
        ``lse_part`` float32 ``[K, Tq, Hq]``."""
        num_items = int(work.shape[0])
        if num_items == 0 or int(q.shape[0]) == 0:
            return
        spec = self.spec
        if self.version == 1:
            kernel = v1_cuda_cores.k1_kernel_v1(self.block_size, spec.d, spec.g, self.positions,
                                                v1_cuda_cores.THREADS, spec.bf16, bf16_partials,
                                                spec.paged)
            launch_smem(kernel, num_items, v1_cuda_cores.THREADS, self.smem, q, k, v, work,
                        q_indices, slots, cu_q, cu_k, np.float32(scale), o_part, lse_part)
            return
        if bf16_partials:
            o_part = o_part.view(np.uint32)  # [K, Tq, Hq, D/2]: two bf16 per word
        if self.version == 2:
            kernel = v2_mma.k1_kernel_v2(self.block_size, spec.d, spec.g, self.positions,
                                         spec.bf16, bf16_partials, spec.paged)
            launch_smem(kernel, num_items, 2 * self.rows, self.smem, q, k, v, work, q_indices,
                        slots, cu_q, cu_k, np.float32(scale * LOG2E), o_part, lse_part,
                        np.int32(self.block_size), np.int32(spec.d // 2))
            return
        o_part = o_part.reshape(o_part.size)  # versions 3 and 4 index it flat
        use_async, vector_stores = copy_options(q, k, v, o_part, bf16_partials,
                                                self.assume_unaligned)
        factory = k1_kernel_v4 if self.version == 4 else k1_kernel_v3
        kernel = factory(self.block_size, spec.d, spec.g, self.positions, spec.bf16,
                         bf16_partials, use_async, self.o_parts, self.groups, vector_stores,
                         spec.paged)
        launch_smem(kernel, num_items, 2 * self.rows * self.groups, self.smem, q, k, v, work,
                    q_indices, slots, cu_q, cu_k, np.float32(scale * LOG2E), o_part, lse_part)


def default_groups(rows, block_size, head_dim, preferred=DEFAULT_GROUPS) -> int:
    """Warp groups of a version 3/4 CTA by default: ``preferred`` where the CTA stays at
    ``MAX_GROUP_WARPS`` warps or fewer (launch bounds then leave 168 registers a thread) and
    fits shared memory, else 1."""
    if (rows // 16 * preferred > MAX_GROUP_WARPS
            or _tile.layout(block_size, head_dim, rows, preferred)[3] > _mma.DYNAMIC_SMEM_LIMIT):
        return 1
    return preferred


def copy_options(q, k, v, o_part, bf16_partials, assume_unaligned=False):
    """``(use_async, vector_stores)`` of a version 3/4 launch. ``cp.async`` needs 16-byte
    aligned rows: D % 16 == 0 keeps slices of aligned arrays aligned, and inputs that are not
    are copied by plain loads. 16-byte stores of bf16 partials need ``o_part`` 16-byte aligned
    too (rows of D/2 words, D % 16 == 0, keep every row aligned then; the kernel takes them
    only where a part of O has a multiple of 4 n-tiles); else 4-byte stores."""
    if assume_unaligned:
        return False, False
    return (all(is_aligned16(x) for x in (q, k, v)),
            bool(bf16_partials) and is_aligned16(o_part))


def default_partial_bytes() -> int:
    """``sparse_attention``'s default ``max_partial_bytes``: an eighth of the current GPU's
    memory, at least ``MAX_PARTIAL_BYTES`` (4 GiB) and at most ``MAX_FORWARD_PARTIAL_BYTES``
    (16 GiB); 4 GiB under the simulator."""
    if SIMULATOR:
        return MAX_PARTIAL_BYTES
    require_gpu()
    return _partial_bytes_on(cuda.get_current_device().id)


@functools.lru_cache(maxsize=None)
def _partial_bytes_on(device_id: int) -> int:
    total = int(cuda.current_context().get_memory_info()[1])
    return int(min(max(total // 8, MAX_PARTIAL_BYTES), MAX_FORWARD_PARTIAL_BYTES))


def partials_are_bf16(partial_dtype, spec) -> bool:
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


def query_chunk(spec, topk, bytes_per_value, max_partial_bytes) -> int:
    """Most queries of one chunk whose ``K*chunk*Hq*D`` partials fit ``max_partial_bytes``
    (at least one query, at most all of them)."""
    per_query = topk * spec.hq * spec.d * bytes_per_value
    return max(1, min(spec.tq, max_partial_bytes // per_query))
