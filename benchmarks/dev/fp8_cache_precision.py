"""What an fp8 (e4m3) decode cache would cost in accuracy (no GPU: the NumPy reference).

At 32 x 64K in the paper configuration the decode step's index kernel reads every cached index
key (537 MB, two thirds of the step; docs/performance.md), so index keys in fp8 would halve the
step's largest read. This script measures the price before any kernel is written: Lq decode
queries at the end of one long sequence (float32 values, bf16 queries, float64 arithmetic), their
top-k selection and their attention output, with the cache stored in

* bf16 (today's cache; the reference row),
* fp8 e4m3 index keys (a scale per token, ``max |k_idx| / 448``), index queries in bf16,
* fp8 e4m3 index queries and keys,
* fp8 e4m3 K and V (a scale per token and head) with bf16 index keys,

and compares each with float32 storage: how many of the selected blocks stay the same (recall
of the float32 top-k, the local block included; the share of (query, group) rows whose whole
selection is unchanged), and the output's error, over all rows and over the rows whose selection
is unchanged (the values' rounding alone). bf16 against float32 is the noise the cache has
today, so fp8 is judged by how far it moves beyond it.

    python -m benchmarks.dev.fp8_cache_precision [--n 32768] [--lq 64] [--out FILE]

Random Gaussian index queries and keys make block maxima close together, which is the hard case
for a selection; trained index keys separate the blocks more.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import msa.reference as R
from msa.problems import make_problem


def stored(x: np.ndarray, fmt: str) -> np.ndarray:
    """``x`` stored in ``fmt`` and read back as float64; fp8 with a scale per last-axis row."""
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64))
    if fmt in ("float32", "bfloat16"):
        return t.to(getattr(torch, fmt)).double().numpy()
    scale = t.abs().amax(dim=-1, keepdim=True) / 448.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return ((t / scale).to(torch.float8_e4m3fn).double() * scale).numpy()


def measure(n: int, lq: int, seed: int = 0) -> dict:
    p = make_problem((n,), (lq,), num_q_heads=16, num_kv_heads=4, head_dim=128, index_dim=128,
                     block_size=128, topk=16, dtype=np.float32, seed=seed)
    cq, ck, bk, topk = p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, p.topk
    base = {name: getattr(p, name).astype(np.float64)
            for name in ("q", "k", "v", "q_idx", "k_idx")}  # float32 values
    base["q"] = stored(base["q"], "bfloat16")  # the decode query: bf16 in every case

    def run(q_idx_fmt, k_idx_fmt, kv_fmt):
        q_idx, k_idx = stored(base["q_idx"], q_idx_fmt), stored(base["k_idx"], k_idx_fmt)
        k, v = stored(base["k"], kv_fmt), stored(base["v"], kv_fmt)
        I = R.select_blocks(R.block_scores(q_idx, k_idx, cq, ck, bk), cq, ck, bk, topk)
        o, _ = R.sparse_attention(base["q"], k, v, I, cq, ck, bk)
        return I, o

    I_ref, o_ref = run("float32", "float32", "float32")
    peak = float(np.abs(o_ref).max())
    sel_ref = [set(row[row >= 0].tolist()) for row in I_ref.reshape(-1, topk)]
    cases = {
        "bf16 cache (today)": ("bfloat16", "bfloat16", "bfloat16"),
        "fp8 index keys": ("bfloat16", "e4m3", "bfloat16"),
        "fp8 index queries and keys": ("e4m3", "e4m3", "bfloat16"),
        "fp8 K and V": ("bfloat16", "bfloat16", "e4m3"),
        "fp8 index keys, K and V": ("bfloat16", "e4m3", "e4m3"),
    }
    rows = {}
    for name, fmts in cases.items():
        I, o = run(*fmts)
        sel = [set(row[row >= 0].tolist()) for row in I.reshape(-1, topk)]
        kept = sum(len(a & b) for a, b in zip(sel, sel_ref)) / sum(len(b) for b in sel_ref)
        same = np.array([a == b for a, b in zip(sel, sel_ref)]).reshape(I.shape[:2])  # [Tq, Hkv]
        d = np.abs(o - o_ref).reshape(*same.shape, -1)  # [Tq, Hkv, G*D]: a group's heads
        rows[name] = {"recall": kept, "rows_with_the_same_selection": float(same.mean()),
                      "max_abs_over_max_ref": float(d.max() / peak),
                      "mean_abs_over_mean_ref": float(d.mean() / np.abs(o_ref).mean()),
                      "same_selection_max_abs_over_max_ref": float(d[same].max() / peak)}
    return {"n": n, "lq": lq,
            "config": "Hq 16, Hkv 4, D = Didx = 128, Bk 128, k 16; float32 storage as reference",
            "rows": rows}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=32768, help="context length (default 32768)")
    ap.add_argument("--lq", type=int, default=64, help="decode queries at its end (default 64)")
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)
    t0 = time.time()
    res = measure(args.n, args.lq)
    print(f"N = {res['n']}, {res['lq']} queries, {res['config']} ({time.time() - t0:.0f} s)")
    print(f"{'':28s} {'recall':>8s} {'same sel.':>10s} {'max|d|/max|ref|':>16s} "
          f"{'mean|d|/mean|ref|':>18s} {'same sel. max|d|':>17s}")
    for name, e in res["rows"].items():
        print(f"{name:28s} {e['recall']:8.4f} {e['rows_with_the_same_selection']:10.3f} "
              f"{e['max_abs_over_max_ref']:16.2e} {e['mean_abs_over_mean_ref']:18.2e} "
              f"{e['same_selection_max_abs_over_max_ref']:17.2e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
