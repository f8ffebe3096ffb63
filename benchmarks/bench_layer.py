"""The MSA training layer's whole step on the GPU, against the same layer with dense attention.

    source .gpu/env.sh && python3 -m benchmarks.bench_layer --out FILE       # every target
    source .gpu/env.sh && python3 -m benchmarks.bench_layer --quick --out FILE
    source .gpu/env.sh && bash benchmarks/gpu_session.sh layer              # every target, $OUT
    python -m benchmarks.bench_layer --device cpu --tiny --out FILE          # anywhere, toy sizes

Paper configuration (d_model 3072, Hq 64, Hkv 4, D = Didx = 128, Bk 128, K 16, bf16), one
sequence of N tokens. The step is what a training loop runs::

    out = layer(x, cu)                                   # Algorithm 1, lines 1-7
    (torch.sum(out.output * g) + out.loss_kl).backward()

whose gradients the benchmark feeds to autograd directly (``torch.autograd.backward((output,
loss_kl), (g, 1))``: the same gradients, without the harness's own ``N x d_model`` products),
against the dense layer: the same four projections (``x @ W_q``, ``W_k``, ``W_v``, ``W_o``)
around causal ``scaled_dot_product_attention(..., enable_gqa=True)``, forward and backward. Both
take ``x`` with ``requires_grad`` (a layer inside a model); the gradients are set to None before
each step. One run measures, sizes smallest first, within a time box (``--budget-s``):

1. the step time of each (median of CUDA-event timings after an untimed first step, which is
   timed on the host as ``first_step_s``), their ratio ``msa_speedup`` (dense / MSA) at every
   N up to ``--dense-max-n``, peak GPU memory, and whether the outputs, ``L_KL`` and every
   gradient are finite; where the smallest ratio is below 1 and a larger one above (or all are
   above), ``--crossover-probes`` more sizes between (or below) them, and the crossover length
   interpolated in log-log;
2. the sizes above ``--isolate-above`` (512K) in a child process of their own, so that running
   out of memory or a sticky CUDA error there cannot spoil the rest; the dense layer is not run
   above ``--dense-max-n``;
3. at ``--profile N`` one step under torch.profiler: the share of the step's wall interval
   (a ``record_function`` around the step and its synchronize) during which at least one
   kernel runs (the union of the kernels' intervals, so that overlapping kernels count once),
   the same with memory copies and sets, the longest idle gaps with the host operations that
   ran during them, and the host operations with the most self CPU time;
4. the warmup step (``layer.warmup = True``: dense main branch by PyTorch's fused flash op that
   returns the LSE, the KL on the full causal support) at ``--warmup-sizes``, next to the sparse
   step of the same N, and its two halves timed apart (``main_branch_ms``: the dense branch
   forward and backward; ``kl_ms``: the KL and its gradients); a step predicted to take more than
   ``WARMUP_SINGLE_S`` runs once, timed, with no untimed step before it (its kernels were
   compiled at a smaller N) and no halves;
5. the cold start: two fresh processes one after the other (``--cold-start-child``), each
   timing its imports, setup and first step at ``--cold-start N`` (``first_step_s``: the step
   alone, the target's number; ``after_torch_import_s``: msa's import, the layer and the step;
   ``total_s`` from the process's start, ``wall_s`` as its parent saw it); by default they share an
   empty kernel cache folder (``XDG_CACHE_HOME``, ``--cold-start-cache fresh``), so the first
   compiles every kernel and the second finds them on disk, whatever the machine's own cache
   holds; this process then uses that folder too;
6. ``torch.compile(layer)`` (inductor on a GPU, ``aot_eager`` on the CPU) at ``--compile-check
   N``: its first step's seconds and whether its step equals the eager one (selection, output,
   ``L_KL`` and LSE bit for bit, every gradient within ``COMPILE_GRAD_TOL`` of its largest
   entry).

Before each item the run estimates its seconds from what it has measured (the sparse step
linear in N, the dense and the warmup quadratic); an item that would end past the budget is
skipped with a row that says so. The JSON is rewritten after every item (a run cut short keeps
what it measured), and ends with ``summary`` (the targets, measured or not) and the figure
(``bench_layer.png`` beside the JSON; ``python -m benchmarks.plot`` redraws it from the JSON).

Useful FLOPs (MiniMax MSA's convention): the sparse main branch forward ``2 (D + D) Hq S`` and
backward ``2 (3D + 2D) Hq S`` with ``S`` the (query, visible selected key) pairs; the dense
``S = N (N + 1) / 2``. The projections are ``2 N d_model (2 Hq D + 2 Hkv D + Hkv Didx + Didx)``
forward and twice that backward.

``--device cpu`` runs the layer's CPU path (the NumPy reference) and times on the host; the GPU
parts say why they did not run (no kernel activity in the profile, the chunked fallback in the
warmup). ``--tiny`` is a toy configuration (d_model 64, Hq 4, Hkv 2, D = Didx = 16, Bk 16, K 2,
float32) at N 64-512, which exercises every step of the run in well under a minute on a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

T0 = time.perf_counter()  # this process's clock for the progress lines and the budget
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STEP_MARK = "bench_layer.step"  # the profiler's range around one step
WARMUP_SINGLE_S = 10.0  # a warmup step predicted longer than this runs once, timed
BUSY_TARGET = 0.9  # the GPU's busy share of the 128K step
COLD_START_TARGET_S = 10.0  # the first step of a process that finds the kernels on disk
COMPILE_GRAD_TOL = {"bfloat16": 2e-2, "float16": 2e-2, "float32": 1e-5, "float64": 1e-12}
SPEEDUP_TARGETS = {32768: 1.5, 131072: 5.0}  # dense step / MSA step


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int
    hq: int
    hkv: int
    d: int
    d_idx: int
    block_size: int
    topk: int
    dtype: str


PAPER = Config(3072, 64, 4, 128, 128, 128, 16, "bfloat16")
TINY = Config(64, 4, 2, 16, 16, 16, 2, "float32")

# What each preset measures; an option given on the command line overrides its entry.
PRESETS = {
    "full": dict(sizes=(8192, 32768, 131072, 524288), reps=3, dense_max_n=131072,
                 warmup_sizes=(8192, 32768, 131072), profile=131072, cold_start=32768,
                 compile_check=4096, crossover_probes=2, isolate_above=131072, budget_s=400.0),
    "quick": dict(sizes=(8192, 32768), reps=2, dense_max_n=32768, warmup_sizes=(8192, 32768),
                  profile=32768, cold_start=32768, compile_check=0, crossover_probes=0,
                  isolate_above=0, budget_s=240.0),
    "tiny": dict(sizes=(64, 128, 256, 512), reps=2, dense_max_n=256, warmup_sizes=(128, 256),
                 profile=256, cold_start=128, compile_check=64, crossover_probes=1,
                 isolate_above=256, budget_s=300.0),
    "tiny-quick": dict(sizes=(64, 128), reps=1, dense_max_n=128, warmup_sizes=(128,),
                       profile=128, cold_start=0, compile_check=0, crossover_probes=0,
                       isolate_above=0, budget_s=120.0),
}


def log(msg: str) -> None:
    """A progress line with this process's elapsed seconds."""
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", flush=True)


