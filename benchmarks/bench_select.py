"""Index branch on the GPU: warp-heap top-k vs ``torch.topk``; index + top-k vs a PyTorch pipeline.

    source .gpu/env.sh && python3 -m benchmarks.bench_select --out benchmarks/results/select.json

1. Top-k (paper §4.1) on fp32 scores ``[Hkv=4, Tq=65536, NB]`` for NB in {1024, 8192}, K = 16,
   against ``torch.topk(M, 16, dim=-1)`` on the same tensor. Every row must see all NB blocks, so
   the problem is one sequence of ``NB * Bk`` keys with ``Bk = 65536`` whose 65536 queries are its
   last positions: each query's local block is ``NB - 1`` and blocks ``0..NB-2`` are candidates.
   Bytes read = 4 * rows * NB (rows = 4 * 65536); GB/s = bytes / time; fraction of the H200's
   4.26 TB/s device copy. Every kernel version runs in the same process as the baseline (1, the
   paper's warp heap 2, the default 3; the row of the default is marked), torch.topk is
   timed before and after them and the ratio uses the faster of the two (clock drift).
2. Index + top-k (eq 6-7), Hkv = 4, Didx = 128, bf16, K = 16, Bk = 128, one causal sequence of N
   tokens (Lq = Lk = N): ``msa.cuda.select.select_blocks_fused``, every version: 2 and 3 (one
   tensor-core kernel, index v2 or v3, block maxima straight into per-row heaps, M never
   written) and 1 (block scores of a chunk of queries, then the default top-k) against the
   PyTorch pipeline a user would write (bf16 matmul, causal mask, block max, forced local block,
   topk), chunked over queries to fit, at N in {32K, 128K}; ours alone (the default, 3) at 1M.
   FLOPs = Hkv * Didx * N^2 (paper eq 12's index term: 2 flops per multiply-add over the causal
   half); TFLOP/s = FLOPs / time. The two stages are also timed apart at 128K (``block_scores``
   v2 and v3 writing the whole M, then every ``select_blocks`` version but 1 on it).

Offsets (``cu_seqlens``) are host NumPy arrays, as msa's launchers read them on the host.

Correctness comes first: top-k rows are compared by their scores with ``torch.topk``'s (exact,
tie-proof); index + top-k rows are checked on a sample of queries against float64 block scores:
every selected block scores at least the float64 K-1-th best minus a float32-derived tolerance.
A case that fails records its error in the JSON instead of stopping the run.
"""

from __future__ import annotations

import argparse
import math
import traceback

from benchmarks.common import HBM_COPY_TBPS, cuda_time_ms, print_table, write_json

TOPK = 16
HKV = 4
D_IDX = 128
BK = 128


# -- 1. top-k -----------------------------------------------------------------------------------

def _topk_problem(nb, tq=65536, hkv=HKV):
    import numpy as np
    import torch

    g = torch.Generator(device="cuda").manual_seed(nb)
    M = torch.randn((hkv, tq, nb), device="cuda", dtype=torch.float32, generator=g)
    bk = 65536  # every query sits in the last block: all NB blocks visible
    cu_q = np.array([0, tq], np.int32)
    cu_k = np.array([0, nb * bk], np.int32)
    return M, cu_q, cu_k, bk


def _gate_topk(I, M):
    """Our rows vs torch.topk on the candidates (blocks 0..NB-2): same scores, local block last."""
    import torch

    nb = M.shape[-1]
    assert I.shape == (M.shape[1], M.shape[0], TOPK), I.shape
    assert bool((I[..., -1] == nb - 1).all()), "local block missing"
    ours = I[..., :-1].long().permute(1, 0, 2)  # [Hkv, Tq, K-1]
    assert bool((ours[..., 1:] > ours[..., :-1]).all()), "rows not ascending"
    got = torch.gather(M, -1, ours).sort(dim=-1, descending=True).values
    want = torch.topk(M[..., : nb - 1], TOPK - 1, dim=-1).values
    assert torch.equal(got, want), "selected scores differ from torch.topk's"


