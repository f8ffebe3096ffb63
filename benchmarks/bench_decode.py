"""Decode on a paged KV cache (docs/design.md §8): the msa step against dense SDPA decode and its HBM floor.

    source .gpu/env.sh && python3 -m benchmarks.bench_decode --out $OUT/bench_decode.json [--quick]
    ... --chunked-prefill 1:131072:4096,8:32768:2048 --out $OUT/bench_chunked_prefill.json

Paper configuration: Hq = 64, Hkv = 4 (G = 16), D = Didx = 128, Bk = 128 (one page = one
block), K = 16, bf16. B requests of N cached tokens each (pages shuffled in the pool), Lq new
queries a request (1: plain decode; 4, 8: MTP drafts), Gaussian queries, keys and index keys
(so the selections are close to uniform random: the union of the Lq drafts' selections is
large). ``--shared-index-queries``: every draft of a request has the first draft's index query,
so the drafts select the same blocks but for their local ones (MTP drafts whose selections
agree).

* msa: ``msa.cuda.decode.plan`` once, then ``run`` (index split + merge, attention split +
  combine) captured in a CUDA graph and replayed; also the eager ``run`` (host launch cost
  included) and each kernel alone (CUDA events around its launch). ``first_s``: the wall time
  of the first ``plan`` + ``run`` of a shape in this process (kernels compiled or loaded from
  Numba's disk cache).
* dense: ``scaled_dot_product_attention`` over the same cache stored contiguously ``[B, Hkv,
  N, D]``: Lq = 1 is ``q [B, Hq, 1, D]`` with ``enable_gqa=True`` (flash-decoding); Lq > 1
  folds each group's Lq x G query rows into the query axis ``q [B, Hkv, Lq G, D]`` with the
  bottom-right causal mask (row of draft i sees the keys ``<= N - Lq + i``) as a boolean
  ``attn_mask`` (the exact attention of those rows; SDPA's memory-efficient kernel).
* floors, at this GPU's device-to-device copy rate, measured at the start of the run
  (``benchmarks.common.copy_tbps``; 4.26 TB/s on the H200, ``hbm_copy_TBps`` in the JSON):
  msa reads the index keys once (``B N Didx 2`` bytes) and each selected page once per (request,
  KV head) (``sum_{b,r} |union_{i} I[b,i,r]| * 2 Bk D 2`` bytes, counted from the selection);
  dense reads K and V once (``B N Hkv D 2 * 2`` bytes). ``GBps`` = those bytes / time.

``--chunked-prefill B:N:C,...``: chunked prefill into the cache instead (``bench_chunk``):
``prefill_chunk``, which reads K and V from their pages, against gathering them first.

Correctness first, for each shape before it is timed: on the first and last request, the index
block maxima recomputed in PyTorch (fp32 from the bf16 inputs) must make every selected block
score at least the (K-1)-th best minus 1e-3 of the row's largest score, with the local block in
and the right count; and o must match a PyTorch gather attention on msa's own selection within
2e-2 of max |o| (bf16 output). A failing case records its error and is not timed. Every case
is wrapped in try/except; ``--budget-s`` skips the cases left once that much time has passed.
"""

from __future__ import annotations

import argparse
import math
import os
import time
import traceback

os.environ.setdefault("NUMBA_CUDA_ARRAY_INTERFACE_SYNC", "0")

from benchmarks.common import copy_tbps, cuda_time_ms, print_table, write_json  # noqa: E402

HQ, HKV, D, BK, TOPK, D_IDX = 64, 4, 128, 128, 16, 128
G = HQ // HKV
GATE_REL = 2e-2
K, M = 1024, 1024 * 1024
HEADLINE = [(32, 64 * K, 1), (8, 128 * K, 1), (128, 8 * K, 1), (32, 64 * K, 8)]
GRID = ([(b, n, lq) for b in (1, 8, 32, 128) for n in (8 * K, 32 * K, 128 * K)
         for lq in (1, 4, 8)] + [(1, M, lq) for lq in (1, 4, 8)])