def case_of(n: int) -> str:
    return f"N={n // 1024}K" if n >= 1024 and n % 1024 == 0 else f"N={n}"


# -- the layers and their steps ------------------------------------------------------------------

def _torch_dtype(cfg):
    import torch

    return getattr(torch, cfg.dtype)


def make_layer(cfg: Config, device: str, seed: int = 0):
    import torch

    from msa.torch import MSAAttention

    torch.manual_seed(seed)
    return MSAAttention(cfg.d_model, cfg.hq, cfg.hkv, cfg.d, cfg.d_idx, block_size=cfg.block_size,
                        topk=cfg.topk, device=device, dtype=_torch_dtype(cfg))


class DenseLayer:
    """The MSA layer's main projections around causal SDPA (no index branch)."""

    def __init__(self, layer, cfg: Config):
        self.w_q, self.w_k, self.w_v, self.w_o = layer.w_q, layer.w_k, layer.w_v, layer.w_o
        self.cfg = cfg

    def parameters(self):
        return [self.w_q, self.w_k, self.w_v, self.w_o]

    def __call__(self, x):
        import torch.nn.functional as F

        c, t = self.cfg, x.shape[0]
        q = (x @ self.w_q).view(t, c.hq, c.d).transpose(0, 1)[None]  # [1, Hq, T, D]
        k = (x @ self.w_k).view(t, c.hkv, c.d).transpose(0, 1)[None]
        v = (x @ self.w_v).view(t, c.hkv, c.d).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return o[0].transpose(0, 1).reshape(t, c.hq * c.d) @ self.w_o


def inputs(cfg: Config, n: int, device: str, seed: int = 1):
    """``x [N, d_model]`` (requires grad), host offsets ``cu [2]`` and the output's gradient
    ``g``, scaled so that ``sum(output * g)`` is of order 1."""
    import numpy as np
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    dt = _torch_dtype(cfg)
    x = torch.randn(n, cfg.d_model, device=device, dtype=dt, generator=gen).requires_grad_(True)
    g = torch.randn(n, cfg.d_model, device=device, dtype=dt, generator=gen)
    g.mul_(1.0 / math.sqrt(n * cfg.d_model))  # in place: no float32 temporaries at 512K
    return x, np.array([0, n], dtype=np.int32), g


def _clear_grads(x, params):
    x.grad = None
    for w in params:
        w.grad = None


def sparse_step(layer, x, cu, g):
    """``out = layer(x, cu)``, then the gradients of ``sum(out.output * g) + out.loss_kl``."""
    import torch

    _clear_grads(x, layer.parameters())
    out = layer(x, cu)
    torch.autograd.backward((out.output, out.loss_kl), (g, torch.ones_like(out.loss_kl)))
    return out


def dense_step(dense, x, g):
    _clear_grads(x, dense.parameters())
    dense(x).backward(g)


def projection_flops(cfg: Config, n: int) -> int:
    return 2 * n * cfg.d_model * (2 * cfg.hq * cfg.d + 2 * cfg.hkv * cfg.d + cfg.hkv * cfg.d_idx
                                  + cfg.d_idx)


def visible_pairs(cfg: Config, I, n: int) -> int:
    """S: (query, visible selected key) pairs of a one-sequence selection I [N, Hkv, K]."""
    import torch

    pos = torch.arange(n, device=I.device).view(n, 1, 1)
    start = I.long() * cfg.block_size
    keys = torch.clamp(torch.minimum(pos + 1, torch.full_like(start, n)) - start, 0,
                       cfg.block_size)
    return int(torch.where(I >= 0, keys, torch.zeros_like(keys)).sum()) // cfg.hkv


def sparse_flops(cfg: Config, n: int, pairs: int) -> int:
    return (2 * (cfg.d + cfg.d) * cfg.hq * pairs + 2 * (3 * cfg.d + 2 * cfg.d) * cfg.hq * pairs
            + 3 * projection_flops(cfg, n))


def dense_flops(cfg: Config, n: int) -> int:
    pairs = n * (n + 1) // 2
    flops = 2 * (cfg.d + cfg.d) * cfg.hq * pairs + 2 * (3 * cfg.d + 2 * cfg.d) * cfg.hq * pairs
    return flops + 3 * (projection_flops(cfg, n) - 2 * n * cfg.d_model * (cfg.hkv * cfg.d_idx
                                                                          + cfg.d_idx))


def all_finite(out, x, params) -> bool:
    import torch

    tensors = [out.output, out.loss_kl, x.grad] + [w.grad for w in params]
    return all(t is not None and bool(torch.isfinite(t).all()) for t in tensors)


def warmup_main_branch(cfg: Config, device: str) -> str:
    """Which code the warmup's dense main branch runs here, and why."""
    import numpy as np
    import torch

    from msa.torch import ops

    q = torch.empty((1, cfg.hq, cfg.d), dtype=_torch_dtype(cfg), device=device)
    cu = np.array([0, 1], dtype=np.int64)
    if ops._fused_dense_applies(q, cu, cu):
        return "aten._scaled_dot_product_flash_attention (fused, returns the LSE)"
    why = ("CPU tensors" if device == "cpu" else
           f"{cfg.dtype}, D={cfg.d}: the fused op takes CUDA fp16/bf16 with D % 8 == 0, D <= 256")
    return f"chunked PyTorch fallback ({why})"


# -- timing, memory, failures --------------------------------------------------------------------

