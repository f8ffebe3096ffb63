"""Benchmark: the GPU reverse index + hot-row scheduler (msa.cuda.csr / msa.cuda.schedule, §4.2)
against the PyTorch build a user would write (stable argsort of row keys, bincount, cumsum).

GPU only. For N in {32K, 128K, 1M} tokens (one prefill sequence), K = 16, Hkv = 4, Bk = 128 and
two selections, uniform random over the visible blocks and skewed (blocks 0-2 chosen by every
query that sees them, the sink pattern), it

1. checks correctness first: msa's (row_ptr, q_indices, slots) must equal the PyTorch build
   exactly and msa's work items (first ``num_items`` rows) the PyTorch schedule;
2. times with CUDA events (warm-up excluded, median of ``--reps`` runs), launchers included
   (validate=False, the production setting): msa CSR, msa schedule, msa CSR + schedule, the
   PyTorch CSR, the PyTorch CSR + schedule, and msa's CSR phases;
3. reports effective GB/s with ``bytes = 12 * Tq * Hkv * K`` (read I once, 4 B per entry, write
   q_indices and slots once, 4 B each: the traffic any CSR build must do), the ratio
   PyTorch / msa, the peak GPU memory of each, and the schedule size;
4. times msa's phases one by one (checks + plan, tile histogram v2 and v1, look-back scan,
   scatter v2 and v3, schedule, and the Python per call) and prints them in a second table, so
   that a change can be traced to its phase.

    python benchmarks/bench_csr.py --out benchmarks/results/csr.json

Every case runs inside try/except; an error is recorded in the JSON instead of stopping the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import numpy as np

from benchmarks.common import cuda_time_ms, header

SIZES = (32 * 1024, 128 * 1024, 1024 * 1024)
PATTERNS = ("uniform", "skewed")
HKV, TOPK, BK = 4, 16, 128
HOT = 3  # blocks 0..2 in the skewed selection


def selection(n, hkv, topk, bk, *, hot, seed, device="cuda"):
    """I int32 [n, Hkv, K] for one sequence of n tokens, on the GPU: the local block L, blocks
    ``0..hot-1`` when visible, and one random block from each of the ``K-1-hot`` equal strata of
    ``[hot, L)`` (unique by construction), ascending, -1 padded at the tail."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    local = torch.arange(n, device=device) // bk  # [n]
    free = topk - 1 - hot
    span = (local - hot).clamp(min=0)[:, None, None]  # [n, 1, 1]
    k = torch.arange(free, device=device)
    start = hot + span * k // free  # [n, 1, free]
    stop = hot + span * (k + 1) // free
    u = torch.rand((n, hkv, free), generator=g, device=device)
    rand = torch.where(stop > start, start + (u * (stop - start)).long(), -1)  # [n, Hkv, free]
    blocks = torch.arange(hot, device=device)
    sink = torch.where(blocks < local[:, None], blocks, -1)[:, None, :].expand(n, hkv, hot)
    rows = torch.cat([sink, rand, local[:, None, None].expand(n, hkv, 1)], dim=2)
    big = torch.iinfo(torch.int64).max
    rows = torch.sort(torch.where(rows < 0, big, rows), dim=2).values  # -1 to the tail
    return torch.where(rows == big, -1, rows).int().contiguous()