def make_case(b, n, lq, seed=0, shared_index_queries=False):
    """The dense cache ``k, v [B, Hkv, N, D]``, ``k_idx [B, N, Didx]``, its paged copy (pages in
    a random order), the step's ``q [B*Lq, Hq, D]``, ``q_idx [B*Lq, Hkv, Didx]`` (with
    ``shared_index_queries``, each request's first draft's repeated)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    nb = -(-n // BK)
    k = torch.randn((b, HKV, nb * BK, D), generator=gen, **bf)
    v = torch.randn((b, HKV, nb * BK, D), generator=gen, **bf)
    k_idx = torch.randn((b, nb * BK, D_IDX), generator=gen, **bf)
    perm = torch.randperm(b * nb, generator=gen, device="cuda")
    k_cache = torch.empty((b * nb, HKV, BK, D), **bf)
    v_cache = torch.empty((b * nb, HKV, BK, D), **bf)
    k_idx_cache = torch.empty((b * nb, BK, D_IDX), **bf)
    for i in range(b):  # one request at a time: no temporary of the whole cache
        pages = perm[i * nb:(i + 1) * nb]
        k_cache[pages] = k[i].view(HKV, nb, BK, D).transpose(0, 1)
        v_cache[pages] = v[i].view(HKV, nb, BK, D).transpose(0, 1)
        k_idx_cache[pages] = k_idx[i].view(nb, BK, D_IDX)
    table = perm.view(b, nb).int().contiguous()
    seqlens = torch.full((b,), n, dtype=torch.int32, device="cuda")
    q = torch.randn((b * lq, HQ, D), generator=gen, **bf)
    q_idx = torch.randn((b * lq, HKV, D_IDX), generator=gen, **bf)
    if shared_index_queries:
        q_idx = q_idx.view(b, lq, HKV, D_IDX)[:, :1].expand(b, lq, HKV, D_IDX).reshape(
            b * lq, HKV, D_IDX).contiguous()
    dense = (k[:, :, :n], v[:, :, :n], k_idx[:, :n])
    return dense, (q, q_idx, k_cache, v_cache, k_idx_cache, table, seqlens)


def dense_decode_fn(q, k, v, lq):
    """SDPA over the contiguous cache (module docstring): o [B*Lq, Hq, D]."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    b, _, n, _ = k.shape
    if lq == 1:
        qd = q.view(b, 1, HQ, D).transpose(1, 2)  # [B, Hq, 1, D]
        return lambda: sdpa(qd, k, v, enable_gqa=True).transpose(1, 2).reshape(b, HQ, D)
    # rows (i, g) of group r: [B, Hkv, Lq*G, D]; draft i sees keys <= n - lq + i
    qd = q.view(b, lq, HKV, G, D).permute(0, 2, 1, 3, 4).reshape(b, HKV, lq * G, D)
    pos = n - lq + torch.arange(lq, device=q.device).repeat_interleave(G)  # [Lq*G]
    mask = (torch.arange(n, device=q.device)[None, :] <= pos[:, None])[None, None]

    def run():
        o = sdpa(qd, k, v, attn_mask=mask)  # [B, Hkv, Lq*G, D]
        return o.view(b, HKV, lq, G, D).permute(0, 2, 1, 3, 4).reshape(b * lq, HQ, D)

    return run


def union_pages(I, lq):
    """Pages the step reads: per (request, KV head) the distinct valid blocks of its Lq rows."""
    import torch

    b = I.shape[0] // lq
    x = I.view(b, lq, HKV, -1).permute(0, 2, 1, 3).reshape(b * HKV, -1).long()
    x = torch.where(x >= 0, x, torch.full_like(x, -1)).sort(dim=-1).values
    distinct = (x[:, 1:] != x[:, :-1]) & (x[:, 1:] >= 0)
    return int(distinct.sum() + (x[:, 0] >= 0).sum())


