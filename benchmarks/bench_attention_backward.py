"""The main branch's backward (eq 8's gradient) on the GPU, against what a user would run instead.

    source .gpu/env.sh && python3 -m benchmarks.bench_attention_backward --out FILE

Paper configuration (Hq = 64, Hkv = 4, D = 128, Bk = 128, K = 16, bf16, one causal sequence of N
tokens, the ``uniform`` selection of ``bench_attention``). For each N, side by side in one run:

* ``msa.cuda.attention.sparse_attention_backward`` version 3 (``wgmma``, where the GPU has
  it) and version 2 (tensor cores by ``mma.sync``), each one KV-outer kernel for dK, dV and the
  dQ partials, then their sum, version 3 (else 2) with bf16 dQ partials
  (``partial_dtype="bfloat16"``, with dq's max difference to float32 partials' relative to its
  max), and version 1 (CUDA cores, dQ Q-outer, dK/dV KV-outer; up to ``--v1-max-n``), timed
  alone on the forward's ``o, lse``, with whether version 3's outputs equal version 2's
  bitwise;
* ``msa.torch.sparse_attention_backward``, the PyTorch backward ``msa.torch`` uses by default
  (gathered K/V per chunk of queries, batched matmuls, ``index_add_``);
* fla-core's Triton NSA backward (``parallel_nsa_bwd``) on the same selection, given its own
  forward's ``o, lse`` (``parallel_nsa_fwd``), the peer kernel for this function;
* dense causal ``scaled_dot_product_attention``'s backward (autograd), what a user runs without
  MSA (``torch.autograd.grad`` on a stored forward graph, retained between repetitions).

Useful FLOPs of a sparse backward = 10 * Hq * D * S (five matmuls of the forward's size; S as in
``bench_attention.visible_tokens``); the dense backward's own = 10 * Hq * D * N(N+1)/2.
Correctness first: msa's (dq, dk, dv) against the PyTorch backward's, max |diff| / max |ref|
below 2e-2 each, else the row records the error and is not timed. ``--budget-s`` skips what is
left once that much time has passed (version 1 is slow: a hot row is one CTA).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("NUMBA_CUDA_ARRAY_INTERFACE_SYNC", "0")

from benchmarks.bench_attention import (BK, D, HQ, HKV, TOPK, _error_row, _peak_and_first,  # noqa: E402
                                        _qkv, _rel_err, _row, dense_sdpa, make_selection,
                                        visible_tokens)
from benchmarks.common import cuda_time_ms, print_table, write_json  # noqa: E402

GATE_REL = 2e-2


def bench_backward(n, args):
    import torch

    from msa.cuda._core import wgmma as _wgmma
    from msa.cuda.attention import sparse_attention as msa_forward
    from msa.cuda.attention import sparse_attention_backward as msa_backward
    from msa.torch import sparse_attention_backward as torch_backward

    case = f"backward N={n // 1024}K uniform"
    rows = []
    q, k, v = _qkv(n, seed=3)
    I = make_selection("uniform", n, seed=4)
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    S = visible_tokens(I)
    flops = 10 * HQ * D * S
    o, lse = msa_forward(q, k, v, I, cu, cu, BK, validate=False)
    do = torch.randn_like(q)
    want = None
    try:
        def run_torch():
            return torch_backward(q, k, v, o, lse, do, I, cu, cu, BK)
        want, peak = _peak_and_first(run_torch)
        ms = cuda_time_ms(run_torch, warmup=0, reps=args.reps)
        rows.append(_row(case, "PyTorch backward (msa.torch)", ms, flops, peak))
    except Exception as exc:
        rows.append(_error_row(case, "PyTorch backward (msa.torch)", exc))
    torch.cuda.empty_cache()
    torch_ms = next((r["ms"] for r in rows if r.get("impl", "").startswith("PyTorch")
                     and r.get("ms")), None)
    outs = {}
    best = 2 if _wgmma.why_not_available() else 3
    for version, pdt in ((3, None), (best, "bfloat16"), (2, None), (1, None)):
        if version == 1 and n > args.v1_max_n:
            continue
        if version == 3 and _wgmma.why_not_available():
            continue
        impl = f"msa.cuda backward v{version}" + (", bf16 dQ partials" if pdt else "")
        try:
            def run_msa():
                return msa_backward(q, k, v, o, lse, do, I, cu, cu, BK, version=version,
                                    partial_dtype=pdt, validate=False)
            got, peak = _peak_and_first(run_msa)
            errs = [_rel_err(a, b) for a, b in zip(got, want)] if want is not None else []
            if errs and max(errs) > GATE_REL:
                raise AssertionError(f"gate: rel errors (dq, dk, dv) {errs} > {GATE_REL}")
            ms = cuda_time_ms(run_msa, warmup=0, reps=args.reps if version >= 2 else 1)
            extra = {}
            if pdt:  # dq against float32 partials' (the row before), relative to its max
                if outs:
                    ref_dq = next(iter(outs.values()))[0]
                    extra["dq_rel_err_vs_f32_partials"] = _rel_err(got[0].cpu(), ref_dq)
            elif version == 3:  # kept on the host, out of version 2's peak memory
                outs[3] = [x.cpu() for x in got]
            elif version == 2 and 3 in outs:
                extra["v3_equals_v2_bitwise"] = all(
                    torch.equal(a, b.cpu()) for a, b in zip(outs[3], got))
            rows.append(_row(case, impl, ms, flops, peak,
                             gate_rel_err=max(errs) if errs else None,
                             vs_torch=(torch_ms / ms) if torch_ms else None, **extra))
        except Exception as exc:
            rows.append(_error_row(case, impl, exc))
        torch.cuda.empty_cache()
    fla_ms = None
    if not args.skip_fla:
        impl = "fla-core parallel_nsa_bwd (same selection)"
        try:
            from fla.ops.nsa.parallel import parallel_nsa_bwd

            from benchmarks.bench_attention import fla_forward_fn

            fo, flse = fla_forward_fn(q, k, v, I)()
            qb, kb, vb, dob, Ib = q[None], k[None], v[None], do[None], I[None]

            def run_fla():
                return parallel_nsa_bwd(qb, kb, vb, fo, flse, dob, Ib, TOPK, BK, D ** -0.5)
            got, peak = _peak_and_first(run_fla)
            errs = ([_rel_err(a[0], b) for a, b in zip(got, want)] if want is not None else [])
            ms = fla_ms = cuda_time_ms(run_fla, warmup=1, reps=args.reps)
            rows.append(_row(case, impl, ms, flops, peak,
                             gate_rel_err=max(errs) if errs else None))
        except Exception as exc:
            rows.append(_error_row(case, impl, exc))
        torch.cuda.empty_cache()
    for r in rows:
        if r["impl"].startswith("msa") and r.get("ms") and fla_ms:
            r["vs_fla"] = fla_ms / r["ms"]
    try:
        qd, kd, vd = (x.detach().clone().requires_grad_() for x in (q, k, v))
        od = dense_sdpa(qd, kd, vd)

        def run_dense():
            return torch.autograd.grad(od, (qd, kd, vd), do, retain_graph=True)
        _, peak = _peak_and_first(run_dense)
        ms = cuda_time_ms(run_dense, warmup=0, reps=args.reps)
        rows.append(_row(case, "dense SDPA backward (causal)", ms, 10 * HQ * D * n * (n + 1) / 2,
                         peak))
    except Exception as exc:
        rows.append(_error_row(case, "dense SDPA backward (causal)", exc))
    torch.cuda.empty_cache()
    dense_ms = rows[-1].get("ms")
    for r in rows:
        if r["impl"].startswith("msa") and r.get("ms") and dense_ms:
            r["vs_dense"] = dense_ms / r["ms"]
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/attention_backward.json")
    p.add_argument("--sizes", default="8192,32768,131072")
    p.add_argument("--v1-max-n", type=int, default=8192, help="time msa's v1 up to this N")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument("--skip-fla", action="store_true", help="no fla-core baseline")
    args = p.parse_args(argv)
    t_start = time.time()
    config = dict(Hq=HQ, Hkv=HKV, D=D, Bk=BK, K=TOPK, dtype="bfloat16", args=vars(args))
    rows = []
    for n in (int(x) for x in args.sizes.split(",") if x):
        if time.time() - t_start > args.budget_s:
            rows.append(dict(case=f"backward N={n // 1024}K", impl="-",
                             error=f"skipped: over --budget-s {args.budget_s}"))
            continue
        try:
            rows += bench_backward(n, args)
        except Exception as exc:
            rows.append(_error_row(f"backward N={n // 1024}K", "setup", exc))
        print(f"   [{time.time() - t_start:.0f} s] N={n}", flush=True)
        write_json(args.out, rows, config=config, wall_s=time.time() - t_start)
    print_table(rows, ["case", "impl", "ms", "TFLOPs", "peak_GiB", "vs_torch", "vs_fla", "vs_dense",
                       "gate_rel_err",
                       "error"])
    write_json(args.out, rows, config=config, wall_s=time.time() - t_start)
    return rows


if __name__ == "__main__":
    main()
