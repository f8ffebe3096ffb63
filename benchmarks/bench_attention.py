"""Main branch on the GPU: KV-outer sparse attention (CSR + schedule + K1 + K2) and the MSA prefill.

    source .gpu/env.sh && python3 -m benchmarks.bench_attention --out benchmarks/results/attention.json

Paper configuration: Hq = 64, Hkv = 4 (G = 16), D = 128, Bk = 128, K = 16, bf16, one causal
sequence of N tokens (Lq = Lk = N).

1. Sparse attention (eq 8) at N in {32K, 128K} for three selections, each with the local block:
   ``uniform`` (K-1 blocks uniformly at random among the earlier ones), ``sink+local+random``
   (block 0, the two blocks before the local one, the rest random) and ``skewed`` (K-1 blocks
   drawn with weights ~ (b+1)^-1.5: a few very hot blocks, the scheduler's hard case). Against:
   * dense causal ``scaled_dot_product_attention`` (what a user runs without MSA);
   * FlexAttention with the same selection (block mask = union of each 128-query block's
     selected blocks, exact token-level ``mask_mod``), compiled;
   * a PyTorch gather implementation (Q-outer: per query chunk, gather the selected K/V blocks,
     bf16 batched matmuls, masked softmax), at 32K only (it is slow).
   Useful FLOPs = 4 * Hq * D * S, S = sum over (t, r) of the visible tokens of t's selected
   blocks in group r, divided by Hkv (eq 13's k*Bk*N, exactly, with the causal cut of the local
   block). TFLOP/s = FLOPs / time for every implementation of the same selection; the dense
   baseline's own FLOPs (4 * Hq * D * N(N+1)/2) are reported beside it. Peak torch-allocated
   memory of one call next to each time. The MSA time is also split into CSR + schedule, K1 and
   K2 (CUDA events around each stage, one query chunk).
2. K1 alone, versions side by side (``--k1-versions``, default 4, 3, 2, 1: wgmma, registers,
   shared-memory tensor cores, CUDA cores) at N = 32K, ``uniform``: CSR + schedule, K1 and K2 timed by CUDA
   events on one query chunk (the last 16K queries against every key), each version behind
   its own correctness gate (the chunk's last 512 outputs against the gather implementation);
   K1 TFLOP/s = 4 * Hq * D * S_chunk / K1 time, with ``vs_v2`` = v2 time / this time.
3. MSA prefill (``msa.cuda.attention.msa_prefill``: index branch + top-k + sparse attention,
   Didx = 128) against dense causal SDPA at N in {128K, 1M} (1M: one timed run each; dense SDPA
   takes ~36 s there).

Correctness first: the MSA output is compared with the gather implementation (on a sample of
query chunks at 128K) before any timing: max |o_msa - o_gather| / max |o_gather| must be below
2e-2 (both bf16); a failing case records its error in the JSON and is not timed. Every case is
wrapped in try/except, so one failure (e.g. out of memory) does not stop the run.
"""

from __future__ import annotations

import argparse
import math
import os
import time
import traceback

# Numba synchronises the producer's stream every time it imports a torch tensor through the CUDA
# array interface (dozens of host syncs per sparse_attention call). Every launch here is on the
# default stream, torch's too, so the sync buys nothing; turn it off before numba is imported.
os.environ.setdefault("NUMBA_CUDA_ARRAY_INTERFACE_SYNC", "0")

from benchmarks.common import cuda_time_ms, print_table, write_json

HQ, HKV, D, BK, TOPK, D_IDX = 64, 4, 128, 128, 16, 128
DEVICE = "cuda"  # the helpers below also run on "cpu" (a smoke test of the baselines)
G = HQ // HKV
GATE_REL = 2e-2


# -- problems and selections --------------------------------------------------------------------