def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def time_ms(fn, device: str, reps: int) -> float:
    """Median ms of ``reps`` calls: CUDA events on the GPU, the host clock on the CPU."""
    if device == "cuda":
        from benchmarks.common import cuda_time_ms

        return cuda_time_ms(fn, warmup=0, reps=reps)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return times[len(times) // 2]


def reset_peak(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str):
    """Peak torch-allocated GPU memory since ``reset_peak`` in GiB (None on the CPU)."""
    if device != "cuda":
        return None
    import torch

    return torch.cuda.max_memory_allocated() / 2**30


def failure(exc: BaseException, device: str) -> dict:
    """The fields of a row whose measurement raised: the error, and for an out-of-memory error
    the peak reached before it."""
    row = dict(error=f"{type(exc).__name__}: {str(exc)[:400]}")
    text = str(exc).lower()
    if "out of memory" in text or "out_of_memory" in text:  # torch's, or a CUDA driver call's
        row["oom"] = True
        row["peak_gib_before_oom"] = peak_gib(device)
    return row


def free_memory(device: str) -> None:
    import gc

    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


# -- the run: rows, budget, estimates, the JSON ---------------------------------------------------

class Run:
    """What one invocation measured so far, its time box, and the JSON it keeps rewriting."""

    def __init__(self, args, cfg: Config):
        self.args, self.cfg = args, cfg
        self.rows: list[dict] = []
        self.extra: dict = {}
        self.header = None

    # budget
    def elapsed(self) -> float:
        return time.perf_counter() - T0

    def left(self) -> float:
        return self.args.budget_s - self.elapsed()

    def fits(self, est_s, n: int, impl: str) -> bool:
        """Whether an item estimated at ``est_s`` seconds (None: nothing to estimate from yet,
        so it runs while any time is left) ends within the budget; if not, a row that says why
        it was skipped."""
        if self.elapsed() + (est_s or 0.0) <= self.args.budget_s:
            return True
        more = "" if est_s is None else f"about {est_s:.0f} s more "
        self.add(dict(case=case_of(n), n=n, impl=impl, skipped=(
            f"time budget: at {self.elapsed():.0f} s, {more}would pass the "
            f"{self.args.budget_s:.0f} s of --budget-s")))
        return False

    # estimates from what was measured (seconds)
    def measured(self, impl: str) -> list[tuple[int, dict]]:
        return sorted((r["n"], r) for r in self.rows if r.get("impl") == impl and r.get("ms"))

    def step_ms(self, impl: str, n: int, power: float):
        """The ms of ``impl`` at N from its largest measurement at or below N (else its smallest),
        scaled as ``N ** power``; None before any."""
        pts = self.measured(impl)
        if not pts:
            return None
        below = [p for p in pts if p[0] <= n]
        n0, r0 = below[-1] if below else pts[0]
        return r0["ms"] * (n / n0) ** power

    def est_sparse(self, n: int):
        ms = self.step_ms(IMPL_SPARSE, n, 1.0)
        return None if ms is None else (2 * self.args.reps + 3) * ms / 1e3 + 2.0

    def est_dense(self, n: int):
        ms = self.step_ms(IMPL_DENSE, n, 2.0)
        return None if ms is None else (self.args.reps + 1) * ms / 1e3 + 1.0

    def est_warmup_step(self, n: int):
        return self.step_ms(IMPL_WARMUP, n, 2.0)

    # rows and the JSON
    def add(self, row: dict, *, show: bool = True) -> dict:
        self.rows.append(row)
        if show:
            log("  " + "  ".join(f"{k}={_fmt(v)}" for k, v in row.items()))
        self.write()
        return row

    def write(self) -> None:
        if self.header is None:
            from benchmarks.common import header

            self.header = header()
        payload = {"header": self.header,
                   "config": dict(dataclasses.asdict(self.cfg), device=self.args.device,
                                  preset=self.args.preset_name),
                   "run": dict(budget_s=self.args.budget_s, elapsed_s=round(self.elapsed(), 1),
                               argv=self.args.argv),
                   **self.extra, "results": self.rows}
        tmp = self.args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=2, default=str)
        os.replace(tmp, self.args.out)


IMPL_SPARSE = "MSAAttention step"
IMPL_DENSE = "dense layer step (SDPA)"
IMPL_WARMUP = "MSAAttention warmup step"


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, str) and len(v) > 160:
        return v[:160] + "..."
    return str(v)


# -- 1: the sparse and the dense step at one size --------------------------------------------------

def bench_size(run: Run, n: int, *, role: str = "sweep"):
    """The MSA step at N, then the dense step (N <= --dense-max-n), then the profile
    (N == --profile), each behind the budget."""
    args, cfg, dev = run.args, run.cfg, run.args.device
    case = case_of(n)
    if not run.fits(run.est_sparse(n), n, IMPL_SPARSE):
        return
    log(f"{case}: MSA step ({role})")
    layer = x = g = out = dense = None
    try:
        layer = make_layer(cfg, dev)
        x, cu, g = inputs(cfg, n, dev)
        reset_peak(dev)
        t = time.perf_counter()
        out = sparse_step(layer, x, cu, g)  # untimed (the first step's compiles and allocations)
        sync(dev)
        first_s = time.perf_counter() - t
        finite = all_finite(out, x, layer.parameters())
        pairs = visible_pairs(cfg, out.block_indices, n)
        loss_kl = float(out.loss_kl.detach())
        out = None
        reset_peak(dev)
        ms = time_ms(lambda: sparse_step(layer, x, cu, g), dev, args.reps)
        peak = peak_gib(dev)
        # the same step with the main backward's dQ partials in bf16 (an option of the layer)
        layer.main_backward_partials = "bfloat16"
        sparse_step(layer, x, cu, g)
        bf16_ms = time_ms(lambda: sparse_step(layer, x, cu, g), dev, args.reps)
        layer.main_backward_partials = "float32"
        run.add(dict(case=case, n=n, impl=IMPL_SPARSE, ms=ms,
                     tflops=sparse_flops(cfg, n, pairs) / ms / 1e9, peak_gib=peak,
                     bf16_partials_ms=bf16_ms, pairs=pairs, first_step_s=first_s,
                     finite=finite, loss_kl=loss_kl, reps=args.reps, role=role,
                     process=args.process))
    except Exception as exc:  # recorded, not fatal: the next size may still run
        run.add(dict(case=case, n=n, impl=IMPL_SPARSE, role=role, process=args.process,
                     **failure(exc, dev)))
        layer = x = g = out = None
        free_memory(dev)
        return
    sparse_ms = ms
    if n <= args.dense_max_n and run.fits(run.est_dense(n), n, IMPL_DENSE):
        log(f"{case}: dense step")
        try:
            dense = DenseLayer(layer, cfg)
            dense_step(dense, x, g)
            sync(dev)
            reset_peak(dev)
            ms = time_ms(lambda: dense_step(dense, x, g), dev, args.reps)
            run.add(dict(case=case, n=n, impl=IMPL_DENSE, ms=ms,
                         tflops=dense_flops(cfg, n) / ms / 1e9, peak_gib=peak_gib(dev),
                         msa_speedup=ms / sparse_ms, reps=args.reps, role=role,
                         process=args.process))
        except Exception as exc:
            run.add(dict(case=case, n=n, impl=IMPL_DENSE, role=role, process=args.process,
                         **failure(exc, dev)))
        dense = None
        free_memory(dev)
    if n == args.profile and run.fits(3 * sparse_ms / 1e3 + 10.0, n, "profile"):
        log(f"{case}: profiled step")
        try:
            run.extra["profile"] = profile_step(lambda: sparse_step(layer, x, cu, g), dev, n,
                                                sparse_ms)
        except Exception as exc:
            run.extra["profile"] = dict(n=n, **failure(exc, dev))
        run.write()
        prof = run.extra["profile"]
        log(f"{case}: GPU busy share {_fmt(prof.get('gpu_busy_share'))} "
            f"({prof.get('why_no_gpu_share') or prof.get('error') or 'kernels only'})")
    layer = x = g = dense = None
    free_memory(dev)


