"""What storing K1's partials in fewer bits costs in accuracy (no GPU: the NumPy reference).

K1 writes one partial ``O_s [D]`` per (query, head, selected block) and K2 combines them by
their LSEs (eq 15-16). At 128K in the paper configuration the partials are 34 GB of bf16 written
and read back, about two thirds of the forward's HBM floor (docs/performance.md), so each byte
saved there is time saved. This script measures the price: it builds one problem with the paper's
head dim, block size and top-k (bf16-valued inputs), computes the float64 partials with
``msa.reference.attention_partials``, rounds them to each candidate storage format, combines
them (``msa.reference.combine_partials``, in float32) and compares the result with the float64
output. The bf16 output a user receives is listed too: it is the error the forward has anyway.

    python -m benchmarks.dev.partials_precision [--n 4096] [--out FILE]

Formats: float32, bf16 (today's default), fp16, fp8 e4m3 with one scale per partial row
(``max |O_s| / 448``; a partial is a convex combination of V rows, so the scale only spreads
its range over e4m3's), fp8 e5m2 with the same scale. Rounding uses torch's fp8 and bf16 casts
(round to nearest even).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import msa.reference as R
from msa.problems import make_problem


def rounded(x: np.ndarray, fmt: str) -> np.ndarray:
    """``x`` (float64) stored in ``fmt`` and read back as float32; fp8 with a per-row scale."""
    t = torch.from_numpy(x)
    if fmt == "float32":
        return t.float().numpy()
    if fmt in ("bfloat16", "float16"):
        return t.to(getattr(torch, fmt)).float().numpy()
    fp8, top = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}[fmt]
    scale = t.abs().amax(dim=-1, keepdim=True) / top  # [..., 1]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return ((t / scale).to(fp8).double() * scale).float().numpy()


def measure(n: int, seed: int = 0) -> dict:
    p = make_problem((n,), num_q_heads=16, num_kv_heads=2, head_dim=128, index_dim=32,
                     block_size=128, topk=16, dtype=np.float32, seed=seed)
    # bf16-valued inputs, computed in float64: the partials are exact up to float64
    q, k, v, q_idx, k_idx = (torch.from_numpy(a).bfloat16().double().numpy()
                             for a in (p.q, p.k, p.v, p.q_idx, p.k_idx))
    cq, ck, bk, topk = p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, p.topk
    I = R.select_blocks(R.block_scores(q_idx, k_idx, cq, ck, bk), cq, ck, bk, topk)
    row_ptr, q_indices, slots = R.build_csr(I, cq, ck, bk)
    work = R.build_schedule(row_ptr, ck, bk, 64)
    o_part, lse_part = R.attention_partials(q, k, v, work, q_indices, slots, cq, ck, bk, topk)
    exact, _ = R.combine_partials(o_part, lse_part)  # float64 [Tq, Hq, D]
    peak = float(np.abs(exact).max())
    lse32 = lse_part.astype(np.float32)

    def errors(o):
        d = np.abs(o.astype(np.float64) - exact)
        rel = d / np.maximum(np.abs(exact), 1e-3 * peak)
        return {"max_abs_over_max_ref": float(d.max() / peak),
                "mean_abs_over_mean_ref": float(d.mean() / np.abs(exact).mean()),
                "p99_rel": float(np.quantile(rel, 0.99))}

    rows = {"bf16 output (what the forward returns)": errors(rounded(exact, "bfloat16"))}
    for fmt in ("float32", "bfloat16", "float16", "e4m3", "e5m2"):
        o, _ = R.combine_partials(rounded(o_part, fmt), lse32, out_dtype=np.float32)
        rows[f"partials in {fmt}, combined in float32"] = errors(o)
        out = torch.from_numpy(o).bfloat16().double().numpy()
        rows[f"partials in {fmt}, bf16 output"] = errors(out)
    return {"n": n, "heads": "Hq 16, Hkv 2, D 128, Bk 128, k 16", "rows": rows}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=4096, help="sequence length (default 4096)")
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)
    t0 = time.time()
    res = measure(args.n)
    print(f"N = {res['n']}, {res['heads']} ({time.time() - t0:.0f} s)")
    print(f"{'':48s} {'max|d|/max|ref|':>16s} {'mean|d|/mean|ref|':>18s} {'p99 rel':>9s}")
    for name, e in res["rows"].items():
        print(f"{name:48s} {e['max_abs_over_max_ref']:16.2e} {e['mean_abs_over_mean_ref']:18.2e} "
              f"{e['p99_rel']:9.2e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
