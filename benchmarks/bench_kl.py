"""Sparse KL on the GPU (paper §3.2, eq 9-11): loss and backward into the index branch.

    source .gpu/env.sh && python3 -m benchmarks.bench_kl --out benchmarks/results/kl.json

Paper configuration: Hq = 64, Hkv = 4 (G = 16), D = 128, Didx = 128, Bk = 128, K = 16, bf16,
one causal sequence of N tokens (Lq = Lk = N), N in {32K, 128K}; the selection is the local
block plus K-1 earlier blocks uniformly at random (ascending, -1 padded for early queries).

Timed, each the median of several runs between CUDA events after a warm-up:

* ``msa_fwd``: ``msa.cuda.kl.kl_loss`` (kl and loss); ``msa_bwd``: ``kl_backward`` (dq_idx,
  dk_idx, its CSR build included); ``msa_fwd+bwd`` = both calls back to back;
  ``msa_loss_and_backward``: ``kl_loss_and_backward``, the training step's one call (v3 scores
  the support with the teacher once: its FLOPs count the scores once). Every version of
  ``msa.cuda.kl.VERSIONS`` (v1 only up to ``--v1-max-n``, default 0 = never: it is the simple
  one and takes minutes; v2 up to ``--v2-max-n``, default 32K). v3, the tensor-core default,
  was numbered v4 before the stage layout: results of older commits call it ``msa_v4``;
* ``attention_fwd``: ``msa.cuda.attention.sparse_attention`` on the same selection (CSR +
  schedule + K1 + K2), the main branch's forward that produces the ``lse`` the KL reuses; the
  target is KL forward + backward <= 1.5x this;
* ``torch_fwd+bwd``: the same loss in PyTorch (per chunk of queries: gather the support's keys,
  teacher = mean of the heads' ``exp(S - lse)``, student ``log_softmax``, KL, ``backward``
  into float32 leaves ``q_idx``, ``k_idx``), float32 math (TF32 off) on the same bf16 inputs;
  the target is >= 10x slower than ``msa_fwd+bwd``. Timed with ``--torch-reps`` calls per size
  (default 3 at the first size, 1 after: one call at 128K takes ~25 s), recorded as ``reps``.

Useful FLOPs, with ``S = sum_{t, r} |support(t, r)|`` (query, group, key) triples: forward
``2 S (G D + Didx)`` (teacher and student scores); backward ``2 S (G D + Didx) + 4 S Didx``
(scores again, then ``dS k_idx`` and ``dS^T q_idx``). TFLOP/s = FLOPs / time; the attention row
uses its own ``4 Hq D S / Hkv``. Peak torch-allocated memory of one call is reported beside.

Correctness first: at every N the kernels' loss, dq_idx and dk_idx are compared with the PyTorch
implementation (max |a - b| / max |b| <= 1e-3, both float32 math on the same inputs); a failing
version is recorded with its error and not timed. Every case is wrapped in try/except.
"""

from __future__ import annotations

import argparse
import math
import os
import time
import traceback

# Numba synchronises the producer's stream whenever it imports a torch tensor through the CUDA
# array interface; every launch here is on the default stream, so turn that off (as
# bench_attention does) before numba is imported.
os.environ.setdefault("NUMBA_CUDA_ARRAY_INTERFACE_SYNC", "0")

from benchmarks.common import cuda_time_ms, print_table, write_json

HQ, HKV, D, D_IDX, BK, TOPK = 64, 4, 128, 128, 128, 16
G = HQ // HKV
GATE_REL = 1e-3


# -- problem ------------------------------------------------------------------------------------