def _qkv(n, seed=0):
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn((n, HQ, D), device=DEVICE, generator=g, dtype=torch.bfloat16)
    k = torch.randn((n, HKV, D), device=DEVICE, generator=g, dtype=torch.bfloat16)
    v = torch.randn((n, HKV, D), device=DEVICE, generator=g, dtype=torch.bfloat16)
    return q, k, v


def make_selection(pattern, n, seed=0, topk=TOPK, bk=BK, hkv=HKV):
    """I int32 [n, Hkv, K >= 2] on the GPU: the local block + K-1 earlier blocks by ``pattern``,
    ascending, -1 padded (a query with fewer than K visible blocks). Gumbel top-k = sampling
    without replacement with the pattern's weights."""
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    nb = -(-n // bk)
    blocks = torch.arange(nb, device=DEVICE)
    out = torch.empty((n, hkv, topk), dtype=torch.int32, device=DEVICE)
    chunk = max(1, (1 << 24) // (hkv * nb))
    big = nb + 1
    for t0 in range(0, n, chunk):
        t1 = min(n, t0 + chunk)
        local = torch.arange(t0, t1, device=DEVICE) // bk  # [C]
        u = torch.rand((t1 - t0, hkv, nb), device=DEVICE, generator=g).clamp_(1e-20, 1.0)
        score = -torch.log(-torch.log(u))  # Gumbel(0, 1)
        if pattern == "skewed":
            score += -1.5 * torch.log(blocks.float() + 1.0)
        elif pattern == "sink+local+random":
            fixed = ((blocks[None, :] == 0) | (blocks[None, :] == local[:, None] - 1)
                     | (blocks[None, :] == local[:, None] - 2))  # [C, NB]
            score += 1e4 * fixed[:, None, :]
        elif pattern != "uniform":
            raise ValueError(f"unknown pattern {pattern!r}")
        earlier = blocks[None, :] < local[:, None]  # [C, NB]: the local block is added below
        score.masked_fill_(~earlier[:, None, :], -math.inf)
        val, idx = torch.topk(score, min(topk - 1, nb), dim=-1)
        idx = torch.where(val > -math.inf, idx, torch.full_like(idx, big))
        idx = torch.nn.functional.pad(idx, (0, topk - 1 - idx.shape[-1]), value=big)
        sel = torch.cat([idx, local[:, None, None].expand(-1, hkv, 1)], dim=-1)
        sel = sel.sort(dim=-1).values
        out[t0:t1] = torch.where(sel == big, torch.full_like(sel, -1), sel).int()
    return out


def visible_tokens(I, bk=BK, t_offset=0):
    """S = sum_{t, r} |support(t, r)| / Hkv for one causal sequence (row t of I is the query at
    position ``t_offset + t``)."""
    import torch

    n = I.shape[0]
    total = 0
    for t0 in range(0, n, 1 << 16):
        t1 = min(n, t0 + (1 << 16))
        b = I[t0:t1].long()
        pos = torch.arange(t_offset + t0, t_offset + t1, device=I.device)[:, None, None]
        vis = (pos - b * bk + 1).clamp(0, bk)
        total += int(torch.where(b >= 0, vis, torch.zeros_like(vis)).sum())
    return total / I.shape[1]


# -- baselines ----------------------------------------------------------------------------------

def dense_sdpa(q, k, v):
    import torch

    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, N, D]
    o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True,
                                                         enable_gqa=True)
    return o[0].transpose(0, 1)