def bench_size_isolated(run: Run, n: int):
    """``bench_size`` at N in a child process (this script with ``--child``), its rows and
    profile merged into this run's."""
    args = run.args
    case = case_of(n)
    est = run.est_sparse(n)
    startup = run.extra.get("cold_start", {}).get("second", {}).get("total_s") or 20.0
    if not run.fits(None if est is None else est + startup, n, IMPL_SPARSE):
        return
    free_memory(args.device)
    fd, child_out = tempfile.mkstemp(prefix="bench_layer_child_", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", "benchmarks.bench_layer", "--child", "--sizes", str(n),
           "--device", args.device, "--reps", str(args.reps), "--dense-max-n",
           str(args.dense_max_n), "--profile", str(args.profile), "--budget-s",
           f"{max(run.left(), 1.0):.0f}", "--out", child_out]
    cmd += ["--tiny"] if args.tiny else []
    log(f"{case}: in a child process: {' '.join(cmd[1:])}")
    rc, why = stream(cmd, timeout_s=max(run.left(), 1.0) + 60.0, prefix=f"  [{case} child] ")
    try:
        with open(child_out) as f:
            child = json.load(f)
    except (OSError, ValueError):
        child = {}
    finally:
        os.unlink(child_out)
    rows = child.get("results", [])
    for row in rows:  # printed by the child already
        run.add(dict(row, process="child"), show=False)
    if "profile" in child:
        run.extra["profile"] = child["profile"]
    if rc != 0 or not any(r.get("impl") == IMPL_SPARSE for r in rows):
        run.add(dict(case=case, n=n, impl=IMPL_SPARSE, process="child",
                     error=f"child process: {why}"))


def stream(cmd, *, timeout_s: float, prefix: str, env=None):
    """Run ``cmd`` from the repository root, its output printed line by line with ``prefix``;
    ``(returncode, what happened)``; killed after ``timeout_s``."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []

    def pump():
        for line in proc.stdout:
            tail.append(line)
            del tail[:-40]
            print(prefix + line.rstrip(), flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        reader.join(5)
        return -9, f"killed after {timeout_s:.0f} s"
    reader.join(5)
    last = "".join(tail[-5:]).strip()[-400:]
    return rc, f"exit status {rc}" + (f": {last}" if rc else "")


# -- 1 (cont.): the crossover length ---------------------------------------------------------------

def speedups(run: Run) -> list[tuple[int, float]]:
    """``(N, dense ms / MSA ms)`` where both ran."""
    return sorted((r["n"], r["msa_speedup"]) for r in run.rows if r.get("msa_speedup"))


def crossover(points):
    """``(N, how)``: where dense / MSA crosses 1, log-log between the measured sizes that
    bracket it; ``(None, why)`` where no pair does."""
    if not points:
        return None, "no size with both steps measured"
    for (n0, r0), (n1, r1) in zip(points, points[1:]):
        if r0 < 1.0 <= r1:
            f = -math.log(r0) / (math.log(r1) - math.log(r0))
            n = math.exp(math.log(n0) + f * (math.log(n1) - math.log(n0)))
            return n, f"log-log between {case_of(n0)} ({r0:.3g}x) and {case_of(n1)} ({r1:.3g}x)"
    if points[0][1] >= 1.0:
        return None, f"MSA is already faster at the smallest size measured, {case_of(points[0][0])}"
    return None, (f"MSA is slower up to the largest size with a dense step, "
                  f"{case_of(points[-1][0])} ({points[-1][1]:.3g}x)")


def probe_crossover(run: Run):
    """``--crossover-probes`` more sizes: the geometric middle of the bracketing pair, or half
    the smallest size when MSA already wins there."""
    bk = run.cfg.block_size
    for _ in range(run.args.crossover_probes):
        pts = speedups(run)
        if not pts:
            return
        target = None
        for (n0, r0), (n1, r1) in zip(pts, pts[1:]):
            if r0 < 1.0 <= r1:
                target = max(bk, round(math.sqrt(n0 * n1) / bk) * bk)
                if target in (n0, n1):
                    return
                break
        else:
            if pts[0][1] >= 1.0 and pts[0][0] // 2 >= 4 * bk:
                target = pts[0][0] // 2
        if target is None or any(n == target for n, _ in pts):
            return
        bench_size(run, target, role="crossover probe")


# -- 3: the GPU's busy share ----------------------------------------------------------------------

def union_ns(intervals):
    """Merged ``[start, end)`` intervals (sorted) of a list of them."""
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def clip(intervals, lo, hi):
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def profile_step(step, device: str, n: int, unprofiled_ms: float) -> dict:
    """One step under torch.profiler (CPU activity, and CUDA where the device is a GPU):
    :func:`timeline_summary` of its events, with the host operations of most self CPU time and
    the kernels of most device time."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    step()
    sync(device)
    with profile(activities=acts) as prof:
        with record_function(STEP_MARK):
            step()
            sync(device)

    def kind(e):
        try:
            return str(e.activity_type())
        except Exception:  # an older torch: classify by device and name
            if e.device_type() != torch.autograd.DeviceType.CUDA:
                return "cpu_op"
            name = e.name().lower()
            return ("gpu_memcpy" if "memcpy" in name else "gpu_memset" if "memset" in name
                    else "kernel")

    spans = [(kind(e), e.name(), e.start_ns(), e.start_ns() + e.duration_ns())
             for e in prof.profiler.kineto_results.events()]
    averages = prof.key_averages()
    summary = dict(n=n, unprofiled_step_ms=unprofiled_ms, **timeline_summary(spans, device))
    summary["top_host_ops"] = [
        dict(name=e.key, self_cpu_ms=e.self_cpu_time_total / 1e3, calls=e.count)
        for e in sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
        if e.key != STEP_MARK]
    if summary.get("gpu_busy_ms") is not None:
        summary["gpu_busy_share_of_unprofiled_step"] = min(
            1.0, summary["gpu_busy_ms"] / unprofiled_ms)
        summary["top_kernels"] = [
            dict(name=e.key[:100], ms=e.self_device_time_total / 1e3, calls=e.count)
            for e in sorted(averages, key=lambda e: e.self_device_time_total, reverse=True)[:10]]
    return summary


