"""Shared benchmark plumbing: CUDA-event timing, the JSON header, tables.

Every benchmark: correctness gate first, warm-up excluded, CUDA events, median of several runs,
each timing printed with its GB/s or TFLOP/s from a formula written beside it, baselines
measured in the same run, results as JSON under benchmarks/results/.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import subprocess
import time

HBM_COPY_TBPS = 4.26  # H200 device-to-device copy measured on the lent machine (device README)


@functools.lru_cache(maxsize=None)
def copy_tbps(nbytes: int = 2 << 30) -> float:
    """This GPU's device-to-device copy rate in TB/s, ``2 nbytes`` (read + written) over the
    median time of a ``nbytes`` torch copy, measured once per process: the rate an HBM floor
    is computed at, so that floors are the card's own (``HBM_COPY_TBPS`` is the H200's)."""
    import torch

    def timed_copy():
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        return cuda_time_ms(lambda: dst.copy_(src), warmup=3, reps=9)

    ms = timed_copy()
    torch.cuda.empty_cache()  # the two buffers back to the GPU for the benchmark
    return 2 * nbytes / (ms * 1e9)


def cuda_time_ms(fn, *, warmup: int = 2, reps: int = 7) -> float:
    """Median wall time of ``fn()`` in ms between CUDA events (torch), warm-up excluded."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def kernel_table(fn, title: str, *, rows: int = 12, width: int = 60) -> None:
    """Print the wall time of one warm ``fn()`` and torch.profiler's table of the CUDA kernels
    of another call, most time first (``fn`` is called once more before, as a warm-up)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    t = time.time()
    fn()
    torch.cuda.synchronize()
    wall = time.time() - t
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"===== {title}: one call, wall {wall * 1e3:.1f} ms", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows,
                                    max_name_column_width=width), flush=True)


def peak_memory_gib(fn) -> float:
    """Peak torch-allocated GPU memory of one ``fn()`` call, in GiB (CuPy/Numba pools not counted)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def header() -> dict:
    """GPU, library versions and commit, for the top of every results JSON."""
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version()}
    # MSA_COMMIT where set (a copy of another commit's tree run inside this checkout, whose git
    # would name this checkout's commit); else the tree's commit, "-dirty" where tracked files
    # differ from it
    info["commit"] = os.environ.get("MSA_COMMIT", "")
    if not info["commit"]:
        try:
            out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7",
                                  "--exclude=*"], capture_output=True, text=True,
                                 check=False).stdout.strip()
        except OSError:
            out = ""
        info["commit"] = out or "unknown"
    for mod in ("numpy", "numba", "numba.cuda", "torch", "cupy"):
        try:
            m = __import__(mod, fromlist=["x"])
            info[mod] = getattr(m, "__version__", "?")
        except Exception as exc:  # a missing optional library is recorded, not fatal
            info[mod] = f"unavailable ({type(exc).__name__})"
    try:
        import torch
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda_runtime"] = torch.version.cuda
    except Exception as exc:
        info["gpu"] = f"unavailable ({type(exc).__name__})"
    return info


def write_json(path: str, results: list, **extra) -> None:
    payload = {"header": header(), **extra, "results": results}
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)


def print_table(rows: list[dict], columns: list[str]) -> None:
    """A plain fixed-width table of ``rows`` (missing keys print as '-')."""
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)
    cells = [[fmt(r.get(c, "-")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c)
              for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


class Stopwatch:
    """Host wall time, for the few steps that are not on the GPU stream."""

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.ms = (time.perf_counter() - self.t0) * 1e3