def gather_attention(q, k, v, I, t_begin=0, t_end=None, chunk=256, bk=BK):
    """Q-outer sparse attention in PyTorch (what a user writes without a kernel): per chunk of
    queries, gather each query's K selected blocks of K and V, scores in bf16 batched matmuls,
    float32 masked softmax, P V. Returns o [t_end - t_begin, Hq, D] bf16."""
    import torch

    n = k.shape[0]
    t_end = n if t_end is None else t_end
    nb = -(-n // bk)
    pad = nb * bk - n
    kb = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)).view(nb, bk, HKV, D).permute(2, 0, 1, 3)
    vb = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).view(nb, bk, HKV, D).permute(2, 0, 1, 3)
    scale = 1.0 / math.sqrt(D)
    out = torch.empty((t_end - t_begin, HQ, D), dtype=q.dtype, device=q.device)
    heads = torch.arange(HKV, device=q.device)[None, :, None]
    offs = torch.arange(bk, device=q.device)
    for t0 in range(t_begin, t_end, chunk):
        t1 = min(t_end, t0 + chunk)
        c = t1 - t0
        idx = I[t0:t1].long()  # [C, Hkv, K]
        valid = idx >= 0
        idx = idx.clamp(min=0)
        keys = kb[heads, idx].reshape(c, HKV, TOPK * bk, D)  # [C, Hkv, K*Bk, D]
        vals = vb[heads, idx].reshape(c, HKV, TOPK * bk, D)
        key_pos = (idx[..., None] * bk + offs).reshape(c, HKV, TOPK * bk)
        pos = torch.arange(t0, t1, device=q.device)[:, None, None]
        mask = (valid[..., None].expand(-1, -1, -1, bk).reshape(c, HKV, TOPK * bk)
                & (key_pos <= pos))
        qc = q[t0:t1].view(c, HKV, G, D)
        s = torch.matmul(qc, keys.transpose(-1, -2)).float() * scale  # [C, Hkv, G, K*Bk]
        s.masked_fill_(~mask[:, :, None, :], -math.inf)
        p = torch.softmax(s, dim=-1).to(v.dtype)
        out[t0 - t_begin:t1 - t_begin] = torch.matmul(p, vals).reshape(c, HQ, D)
    return out