def timeline_summary(spans, device: str = "cuda") -> dict:
    """The GPU's busy share of the step from profiler events ``(kind, name, start_ns, end_ns)``
    (kinds as ``_KinetoEvent.activity_type``): the step's wall interval is the host range named
    ``STEP_MARK``; busy is the union of the kernels' intervals clipped to it (overlapping
    kernels count once), also with memory copies and sets; the ten longest idle gaps, each with
    the innermost host operations (ops, launches, runtime calls) that cover most of it."""
    marks = [s for s in spans if s[1] == STEP_MARK and s[0] == "user_annotation"]
    marks = marks or [s for s in spans if s[1] == STEP_MARK]
    w0, w1 = marks[0][2], marks[0][3]
    wall_ns = w1 - w0
    kernels = [(s, e) for k, _, s, e in spans if k == "kernel"]
    memops = [(s, e) for k, _, s, e in spans if k in ("gpu_memcpy", "gpu_memset")]
    out = dict(wall_ms=wall_ns / 1e6, kernels=len(kernels), target=BUSY_TARGET)
    if not kernels:
        out.update(gpu_busy_ms=None, gpu_busy_share=None, met=None, why_no_gpu_share=(
            "no CUDA device: torch.profiler records kernel activity on a GPU only"
            if device != "cuda" else "the profiler recorded no kernel (CUPTI unavailable?)"))
        return out
    busy = union_ns(clip(kernels, w0, w1))
    busy_all = union_ns(clip(kernels + memops, w0, w1))
    busy_ns = sum(e - s for s, e in busy)
    share = busy_ns / wall_ns
    gaps = [(a[1], b[0]) for a, b in zip([[w0, w0]] + busy_all, busy_all + [[w1, w1]])
            if b[0] > a[1]]
    host_kinds = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")  # launches too
    host = [(s, e, name) for k, name, s, e in spans if k in host_kinds and name != STEP_MARK]

    def during(s, e):
        over = [(min(e, c1) - max(s, c0), c1 - c0, name) for c0, c1, name in host
                if c1 > s and c0 < e]
        most = [o for o in over if o[0] >= 0.5 * (e - s)] or sorted(over, reverse=True)[:3]
        return [dict(name=name, overlap_ms=ov / 1e6)
                for ov, _, name in sorted(most, key=lambda o: o[1])[:3]]

    out.update(
        gpu_busy_ms=busy_ns / 1e6, gpu_busy_share=share,
        gpu_busy_share_with_memops=sum(e - s for s, e in busy_all) / wall_ns,
        met=share >= BUSY_TARGET,
        idle_gaps=[dict(at_ms=(s - w0) / 1e6, ms=(e - s) / 1e6, host_ops=during(s, e))
                   for s, e in sorted(gaps, key=lambda g: g[0] - g[1])[:10]])
    return out


# -- 4: the warmup step ----------------------------------------------------------------------------

def warmup_parts(layer, x, cu, dev: str, reps: int) -> dict:
    """The warmup step's two halves on the layer's own projections of ``x``, each forward and
    backward: the dense main branch (``dense_attention``) and the KL on the full causal support
    (``kl_loss`` with its gradients)."""
    import torch

    from msa.torch import functional as F

    t, c = x.shape[0], layer
    with torch.no_grad():
        q = (x @ c.w_q).view(t, c.num_q_heads, c.head_dim)
        k = (x @ c.w_k).view(t, c.num_kv_heads, c.head_dim)
        v = (x @ c.w_v).view(t, c.num_kv_heads, c.head_dim)
        q_idx = (x @ c.w_q_idx).view(t, c.num_kv_heads, c.index_dim)
        k_idx = x @ c.w_k_idx
    qkv = [a.detach().requires_grad_(True) for a in (q, k, v)]
    idx = [a.detach().requires_grad_(True) for a in (q_idx, k_idx)]
    do = torch.randn_like(q)
    lse = []

    def main_branch():
        o, lse_now = F.dense_attention(*qkv, cu, cu, scale=c.scale)
        o.backward(do)
        lse[:] = [lse_now]

    def kl():
        _, loss = F.kl_loss(q, k, *idx, None, lse[0], cu, cu, c.block_size, scale=c.scale,
                            index_scale=c.index_scale, validate=False)
        loss.backward()

    main_branch()
    kl()
    return dict(main_branch_ms=time_ms(main_branch, dev, reps), kl_ms=time_ms(kl, dev, reps))


