"""Does the order of a request's pages in the pool cost the decode kernels bandwidth? (GPU)

    source .gpu/env.sh && python3 -m benchmarks.dev.decode_page_order [--cases 32:65536:1,8:131072:1]
    ncu --profile-from-start off -k regex:split_kernel -c 2 --set full \
        python3 -m benchmarks.dev.decode_page_order --cases 32:65536:1 --profile-one

``bench_decode`` stores each request's pages at random places in the pool, as a serving cache
does, while dense decode reads one contiguous cache; both decode index rungs read the index keys
at 78-84% of dense decode's rate whatever the bytes they keep in flight (docs/performance.md,
rung 4 under "Tried and dropped"). For each ``B:N:Lq``: the benchmark's cache, then the same
cache copied so that every request's pages lie in order and contiguously (block table
``arange``); ``plan`` + ``run`` on both (the outputs must be equal bit for bit), then each
kernel alone in a CUDA graph, median of ``--reps``. With ``--profile-one`` only one eager step
on the benchmark's cache runs, between ``cudaProfilerStart`` and ``Stop`` (for ``ncu``).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("NUMBA_CUDA_ARRAY_INTERFACE_SYNC", "0")


def main(argv=None):
    import torch

    from benchmarks.bench_decode import BK, TOPK, kernel_times, make_case
    from benchmarks.common import write_json
    from msa.cuda import decode as gpu

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="32:65536:1,8:131072:1")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--profile-one", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"),
                                                  "decode_page_order.json"))
    args = ap.parse_args(argv)
    rows = []
    for case in args.cases.split(","):
        b, n, lq = (int(x) for x in case.split(":"))
        _, step = make_case(b, n, lq)
        if args.profile_one:
            plan = gpu.plan(*step, BK, TOPK)
            gpu.run(plan, *step)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            gpu.run(plan, *step)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            return
        q, q_idx, k_cache, v_cache, k_idx_cache, table, lens = step
        order = table.flatten().long()
        in_order = (q, q_idx, k_cache[order].contiguous(), v_cache[order].contiguous(),
                    k_idx_cache[order].contiguous(),
                    torch.arange(order.numel(), device="cuda", dtype=torch.int32).view_as(table)
                    .contiguous(), lens)
        outs = []
        for name, s in (("random pages", step), ("pages in order", in_order)):
            plan = gpu.plan(*s, BK, TOPK)
            gpu.run(plan, *s)
            torch.cuda.synchronize()
            outs.append((plan.o.view(torch.int16).clone(), plan.block_indices.clone()))
            row = dict(case=case, cache=name, kernels_ms=kernel_times(plan, s, args.reps))
            print(row, flush=True)
            rows.append(row)
        same = all(torch.equal(x, y) for x, y in zip(*outs))
        rows[-1]["equal_to_random_pages"] = rows[-2]["equal_to_random_pages"] = same
        if not same:
            raise SystemExit(f"{case}: the outputs differ between the two page orders")
        del step, in_order, k_cache, v_cache, k_idx_cache
        torch.cuda.empty_cache()
    write_json(args.out, rows, cases=args.cases)


if __name__ == "__main__":
    main()