def flex_attention_fn(I, n, bk=BK, compile=True):
    """``fn(q, k, v)`` running compiled FlexAttention with a block mask built from the selection:
    a (128-query block, KV block) pair is computed if any query of the block selected it, and
    ``mask_mod`` keeps exactly each query's selected, causally visible tokens."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    nb = -(-n // bk)
    assert n % bk == 0, "FlexAttention baseline: N must be a multiple of Bk"
    idx = torch.where(I >= 0, I.long(), torch.full_like(I, nb, dtype=torch.long))
    sel = torch.zeros((n, HKV, nb + 1), dtype=torch.bool, device=I.device)
    sel.scatter_(2, idx, True)
    sel = sel[..., :nb].contiguous()  # [N, Hkv, NB] token-level lookup
    union = sel.view(nb, bk, HKV, nb).any(dim=1)  # [NQB, Hkv, NB]
    num = union.sum(-1).int()  # [NQB, Hkv]
    order = torch.argsort((~union).to(torch.int8), dim=-1, stable=True).int()  # selected first
    kv_num = num.transpose(0, 1).repeat_interleave(G, dim=0)[None].contiguous()  # [1, Hq, NQB]
    kv_idx = order.permute(1, 0, 2).repeat_interleave(G, dim=0)[None].contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        return sel[q_idx, h // G, kv_idx // bk] & (kv_idx <= q_idx)

    try:
        bm = BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=bk, mask_mod=mask_mod,
                                      seq_lengths=(n, n))
    except TypeError:  # older torch: no seq_lengths
        bm = BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=bk, mask_mod=mask_mod)
    compiled = torch.compile(flex_attention, dynamic=False) if compile else flex_attention

    def fn(q, k, v):
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        return compiled(qt, kt, vt, block_mask=bm, enable_gqa=True)[0].transpose(0, 1)

    return fn


# -- helpers ------------------------------------------------------------------------------------

def fla_forward_fn(q, k, v, I, bk=BK):
    """``fn()`` running fla-core's Triton NSA selected-attention forward (``parallel_nsa_fwd``)
    on our ``[T, H, D]`` tensors and int32 ``[T, Hkv, K]`` selection as a batch of one (its -1
    padding is skipped); returns ``(o [1, T, Hq, D], lse)``. It autotunes on its first call.
    ImportError where fla-core is not installed (a GPU-benchmark-only dependency)."""
    from fla.ops.nsa.parallel import parallel_nsa_fwd

    scale = q.shape[-1] ** -0.5
    qb, kb, vb, Ib = q[None], k[None], v[None], I[None]
    return lambda: parallel_nsa_fwd(qb, kb, vb, Ib, I.shape[-1], bk, scale)


def _offsets(n, args):
    """``cu_seqlens`` of one sequence of ``n`` tokens for the msa calls: NumPy (``--offsets
    host``, the default: msa reads them on the host, and a CUDA tensor costs a device-to-host
    read that waits for the GPU's queued work on every call) or a CUDA tensor."""
    import numpy as np
    import torch

    if args.offsets == "host":
        return np.array([0, n], dtype=np.int32)
    return torch.tensor([0, n], dtype=torch.int32, device=DEVICE)


def _peak_and_first(fn):
    """(first result, peak torch-allocated GiB of that call); the call is also the warm-up."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() / 2**30


def _rel_err(a, b):
    a, b = a.float(), b.float()
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)


def _row(case, impl, ms, flops, peak=None, **extra):
    row = dict(case=case, impl=impl, ms=ms, TFLOPs=flops / ms / 1e9 if ms else None)
    if peak is not None:
        row["peak_GiB"] = peak
    row.update(extra)
    return row


def _error_row(case, impl, exc):
    return dict(case=case, impl=impl, error=f"{type(exc).__name__}: {exc}",
                trace=traceback.format_exc(limit=6))


def stage_breakdown(q, k, v, I, version=None, partials="bfloat16", max_queries=16384, gate=False,
                    tile_rows=None, groups=None):
    """ms of CSR + schedule, K1 and K2 for the last ``max_queries`` queries (one query chunk of
    ``sparse_attention``, against every key), CUDA events around each stage. With ``gate``, the
    chunk's last 512 outputs are first compared with ``gather_attention`` (rel err in the
    result; ValueError above ``GATE_REL``, before any timing)."""
    import numpy as np
    import torch
    from numba import cuda

    from msa.cuda._core.arrays import ArrayContext, device_constant
    from msa.cuda._core.launch import kernel_array
    from msa.cuda.attention._plan import K1Plan, Spec
    from msa.cuda.combine import launch_combine
    from msa.cuda.csr import build_csr
    from msa.cuda.schedule import build_schedule

    n = q.shape[0]
    c = min(n, max_queries)
    ref = gather_attention(q, k, v, I, n - min(c, 512), n) if gate else None
    q, I = q[n - c:], I[n - c:]
    cu_q, cu_k = np.array([0, c], np.int32), np.array([0, n], np.int32)
    spec = Spec(q, k, v)
    plan = K1Plan(spec, BK, version, tile_rows, groups)
    chunk = -(-2 * TOPK * BK // plan.positions) * plan.positions
    scale = 1.0 / math.sqrt(D)
    ctx = ArrayContext(q, k, v, I)
    qa, ka, va = plan.inputs(ctx, q, k, v)
    bf16_partials = partials == "bfloat16"
    o_part = torch.empty((TOPK, c, HQ, D), device=DEVICE,
                         dtype=torch.bfloat16 if bf16_partials else torch.float32)
    lse_part = torch.empty((TOPK, c, HQ), dtype=torch.float32, device=DEVICE)
    o = torch.empty_like(q)
    lse = torch.empty((c, HQ), dtype=torch.float32, device=DEVICE)
    d_cu_q, d_cu_k = device_constant(cu_q), device_constant(cu_k)
    o_part_bits = o_part.view(torch.int16) if bf16_partials else o_part
    args = [cuda.as_cuda_array(x, sync=False) for x in (o_part_bits, lse_part,
                                                        o.view(torch.int16), lse)]
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]

    def run():
        ev[0].record()
        row_ptr, qi, sl = build_csr(I, cu_q, cu_k, BK, validate=False)
        work, _ = build_schedule(row_ptr, cu_k, BK, chunk, max_edges=c * TOPK, validate=False)
        ev[1].record()
        lse_part.fill_(-math.inf)
        plan.launch(qa, ka, va, kernel_array(work), kernel_array(qi), kernel_array(sl),
                    d_cu_q, d_cu_k, scale, args[0], args[1], bf16_partials)
        ev[2].record()
        launch_combine(args[0], args[1], args[2], args[3], head_dim=D,
                       bf16_part=bf16_partials, bf16_out=True)
        ev[3].record()
        torch.cuda.synchronize()
        return [ev[i].elapsed_time(ev[i + 1]) for i in range(3)]

    run()  # warm-up
    extra = {}
    if gate:
        torch.cuda.synchronize()
        err = _rel_err(o[c - ref.shape[0]:], ref)
        if not err < GATE_REL:
            raise ValueError(f"correctness gate failed: rel err {err:.3g} >= {GATE_REL}")
        extra["gate_rel_err"] = err
    times = sorted((run() for _ in range(3)), key=sum)[1]
    flops = 4 * HQ * D * visible_tokens(I, t_offset=n - c)
    del o_part, lse_part
    part_bytes = 2 if bf16_partials else 4
    return dict(extra, version=plan.version, tile_rows=plan.rows, groups=plan.groups,
                breakdown_queries=c,
                csr_schedule_ms=times[0],
                k1_ms=times[1], k2_ms=times[2],
                k1_TFLOPs=flops / times[1] / 1e9,
                # bytes K2 moves: every O_s read once (all K slots are used here) + bf16 O written
                k2_GBps=(part_bytes * TOPK + 2) * c * HQ * D / times[2] / 1e6)


# -- 1. sparse attention ------------------------------------------------------------------------

def bench_sparse(n, pattern, args):
    import torch

    from msa.cuda.attention import sparse_attention

    case = f"sparse N={n // 1024}K {pattern}"
    rows = []
    q, k, v = _qkv(n)
    I = make_selection(pattern, n)
    S = visible_tokens(I)
    flops = 4 * HQ * D * S  # useful FLOPs of the selection
    dense_flops = 4 * HQ * D * n * (n + 1) / 2
    cu = _offsets(n, args)
    print(f"== {case}: visible selected tokens per query {S / n:.1f}, "
          f"useful GFLOP {flops / 1e9:.1f}", flush=True)

    # Correctness gate against the PyTorch gather implementation.
    gate = None
    msa = {}
    configs = [(version, partials, None) for version in args.versions
               for partials in (args.partials if version == args.versions[0] else args.partials[:1])]
    # v3 with each requested number of warp groups, bf16 partials
    configs += [(3, args.partials[0], g) for g in args.groups if 3 in args.versions]
    for version, partials, groups in configs:
        impl = f"msa v{version} ({partials} partials" + (f", groups={groups})" if groups else ")")
        if version == 1 and n > args.v1_max_n:
            continue
        try:
            def run(version=version, partials=partials, groups=groups):
                return sparse_attention(q, k, v, I, cu, cu, BK, version=version, validate=False,
                                        max_partial_bytes=args.max_partial_bytes,
                                        partial_dtype=partials, groups=groups)
            (o, _), peak = _peak_and_first(run)
            if gate is None:
                spans = [(0, min(n, 512)), (n // 2, n // 2 + 512), (n - 512, n)]
                ref = torch.cat([gather_attention(q, k, v, I, a, b) for a, b in spans])
                gate = lambda out: _rel_err(torch.cat([out[a:b] for a, b in spans]), ref)  # noqa
            err = gate(o)
            del o
            if not err < GATE_REL:
                rows.append(dict(case=case, impl=impl, gate_rel_err=err,
                                 error=f"correctness gate failed: rel err {err:.3g} >= {GATE_REL}"))
                continue
            ms = cuda_time_ms(run, warmup=1, reps=args.reps)
            msa[(version, partials, groups)] = ms
            extra = dict(gate_rel_err=err)
            if args.breakdown and version == args.versions[0]:
                try:
                    extra.update(stage_breakdown(q, k, v, I, version, partials, groups=groups))
                except Exception as exc:  # the breakdown is a diagnosis, never fatal
                    extra["breakdown_error"] = f"{type(exc).__name__}: {exc}"
            rows.append(_row(case, impl, ms, flops, peak, **extra))
        except Exception as exc:
            rows.append(_error_row(case, impl, exc))
        torch.cuda.empty_cache()
    best = min(msa.values()) if msa else None

    def baseline(impl, fn, reps, fl=flops, **extra):
        try:
            _, peak = _peak_and_first(fn)
            ms = cuda_time_ms(fn, warmup=0, reps=reps)
            rows.append(_row(case, impl, ms, fl, peak,
                             msa_speedup=(ms / best) if best else None, **extra))
        except Exception as exc:
            rows.append(_error_row(case, impl, exc))
        torch.cuda.empty_cache()

    # Dense attention does not depend on the selection: measured once per N, reused.
    dense = args.dense_cache.get(n)
    if dense is None:
        baseline("dense SDPA (causal)", lambda: dense_sdpa(q, k, v), args.reps)
        dense = args.dense_cache[n] = dict(rows[-1])
    else:
        rows.append(dict(dense, case=case, msa_speedup=(dense["ms"] / best) if best and
                         dense.get("ms") else None, reused_from=dense["case"]))
    if rows[-1].get("ms"):
        rows[-1]["TFLOPs"] = flops / rows[-1]["ms"] / 1e9
        rows[-1]["dense_TFLOPs_own"] = dense_flops / rows[-1]["ms"] / 1e9
    if not args.skip_flex:
        try:
            flex = flex_attention_fn(I, n)
            baseline("FlexAttention (same selection)", lambda: flex(q, k, v), max(2, args.reps // 2))
            del flex
        except Exception as exc:
            rows.append(_error_row(case, "FlexAttention (same selection)", exc))
    if not args.skip_fla:
        try:
            fla_fwd = fla_forward_fn(q, k, v, I)
            err = gate(fla_fwd()[0][0]) if gate is not None else None
            baseline("fla-core parallel_nsa_fwd (same selection)", fla_fwd, args.reps,
                     gate_rel_err=err)
        except Exception as exc:
            rows.append(_error_row(case, "fla-core parallel_nsa_fwd (same selection)", exc))
    if n <= args.gather_max_n:
        baseline("PyTorch gather (Q-outer)", lambda: gather_attention(q, k, v, I), 2)
    del q, k, v, I
    torch.cuda.empty_cache()
    return rows


# -- 2. K1 versions side by side ------------------------------------------------------------------

def bench_k1(n, pattern, args):
    """K1 of each version in ``args.k1_versions`` on one query chunk (``stage_breakdown``),
    each behind its own correctness gate; one failing version does not stop the others."""
    import torch

    case = f"K1 N={n // 1024}K {pattern}"
    rows = []
    q, k, v = _qkv(n, seed=3)
    I = make_selection(pattern, n, seed=3)
    print(f"== {case}", flush=True)
    # v3 also at 128-row tiles (8 warps, one CTA per SM) and with several warp groups of
    # 64-row tiles per CTA (--k1-groups)
    configs = [(version, None, None) for version in args.k1_versions]
    configs += [(3, 128, None)] if 3 in args.k1_versions else []
    configs += [(3, 64, g) for g in args.k1_groups if 3 in args.k1_versions]
    for version, tile_rows, groups in configs:
        impl = (f"K1 v{version}" + (f" T={tile_rows}" if tile_rows else "")
                + (f" groups={groups}" if groups else "") + " (bf16 partials)")
        try:
            r = stage_breakdown(q, k, v, I, version, "bfloat16", gate=True, tile_rows=tile_rows,
                                groups=groups)
            rows.append(dict(case=case, impl=impl, ms=r["k1_ms"], TFLOPs=r["k1_TFLOPs"], **r))
        except Exception as exc:
            rows.append(_error_row(case, impl, exc))
        torch.cuda.empty_cache()
    v2 = next((r["ms"] for r in rows if r.get("version") == 2 and r.get("ms")), None)
    # "vs_v2": v2's K1 time / this K1 time (> 1: faster than v2)
    for r in rows:
        if v2 and r.get("ms"):
            r["vs_v2"] = v2 / r["ms"]
    del q, k, v, I
    torch.cuda.empty_cache()
    return rows


# -- 3. MSA prefill -------------------------------------------------------------------------------

def index_inputs(n, seed=2):
    """The index branch's bf16 inputs for one sequence of ``n`` tokens: ``q_idx`` [n, Hkv,
    Didx] and ``k_idx`` [n, Didx], standard normal."""
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q_idx = torch.randn((n, HKV, D_IDX), device=DEVICE, generator=g, dtype=torch.bfloat16)
    k_idx = torch.randn((n, D_IDX), device=DEVICE, generator=g, dtype=torch.bfloat16)
    return q_idx, k_idx


def bench_prefill(n, args):
    import torch

    from msa.cuda.attention import msa_prefill

    case = f"prefill N={n // 1024}K"
    rows = []
    q, k, v = _qkv(n, seed=1)
    q_idx, k_idx = index_inputs(n)
    cu = _offsets(n, args)
    reps = 1 if n > (256 << 10) else args.reps
    ms_prefill = None
    try:
        def run():
            return msa_prefill(q, k, v, q_idx, k_idx, cu, cu, BK, TOPK,
                               max_partial_bytes=args.max_partial_bytes,
                               groups=args.prefill_groups,
                               index_version=args.prefill_index_version)
        (o, lse, I), peak = _peak_and_first(run)
        S = visible_tokens(I)
        flops = 4 * HQ * D * S + HKV * D_IDX * n * n  # attention + index (eq 12's two terms)
        del o, lse, I
        ms_prefill = cuda_time_ms(run, warmup=0, reps=reps)
        rows.append(_row(case, "msa_prefill (index + top-k + sparse)", ms_prefill, flops, peak,
                         groups=args.prefill_groups, index_version=args.prefill_index_version))
    except Exception as exc:
        rows.append(_error_row(case, "msa_prefill", exc))
    torch.cuda.empty_cache()
    dense_flops = 4 * HQ * D * n * (n + 1) / 2
    if n in args.dense_cache and args.dense_cache[n].get("ms"):
        ms = args.dense_cache[n]["ms"]
        rows.append(_row(case, "dense SDPA (causal)", ms, dense_flops,
                         args.dense_cache[n].get("peak_GiB"), reused_from=args.dense_cache[n]["case"],
                         msa_speedup=(ms / ms_prefill) if ms_prefill else None))
    elif n <= args.dense_max_n:
        try:
            _, peak = _peak_and_first(lambda: dense_sdpa(q, k, v)) if reps > 1 else (None, None)
            ms = cuda_time_ms(lambda: dense_sdpa(q, k, v), warmup=0, reps=reps)
            rows.append(_row(case, "dense SDPA (causal)", ms, dense_flops, peak,
                             msa_speedup=(ms / ms_prefill) if ms_prefill else None))
        except Exception as exc:
            rows.append(_error_row(case, "dense SDPA (causal)", exc))
    del q, k, v, q_idx, k_idx
    torch.cuda.empty_cache()
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/attention.json")
    p.add_argument("--sizes", default="32768,131072", help="sparse attention N, comma separated")
    p.add_argument("--patterns", default="uniform,sink+local+random,skewed")
    p.add_argument("--prefill-sizes", default="131072,1048576")
    p.add_argument("--versions", default="4,3,2,1",
                   help="K1 versions to time end to end (first = breakdown)")
    p.add_argument("--k1-sizes", default="32768", help="N of the K1 side-by-side section")
    p.add_argument("--k1-versions", default="4,3,2,1", help="K1 versions side by side")
    p.add_argument("--partials", default="bfloat16,float32",
                   help="partial dtypes to time with the first version (the others: the first)")
    p.add_argument("--v1-max-n", type=int, default=32768, help="time K1 v1 up to this N")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--max-partial-bytes", type=int, default=None)
    p.add_argument("--gather-max-n", type=int, default=32768)
    p.add_argument("--dense-max-n", type=int, default=1 << 20)
    p.add_argument("--budget-s", type=float, default=240.0,
                   help="skip the cases left once this much wall time has passed")
    p.add_argument("--k1-groups", default="1,2,3,4",
                   help="K1 v3 warp groups per CTA to time in the K1 section (64-row tiles; "
                        "the plain v3 row is the library default)")
    p.add_argument("--groups", default="",
                   help="also time sparse attention with K1 v3 and these warp groups")
    p.add_argument("--prefill-groups", type=int, default=None,
                   help="K1 v3 warp groups in the prefill (default: the library's)")
    p.add_argument("--prefill-index-version", type=int, default=None,
                   help="select_blocks_fused version (1-3) in the prefill (default: the library's)")
    p.add_argument("--skip-flex", action="store_true")
    p.add_argument("--skip-fla", action="store_true", help="no fla-core baseline")
    p.add_argument("--offsets", choices=("host", "device"), default="host",
                   help="cu_seqlens for the msa calls: NumPy arrays or CUDA tensors")
    p.add_argument("--no-breakdown", dest="breakdown", action="store_false")
    args = p.parse_args(argv)
    args.versions = [int(x) for x in args.versions.split(",") if x]
    args.k1_versions = [int(x) for x in args.k1_versions.split(",") if x]
    args.k1_groups = [int(x) for x in args.k1_groups.split(",") if x]
    args.groups = [int(x) for x in args.groups.split(",") if x]
    args.partials = [x for x in args.partials.split(",") if x]
    t_start = time.time()
    rows = []
    # K1 side by side first: the cheapest section, and the one a kernel change is judged by
    cases = [("k1", int(n), "uniform") for n in args.k1_sizes.split(",") if n]
    cases += [("sparse", int(n), pat) for n in args.sizes.split(",") if n
              for pat in args.patterns.split(",") if pat]
    cases += [("prefill", int(n), None) for n in args.prefill_sizes.split(",") if n]
    config = dict(Hq=HQ, Hkv=HKV, D=D, Bk=BK, K=TOPK, Didx=D_IDX, dtype="bfloat16",
                  args={k: v for k, v in vars(args).items()})
    args.dense_cache = {}
    for kind, n, pattern in cases:
        name = f"{kind} N={n // 1024}K" + (f" {pattern}" if pattern else "")
        if time.time() - t_start > args.budget_s:
            rows.append(dict(case=name, impl="-", error=f"skipped: over --budget-s {args.budget_s}"))
            continue
        try:
            if kind == "sparse":
                rows += bench_sparse(n, pattern, args)
            elif kind == "k1":
                rows += bench_k1(n, pattern, args)
            else:
                rows += bench_prefill(n, args)
        except Exception as exc:
            rows.append(_error_row(name, "setup", exc))
        print(f"   [{time.time() - t_start:.0f} s] {name}", flush=True)
        # written after every case, so that a timeout still leaves the results so far
        write_json(args.out, rows, config=config, wall_s=time.time() - t_start)
    print_table(rows, ["case", "impl", "ms", "TFLOPs", "peak_GiB", "msa_speedup", "gate_rel_err",
                       "k1_ms", "k1_TFLOPs", "vs_v2", "k2_ms", "csr_schedule_ms", "error"])
    write_json(args.out, rows, config=config, wall_s=time.time() - t_start)
    return rows


if __name__ == "__main__":
    main()
