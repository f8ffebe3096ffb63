"""The decode merge, one warp a row against the wide merge, on a real step's candidate lists (GPU).

    source .gpu/env.sh && python3 -m benchmarks.dev.decode_merge [--cases 1:131072,8:131072]

For each ``B:N`` (paper configuration, Lq = 1): ``msa.cuda.decode.plan`` and one ``run`` fill
the index splits' candidate lists; then ``merge_kernel`` (one warp a row) and
``merge_kernel_wide`` (``wide_warps`` warps a row) each merge them into a fresh selection, timed
alone (10 launches captured in a CUDA graph, its replays timed with CUDA events, the median of
7), after checking that both give the same selection bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("NUMBA_CUDA_ARRAY_INTERFACE_SYNC", "0")


def main(argv=None):
    import torch

    from benchmarks.bench_decode import BK, TOPK, graph_of, make_case
    from benchmarks.common import cuda_time_ms
    from msa.cuda import decode as gpu
    from msa.cuda.decode import v2_split_index as v2i
    from msa.cuda._core.streams import stream_handle
    from msa.cuda.decode._plan import Kernel, arg

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="1:131072,1:1048576,8:131072,32:65536")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"),
                                                  "decode_merge.json"))
    args = ap.parse_args(argv)
    rows = []
    for case in args.cases.split(","):
        b, n = (int(x) for x in case.split(":"))
        _, step = make_case(b, n, 1)
        plan = gpu.plan(*step, BK, TOPK)
        gpu.run(plan, *step)
        cand_s, cand_i = plan.workspace["cand_s"], plan.workspace["cand_i"]
        splits = int(cand_s.shape[0])
        w = max(2, v2i.wide_warps(splits, TOPK))
        lens = step[6]
        capacity = int(step[5].shape[1]) * BK
        n_rows = int(plan.block_indices.shape[0]) * int(plan.block_indices.shape[1])
        wm = v2i.merge_warps(TOPK)
        one = (v2i.merge_kernel(BK, TOPK), -(-n_rows // wm), 32 * wm)
        wide = (v2i.merge_kernel_wide(BK, TOPK, w), n_rows, 32 * w)
        outs, times = [], []
        for kernel, grid, block in (one, wide):
            out = torch.full_like(plan.block_indices, -7)
            k = Kernel(kernel, grid, block)
            kargs = (arg(cand_s), arg(cand_i), arg(lens), 1, capacity, arg(out))

            def ten(k=k, kargs=kargs):  # as run launches: on the current torch stream
                for _ in range(10):
                    k.launch(stream_handle(None, "torch"), *kargs)

            ten()
            torch.cuda.synchronize()
            outs.append(out.clone())
            graph = graph_of(ten)  # ten launches a replay, no host launch cost
            times.append(cuda_time_ms(graph.replay, warmup=1, reps=7) / 10)
        row = dict(B=b, N=n, splits=splits, wide_warps=w, equal=bool(torch.equal(*outs)),
                   one_warp_ms=times[0], wide_ms=times[1], speedup=times[0] / times[1])
        print(row, flush=True)
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
