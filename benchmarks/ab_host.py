"""A/B in one process: ``sparse_attention``'s host side, uploads of the chunk offsets memoised
(``device_constant``) or fresh each call (``_device_copy``), offsets passed on the device or the
host; and ``msa_prefill`` the same two ways.

``python3 -m benchmarks.ab_host --out FILE [--sizes 131072] [--rounds 3]``: the paper
configuration (``bench_attention``'s problems, uniform selection, bf16), each configuration timed
in turn (median of ``--reps`` between CUDA events, as ``bench_attention``), ``--rounds`` times.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("NUMBA_CUDA_ARRAY_INTERFACE_SYNC", "0")

from benchmarks.bench_attention import (BK, D, D_IDX, HKV, HQ, TOPK, _qkv,  # noqa: E402
                                        make_selection, visible_tokens)
from benchmarks.common import cuda_time_ms, print_table, write_json  # noqa: E402

# name, memoised uploads, offsets on the host
CONFIGS = [
    ("fresh uploads, device offsets", False, False),
    ("memoised uploads, device offsets", True, False),
    ("fresh uploads, host offsets", False, True),
    ("memoised uploads, host offsets", True, True),
]


def main(argv=None):
    import torch

    from msa.cuda import attention as gpu

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--sizes", default="131072")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--prefill", action="store_true", help="also time msa_prefill")
    args = p.parse_args(argv)
    memoised = gpu.device_constant
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        q, k, v = _qkv(n)
        I = make_selection("uniform", n)
        flops = 4 * HQ * D * visible_tokens(I)
        cu_dev = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        cu_host = cu_dev.cpu().numpy()
        g = torch.Generator(device="cuda").manual_seed(1)
        q_idx = torch.randn((n, HKV, D_IDX), device="cuda", generator=g, dtype=torch.bfloat16)
        k_idx = torch.randn((n, D_IDX), device="cuda", generator=g, dtype=torch.bfloat16)
        cases = [("sparse", lambda cu: gpu.sparse_attention(q, k, v, I, cu, cu, BK,
                                                            validate=False))]
        if args.prefill:
            cases.append(("prefill", lambda cu: gpu.msa_prefill(q, k, v, q_idx, k_idx, cu, cu,
                                                                BK, TOPK)))
        for what, fn in cases:
            times = {c[0]: [] for c in CONFIGS}
            for _ in range(args.rounds):
                for name, memo, host in CONFIGS:
                    gpu.device_constant = memoised if memo else gpu._device_copy
                    cu = cu_host if host else cu_dev
                    times[name].append(cuda_time_ms(lambda: fn(cu), warmup=1, reps=args.reps))
            gpu.device_constant = memoised
            for name, *_ in CONFIGS:
                ms = min(times[name])
                rows.append(dict(case=f"{what} N={n // 1024}K uniform", impl=name, ms=ms,
                                 ms_rounds=times[name],
                                 TFLOPs=flops / ms / 1e9 if what == "sparse" else None))
            print_table(rows[-len(CONFIGS):], ["case", "impl", "ms", "TFLOPs", "ms_rounds"])
        del q, k, v, I, q_idx, k_idx
        torch.cuda.empty_cache()
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