def bench_warmup(run: Run, n: int):
    import torch

    args, cfg, dev = run.args, run.cfg, run.args.device
    case = case_of(n)
    one = run.est_warmup_step(n)  # ms of one step, None before the first
    single = one is not None and one / 1e3 > WARMUP_SINGLE_S
    reps = 1 if single else max(1, args.reps - 1)
    est = None if one is None else (reps + (0 if single else 1)) * one / 1e3 + 2.0
    if not run.fits(est, n, IMPL_WARMUP):
        return
    log(f"{case}: warmup step ({'one timed step' if single else f'{reps} timed'}"
        f"{'' if one is None else f', about {one / 1e3:.1f} s each'})")
    layer = x = g = None
    row = dict(case=case, n=n, impl=IMPL_WARMUP, main_branch=warmup_main_branch(cfg, dev),
               kl_support="full causal", process=args.process)
    try:
        layer = make_layer(cfg, dev)
        layer.warmup = True
        x, cu, g = inputs(cfg, n, dev)
        if not single:
            t = time.perf_counter()
            out = sparse_step(layer, x, cu, g)
            sync(dev)
            row["first_step_s"] = time.perf_counter() - t
            row["finite"] = all_finite(out, x, layer.parameters())
            row["loss_kl"] = float(out.loss_kl.detach())
            out = None
        reset_peak(dev)
        ms = time_ms(lambda: sparse_step(layer, x, cu, g), dev, reps)
        row.update(ms=ms, peak_gib=peak_gib(dev), reps=reps, untimed_first_step=not single)
        if single:
            row["finite"] = all(t is not None and bool(torch.isfinite(t).all())
                                for t in [x.grad] + [w.grad for w in layer.parameters()])
        sparse = [r for r in run.rows if r.get("impl") == IMPL_SPARSE and r.get("n") == n
                  and r.get("ms")]
        if sparse:
            row["vs_sparse_step"] = ms / sparse[0]["ms"]
        if not single and run.fits(2 * (reps + 1) * ms / 1e3 + 1.0, n, "warmup step's halves"):
            layer.zero_grad(set_to_none=True)
            x.grad = None
            row.update(warmup_parts(layer, x.detach(), cu, dev, reps))
    except Exception as exc:  # reported, not fatal: the warmup's memory is a target
        row.update(failure(exc, dev))
    run.add(row)
    layer = x = g = None
    free_memory(dev)


# -- 5: the cold start -----------------------------------------------------------------------------

def cold_start_child(args) -> int:
    """In a fresh process: imports, setup, first and second step at N; one JSON line."""
    t0 = time.perf_counter()
    cfg, dev, n = (TINY if args.tiny else PAPER), args.device, args.cold_start_child
    import torch  # noqa: F401  (timed: the import is part of a cold start)

    t_torch = time.perf_counter()
    import msa.torch  # noqa: F401

    cache = None
    if dev == "cuda":
        import msa.cuda  # noqa: F401  (the kernels' disk cache is configured here)
        from msa.cuda._core import diskcache

        cache = diskcache.cache_dir()
    t_msa = time.perf_counter()
    layer = make_layer(cfg, dev)
    x, cu, g = inputs(cfg, n, dev)
    sync(dev)
    t_setup = time.perf_counter()
    out = sparse_step(layer, x, cu, g)
    sync(dev)
    t_first = time.perf_counter()
    finite = all_finite(out, x, layer.parameters())
    out = None
    t = time.perf_counter()
    sparse_step(layer, x, cu, g)
    sync(dev)
    t_second = time.perf_counter()
    print("COLD_START_JSON " + json.dumps(dict(
        n=n, import_torch_s=t_torch - t0, import_msa_s=t_msa - t_torch,
        setup_s=t_setup - t_msa, first_step_s=t_first - t_setup,
        after_torch_import_s=t_first - t_torch,  # msa's import, the setup and the first step
        total_s=t_first - t0, second_step_s=t_second - t, finite=finite, kernel_cache=cache,
        kernel_cache_files=count_files(cache))), flush=True)
    return 0


def count_files(path):
    if not path or not os.path.isdir(path):
        return 0 if path else None
    return sum(len(files) for _, _, files in os.walk(path))