def torch_csr(I, rows):
    """The PyTorch build for one sequence: (row_ptr, q_indices, slots) like msa's."""
    import torch

    tq, hkv, topk = I.shape
    width = tq * topk
    heads = torch.arange(hkv, device=I.device)[:, None]
    key = I.permute(1, 0, 2).reshape(hkv, width).long()  # [Hkv, Tq*K] in (t, s) order
    key = torch.where(key >= 0, key, rows) + heads * (rows + 1)  # padding sorts last
    order = torch.sort(key.reshape(-1), stable=True).indices.reshape(hkv, width) - heads * width
    counts = torch.bincount(key.reshape(-1), minlength=hkv * (rows + 1))
    counts = counts.reshape(hkv, rows + 1)[:, :rows]
    row_ptr = torch.zeros((hkv, rows + 1), dtype=torch.int32, device=I.device)
    row_ptr[:, 1:] = torch.cumsum(counts, dim=1)
    real = torch.arange(width, device=I.device)[None, :] < row_ptr[:, -1:]
    q_indices = torch.where(real, order // topk, -1).int()
    slots = torch.where(real, order % topk, -1).int()
    return row_ptr, q_indices, slots


def torch_schedule(row_ptr, chunk_size):
    """The PyTorch scheduler for one sequence: work [W, 6] (reads W back, as torch must)."""
    import torch

    rows = row_ptr.shape[1] - 1
    ptr = row_ptr.long()
    n = ptr[:, 1:] - ptr[:, :-1]  # [Hkv, rows]
    chunks = ((n + chunk_size - 1) // chunk_size).reshape(-1)  # [Hkv*rows]
    item = torch.repeat_interleave(torch.arange(chunks.numel(), device=ptr.device), chunks)
    first = torch.cumsum(chunks, 0) - chunks
    c = torch.arange(item.numel(), device=ptr.device) - first[item]
    h, r = item // rows, item % rows
    q_begin = ptr[h, r] + c * chunk_size
    q_count = torch.minimum(ptr[h, r + 1] - q_begin, torch.full_like(q_begin, chunk_size))
    order = torch.sort(-q_count, stable=True).indices  # items already in (h, r, q_begin) order
    work = torch.stack([h, r, q_begin, q_count, torch.zeros_like(h), r], dim=1)
    return work[order].int()


def time_ms(fn, reps, warmup=2):
    """Median milliseconds of ``fn()`` between two CUDA events (launch overheads included)."""
    return cuda_time_ms(fn, warmup=warmup, reps=reps)


def host_ms(fn, reps):
    """Milliseconds of Python per ``fn()`` (launches queued, not waited for): where this is
    close to the CUDA-event time, the build is bound by the host, not by the GPU."""
    import time

    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / reps * 1e3


def peak_mib(fn):
    """Peak GPU memory (MiB, torch allocator) of one ``fn()`` above what was allocated before."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def run_case(n, pattern, reps):
    import torch

    from msa.cuda import csr as gpu_csr
    from msa.cuda import schedule as gpu_schedule
    from msa.cuda._core.launch import karg
    from msa.cuda.csr import _plan

    case = dict(n=n, pattern=pattern, hkv=HKV, topk=TOPK, block_size=BK)
    chunk_size = 2 * TOPK * BK  # the paper's chunk, about 2*K*Bk queries
    case["chunk_size"] = chunk_size
    I = selection(n, HKV, TOPK, BK, hot=HOT if pattern == "skewed" else 0, seed=n)
    cu = np.array([0, n], np.int32)  # host metadata, as the launchers read it
    rows = n // BK
    edges = n * HKV * TOPK
    bytes_moved = 12 * edges  # read I (4 B/entry) + write q_indices and slots (4 B each)
    case["bytes_formula"] = "12 * Tq * Hkv * K"

    def msa_csr():
        return gpu_csr.build_csr(I, cu, cu, BK, validate=False)

    def msa_schedule(row_ptr):
        return gpu_schedule.build_schedule(row_ptr, cu, BK, chunk_size, max_edges=n * TOPK,
                                           validate=False)

    def msa_all():
        return msa_schedule(msa_csr()[0])

    def torch_all():
        return torch_schedule(torch_csr(I, rows)[0], chunk_size)

    # 1. correctness gate
    got = msa_csr()
    want = torch_csr(I, rows)
    case["csr_equal"] = all(torch.equal(g, w) for g, w in zip(got, want))
    work, num_items = msa_schedule(got[0])
    w = int(num_items[0])
    want_work = torch_schedule(want[0], chunk_size)
    case["schedule_equal"] = w == len(want_work) and torch.equal(work[:w], want_work) and bool(
        (work[w:] == -1).all())
    again = msa_csr()
    case["reproducible"] = all(torch.equal(a, b) for a, b in zip(got, again))
    batch, ctx, dI = gpu_csr._selection(I, cu, cu, BK, False)
    plan = _plan.Plan(batch, dI, ctx)
    case["default_scatter"] = plan.scatter_version()

    def msa_csr_scatter(version):
        return gpu_csr._build_csr(I, cu, cu, BK, validate=False, scatter_version=version)

    for version in (2, 3):
        case[f"csr_scatter_v{version}_equal"] = all(
            torch.equal(g, w) for g, w in zip(msa_csr_scatter(version), want))
    case["work_items"], case["work_capacity"] = w, int(work.shape[0])
    case["nnz_per_head"] = [int(x) for x in got[0][:, -1].tolist()]
    case["max_q_count"] = int(work[:w, 3].max()) if w else 0
    del again, want_work

    # 2. timings
    row_ptr = got[0]
    t = {}
    t["msa_csr_ms"] = time_ms(msa_csr, reps)
    t["msa_schedule_ms"] = time_ms(lambda: msa_schedule(row_ptr), reps)
    t["msa_csr_schedule_ms"] = time_ms(msa_all, reps)
    for version in (2, 3):
        t[f"msa_csr_scatter_v{version}_ms"] = time_ms(lambda: msa_csr_scatter(version), reps)
    t["torch_csr_ms"] = time_ms(lambda: torch_csr(I, rows), reps)
    t["torch_csr_schedule_ms"] = time_ms(torch_all, reps)
    case.update(t)
    case["msa_csr_gbps"] = bytes_moved / t["msa_csr_ms"] / 1e6
    case["torch_csr_gbps"] = bytes_moved / t["torch_csr_ms"] / 1e6
    case["ratio_csr"] = t["torch_csr_ms"] / t["msa_csr_ms"]
    case["ratio_csr_schedule"] = t["torch_csr_schedule_ms"] / t["msa_csr_schedule_ms"]
    case["msa_peak_mib"] = peak_mib(msa_all)
    case["torch_peak_mib"] = peak_mib(torch_all)

    # 3. msa's phases, each launched on its own (with its allocations). The sum can exceed the
    # whole build, where host launch work overlaps GPU work.
    try:
        tile = plan.tile_queries()
        case["tile_queries"] = tile
        case["count_version"] = 2 if _plan.shared_count_fits(plan.rows, plan.tq, tile) else 1
        cursors = plan.count(tile)
        pristine = cursors.clone()
        rp = plan.scan(cursors)
        scanned = cursors.clone()
        q, s = (karg(ctx, ctx.empty((HKV, n * TOPK), np.int32)) for _ in range(2))
        ntiles = cursors.shape[0]

        def scan():
            cursors.copy_(pristine)
            return plan.scan(cursors)

        def scatter():  # the scatter advances the cursors: start from the scanned ones
            cursors.copy_(scanned)
            plan._scatter_tiled(karg(ctx, rp), karg(ctx, cursors), ntiles, tile, q, s)

        def scatter_v3():  # reads the scanned cursors, never changes them
            plan._scatter_split(karg(ctx, rp), karg(ctx, scanned), ntiles, tile, q, s,
                                _plan.SPLIT_THREADS)

        def checks_and_plan():
            b, c, d = gpu_csr._selection(I, cu, cu, BK, False)
            return _plan.Plan(b, d, c)

        phases = {
            "plan_ms (host checks + metadata)": time_ms(checks_and_plan, reps),
            "count_ms (tile histogram)": time_ms(lambda: plan.count(tile), reps),
            "count_v1_ms (zero + global atomics)": time_ms(
                lambda: plan.count(tile, version=1), reps),
            "copy_ms (subtract from the scans)": time_ms(lambda: cursors.copy_(pristine), reps),
            "scan_ms (tile scan + prefix sum, look-back)": time_ms(scan, reps),
            "scatter_v2_ms (+ copy)": time_ms(scatter, reps),
            "scatter_v3_ms (two multi-splits + unpack)": time_ms(scatter_v3, reps)
            if _plan.split_fits(plan.rows) else None,
            "schedule_ms": t["msa_schedule_ms"],
            "host_csr_ms (Python per build_csr)": host_ms(msa_csr, reps),
            "host_schedule_ms (Python per build_schedule)": host_ms(
                lambda: msa_schedule(row_ptr), reps),
        }
        case["msa_csr_phases"] = phases
        case["launches"] = dict(csr="3 (scatter v2) or 5 (v3)", schedule="5 (one torch fill_)")
    except Exception as e:  # the breakdown is a bonus; keep the case
        case["msa_csr_phases_error"] = f"{type(e).__name__}: {e}"

    # The v1 ladder rung (one thread per row) only where it finishes quickly.
    if n <= 32 * 1024:
        try:
            case["msa_csr_v1_ms"] = time_ms(lambda: gpu_csr._build_csr(
                I, cu, cu, BK, validate=False, scatter_version=1), 3, warmup=1)
        except Exception as e:
            case["msa_csr_v1_error"] = f"{type(e).__name__}: {e}"
    return case


def print_table(cases):
    cols = [("N", "n", "{:>8}"), ("pattern", "pattern", "{:>8}"),
            ("ok", None, "{:>3}"),
            ("msa csr ms", "msa_csr_ms", "{:>10.3f}"), ("GB/s", "msa_csr_gbps", "{:>7.0f}"),
            ("torch csr ms", "torch_csr_ms", "{:>12.3f}"), ("GB/s", "torch_csr_gbps", "{:>7.0f}"),
            ("x csr", "ratio_csr", "{:>6.1f}"),
            ("scatter v2 ms", "msa_csr_scatter_v2_ms", "{:>13.3f}"),
            ("scatter v3 ms", "msa_csr_scatter_v3_ms", "{:>13.3f}"),
            ("msa sched ms", "msa_schedule_ms", "{:>12.3f}"),
            ("msa all ms", "msa_csr_schedule_ms", "{:>10.3f}"),
            ("torch all ms", "torch_csr_schedule_ms", "{:>12.3f}"),
            ("x all", "ratio_csr_schedule", "{:>6.1f}"),
            ("W", "work_items", "{:>7}"), ("msa MiB", "msa_peak_mib", "{:>8.0f}"),
            ("torch MiB", "torch_peak_mib", "{:>9.0f}")]
    width = [int(fmt[3:-1].split(".")[0].rstrip("df")) for _, _, fmt in cols]  # "{:>10.3f}" -> 10
    print(" ".join(f"{name:>{w}}" for (name, _, _), w in zip(cols, width)))
    for case in cases:
        if "error" in case:
            print(f"{case['n']:>8} {case['pattern']:>8}  ERROR {case['error']}")
            continue
        cells = []
        for name, key, fmt in cols:
            if key is None:
                ok = all(case.get(k) for k in ("csr_equal", "schedule_equal", "reproducible",
                                               "csr_scatter_v2_equal", "csr_scatter_v3_equal"))
                cells.append("yes" if ok else " NO")
            else:
                cells.append(fmt.format(case.get(key, float("nan"))))
        print(" ".join(cells))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "csr.json"))
    parser.add_argument("--sizes", type=int, nargs="*", default=list(SIZES))
    parser.add_argument("--patterns", nargs="*", default=list(PATTERNS))
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_csr needs a CUDA GPU")
    result = dict(header=header(), cases=[])  # benchmarks.common.header
    for n in args.sizes:
        for pattern in args.patterns:
            try:
                case = run_case(n, pattern, args.reps)
            except Exception as e:
                case = dict(n=n, pattern=pattern, error=f"{type(e).__name__}: {e}",
                            traceback=traceback.format_exc())
            result["cases"].append(case)
            torch.cuda.empty_cache()
            print(json.dumps({k: v for k, v in case.items() if k != "traceback"}), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print()
    print_table(result["cases"])
    print("\nmsa phases (ms):")
    for case in result["cases"]:
        phases = case.get("msa_csr_phases")
        if phases:
            cells = ", ".join(f"{k.split('_ms')[0]} {v:.3f}" for k, v in phases.items()
                              if v is not None)
            print(f"{case['n']:>8} {case['pattern']:>8}  {cells}")
        elif "msa_csr_phases_error" in case:
            print(f"{case['n']:>8} {case['pattern']:>8}  ERROR {case['msa_csr_phases_error']}")
    print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