def gate(dense, step, out, lq, n):
    """Selection near-tie check and o against a gather attention, on the first and last
    request (module docstring); returns (selection violations, o relative error)."""
    import torch

    k, v, k_idx = dense
    q, q_idx = step[0], step[1]
    o, _, I = out
    b = k.shape[0]
    bad, err = 0, 0.0
    s_idx, s = 1 / math.sqrt(D_IDX), 1 / math.sqrt(D)
    for req in sorted({0, b - 1}):
        for i in range(lq):
            t = req * lq + i
            pos = n - lq + i
            loc = pos // BK
            sc = torch.einsum("rd,nd->rn", q_idx[t].float(), k_idx[req, :loc * BK].float())
            M_ = sc.view(HKV, loc, BK).amax(-1) * s_idx if loc else sc.new_empty((HKV, 0))
            for r in range(HKV):
                sel = [int(x) for x in I[t, r].tolist() if x >= 0]
                want = min(TOPK - 1, loc)
                cands = sel[:-1]
                if sel[-1] != loc or len(cands) != want:
                    bad += 1
                    continue
                if want:
                    kth = float(M_[r].topk(want).values[-1])
                    tol = 1e-3 * float(M_[r].abs().max())
                    bad += sum(float(M_[r, j]) < kth - tol for j in cands)
                keys = torch.cat([torch.arange(j * BK, min((j + 1) * BK, pos + 1), device=k.device)
                                  for j in sel])
                kk, vv = k[req, r, keys].float(), v[req, r, keys].float()
                qq = q[t, r * G:(r + 1) * G].float()
                ref = torch.softmax(qq @ kk.T * s, dim=-1) @ vv
                err = max(err, float((o[t, r * G:(r + 1) * G].float() - ref).abs().max())
                          / float(ref.abs().max()))
    return bad, err


def timed(fn, reps):
    """``cuda_time_ms`` of ``fn``, over 10 calls an event pair when one call is short."""
    ms = cuda_time_ms(fn, warmup=1, reps=3)
    if ms >= 2.0:
        return cuda_time_ms(fn, warmup=1, reps=reps)

    def ten():
        for _ in range(10):
            fn()

    return cuda_time_ms(ten, warmup=1, reps=reps) / 10


def graph_of(fn):
    """``fn`` captured in a CUDA graph (after one run on a side stream); returns the graph."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def kernel_times(plan, step, reps):
    """Median ms of each of the plan's launches alone, each in a CUDA graph of its own."""
    import dataclasses

    from msa.cuda import decode as gpu

    out = {}
    for i, entry in enumerate(plan.steps):
        one = dataclasses.replace(plan, steps=[entry])
        name = entry[0].dispatcher.py_func.__qualname__.split(".<locals>")[0]
        name = f"{entry[0].dispatcher.py_func.__module__.rsplit('.', 1)[-1]}.{name}#{i}"
        out[name] = timed(graph_of(lambda one=one: gpu.run(one, *step)).replay, reps)
    return out


