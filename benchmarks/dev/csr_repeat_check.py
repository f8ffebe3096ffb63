"""What the CSR count's check for a repeated block id costs, by way of doing it (GPU only).

    source .gpu/env.sh && python3 -m benchmarks.dev.csr_repeat_check [--n 131072] [--reps 50]

With ``validate=False`` a query may name a block twice; count v2 (``msa.cuda.csr.v2_tiled``)
and the scatters then list it once, at its first slot, so that every slot of a row is written.
Count v2 as it is, with the repeat check done five ways, on ``bench_csr``'s uniform selection at
the paper configuration (Hkv 4, K 16, Bk 128): none (the kernel before the check), loads of the
row (``repeats_a_slot``: up to K - 1 a slot), ``match.any`` over the row's lanes on 64-bit and
on 32-bit ids, shuffles (``shfl.sync`` from each earlier slot's lane), and the kernels' own
``_core.packed.repeats_in_warp`` (a vote that the row is in ascending order, the 32-bit match
only where it is not). Each variant's tile
counts must equal the unchecked kernel's (the selection has no repeats); prints the median
milliseconds of a launch (CUDA events around ``--reps`` back-to-back launches) and writes JSON.
"""

from __future__ import annotations

import argparse
import os

from numba import cuda, int32, int64, uint32

from msa.cuda._core.packed import repeats_a_slot, repeats_in_warp
from msa.cuda.csr._tiles import next_edge, tile_block, tile_row, tile_sequence
from msa.cuda.csr.v2_tiled import HIST_WORDS

STRATEGIES = ("none", "loads", "match64", "match32", "shuffles", "shipped")


def count_kernel(strategy: str):
    """Count v2 with the repeat check ``strategy`` (a compile-time constant)."""
    mode = STRATEGIES.index(strategy)

    @cuda.jit
    def kernel(block_indices, cu_q, row_offsets, tile_queries, tile_counts):
        hist = cuda.shared.array(HIST_WORDS, uint32)
        tile = cuda.blockIdx.x
        h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        lane = cuda.laneid
        tq = block_indices.shape[0]
        topk = block_indices.shape[2]
        rows = tile_counts.shape[2]
        for w in range(tid, (rows + 1) // 2, nt):
            hist[w] = 0
        cuda.syncthreads()
        t_begin = int64(tile) * tile_queries
        nq = int32(max(min(int64(tq), t_begin + tile_queries) - t_begin, int64(0)))
        first, nblocks = tile_sequence(cu_q, row_offsets, t_begin, nq)
        dq = int32(tid // topk)
        s = int32(tid % topk)
        step_q = int32(nt // topk)
        step_s = int32(nt % topk)
        row = uint32(0xFFFFFFFF)
        if topk < 32:
            row = ((uint32(1) << uint32(topk)) - uint32(1)) << uint32(lane - s)
        x = tile_block(block_indices, t_begin, dq, s, nq, h)
        while dq < nq:
            t = t_begin + dq
            s_now = s
            dq, s = next_edge(dq, s, step_q, step_s, topk)
            x_next = tile_block(block_indices, t_begin, dq, s, nq, h)
            r = tile_row(x, t, first, nblocks, cu_q, row_offsets)
            repeated = False
            if mode == 1:
                repeated = r >= 0 and repeats_a_slot(block_indices, t, h, s_now, x)
            elif mode == 2:
                same = uint32(cuda.match_any_sync(int32(row), int64(x)))
                repeated = (same & cuda.lanemask_lt()) != uint32(0)
            elif mode == 3:
                same = uint32(cuda.match_any_sync(int32(row), int32(x)))
                repeated = (same & cuda.lanemask_lt()) != uint32(0)
            elif mode == 5:
                repeated = repeats_in_warp(x, s_now, topk, False)
            elif mode == 4:
                for d in range(1, topk):
                    src = lane - d if d <= s_now else lane
                    y = cuda.shfl_sync(int32(row), int32(x), src)
                    if d <= s_now and y == int32(x):
                        repeated = True
            if r >= 0 and not repeated:
                cuda.atomic.add(hist, r >> 1, uint32(1) << uint32((r & 1) * 16))
            x = x_next
        cuda.syncthreads()
        out = tile_counts[tile, h]
        for r in range(tid, rows, nt):
            out[r] = int32((hist[r >> 1] >> uint32((r & 1) * 16)) & uint32(0xFFFF))

    return kernel


def main(argv=None):
    import numpy as np
    import torch

    from benchmarks.bench_csr import selection
    from benchmarks.common import write_json
    from msa.cuda import csr
    from msa.cuda._core.launch import karg, launch
    from msa.cuda.csr import _plan

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"),
                                                  "csr_repeat_check.json"))
    args = ap.parse_args(argv)
    n, hkv, topk, bk = args.n, 4, 16, 128
    I = selection(n, hkv, topk, bk, hot=0, seed=n)
    cu = np.array([0, n], np.int32)
    batch, ctx, dI = csr._selection(I, cu, cu, bk, False)
    plan = _plan.Plan(batch, dI, ctx)
    tile = plan.tile_queries()
    ntiles = -(-n // tile)
    out = {}
    want = None
    for strategy in STRATEGIES:
        kernel = count_kernel(strategy)
        counts = torch.empty((ntiles, hkv, plan.rows), dtype=torch.int32, device="cuda")

        def run():
            launch(kernel, (ntiles, hkv), _plan.CHUNK_THREADS, plan.I, plan.d_cu_q,
                   plan.d_row_offsets, tile, karg(ctx, counts))

        run()
        torch.cuda.synchronize()
        if want is None:
            want = counts.clone()
        equal = bool(torch.equal(counts, want))
        times = []
        for _ in range(5):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            for _ in range(args.reps):
                run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / args.reps)
        out[strategy] = dict(ms=float(np.median(times)), equal=equal)
        print(f"{strategy:>9}: {out[strategy]['ms']:.4f} ms a launch, counts equal: {equal}")
    write_json(args.out, [dict(strategy=k, **v) for k, v in out.items()], n=n, hkv=hkv,
               topk=topk, block_size=bk, tile_queries=tile, threads=_plan.CHUNK_THREADS)


if __name__ == "__main__":
    main()
