"""A/B of the fused index + top-k kernel's code-generation switches, in one process on the GPU.

    python3 -m benchmarks.ab_index [--n 131072] [--rounds 3] [--prefill]

Each variant sets ``msa.cuda.index``'s ``_TC_STEADY_COPY`` / ``_TC_FUSED_FMAX`` (the kernel
factory is re-run for it) and times ``select_blocks_fused`` (``heap3``, bf16, the benchmark's
Hkv = 4, Didx = 128, Bk = 128, K = 16, one causal sequence) with CUDA events, rounds
alternating; every variant's selection must equal the first one's bit for bit. ``--prefill``
also times ``msa_prefill`` with the first and the last variant. JSON to
``$OUT/ab_index.json`` (default ``/tmp``).
"""

from __future__ import annotations

import argparse
import json
import os

VARIANTS = {  # name: (_TC_STEADY_COPY, _TC_FUSED_FMAX)
    "before (generic copy, compare + select)": (False, False),
    "steady copy": (True, False),
    "fmax": (False, True),
    "steady copy + fmax": (True, True),
}


def main(argv=None):
    import torch

    from benchmarks import bench_attention as B
    from benchmarks.common import cuda_time_ms
    from msa.cuda import index as ix
    from msa.cuda.attention import msa_prefill
    from msa.cuda.select import select_blocks_fused

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill", action="store_true")
    args = ap.parse_args(argv)

    tc2 = ix._block_scores_kernel_tc2.__wrapped__
    cache = {}

    def factory(*a):
        key = (a, ix._TC_STEADY_COPY, ix._TC_FUSED_FMAX)
        if key not in cache:
            cache[key] = tc2(*a)
        return cache[key]

    ix._block_scores_kernel_tc2 = factory

    def use(name):
        ix._TC_STEADY_COPY, ix._TC_FUSED_FMAX = VARIANTS[name]

    n = args.n
    g = torch.Generator(device="cuda").manual_seed(2)
    q_idx = torch.randn((n, B.HKV, B.D_IDX), device="cuda", generator=g, dtype=torch.bfloat16)
    k_idx = torch.randn((n, B.D_IDX), device="cuda", generator=g, dtype=torch.bfloat16)
    cu = B._offsets(n, argparse.Namespace(offsets="host"))
    flops = 2.0 * B.HKV * B.D_IDX * n * (n + 1) / 2  # every causal (query, key) product
    out = {"n": n, "select_ms": {}, "prefill_ms": {}, "bitwise_equal": {}}
    ref = None
    for _ in range(args.rounds):
        for name in VARIANTS:
            use(name)
            sel = select_blocks_fused(q_idx, k_idx, cu, cu, B.TOPK, B.BK, version="heap3")
            if ref is None:
                ref = sel.clone()
            same = bool(torch.equal(sel, ref))
            out["bitwise_equal"][name] = out["bitwise_equal"].get(name, True) and same
            ms = cuda_time_ms(lambda: select_blocks_fused(q_idx, k_idx, cu, cu, B.TOPK, B.BK,
                                                          version="heap3"), warmup=1, reps=5)
            out["select_ms"].setdefault(name, []).append(ms)
            print(f"select_blocks_fused {n}: {name:42s} {ms:7.2f} ms "
                  f"{flops / ms / 1e9:6.1f} TFLOP/s bitwise={same}", flush=True)
    if args.prefill:
        q, k, v = B._qkv(n, seed=1)
        pair = [next(iter(VARIANTS)), list(VARIANTS)[-1]]
        for _ in range(args.rounds):
            for name in pair:
                use(name)
                ms = cuda_time_ms(lambda: msa_prefill(q, k, v, q_idx, k_idx, cu, cu, B.BK,
                                                      B.TOPK), warmup=1, reps=3)
                out["prefill_ms"].setdefault(name, []).append(ms)
                print(f"msa_prefill {n}: {name:42s} {ms:7.2f} ms", flush=True)
        ms = cuda_time_ms(lambda: B.dense_sdpa(q, k, v), warmup=1, reps=2)
        out["dense_sdpa_ms"] = ms
        print(f"dense SDPA {n}: {ms:.1f} ms", flush=True)
    out["commit"] = os.environ.get("MSA_COMMIT")
    path = os.path.join(os.environ.get("OUT", "/tmp"), "ab_index.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
