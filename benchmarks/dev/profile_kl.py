"""GPU kernel times of one ``msa.cuda.kl.kl_loss_and_backward`` call beside one sparse attention
forward on the same selection (torch.profiler, CUDA).

    source .gpu/env.sh && python3 -m benchmarks.dev.profile_kl [N ...]

``bench_kl``'s problem (paper configuration, bf16, one causal sequence of N tokens, the local
block and 15 earlier blocks drawn uniformly, or ``--pattern`` one of ``bench_attention``'s; default
32K and 128K), the default kernels. Prints
the wall time of each call and the per-kernel CUDA time tables, which split the KL into its
passes (the student's LSE, the grad pass, ``dk_idx``, the CSR and schedule). With ``--ncu`` it
runs each call once and nothing else, for ``ncu --profile-from-start off``
(the calls are bracketed by ``cudaProfilerStart``/``Stop``). Public launchers only.
"""

from __future__ import annotations

import argparse


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sizes", nargs="*", type=int, default=[32768, 131072])
    p.add_argument("--ncu", action="store_true", help="one profiled call each, no tables")
    p.add_argument("--pattern", default="uniform",
                   help="the selection: uniform (bench_kl's), sink+local+random or skewed "
                        "(bench_attention's)")
    args = p.parse_args(argv)

    import torch

    from benchmarks.bench_attention import make_selection
    from benchmarks.bench_kl import BK, make_inputs, uniform_selection
    from benchmarks.common import kernel_table
    from msa.cuda.attention import sparse_attention
    from msa.cuda.kl import kl_loss_and_backward

    for n in args.sizes:
        x = make_inputs(n)
        I = uniform_selection(n) if args.pattern == "uniform" else make_selection(args.pattern, n)

        def attention():
            return sparse_attention(x["q"], x["k"], x["v"], I, x["cu"], x["cu"], BK,
                                    validate=False)

        _, lse = attention()
        lse = lse.float().contiguous()

        def kl():
            return kl_loss_and_backward(x["q"], x["k"], x["q_idx"], x["k_idx"], I, lse,
                                        x["cu"], x["cu"], BK, validate=False)

        for name, call in (("sparse_attention", attention), ("kl_loss_and_backward", kl)):
            if args.ncu:  # a warm-up (compiles), then the one profiled call
                call()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStart()
                call()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
                continue
            kernel_table(call, f"n={n} {args.pattern} {name}")


if __name__ == "__main__":
    main()
