"""Host side of the CSR build: tile sizes, which count and scatter run, and their launches.

Nothing here checks its inputs: the public functions of ``msa.cuda.csr`` validated the batch
and the selection (shapes, ``K <= MAX_TOPK``, ``Tq*K < 2**31``), and ``Plan`` takes them as
they are. Each launch describes its arrays once (``_core.launch``: ``karg``, ``dev``) and calls
the compiled kernel directly: at 128K tokens the GPU work of each launch is tens of
microseconds, so Numba's per-launch Python would count.

Memory: the tile counts are int32 ``[ceil(Tq/TQ), Hkv, rows]``. ``TQ`` is the smallest ``C *
2**k`` (at most 8192) with ``TQ >= 8 * rows / K``, i.e. at least 8 edges per (tile, row) on
average, so the tile counts take about 1/16 of the bytes of ``q_indices`` + ``slots``. At N = 1M
keys, Bk = 128 (rows = 8192 per head), K = 16, Hkv = 4: TQ = 4096, 256 tiles, 32 MiB of tile
counts next to 512 MiB of output; at Hkv = 16, K = 64: TQ = 1024, 1024 tiles, 512 MiB next to
8 GiB. Scatter v3 adds two int64 scratch arrays, each the size of the output.
"""

from __future__ import annotations

import numpy as np

from .._core.arrays import SIMULATOR
from .._core.launch import THREADS, dev, grid_size, karg, launch, upload_ints
from .._core.scan import lookback_scan
from . import v1_rowwise, v2_tiled, v3_multisplit

MAX_TOPK = 1024  # one thread per slot of a chunk's query: a CTA holds at most 1024 threads

CHUNK_THREADS = 64 if SIMULATOR else 512  # count v2 CTA threads; scatter v2: C = min(32, this // K)
MAX_TILE = 8192  # most queries per tile (fewer, longer CTAs past it)
# Scatter v3 where the output (q_indices + slots) is at least this large, v2 below it (on an
# H200, v2 is as fast at 128K tokens, 64 MiB, and v3 2.4x faster at 1M, 512 MiB:
# benchmarks/bench_csr.py); v3 also needs at most 128 row groups, else v2 runs.
SPLIT_MIN_BYTES = 192 << 20
SPLIT_HEADROOM = 256 << 20  # left free after v3's scratch, else v2 runs
SPLIT_THREADS = 64 if SIMULATOR else 512  # threads per CTA of scatter v3 (a multiple of 32)


