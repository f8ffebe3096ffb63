"""GPU kernel times of one ``msa.cuda.sparse_attention_backward`` call (torch.profiler, CUDA).

    source .gpu/env.sh && python3 -m benchmarks.dev.profile_backward [N ...]

Paper configuration (``bench_attention``'s Hq, Hkv, D, Bk, K), bf16, one causal sequence of N
tokens (default 32K and 128K) with the ``uniform`` selection; the default kernels. Prints the
wall time of one call and the per-kernel CUDA time table, which splits the backward into its
kernels (the tensor-core kernel, the dQ partials' sum, D, the CSR). Last run on an H200 before
the stage layout (426fbbf); public launchers only.
"""

from __future__ import annotations

import sys


def main(sizes):
    import torch

    from benchmarks.bench_attention import BK, _qkv, make_selection
    from benchmarks.common import kernel_table
    from msa.cuda.attention import sparse_attention, sparse_attention_backward

    for n in sizes:
        q, k, v = _qkv(n, seed=3)
        I = make_selection("uniform", n, seed=4)
        cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        o, lse = sparse_attention(q, k, v, I, cu, cu, BK, validate=False)
        do = torch.randn_like(q)

        def call():
            return sparse_attention_backward(q, k, v, o, lse, do, I, cu, cu, BK, validate=False)

        kernel_table(call, f"n={n}", rows=10, width=50)


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1:]] or [32768, 131072])