def cold_start(run: Run) -> dict:
    """Two fresh processes, one after the other, each timing its first step at N."""
    args = run.args
    n = args.cold_start
    result = dict(n=n, target_s=COLD_START_TARGET_S, cache=args.cold_start_cache)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    if args.cold_start_cache == "fresh":
        result["xdg_cache_home"] = env["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="msa-cold-")
    cmd = [sys.executable, "-m", "benchmarks.bench_layer", "--cold-start-child", str(n),
           "--device", args.device] + (["--tiny"] if args.tiny else [])
    for which in ("first", "second"):
        est = result.get("first", {}).get("wall_s")
        if not run.fits(est, n, f"cold start, {which} process"):
            result[which] = dict(skipped="time budget")
            break
        log(f"cold start: {which} fresh process at {case_of(n)}")
        t = time.perf_counter()
        lines: list[str] = []
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            text, _ = proc.communicate(timeout=max(run.left(), 1.0) + 60.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            text, _ = proc.communicate()
        wall = time.perf_counter() - t
        lines = text.splitlines()
        got = [ln for ln in lines if ln.startswith("COLD_START_JSON ")]
        if got:
            result[which] = dict(json.loads(got[-1].split(" ", 1)[1]), wall_s=wall)
        else:
            result[which] = dict(wall_s=wall, error=f"exit status {proc.returncode}: "
                                 + "\n".join(lines[-8:])[-600:])
        log(f"cold start: {which} process: " + ", ".join(
            f"{k} {_fmt(v)}" for k, v in result[which].items() if k != "kernel_cache"))
        run.extra["cold_start"] = result
        run.write()
    second = result.get("second", {}).get("first_step_s")
    result["met"] = None if second is None else second <= COLD_START_TARGET_S
    return result


# -- 6: torch.compile ------------------------------------------------------------------------------

def compile_check(run: Run, n: int) -> dict:
    import torch

    args, cfg, dev = run.args, run.cfg, run.args.device
    backend = args.compile_backend or ("inductor" if dev == "cuda" else "aot_eager")
    result = dict(n=n, backend=backend)
    try:
        torch._dynamo.reset()
        layer = make_layer(cfg, dev)
        x, cu, g = inputs(cfg, n, dev)
        cu = torch.as_tensor(cu, dtype=torch.int64)  # Dynamo traces tensors, not NumPy arrays
        names = [name for name, _ in layer.named_parameters()]

        def step(module):
            out = sparse_step(module, x, cu, g)
            return out, {name: w.grad.clone() for name, w in zip(names, layer.parameters())} | {
                "x": x.grad.clone()}

        out_e, grads_e = step(layer)
        compiled = torch.compile(layer, backend=backend)
        t = time.perf_counter()
        out_c, grads_c = step(compiled)
        sync(dev)
        result["first_step_s"] = time.perf_counter() - t
        forward = {name: bool(torch.equal(getattr(out_c, name), getattr(out_e, name)))
                   for name in ("block_indices", "output", "loss_kl", "lse")}
        err = {name: float((grads_c[name].float() - want.float()).abs().max()
                           / max(float(want.float().abs().max()), 1e-30))
               for name, want in grads_e.items()}
        tol = COMPILE_GRAD_TOL[cfg.dtype]
        result.update(
            forward_bits_equal=forward, grad_rel_err=err, grad_tol=tol,
            finite=all_finite(out_c, x, layer.parameters()),
            output_max_abs_diff=float((out_c.output.detach().float()
                                       - out_e.output.detach().float()).abs().max()),
            equal=all(forward.values()) and max(err.values()) <= tol,
            eager_ms=time_ms(lambda: sparse_step(layer, x, cu, g), dev, args.reps),
            compiled_ms=time_ms(lambda: sparse_step(compiled, x, cu, g), dev, args.reps))
    except Exception as exc:
        result.update(failure(exc, dev))
    finally:
        torch._dynamo.reset()
        free_memory(dev)
    return result


# -- the summary and the figure --------------------------------------------------------------------

def summarise(run: Run) -> dict:
    rows = run.rows
    pts = speedups(run)
    n_cross, how = crossover(pts)
    targets = []
    for n, want in SPEEDUP_TARGETS.items():
        got = dict(pts).get(n)
        targets.append(dict(what=f"step vs dense at {case_of(n)}", want=f">= {want}x", got=got,
                            met=None if got is None else got >= want))
    biggest = [r for r in rows if r.get("impl") == IMPL_SPARSE and r.get("n") == max(
        run.args.sizes)]
    got = biggest[0] if biggest else {}
    targets.append(dict(what=f"{case_of(max(run.args.sizes))} forward and backward fit",
                        want="runs", got=got.get("ms") and f"{got['ms']:.1f} ms, "
                        f"{_fmt(got.get('peak_gib'))} GiB" or got.get("error") or
                        got.get("skipped"),
                        met=None if not got else bool(got.get("ms"))))
    prof = run.extra.get("profile", {})
    targets.append(dict(what=f"GPU busy share at {case_of(prof.get('n', run.args.profile))}",
                        want=f">= {BUSY_TARGET}", got=prof.get("gpu_busy_share"),
                        met=prof.get("met")))
    cold = run.extra.get("cold_start", {})
    targets.append(dict(what="first step of a second fresh process (kernels on disk)",
                        want=f"<= {COLD_START_TARGET_S} s",
                        got=cold.get("second", {}).get("first_step_s"), met=cold.get("met")))
    finite = [r.get("finite") for r in rows if "finite" in r]
    targets.append(dict(what="outputs, L_KL and gradients finite", want="every step",
                        got=f"{sum(map(bool, finite))} of {len(finite)}",
                        met=all(finite) if finite else None))
    comp = run.extra.get("compile_check", {})
    targets.append(dict(what="torch.compile(layer) step equals eager", want="equal",
                        got=comp.get("equal", comp.get("error")), met=comp.get("equal")))
    warm = {case_of(r["n"]): r.get("vs_sparse_step") for r in rows
            if r.get("impl") == IMPL_WARMUP and r.get("ms")}
    return dict(msa_speedup={case_of(n): r for n, r in pts}, crossover_n=n_cross,
                crossover=how, warmup_vs_sparse=warm, targets=targets)


def figure(path: str):
    """``bench_layer.png`` beside the JSON at ``path``: step ms against N (MSA, dense, warmup;
    log-log) and the dense / MSA ratio with the targets. Returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    with open(path) as f:
        payload = json.load(f)
    rows = payload.get("results", [])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    for impl, style in ((IMPL_SPARSE, "o-"), (IMPL_DENSE, "s--"), (IMPL_WARMUP, "^:")):
        pts = sorted((r["n"], r["ms"]) for r in rows if r.get("impl") == impl and r.get("ms"))
        if pts:
            ax.plot(*zip(*pts), style, label=impl)
            for n, ms in pts:
                ax.annotate(f"{ms:.3g}", (n, ms), textcoords="offset points", xytext=(3, 4),
                            fontsize=6)
    for r in rows:
        if r.get("impl") == IMPL_SPARSE and not r.get("ms") and r.get("n"):
            ax.axvline(r["n"], color="red", lw=0.6, ls=":")
            ax.annotate("OOM" if r.get("oom") else "skipped" if r.get("skipped") else "error",
                        (r["n"], 1), xycoords=("data", "axes fraction"), xytext=(2, -10),
                        textcoords="offset points", fontsize=6, color="red")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("N (tokens, one sequence)")
    ax.set_ylabel("ms per step (forward + backward)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    pts = sorted((r["n"], r["msa_speedup"]) for r in rows if r.get("msa_speedup"))
    if pts:
        bx.plot(*zip(*pts), "o-", label="dense step / MSA step")
        for n, s in pts:
            bx.annotate(f"{s:.2f}x", (n, s), textcoords="offset points", xytext=(3, 4),
                        fontsize=7)
    largest = max([r["n"] for r in rows if r.get("n")], default=0)
    for n, want in SPEEDUP_TARGETS.items():
        if n > 2 * largest:  # a toy run's sizes are far below the targets'
            continue
        bx.plot([n], [want], "r_", ms=14, mew=2)
        bx.annotate(f"target {want}x", (n, want), textcoords="offset points", xytext=(5, -10),
                    fontsize=6, color="red")
    bx.axhline(1.0, color="gray", lw=0.8)
    summary = payload.get("summary", {})
    if summary.get("crossover_n"):
        bx.axvline(summary["crossover_n"], color="gray", ls=":", lw=0.8)
        bx.annotate(f"crossover {summary['crossover_n'] / 1024:.1f}K",
                    (summary["crossover_n"], 1.0), textcoords="offset points", xytext=(3, 6),
                    fontsize=6)
    bx.set_xscale("log", base=2)
    bx.set_yscale("log")
    for a in (ax, bx):
        a.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
            lambda v, _: f"{v / 1024:g}K" if v >= 1024 else f"{v:g}"))
    bx.set_xlabel("N")
    bx.set_ylabel("dense step / MSA step (higher: MSA faster)")
    bx.grid(alpha=0.3, which="both")
    notes = []
    prof = payload.get("profile", {})
    if prof.get("gpu_busy_share") is not None:
        notes.append(f"GPU busy {prof['gpu_busy_share']:.0%} of the {case_of(prof['n'])} step")
    cold = payload.get("cold_start", {})
    if cold.get("first", {}).get("first_step_s") is not None:
        notes.append(f"first step at {case_of(cold['n'])}: fresh process "
                     f"{cold['first']['first_step_s']:.3g} s, kernels on disk "
                     f"{cold.get('second', {}).get('first_step_s', float('nan')):.3g} s")
    head, cfg = payload.get("header", {}), payload.get("config", {})
    where = head.get("gpu", "?") if cfg.get("device") != "cpu" else "the CPU (NumPy reference)"
    fig.suptitle(f"MSA layer training step on {where}, commit "
                 f"{str(head.get('commit', '?'))[:7]}: d_model={cfg.get('d_model')}, "
                 f"Hq={cfg.get('hq')}, Hkv={cfg.get('hkv')}, D={cfg.get('d')}, "
                 f"Bk={cfg.get('block_size')}, k={cfg.get('topk')}, {cfg.get('dtype')}"
                 + ("\n" + "; ".join(notes) if notes else ""), fontsize=8)
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


# -- the command line ------------------------------------------------------------------------------

def _sizes(text):
    return tuple(int(s) for s in text.split(",") if s.strip())


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/bench_layer.json")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="a short pass: 8K and 32K")
    p.add_argument("--tiny", action="store_true", help="the toy configuration at N 64-512")
    p.add_argument("--sizes", type=_sizes, help="comma-separated N, run smallest first")
    p.add_argument("--reps", type=int, help="timed steps per measurement (median)")
    p.add_argument("--dense-max-n", type=int, help="largest N of the dense step")
    p.add_argument("--warmup-sizes", type=_sizes, help="N of the warmup step ('' for none)")
    p.add_argument("--warmup-max-n", type=int, help="only the warmup sizes up to this N")
    p.add_argument("--profile", type=int, help="N of the profiled step (0: none)")
    p.add_argument("--cold-start", type=int, nargs="?", const=32768,
                   help="N of the two fresh processes' first step (0: none)")
    p.add_argument("--no-cold-start", action="store_const", const=0, dest="cold_start")
    p.add_argument("--cold-start-cache", choices=("fresh", "default"), default="fresh",
                   help="the fresh processes' kernel cache: an empty folder, or the user's")
    p.add_argument("--compile-check", type=int, help="N of the torch.compile check (0: none)")
    p.add_argument("--compile-backend", default=None)
    p.add_argument("--crossover-probes", type=int, help="extra sizes to find the crossover")
    p.add_argument("--isolate-above", type=int, help="sizes above this in a child (0: none)")
    p.add_argument("--budget-s", type=float, help="time box of the whole run, seconds")
    p.add_argument("--no-figure", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cold-start-child", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    name = ("tiny" if args.tiny else "full") if not args.quick else (
        "tiny-quick" if args.tiny else "quick")
    args.preset_name = name
    for key, value in PRESETS[name].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.warmup_max_n is not None:
        args.warmup_sizes = tuple(n for n in args.warmup_sizes if n <= args.warmup_max_n)
    if args.child:  # one size for the parent: no other phases
        args.cold_start, args.compile_check, args.crossover_probes = 0, 0, 0
        args.warmup_sizes, args.isolate_above, args.no_figure = (), 0, True
    args.process = "child" if args.child else "main"
    for name in ("reps",):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda, but torch.cuda.is_available() is False: use --device cpu")
    return args


def main(argv=None):
    global T0
    T0 = time.perf_counter()  # the budget counts from here (main may run twice in one process)
    args = parse(argv)
    if args.cold_start_child:
        return cold_start_child(args)
    cfg = TINY if args.tiny else PAPER
    run = Run(args, cfg)
    saved_cache_env = os.environ.get("XDG_CACHE_HOME")
    fresh_cache = None
    log(f"bench_layer: preset {args.preset_name}, device {args.device}, sizes "
        f"{','.join(map(str, args.sizes))}, budget {args.budget_s:.0f} s, out {args.out}")
    try:
        if args.cold_start:
            run.extra["cold_start"] = cold_start(run)
            fresh_cache = run.extra["cold_start"].get("xdg_cache_home")
            if fresh_cache and args.device == "cuda" and "msa.cuda" not in sys.modules:
                os.environ["XDG_CACHE_HOME"] = fresh_cache  # the kernels the children compiled
        for n in sorted(args.sizes):
            if args.isolate_above and n > args.isolate_above:
                bench_size_isolated(run, n)
            else:
                bench_size(run, n)
        probe_crossover(run)
        for n in sorted(args.warmup_sizes):
            bench_warmup(run, n)
        if args.compile_check:
            est = 90.0 if args.device == "cuda" else 30.0
            if run.fits(est, args.compile_check, "torch.compile check"):
                log(f"{case_of(args.compile_check)}: torch.compile check")
                run.extra["compile_check"] = compile_check(run, args.compile_check)
                log("torch.compile check: " + ", ".join(
                    f"{k} {_fmt(v)}" for k, v in run.extra["compile_check"].items()))
        if not args.child:
            run.extra["summary"] = summarise(run)
        run.write()
        if not args.no_figure:
            try:
                run.extra["figure"] = figure(args.out)
            except ImportError as exc:
                run.extra["figure"] = f"not drawn: {exc} (python -m benchmarks.plot redraws it)"
            run.write()
            log(f"figure: {run.extra['figure']}")
    finally:
        if saved_cache_env is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = saved_cache_env
        if fresh_cache:
            shutil.rmtree(fresh_cache, ignore_errors=True)
    if not args.child:
        for t in run.extra.get("summary", {}).get("targets", []):
            log(f"target: {t['what']}: want {t['want']}, got {_fmt(t['got'])}, met {t['met']}")
    log(f"wrote {args.out}")
    return run


if __name__ == "__main__":
    main()