def chunk_queries(topk: int) -> int:
    """C: queries a scatter v2 CTA ranks at once (one thread per slot, at most 32 queries)."""
    return max(1, min(32, CHUNK_THREADS // topk))


def default_tile(rows: int, topk: int) -> int:
    """TQ: at least 8 edges per (tile, row) on average (see the module docstring)."""
    tile = chunk_queries(topk)
    while tile < MAX_TILE and tile * topk < 8 * rows:
        tile *= 2
    return tile


def shared_count_fits(rows: int, tq: int, tile: int) -> bool:
    """Whether count v2 (16-bit counts of every row in shared memory) takes tiles of ``tile``
    queries (else count v1 runs)."""
    return rows <= 2 * v2_tiled.HIST_WORDS and min(tile, tq) < 1 << 16


def split_fits(rows: int) -> bool:
    """Whether scatter v3 takes ``rows`` CSR rows a head (at most 128 groups of 128)."""
    return rows <= v3_multisplit.MAX_SPLIT_ROWS


def pick_scatter(version, rows: int, out_bytes: int, free_bytes, *,
                 min_bytes: int = SPLIT_MIN_BYTES) -> int:
    """The scatter that runs: ``version`` (1, 2 or 3; 3 becomes 2 where v3 does not fit), or
    for ``None`` 3 for outputs of at least ``min_bytes`` where v3 fits, else 2.

    v3's scratch is two int64 arrays as large as the output (``out_bytes``: ``q_indices`` and
    ``slots`` together), 1 GiB in all at N = 1M, Hkv = 4, K = 16. Where the device cannot
    allocate the output and that scratch (``free_bytes()``, called only then) with
    ``SPLIT_HEADROOM`` to spare, v2 runs, which needs no scratch.
    """
    if version is not None:
        return 2 if version == 3 and not split_fits(rows) else version
    if out_bytes < min_bytes or not split_fits(rows):
        return 2
    return 3 if 3 * out_bytes + SPLIT_HEADROOM <= free_bytes() else 2


class Plan:
    """Shapes and device metadata of one validated selection ``I [Tq, Hkv, K]`` of ``batch``."""

    def __init__(self, batch, block_indices, ctx):
        self.ctx = ctx
        self.I = dev(block_indices)
        self.tq = batch.tq
        self.hkv, self.topk = (int(x) for x in block_indices.shape[1:])
        self.rows = batch.rows
        self.width = self.tq * self.topk  # one head's q_indices
        self.edges = self.hkv * self.width
        self.d_cu_q = upload_ints(batch.cu_q)
        self.d_row_offsets = upload_ints(batch.row_offsets)

    def zeros(self, shape):
        # (ArrayContext's fill cannot launch on an empty Numba array)
        return self.ctx.empty(shape, np.int32, fill=0 if int(np.prod(shape)) else None)

    def tile_queries(self, tile=None) -> int:
        return tile or default_tile(self.rows, self.topk)

    def scatter_version(self, version=None) -> int:
        return pick_scatter(version, self.rows, 8 * self.edges, self.ctx.free_bytes)

    def count(self, tile, version=2):
        """Tile counts int32 [ceil(Tq/tile), Hkv, rows] (caller's array): count v2 where it
        fits, else v1 (global atomics into a zeroed array)."""
        ntiles = max(1, -(-self.tq // tile))
        shape = (ntiles, self.hkv, self.rows)
        if not (self.edges and self.rows):
            return self.zeros(shape)
        if version == 2 and shared_count_fits(self.rows, self.tq, tile):
            tile_counts = self.ctx.empty(shape, np.int32)
            launch(v2_tiled.count_kernel, (ntiles, self.hkv), CHUNK_THREADS, self.I,
                   self.d_cu_q, self.d_row_offsets, tile, karg(self.ctx, tile_counts))
            return tile_counts
        tile_counts = self.zeros(shape)
        launch(v1_rowwise.count_kernel, grid_size(self.tq * self.hkv), THREADS, self.I,
               self.d_cu_q, self.d_row_offsets, tile, karg(self.ctx, tile_counts))
        return tile_counts

    def scan(self, tile_counts, threads=None):
        """Scan v3 (one look-back launch): the tile counts become each tile's start inside its
        row (in place, the scatters' cursors); returns ``row_ptr`` int32 [Hkv, rows+1]."""
        row_ptr = self.ctx.empty((self.hkv, self.rows + 1), np.int32)
        lookback_scan(karg(self.ctx, tile_counts), karg(self.ctx, row_ptr), threads=threads)
        return row_ptr

    def scatter(self, row_ptr_arg, cursors, tile, version, split_threads=None):
        """``(q_indices, slots)`` int32 [Hkv, Tq*K] (caller's arrays) by scatter ``version``;
        ``cursors``: the scanned tile counts of tiles of ``tile`` queries (v2 advances them, v1
        does not read them)."""
        ctx = self.ctx
        q_indices = ctx.empty((self.hkv, self.width), np.int32)
        slots = ctx.empty((self.hkv, self.width), np.int32)
        if self.edges:
            dq, ds = karg(ctx, q_indices), karg(ctx, slots)
            if version == 1:
                self._scatter_rowwise(row_ptr_arg, dq, ds)
            elif version == 3:
                self._scatter_split(row_ptr_arg, karg(ctx, cursors), cursors.shape[0], tile,
                                    dq, ds, split_threads or SPLIT_THREADS)
            else:
                self._scatter_tiled(row_ptr_arg, karg(ctx, cursors), cursors.shape[0], tile,
                                    dq, ds)
        return q_indices, slots

    def _scatter_rowwise(self, row_ptr_arg, dq, ds):
        n = self.hkv * self.rows
        if n:
            launch(v1_rowwise.scatter_kernel, -(-n // THREADS), THREADS, self.I, self.d_cu_q,
                   self.d_row_offsets, row_ptr_arg, dq, ds)
        launch(v1_rowwise.fill_tail_kernel, grid_size(self.edges), THREADS, row_ptr_arg, dq,
               ds)

    def _scatter_tiled(self, row_ptr_arg, cursors_arg, ntiles, tile, dq, ds):
        chunk = chunk_queries(self.topk)
        table = 1
        while table < 2 * chunk * self.topk:
            table *= 2
        launch(v2_tiled.scatter_kernel, (ntiles, self.hkv), chunk * self.topk, self.I,
               self.d_cu_q, self.d_row_offsets, row_ptr_arg, cursors_arg, tile, chunk, table,
               dq, ds)

    def _scatter_split(self, row_ptr_arg, cursors_arg, ntiles, tile, dq, ds, threads):
        """Two launches over (tile, head) and one streaming launch; two int64 scratch arrays
        [Hkv, Tq*K]."""
        ctx = self.ctx
        grid = (ntiles, self.hkv)
        records = karg(ctx, ctx.empty((self.hkv, self.width), np.int64))
        launch(v3_multisplit.split_groups_kernel, grid, threads, self.I, self.d_cu_q,
               self.d_row_offsets, row_ptr_arg, cursors_arg, tile, records)
        packed = karg(ctx, ctx.empty((self.hkv, self.width), np.int64))
        launch(v3_multisplit.split_rows_kernel, grid, threads, row_ptr_arg, cursors_arg,
               records, packed)
        launch(v3_multisplit.unpack_kernel, (grid_size(self.width), self.hkv), THREADS,
               row_ptr_arg, packed, dq, ds)


def build(batch, block_indices, ctx, *, scatter_version=None, count_version=2, tile_queries=None,
          scan_threads=None, split_threads=None):
    """``(row_ptr, q_indices, slots)`` (``ctx`` arrays) of a validated selection: count, scan v3,
    scatter. The keywords are the tests' knobs (small tiles and CTAs exercise the multi-tile
    and multi-block paths that only large problems take by default)."""
    plan = Plan(batch, block_indices, ctx)
    version = plan.scatter_version(scatter_version)
    tile = plan.tile_queries(tile_queries)
    cursors = plan.count(tile, count_version)
    row_ptr = plan.scan(cursors, scan_threads)
    q_indices, slots = plan.scatter(karg(ctx, row_ptr), cursors, tile, version, split_threads)
    return row_ptr, q_indices, slots
