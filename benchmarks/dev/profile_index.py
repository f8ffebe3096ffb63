"""Two calls of the fused index + top-k (``select_blocks_fused``, default kernel) for a profiler.

    ncu --set full --kernel-name regex:^kernel --launch-count 1 python3 -m benchmarks.dev.profile_index 131072

One causal sequence of N tokens (default 131072), bf16, the benchmark's Hkv = 4, Didx = 128,
Bk = 128, K = 16 (``benchmarks.bench_attention``'s constants). Last run on an H200 before the
stage layout (426fbbf); public launchers only.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None):
    import torch

    from benchmarks import bench_attention as B
    from msa.cuda.select import select_blocks_fused

    n = int((argv if argv is not None else sys.argv[1:] or ["131072"])[0])
    q_idx, k_idx = B.index_inputs(n)
    cu = B._offsets(n, argparse.Namespace(offsets="host"))
    for _ in range(2):
        sel = select_blocks_fused(q_idx, k_idx, cu, cu, B.BK, B.TOPK)
    torch.cuda.synchronize()
    print("selected", tuple(sel.shape))


if __name__ == "__main__":
    main()