def bench_topk(nb):
    import numpy as np
    import torch
    from numba import cuda

    import msa.cuda.select as S
    from msa._batch import Batch

    M, cu_q, cu_k, bk = _topk_problem(nb)
    rows = M.shape[0] * M.shape[1]
    nbytes = 4 * rows * nb  # bytes read = 4 * rows * NB
    out = []
    raw = cuda.as_cuda_array(M)  # a Numba view: no per-launch conversion
    raw_out = cuda.device_array((M.shape[1], M.shape[0], TOPK), np.int32)
    batch = Batch.of(cu_q, cu_k, bk)
    torch_before = cuda_time_ms(lambda: torch.topk(M, TOPK, dim=-1))
    rows_ours = []
    for version in S.VERSIONS:
        default = " (default)" if version == S.DEFAULT_VERSION else ""
        row = dict(case=f"topk NB={nb}", impl=f"msa v{version}{default}", version=version)
        try:
            I = S.select_blocks(M, cu_q, cu_k, bk, TOPK, version=version)
            _gate_topk(I, M)
            reps = 3 if version == 1 else 10
            ms = cuda_time_ms(lambda: S.select_blocks(M, cu_q, cu_k, bk, TOPK, version=version),
                              reps=reps)
            row.update(ms=ms, GBps=nbytes / ms / 1e6, frac_hbm=nbytes / ms / 1e9 / HBM_COPY_TBPS)
            if version != 1:  # the launch alone: no validation, no host read of cu_seqlens
                row["ms_kernel"] = cuda_time_ms(
                    lambda: S.launch_select_blocks(raw, batch, 0, TOPK, raw_out, version=version),
                    reps=reps)
        except Exception as exc:
            row.update(error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc(limit=4))
        rows_ours.append(row)
    torch_after = cuda_time_ms(lambda: torch.topk(M, TOPK, dim=-1))
    ms_torch = min(torch_before, torch_after)
    out.append(dict(case=f"topk NB={nb}", impl="torch.topk", ms=ms_torch,
                    ms_before=torch_before, ms_after=torch_after,
                    GBps=nbytes / ms_torch / 1e6, frac_hbm=nbytes / ms_torch / 1e9 / HBM_COPY_TBPS))
    for row in rows_ours:
        if "ms" in row:
            row["speedup_vs_torch"] = ms_torch / row["ms"]
    out += rows_ours
    del M
    torch.cuda.empty_cache()
    return out


# -- 2. index + top-k ---------------------------------------------------------------------------

