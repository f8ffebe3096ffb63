"""A/B of K2 v2's load schedule, in one process on the GPU.

    python3 -m benchmarks.ab_k2 [--queries 16384] [--n 131072] [--rounds 3]

Variants: slots a lane loads before using them (``_V2_UNROLL`` vectors), whether the first
batch goes out with the LSE loads (``_V2_EARLY``), and the CTAs an SM the launch bounds ask
for (``_V2_MIN_CTAS``, i.e. the register cap). First K2 alone on ``--queries`` queries of
random bf16 partials (K = 16, Hq = 64, D = 128; every variant's output must equal the first
one's bit for bit), rounds alternating; then the first variant and the two fastest in
``sparse_attention`` (bitwise checked too) and ``msa_prefill`` at ``--n`` (the benchmark's
uniform selection), and dense SDPA once. JSON to ``$OUT/ab_k2.json`` (default ``/tmp``).
"""

from __future__ import annotations

import argparse

VARIANTS = {  # name: (unroll vectors, early, min CTAs an SM)
    "default u4 late 8": (4, False, 8),
    "u4 early 8": (4, True, 8),
    "u4 early 6": (4, True, 6),
    "u8 late 6": (8, False, 6),
    "u8 early 6": (8, True, 6),
    "u8 early 5": (8, True, 5),
    "u8 early 4": (8, True, 4),
}


def main(argv=None):
    import torch

    from benchmarks import bench_attention as B
    from benchmarks.common import (rekey_kernel_factory, same_bits_as_first, time_rounds,
                                   write_out_json)
    from msa.cuda import combine as C
    from msa.cuda.attention import sparse_attention

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queries", type=int, default=16384)
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)

    rekey_kernel_factory(C, "_combine_kernel_vec", lambda: C._V2_JIT.get("launch_bounds"))

    def use(name):
        u, e, m = VARIANTS[name]
        C._V2_UNROLL, C._V2_EARLY = u, e
        C._V2_JIT = {"launch_bounds": (32 * C._V2_WARPS, m)}

    out = {"k2_ms": {}, "attention_ms": {}, "prefill_ms": {}}
    k_slots, t, h, d = B.TOPK, args.queries, B.HQ, B.D
    g = torch.Generator(device="cuda").manual_seed(3)
    o_part = torch.randn((k_slots, t, h, d), device="cuda", generator=g, dtype=torch.bfloat16)
    lse = torch.randn((k_slots, t, h), device="cuda", generator=g, dtype=torch.float32) * 3
    out["k2_bytes"] = o_part.numel() * 2 + lse.numel() * 4 + t * h * d * 2

    def k2():
        return C.combine_partials(o_part, lse, "bfloat16", version=2)

    time_rounds(out["k2_ms"], VARIANTS, use, k2, rounds=args.rounds, label="K2",
                check=same_bits_as_first(k2), warmup=2, reps=9)
    o_part = lse = None  # free the partials before the end-to-end calls

    timed = [name for name in VARIANTS if name in out["k2_ms"]]
    fastest = sorted(timed, key=lambda name: min(out["k2_ms"][name]))[:2]
    pair = [timed[0]] + [name for name in fastest if name != timed[0]][:2]
    n = args.n
    q, k, v = B._qkv(n, seed=1)
    sel = B.make_selection("uniform", n)
    cu = B._offsets(n, argparse.Namespace(offsets="host"))

    def attention():
        return sparse_attention(q, k, v, sel, cu, cu, B.BK, validate=False)

    time_rounds(out["attention_ms"], pair, use, attention, rounds=args.rounds,
                label=f"sparse_attention {n}", check=same_bits_as_first(attention))
    q = k = v = None  # prefill_rounds makes its own (the same seed)
    B.prefill_rounds(out, pair, use, n, args.rounds)
    write_out_json("ab_k2.json", out)


if __name__ == "__main__":
    main()