def bench_case(b, n, lq, args):
    import torch

    from msa.cuda import decode as gpu
    from msa.cuda.decode.v2_split_index import wide_warps

    rows = []
    name = f"B={b} N={n // K}K Lq={lq}" + (" shared" if args.shared_index_queries else "")
    torch.cuda.empty_cache()
    dense, step = make_case(b, n, lq, shared_index_queries=args.shared_index_queries)
    torch.cuda.synchronize()
    t0 = time.time()
    plan = gpu.plan(*step, BK, TOPK)
    out = gpu.run(plan, *step)
    torch.cuda.synchronize()
    first_s = time.time() - t0
    bad, err = gate(dense, step, out, lq, n)
    row = dict(case=name, B=b, N=n, Lq=lq, shared_index_queries=args.shared_index_queries,
               version=plan.version, first_s=first_s,
               index_splits=plan.index_splits, attention_splits=plan.attention_splits,
               merge_warps_a_row=wide_warps(plan.index_splits, TOPK),
               workspace_MiB=plan.workspace_bytes() / 2**20, gate_selection_bad=bad,
               gate_rel_err=err)
    if bad or not err < GATE_REL:
        row["error"] = f"correctness gate failed: {bad} selection violations, o rel err {err:.3g}"
        return [row]
    eager_o = plan.o.clone()
    graph = graph_of(lambda: gpu.run(plan, *step))
    plan.o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    row["graph_equals_eager"] = bool(torch.equal(plan.o.view(torch.int16),
                                                 eager_o.view(torch.int16)))
    torch.cuda.reset_peak_memory_stats()
    row["msa_ms"] = timed(graph.replay, args.reps)
    row["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    row["msa_eager_ms"] = timed(lambda: gpu.run(plan, *step), args.reps)
    row["kernels_ms"] = kernel_times(plan, step, args.reps)
    pages = union_pages(plan.block_indices, lq)
    index_bytes = b * n * D_IDX * 2
    page_bytes = pages * 2 * BK * D * 2
    row["pages_read"] = pages
    row["floor_ms"] = (index_bytes + page_bytes) / (copy_tbps() * 1e9)
    row["msa_GBps"] = (index_bytes + page_bytes) / row["msa_ms"] / 1e6
    row["floor_ratio"] = row["msa_ms"] / row["floor_ms"]
    # dense
    k, v, _ = dense
    fn = dense_decode_fn(step[0], k, v, lq)
    dense_bytes = b * n * HKV * D * 2 * 2
    row["dense_ms"] = timed(fn, args.reps)
    row["dense_floor_ms"] = dense_bytes / (copy_tbps() * 1e9)
    row["dense_GBps"] = dense_bytes / row["dense_ms"] / 1e6
    row["speedup"] = row["dense_ms"] / row["msa_ms"]
    del graph
    rows.append(row)
    print(f"{name:24s} msa {row['msa_ms']:.3f} ms (floor {row['floor_ms']:.3f}, "
          f"x{row['floor_ratio']:.2f}) dense {row['dense_ms']:.3f} ms -> {row['speedup']:.2f}x, "
          f"first {first_s:.1f} s, kernels {row['kernels_ms']}", flush=True)
    return rows


def bench_chunk(b, n, c, args):
    """Chunked prefill into the cache: the last ``c`` of each request's ``n`` cached tokens as
    queries. ``msa.cuda.decode.prefill_chunk`` (index keys gathered, K and V read from their
    pages) against the rung it replaced, ``gather_cache`` of K, V and K_idx then ``msa_prefill``
    on the packed copies; both must give bitwise the same ``o``, ``lse`` and selection."""
    import numpy as np
    import torch

    from msa.cuda import decode as gpu
    from msa.cuda.attention import msa_prefill

    name = f"chunk B={b} N={n // K}K C={c}"
    torch.cuda.empty_cache()
    _, (q, q_idx, k_cache, v_cache, k_idx_cache, table, seqlens) = make_case(b, n, c)
    cu_q = (np.arange(b + 1) * c).astype(np.int32)

    def paged():
        return gpu.prefill_chunk(q, q_idx, k_cache, v_cache, k_idx_cache, table, seqlens, cu_q,
                                 BK, TOPK)

    def gathered():
        k, v, k_idx, cu_k = gpu.gather_cache(k_cache, v_cache, k_idx_cache, table, seqlens)
        return msa_prefill(q, k, v, q_idx, k_idx, cu_q, cu_k, BK, TOPK)

    row = dict(case=name, B=b, N=n, C=c)
    a, g = paged(), gathered()
    torch.cuda.synchronize()
    row["bitwise_equal"] = all(torch.equal(x, y) for x, y in zip(a, g))  # o, lse, selection
    if not row["bitwise_equal"]:
        row["error"] = "correctness gate failed: prefill_chunk differs from gather + msa_prefill"
        return [row]
    del a, g
    for label, fn in (("paged", paged), ("gathered", gathered)):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        row[f"{label}_ms"] = timed(fn, args.reps)
        row[f"{label}_extra_GiB"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    row["speedup"] = row["gathered_ms"] / row["paged_ms"]
    print(f"{name:28s} paged {row['paged_ms']:.3f} ms (+{row['paged_extra_GiB']:.2f} GiB) "
          f"gathered {row['gathered_ms']:.3f} ms (+{row['gathered_extra_GiB']:.2f} GiB) -> "
          f"{row['speedup']:.2f}x", flush=True)
    return [row]


def first_only():
    import torch

    from msa.cuda import decode as gpu

    b, n, lq = HEADLINE[0]
    _, step = make_case(b, n, lq)
    torch.cuda.synchronize()
    t0 = time.time()
    plan = gpu.plan(*step, BK, TOPK)
    gpu.run(plan, *step)
    torch.cuda.synchronize()
    print(f"first plan + run of B={b} N={n // K}K Lq={lq}: {time.time() - t0:.2f} s", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "bench_decode.json"))
    p.add_argument("--quick", action="store_true", help="the four headline shapes only")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--budget-s", type=float, default=230.0,
                   help="skip the cases left once this much wall time has passed")
    p.add_argument("--cases", default="",
                   help="only these cases, as B:N:Lq separated by commas (e.g. 32:65536:8)")
    p.add_argument("--shared-index-queries", action="store_true",
                   help="every draft of a request gets the first draft's index query")
    p.add_argument("--chunked-prefill", default="",
                   help="instead of decode steps, chunked prefill into the cache at these "
                        "B:N:C (C new tokens a request among N cached), e.g. 1:131072:4096")
    p.add_argument("--first-only", action="store_true",
                   help="plan + run the first shape once and print the wall time (run twice: "
                        "the second process finds Numba's disk cache warm)")
    args = p.parse_args(argv)
    if args.first_only:
        return first_only()
    cases = list(HEADLINE) + ([] if args.quick else [c for c in GRID if c not in HEADLINE])
    if args.cases:
        cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")]
    run_case = bench_case
    if args.chunked_prefill:
        cases = [tuple(int(x) for x in c.split(":")) for c in args.chunked_prefill.split(",")]
        run_case = bench_chunk
    config = dict(Hq=HQ, Hkv=HKV, D=D, Bk=BK, K=TOPK, Didx=D_IDX, dtype="bfloat16",
                  hbm_copy_TBps=copy_tbps(), args=vars(args))
    t_start = time.time()
    rows = []
    for b, n, lq in cases:
        name = f"B={b} N={n // K}K Lq={lq}"
        if time.time() - t_start > args.budget_s:
            rows.append(dict(case=name, error=f"skipped: over --budget-s {args.budget_s}"))
            continue
        try:
            rows += run_case(b, n, lq, args)
        except Exception as exc:
            rows.append(dict(case=name, error=f"{type(exc).__name__}: {exc}",
                             trace=traceback.format_exc(limit=8)))
            print(name, "FAILED", exc, flush=True)
        write_json(args.out, rows, config=config, wall_s=time.time() - t_start)
    print_table(rows, ["case", "paged_ms", "gathered_ms", "paged_extra_GiB",
                       "gathered_extra_GiB", "speedup", "error"] if args.chunked_prefill else
                ["case", "msa_ms", "floor_ms", "floor_ratio", "dense_ms", "speedup",
                 "msa_eager_ms", "first_s", "peak_GiB", "gate_rel_err", "error"])
    write_json(args.out, rows, config=config, wall_s=time.time() - t_start)
    return rows


if __name__ == "__main__":
    main()