def make_inputs(n, seed=0):
    """bf16 q, k, v, q_idx, k_idx on the GPU and ``cu_seqlens`` of one sequence of n tokens."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16)

    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    return dict(q=randn(n, HQ, D), k=randn(n, HKV, D), v=randn(n, HKV, D),
                q_idx=randn(n, HKV, D_IDX), k_idx=randn(n, D_IDX), cu=cu)


def uniform_selection(n, seed=0):
    """I int32 [n, Hkv, K]: the local block and K-1 earlier blocks drawn uniformly (Gumbel
    top-k without replacement), ascending, -1 where a query has fewer than K visible blocks."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    nb = -(-n // BK)
    out = torch.empty((n, HKV, TOPK), dtype=torch.int32, device="cuda")
    chunk = max(1, (1 << 24) // (HKV * nb))
    blocks = torch.arange(nb, device="cuda")
    for t0 in range(0, n, chunk):
        t1 = min(n, t0 + chunk)
        local = torch.arange(t0, t1, device="cuda") // BK  # [C]
        keys = torch.rand((t1 - t0, HKV, nb), device="cuda", generator=g)  # [C, Hkv, NB]
        earlier = blocks[None, None, :] < local[:, None, None]
        keys = torch.where(earlier, keys, torch.full_like(keys, -1.0))
        keys[torch.arange(t1 - t0), :, local] = 2.0  # the local block always wins
        top = keys.topk(min(TOPK, nb), dim=-1)
        ids = torch.where(top.values >= 0, top.indices, torch.full_like(top.indices, nb))
        ids = ids.sort(dim=-1).values
        ids = torch.where(ids == nb, torch.full_like(ids, -1), ids)
        out[t0:t1] = -1
        out[t0:t1, :, :ids.shape[-1]] = ids.to(torch.int32)
    return out


def support_size(I, n):
    """``S``: (query, group, key) triples of the support (the local block is cut causally)."""
    import torch

    t = torch.arange(n, device="cuda")[:, None, None]
    b = I.long()
    full = (b >= 0) & ((b + 1) * BK <= t)  # wholly visible blocks
    local = (b >= 0) & (b * BK <= t) & ((b + 1) * BK > t)
    return int(full.sum()) * BK + int(((t - b * BK + 1) * local).sum())


# -- the PyTorch implementation ------------------------------------------------------------------

def _gather_support(I, t0, t1, n):
    """Keys [C, Hkv, K*Bk] (long, clamped) and the support mask of queries [t0, t1)."""
    import torch

    b = I[t0:t1].long()  # [C, Hkv, K]
    keys = b[..., None] * BK + torch.arange(BK, device="cuda")  # [C, Hkv, K, Bk]
    t = torch.arange(t0, t1, device="cuda")[:, None, None, None]
    valid = (b[..., None] >= 0) & (keys <= t) & (keys < n)
    c = t1 - t0
    return keys.clamp(0, n - 1).reshape(c, HKV, -1), valid.reshape(c, HKV, -1)


def torch_lse(q, k, I, chunk=256):
    """The main branch's LSE on the support, float32 [n, Hq] (if sparse_attention is missing)."""
    import torch

    n = q.shape[0]
    out = torch.empty((n, HQ), dtype=torch.float32, device="cuda")
    kh = k.permute(1, 0, 2)  # [Hkv, n, D]
    heads = torch.arange(HKV, device="cuda")[None, :, None]
    with torch.no_grad():
        for t0 in range(0, n, chunk):
            t1 = min(n, t0 + chunk)
            keys, valid = _gather_support(I, t0, t1, n)
            kg = kh[heads, keys].float()  # [C, Hkv, KB, D]
            qc = q[t0:t1].view(t1 - t0, HKV, G, D).float()
            s = torch.matmul(qc, kg.transpose(-1, -2)) / math.sqrt(D)  # [C, Hkv, G, KB]
            s = s.masked_fill(~valid[:, :, None, :], -math.inf)
            out[t0:t1] = torch.logsumexp(s, dim=-1).reshape(t1 - t0, HQ)
    return out


def torch_kl(q, k, q_idx, k_idx, I, lse, chunk=256):
    """``(loss, dq_idx, dk_idx)`` of eq 10 by gather + softmax + autograd, chunked over queries."""
    import torch

    n = q.shape[0]
    qi = q_idx.float().requires_grad_()
    ki = k_idx.float().requires_grad_()
    kh = k.permute(1, 0, 2)  # [Hkv, n, D]
    heads = torch.arange(HKV, device="cuda")[None, :, None]
    total = torch.zeros((), dtype=torch.float32, device="cuda")
    for t0 in range(0, n, chunk):
        t1 = min(n, t0 + chunk)
        c = t1 - t0
        keys, valid = _gather_support(I, t0, t1, n)
        with torch.no_grad():  # the teacher is held constant (stop-gradient)
            kg = kh[heads, keys].float()  # [C, Hkv, KB, D]
            s = torch.matmul(q[t0:t1].view(c, HKV, G, D).float(), kg.transpose(-1, -2))
            s = s / math.sqrt(D) - lse[t0:t1].view(c, HKV, G, 1)
            s = s.masked_fill(~valid[:, :, None, :], -math.inf)  # clamped keys outside
            p = torch.exp(s).mean(dim=2)  # [C, Hkv, KB]
            log_p = torch.log(torch.where(p > 0, p, torch.ones_like(p)))
        s_idx = torch.matmul(ki[keys], qi[t0:t1, :, :, None])[..., 0] / math.sqrt(D_IDX)
        log_p_idx = torch.log_softmax(s_idx.masked_fill(~valid, -math.inf), dim=-1)
        kl = (p * (log_p - log_p_idx.masked_fill(~valid, 0.0))).sum(dim=-1)  # [C, Hkv]
        loss = kl.sum() / (n * HKV)
        loss.backward()
        total += loss.detach()
    return total, qi.grad, ki.grad


# -- helpers ------------------------------------------------------------------------------------

def _rel(a, b):
    import torch

    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _peak(fn):
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def _row(case, impl, ms, flops, peak=None, **extra):
    row = dict(case=case, impl=impl, ms=ms, tflops=flops / (ms * 1e-3) / 1e12 if ms else None,
               peak_gib=peak)
    row.update(extra)
    return row


_T0 = time.time()


def _log(msg):
    """Progress on stdout, so a run cut short still says how far it got."""
    print(f"[{time.time() - _T0:6.1f} s] {msg}", flush=True)


def _error_row(case, impl, exc):
    traceback.print_exc()
    return dict(case=case, impl=impl, error=f"{type(exc).__name__}: {exc}"[:500])


# -- the benchmark ------------------------------------------------------------------------------

def bench(n, args):
    import torch

    import msa.cuda.kl as gpu_kl

    rows = []
    case = f"N={n}"
    x = make_inputs(n)
    I = uniform_selection(n)
    s = support_size(I, n)
    fwd_flops = 2 * s * (G * D + D_IDX)
    bwd_flops = 2 * s * (G * D + D_IDX) + 4 * s * D_IDX
    fused_flops = 2 * s * (G * D + D_IDX) + 4 * s * D_IDX  # scores once, dS k_idx, dS^T q_idx
    attn_flops = 4 * HQ * D * s / HKV

    # The main branch forward: its LSE feeds the KL (and it is the yardstick of the target).
    lse = None
    attn_ms = None
    try:
        from msa.cuda.attention import sparse_attention

        def attention():
            return sparse_attention(x["q"], x["k"], x["v"], I, x["cu"], x["cu"], BK,
                                    validate=False)

        _, lse = attention()
        _log(f"{case}: attention compiled and run")
        attn_ms = cuda_time_ms(attention, warmup=1, reps=args.reps)
        _log(f"{case}: attention fwd {attn_ms:.2f} ms")
        rows.append(_row(case, "attention_fwd", attn_ms, attn_flops, _peak(attention)))
    except Exception as exc:  # not written yet or failing: the KL still gets its LSE
        rows.append(_error_row(case, "attention_fwd", exc))
    if lse is None:
        lse = torch_lse(x["q"], x["k"], I)
    lse = lse.float().contiguous()
    a = (x["q"], x["k"], x["q_idx"], x["k_idx"], I, lse, x["cu"], x["cu"], BK)

    # The PyTorch implementation: the correctness reference and the baseline.
    torch_ms = None
    want = None
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        want = torch_kl(x["q"], x["k"], x["q_idx"], x["k_idx"], I, lse)
        _log(f"{case}: PyTorch reference computed")
        reps = _torch_reps(args, n)
        if n <= args.torch_max_n and reps > 0:
            # the reference call above was the warm-up; one call at 128K takes ~25 s, so the
            # reps are per size (--torch-reps) and recorded in the row
            torch_ms = cuda_time_ms(lambda: torch_kl(x["q"], x["k"], x["q_idx"], x["k_idx"], I,
                                                     lse), warmup=0, reps=reps)
            _log(f"{case}: PyTorch timed, {torch_ms:.1f} ms ({reps} reps)")
            peak = _peak(lambda: torch_kl(x["q"], x["k"], x["q_idx"], x["k_idx"], I, lse)) \
                if reps > 1 else None  # one more call only where it is cheap
            rows.append(_row(case, "torch_fwd+bwd", torch_ms, fwd_flops + bwd_flops, peak,
                             reps=reps))
    except Exception as exc:
        rows.append(_error_row(case, "torch_fwd+bwd", exc))

    for version in gpu_kl.VERSIONS[::-1]:
        if (version == 1 and n > args.v1_max_n) or (version == 2 and n > args.v2_max_n):
            continue
        try:
            def fwd(version=version):
                return gpu_kl.kl_loss(*a, version=version, validate=False)

            def bwd(version=version):
                return gpu_kl.kl_backward(*a, version=version, validate=False)

            kl, loss = fwd()
            dq, dk = bwd()
            _log(f"{case}: msa v{version} compiled and run")
            gate = {}
            if want is not None:
                gate = dict(err_loss=abs(float(loss) - float(want[0])) / abs(float(want[0])),
                            err_dq=_rel(dq, want[1]), err_dk=_rel(dk, want[2]))
                if max(gate.values()) > GATE_REL:
                    rows.append(dict(case=case, impl=f"msa_v{version}", error="correctness gate",
                                     **gate))
                    continue
            fwd_ms = cuda_time_ms(fwd, warmup=1, reps=args.reps)
            bwd_ms = cuda_time_ms(bwd, warmup=1, reps=args.reps)
            both_ms = cuda_time_ms(lambda: (fwd(), bwd()), warmup=0, reps=args.reps)
            ratios = {}
            if attn_ms:
                ratios["vs_attention_fwd"] = both_ms / attn_ms
            if torch_ms:
                ratios["speedup_vs_torch"] = torch_ms / both_ms
            rows.append(_row(case, f"msa_v{version}_fwd", fwd_ms, fwd_flops, _peak(fwd)))
            rows.append(_row(case, f"msa_v{version}_bwd", bwd_ms, bwd_flops, _peak(bwd)))
            _log(f"{case}: msa v{version} fwd {fwd_ms:.2f} ms, bwd {bwd_ms:.2f} ms")
            rows.append(_row(case, f"msa_v{version}_fwd+bwd", both_ms, fwd_flops + bwd_flops,
                             **ratios, **gate))
        except Exception as exc:
            rows.append(_error_row(case, f"msa_v{version}", exc))
            continue
        try:  # the training step's call: loss and gradients together (v3 scores once)
            def fused(version=version):
                return gpu_kl.kl_loss_and_backward(*a, version=version, validate=False)

            _, loss, dq, dk = fused()
            gate = {}
            if want is not None:
                gate = dict(err_loss=abs(float(loss) - float(want[0])) / abs(float(want[0])),
                            err_dq=_rel(dq, want[1]), err_dk=_rel(dk, want[2]))
                if max(gate.values()) > GATE_REL:
                    rows.append(dict(case=case, impl=f"msa_v{version}_loss_and_backward",
                                     error="correctness gate", **gate))
                    continue
            one_ms = cuda_time_ms(fused, warmup=1, reps=args.reps)
            _log(f"{case}: msa v{version} kl_loss_and_backward {one_ms:.2f} ms")
            ratios = {}
            if attn_ms:
                ratios["vs_attention_fwd"] = one_ms / attn_ms
            if torch_ms:
                ratios["speedup_vs_torch"] = torch_ms / one_ms
            rows.append(_row(case, f"msa_v{version}_loss_and_backward", one_ms, fused_flops,
                             _peak(fused), **ratios, **gate))
        except Exception as exc:
            rows.append(_error_row(case, f"msa_v{version}_loss_and_backward", exc))
    return rows


def _torch_reps(args, n):
    """PyTorch reps at size ``n``: the entry of ``--torch-reps`` at n's place in ``--sizes``."""
    sizes = [int(x) for x in args.sizes.split(",")]
    reps = [int(x) for x in str(args.torch_reps).split(",")]
    i = sizes.index(n) if n in sizes else len(sizes) - 1
    return reps[min(i, len(reps) - 1)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/kl.json")
    p.add_argument("--sizes", default="32768,131072", help="N, comma separated")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--torch-reps", default="3,1",
                   help="PyTorch timing reps per size of --sizes, comma separated (the last "
                        "repeats; 0 skips the timing, the correctness reference still runs)")
    p.add_argument("--torch-max-n", type=int, default=131072, help="time PyTorch up to this N")
    p.add_argument("--v1-max-n", type=int, default=0,
                   help="time kernel v1 up to this N (default 0: skipped; its compile and run "
                        "take minutes at 32K)")
    p.add_argument("--v2-max-n", type=int, default=32768,
                   help="time kernel v2 up to this N (a 128K call takes seconds: it would "
                        "spend a minute of the run)")
    args = p.parse_args(argv)
    results = []
    t_start = time.time()
    for n in (int(s) for s in args.sizes.split(",")):
        try:
            results += bench(n, args)
        except Exception as exc:
            results.append(_error_row(f"N={n}", "setup", exc))
        print(f"N={n} done after {time.time() - t_start:.0f} s", flush=True)
    print_table(results, ["case", "impl", "ms", "tflops", "peak_gib", "vs_attention_fwd",
                          "speedup_vs_torch", "err_loss", "err_dq", "err_dk", "error"])
    config = dict(Hq=HQ, Hkv=HKV, D=D, Didx=D_IDX, Bk=BK, K=TOPK, dtype="bfloat16",
                  selection="local + uniform random", gate_rel=GATE_REL, reps=args.reps,
                  torch_reps={n: _torch_reps(args, int(n)) for n in args.sizes.split(",")},
                  v1_max_n=args.v1_max_n, v2_max_n=args.v2_max_n,
                  note="PyTorch is timed with torch_reps calls per size (median); the first "
                       "call, the correctness reference, is its warm-up")
    write_json(args.out, results, config=config)
    return results


if __name__ == "__main__":
    main()
