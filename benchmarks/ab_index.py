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

VARIANTS = {  # name: (_TC_STEADY_COPY, _TC_FUSED_FMAX)
    "before (generic copy, compare + select)": (False, False),
    "steady copy": (True, False),
    "fmax": (False, True),
    "steady copy + fmax": (True, True),
}


def main(argv=None):
    from benchmarks import bench_attention as B
    from benchmarks.common import (rekey_kernel_factory, same_bits_as_first, time_rounds,
                                   write_out_json)
    from msa.cuda import index as ix
    from msa.cuda.select import select_blocks_fused

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill", action="store_true")
    args = ap.parse_args(argv)

    rekey_kernel_factory(ix, "_block_scores_kernel_tc2",
                         lambda: (ix._TC_STEADY_COPY, ix._TC_FUSED_FMAX))

    def use(name):
        ix._TC_STEADY_COPY, ix._TC_FUSED_FMAX = VARIANTS[name]

    n = args.n
    q_idx, k_idx = B.index_inputs(n)
    cu = B._offsets(n, argparse.Namespace(offsets="host"))
    flops = 2.0 * B.HKV * B.D_IDX * n * (n + 1) / 2  # every causal (query, key) product

    def select():
        return select_blocks_fused(q_idx, k_idx, cu, cu, B.TOPK, B.BK, version="heap3")

    out = {"n": n, "flops": flops, "select_ms": {}, "prefill_ms": {}}
    time_rounds(out["select_ms"], VARIANTS, use, select, rounds=args.rounds,
                label=f"select_blocks_fused {n}:", check=same_bits_as_first(select))
    if args.prefill:
        B.prefill_rounds(out, [next(iter(VARIANTS)), list(VARIANTS)[-1]], use, n, args.rounds)
    write_out_json("ab_index.json", out)


if __name__ == "__main__":
    main()