def _index_problem(n, seed=0):
    import numpy as np
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn((n, HKV, D_IDX), device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn((n, D_IDX), device="cuda", generator=g).to(torch.bfloat16)
    cu = np.array([0, n], np.int32)
    return q, k, cu


def torch_pipeline(q, k, topk=TOPK, bk=BK, budget_bytes=8 << 30):
    """What a PyTorch user writes: scores, causal mask, block max, forced local block, top-k.

    One causal sequence (Lq = Lk = N); queries in chunks so that the fp32 score tile
    ``[Hkv, c, N]`` stays within ``budget_bytes``. Returns I [N, Hkv, K] int32 (ascending, -1
    padded like msa's).
    """
    import torch

    n, hkv, d = q.shape
    scale = 1.0 / math.sqrt(d)
    nb_all = -(-n // bk)
    out = torch.empty((n, hkv, topk), dtype=torch.int32, device=q.device)
    chunk = max(bk, budget_bytes // (hkv * n * 4 * 2) // bk * bk)
    for t0 in range(0, n, chunk):
        t1 = min(n, t0 + chunk)
        nb = -(-t1 // bk)  # blocks visible to some query of the chunk
        s = torch.matmul(q[t0:t1].transpose(0, 1), k[: nb * bk if nb * bk <= n else n].T)
        s = s.float() * scale  # [Hkv, c, keys]
        if s.shape[-1] < nb * bk:
            s = torch.nn.functional.pad(s, (0, nb * bk - s.shape[-1]), value=-math.inf)
        pos = torch.arange(t0, t1, device=q.device)
        key = torch.arange(nb * bk, device=q.device)
        s.masked_fill_(key[None, None, :] > pos[None, :, None], -math.inf)
        m = s.view(hkv, t1 - t0, nb, bk).amax(dim=-1)  # [Hkv, c, nb]
        local = pos // bk
        m.scatter_(-1, local[None, :, None].expand(hkv, -1, 1), math.inf)  # forced local block
        kk = min(topk, nb)
        val, idx = torch.topk(m, kk, dim=-1)
        idx = torch.where(val > -math.inf, idx, torch.full_like(idx, nb_all + 1)).sort(dim=-1).values
        idx = torch.where(idx > nb_all, torch.full_like(idx, -1), idx)
        out[t0:t1, :, :kk] = idx.permute(1, 0, 2).int()
        out[t0:t1, :, kk:] = -1
    return out


def _gate_index(I, q, k, sample=256, seed=1):
    """Sampled queries: structure exact; every selected non-local block scores at least the
    float64 (K-1)-th best minus 4x the float32 error of the same block scores. Returns the tol."""
    import numpy as np
    import torch

    n, dev = q.shape[0], q.device
    g = torch.Generator(device=dev).manual_seed(seed)
    ts = torch.randint(0, n, (sample,), device=dev, generator=g).sort().values
    scale = 1.0 / math.sqrt(q.shape[-1])
    nb_all = -(-n // BK)
    key = torch.arange(nb_all * BK, device=dev)
    blocks = {}
    for dt in (torch.float64, torch.float32):
        kp = torch.nn.functional.pad(k.to(dt), (0, 0, 0, nb_all * BK - n))  # [NB*Bk, Didx]
        s = torch.einsum("thd,jd->htj", q[ts].to(dt), kp) * scale  # [Hkv, S, NB*Bk]
        s.masked_fill_(key[None, None, :] > ts[None, :, None], -math.inf)
        blocks[dt] = s.view(HKV, sample, nb_all, BK).amax(-1).double().cpu().numpy()
        del s, kp
    m64, m32 = blocks[torch.float64], blocks[torch.float32]  # [Hkv, S, NB]
    fin = np.isfinite(m64)
    tol = 4 * float(np.abs(m32[fin] - m64[fin]).max()) + 1e-6
    rows = I[ts].cpu().numpy()  # [S, Hkv, K]
    local = (ts // BK).cpu().numpy()
    for i in range(sample):
        L = int(local[i])
        for r in range(HKV):
            row = rows[i, r].tolist()
            real = [b for b in row if b >= 0]
            where = (int(ts[i]), r, row)
            assert real == sorted(set(real)) and real[-1] == L, where
            assert len(real) == min(TOPK, L + 1), where
            assert all(b == -1 for b in row[len(real):]), where
            if L == 0 or TOPK == 1:
                continue
            cand = m64[r, i, :L]
            kth = np.sort(cand)[::-1][min(TOPK - 1, L) - 1]
            worst = cand[real[:-1]].min()
            assert worst >= kth - tol, (*where, worst, kth, tol)
    return tol


def _time_ours(fn, reps, *, heavy):
    """(ms, peak GiB, first result): the first call measures peak memory and serves as warm-up."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    first = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30
    ms = cuda_time_ms(fn, warmup=0 if heavy else 1, reps=reps)
    return ms, peak, first


def bench_index(n, with_torch=True):
    import torch

    import msa.cuda.index as X
    import msa.cuda.select as S

    q, k, cu = _index_problem(n)
    flops = HKV * D_IDX * n * n  # eq 12 index term
    heavy = n > 131072
    reps = 5 if n <= 32768 else (3 if not heavy else 1)
    case = f"index+topk N={n}"
    out = []
    ms_torch = None
    if with_torch:
        row = dict(case=case, impl="torch pipeline (chunked)")
        try:
            ms_torch, peak, _ = _time_ours(lambda: torch_pipeline(q, k), reps, heavy=heavy)
            row.update(ms=ms_torch, TFLOPs=flops / ms_torch / 1e9, peak_GiB=peak)
        except Exception as exc:
            row.update(error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc(limit=4))
        out.append(row)
    for version in (3,) if heavy else S.FUSED_VERSIONS:
        row = dict(case=case, impl=f"msa select_blocks_fused (v{version})")
        try:
            fused = lambda: S.select_blocks_fused(q, k, cu, cu, BK, TOPK, version=version)  # noqa: E731
            ms, peak, I = _time_ours(fused, reps, heavy=heavy)
            row["gate_tol"] = _gate_index(I, q, k)
            row.update(ms=ms, TFLOPs=flops / ms / 1e9, peak_GiB=peak)
            if ms_torch is not None:
                row["speedup_vs_torch"] = ms_torch / ms
        except Exception as exc:
            row.update(error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc(limit=4))
        out.append(row)
    if n == 131072:  # the two stages apart, M materialised (4 * N * NB * 4 bytes = 2 GiB)
        M = None
        for kversion in (2, 3):
            row = dict(case=case, impl=f"msa block_scores (v{kversion}), M written")
            try:
                ms = cuda_time_ms(lambda: X.block_scores(q, k, cu, cu, BK, version=kversion),
                                  warmup=1, reps=reps)
                row.update(ms=ms, TFLOPs=flops / ms / 1e9)
                M = X.block_scores(q, k, cu, cu, BK, version=kversion)
            except Exception as exc:
                row.update(error=f"{type(exc).__name__}: {exc}",
                           trace=traceback.format_exc(limit=4))
            out.append(row)
        nbytes = 4 * HKV * n * (n // BK) / 2  # a causal row reads the blocks before its local one
        for version in S.VERSIONS if M is not None else ():
            if version == 1:
                continue
            row = dict(case=case, impl=f"msa select_blocks (v{version}) on that M")
            try:
                ms = cuda_time_ms(lambda: S.select_blocks(M, cu, cu, BK, TOPK, version=version),
                                  reps=reps)
                row.update(ms=ms, GBps=nbytes / ms / 1e6,
                           frac_hbm=nbytes / ms / 1e9 / HBM_COPY_TBPS)
            except Exception as exc:
                row.update(error=f"{type(exc).__name__}: {exc}",
                           trace=traceback.format_exc(limit=4))
            out.append(row)
        del M
    del q, k
    torch.cuda.empty_cache()
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/select.json")
    parser.add_argument("--quick", action="store_true", help="top-k and N=32K only")
    parser.add_argument("--index-sizes", default=None,
                        help="N of the index + top-k section, comma separated (default 32K, 128K, "
                             "1M; the PyTorch pipeline up to 128K)")
    parser.add_argument("--skip-topk", action="store_true", help="skip the top-k section")
    args = parser.parse_args(argv)
    results = []
    for nb in () if args.skip_topk else (1024, 8192):
        try:
            results += bench_topk(nb)
        except Exception as exc:
            results.append(dict(case=f"topk NB={nb}", error=f"{type(exc).__name__}: {exc}"))
    sizes = [(32768, True)] if args.quick else [(32768, True), (131072, True), (1048576, False)]
    if args.index_sizes is not None:
        sizes = [(int(n), int(n) <= 131072) for n in args.index_sizes.split(",") if n]
    for n, with_torch in sizes:
        try:
            results += bench_index(n, with_torch)
        except Exception as exc:
            results.append(dict(case=f"index+topk N={n}", error=f"{type(exc).__name__}: {exc}"))
    print_table(results, ["case", "impl", "ms", "ms_kernel", "GBps", "frac_hbm", "TFLOPs",
                          "speedup_vs_torch", "peak_GiB", "error"])
    write_json(args.out, results, formulas={
        "topk_bytes": "4 * rows * NB, rows = Hkv * Tq = 4 * 65536",
        "topk_speedup": "min(torch.topk ms before, after our versions) / our ms (select_blocks "
                        "call: validation included; ms_kernel: the launch alone)",
        "index_flops": "Hkv * Didx * N^2 (paper eq 12 index term)",
        "frac_hbm": f"GB/s / {HBM_COPY_TBPS} TB/s (H200 device copy)"},
        config=dict(topk=TOPK, hkv=HKV, d_idx=D_IDX, block_size=BK))
    return results


if __name__ == "__main__":
    main()
