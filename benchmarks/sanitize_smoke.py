"""Run every msa.cuda kernel once at a small size, for compute-sanitizer (GPU only).

    compute-sanitizer --tool memcheck --report-api-errors no python3 -m benchmarks.sanitize_smoke
    compute-sanitizer --tool racecheck python3 -m benchmarks.sanitize_smoke
    compute-sanitizer --tool initcheck python3 -m benchmarks.sanitize_smoke  # unwritten reads
    ... python3 -m benchmarks.sanitize_smoke --paper      # the paper's heads and dims at N = 2048
    ... python3 -m benchmarks.sanitize_smoke --paper --n 512  # the same kernels, in minutes
    ... python3 -m benchmarks.sanitize_smoke --decode-only  # the decode steps alone
    ... python3 -m benchmarks.sanitize_smoke --stages backward,kl  # some stages (see STAGES)
    compute-sanitizer --tool racecheck --kernel-name kns=_attention_bwd_kernel_tc python3 -m
        benchmarks.sanitize_smoke --paper --n 512 --stages backward  # one kernel a call, then
    ... --kernel-name-exclude kns=_attention_bwd_kernel_tc ...  # the group's other kernels
    python3 -m benchmarks.sanitize_smoke --paper --n 512 --repeat 8   # the stages 8 times a process

Each stage's result is checked against msa.reference so a clean sanitizer run also means the
kernels computed the right thing; the script prints one line a stage and exits non-zero on a
mismatch. A stage that raises is reported as ``ERROR`` with its exception and the others still
run, so a rung renamed in a stage's ladder shows up here instead of stopping the run: the rungs
it runs besides the defaults are the ``version=`` lists below (K1_VERSIONS, KL_VERSIONS), kept
with the stages' rung tables. The results of the last runs are in
benchmarks/results/gpu_tests/README.md.

Besides each stage on a valid selection, it runs the layer's paths (``msa_prefill``,
``kl_loss_and_backward``, a decode step on a paged cache with Lq = 1 and 4, a chunked prefill
reading K and V through the block table, the decode merge over several warps a row) and a hostile
selection with ``validate=False`` (ids past the sequence and at the int32 extremes, negative
ids, repeats, -1 before an id) through the bf16 defaults of the forward, the backward and the
KL: memory safe, and every undamaged query's results bitwise those of the clean selection.
``--paper`` uses the paper's shapes (Hq 64, Hkv 4, D = Didx = 128, Bk 128, K 16) at N = 2048
(``--n``), so that the production specialisations of every kernel run under the sanitizer.
"""

from __future__ import annotations

import sys

import numpy as np

# The non-default rungs this smoke test runs (``version=`` of the public launchers), with the
# inputs' dtype each needs: K1 (``attention_partials``) and the KL kernels.
K1_VERSIONS = ((1, "float32"), (2, "bfloat16"), (3, "bfloat16"), (4, "bfloat16"))
KL_VERSIONS = (3,)
# The groups ``--stages`` picks from (a racecheck of all of them at the paper's shapes does not
# fit one 10-minute device call). A group that needs an earlier group's output takes the
# reference's when that group is not run (the CSR and schedule of K1, for instance).
CHUNK = 64  # the schedule's queries a work item (small: several items a row)
# ``backward`` is the production backward (v2, bf16, tensor cores); ``backward_f32`` the float32
# rung, far slower under racecheck at the paper's shapes (it kept a 280 s racecheck of both from
# reaching its first stage), so that the two fit separate device calls.
STAGES = ("index", "csr", "attention", "backward", "backward_f32", "kl", "layer", "hostile",
          "decode")


INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1


def main(argv=None) -> int:
    import argparse
    import warnings

    import torch
    from numba.core.errors import NumbaPerformanceWarning

    from msa import reference as R
    from msa.problems import make_problem

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paper", action="store_true",
                    help="the paper's heads, dims, Bk and K at N = 2048 (one sequence)")
    ap.add_argument("--n", type=int, default=2048,
                    help="--paper's sequence length (racecheck's time grows with it; 512 still "
                         "runs every production specialisation, with fewer blocks than K)")
    ap.add_argument("--decode-only", action="store_true",
                    help="only the decode steps (a sanitizer run of every stage takes minutes)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the chosen stages this many times in one process (an intermittent "
                         "mismatch: later passes get the caching allocator's used memory)")
    ap.add_argument("--stages", default=",".join(STAGES),
                    help=f"comma-separated groups to run, of {', '.join(STAGES)} (default all)")
    args = ap.parse_args(argv)
    # Small grids warn on every launch; kept out so that the sanitizer's own report (its summary
    # line, any hazard it prints as a warning) can be read without filtering the log.
    warnings.simplefilter("ignore", NumbaPerformanceWarning)
    stages = set(args.stages.split(","))
    if not stages <= set(STAGES):
        ap.error(f"--stages: unknown {sorted(stages - set(STAGES))}; known {', '.join(STAGES)}")
    if args.decode_only:
        stages = {"decode"}
    paper = args.paper
    if args.n < 1 or (args.n != 2048 and not args.paper):
        ap.error(f"--n: a positive length that goes with --paper, got {args.n}")
    if args.repeat < 1:
        ap.error(f"--repeat: a positive count, got {args.repeat}")
    if paper:
        p = make_problem((args.n,), num_q_heads=64, num_kv_heads=4, head_dim=128, index_dim=128,
                         block_size=128, topk=16, dtype=np.float32, seed=1)
    else:
        p = make_problem((300, 131), (300, 100), num_q_heads=8, num_kv_heads=2, head_dim=64,
                         index_dim=64, block_size=32, topk=4, dtype=np.float32, seed=1)
    cq, ck, bk, k = p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, p.topk
    dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731
    bf = lambda a: dev(a).to(torch.bfloat16)  # noqa: E731
    ok = True

    def report(stage, good):
        nonlocal ok
        ok &= bool(good)
        print(f"{stage:<28s} {'ok' if good else 'MISMATCH'}", flush=True)

    def attempt(stage, check):
        """``report(stage, check())``; an exception is reported and the next stage runs."""
        nonlocal ok
        try:
            good = check()
        except Exception as exc:
            ok = False
            print(f"{stage:<28s} ERROR {type(exc).__name__}: {exc}", flush=True)
            return
        report(stage, good)

    if stages == {"decode"}:
        for _ in range(args.repeat):
            check_decode(p, attempt, bf, dev)
        torch.cuda.synchronize()
        print("all stages ok" if ok else "SOME STAGE FAILED")
        return 0 if ok else 1

    m_ref = R.block_scores(p.q_idx, p.k_idx, cq, ck, bk)
    idx_ref = R.select_blocks(m_ref, cq, ck, bk, k)
    if "index" in stages:
        check_index(p, m_ref, idx_ref, report, bf, dev)

    row_ptr_ref, q_ind_ref, slots_ref = R.build_csr(idx_ref, cq, ck, bk)
    work_ref = R.build_schedule(row_ptr_ref, ck, bk, CHUNK)
    if "csr" in stages:
        work, q_ind, slots = check_csr(p, idx_ref, work_ref, report, dev)
    else:
        work, q_ind, slots = (torch.from_numpy(np.ascontiguousarray(a, np.int32)).cuda()
                              for a in (work_ref, q_ind_ref, slots_ref))
    for rep in range(args.repeat):
        if args.repeat > 1:
            print(f"-- pass {rep + 1} of {args.repeat}", flush=True)
        check_main(p, stages, idx_ref, work, q_ind, slots, report, attempt, bf, dev)
        if "decode" in stages:
            check_decode(p, attempt, bf, dev)
    torch.cuda.synchronize()
    print("all stages ok" if ok else "SOME STAGE FAILED")
    return 0 if ok else 1


def check_index(p, m_ref, idx_ref, report, bf, dev):
    """The index scores and the top-k: every rung's against the reference."""
    import torch

    import msa.cuda as C

    cq, ck, bk, k = p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, p.topk
    m = C.block_scores(dev(p.q_idx), dev(p.k_idx), dev(cq), dev(ck), bk)
    report("block_scores fp32", np.allclose(m.cpu().numpy(), m_ref, rtol=1e-4, atol=1e-4))
    m_bf = C.block_scores(bf(p.q_idx), bf(p.k_idx), dev(cq), dev(ck), bk)
    report("block_scores bf16 (v3)", np.isfinite(m_bf.cpu().numpy()).sum() == np.isfinite(m_ref).sum())
    idx = C.select_blocks(dev(m_ref), cq, ck, bk, k)
    report("select_blocks (v3)", np.array_equal(idx.cpu().numpy(), idx_ref))
    fused = C.select_blocks_fused(bf(p.q_idx), bf(p.k_idx), dev(cq), dev(ck), bk, k)
    report("select_blocks_fused", fused.shape == idx_ref.shape)
    # the index's tensor-core fallback (Bk % 16 != 0, unaligned k_idx): v3's scores, bit for bit
    m_v2 = C.block_scores(bf(p.q_idx), bf(p.k_idx), dev(cq), dev(ck), bk, version=2)
    report("block_scores bf16 (v2)", torch.equal(m_v2, m_bf))
    fused2 = C.select_blocks_fused(bf(p.q_idx), bf(p.k_idx), dev(cq), dev(ck), bk, k, version=2)
    report("select_blocks_fused (v2)", torch.equal(fused2, fused))


def check_csr(p, idx_ref, work_ref, report, dev):
    """The k2q CSR (both scatters) and the schedule; returns the device ``work, q_ind, slots``."""
    import msa.cuda as C
    from msa import reference as R

    cq, ck, bk = p.cu_seqlens_q, p.cu_seqlens_k, p.block_size
    row_ptr_ref, q_ind_ref, slots_ref = R.build_csr(idx_ref, cq, ck, bk)
    row_ptr, q_ind, slots = C.build_csr(dev(idx_ref), dev(cq), dev(ck), bk)
    report("build_csr", np.array_equal(row_ptr.cpu().numpy(), row_ptr_ref)
           and np.array_equal(q_ind.cpu().numpy(), q_ind_ref)
           and np.array_equal(slots.cpu().numpy(), slots_ref))
    # The large-output scatter (v3, two multi-splits), which build_csr picks only past 192 MiB.
    got_v3 = C.csr._build_csr(dev(idx_ref), dev(cq), dev(ck), bk, scatter_version=3)
    report("build_csr (scatter v3)", all(
        np.array_equal(g.cpu().numpy(), w) for g, w in zip(got_v3, (row_ptr_ref, q_ind_ref,
                                                                   slots_ref))))
    # ... and over two row groups (150 rows of Bk = 4), where its second pass loops over groups.
    cu600 = np.array([0, 600], np.int32)
    i_fix = R.fixed_blocks(cu600, cu600, 4, 4, num_kv_heads=2)
    got_v3 = C.csr._build_csr(dev(i_fix), dev(cu600), dev(cu600), 4, scatter_version=3,
                              tile_queries=128)
    report("build_csr (v3, 2 row groups)", all(
        np.array_equal(g.cpu().numpy(), w) for g, w in zip(got_v3, R.build_csr(i_fix, cu600,
                                                                              cu600, 4))))
    work, n = C.build_schedule(row_ptr, dev(ck), bk, CHUNK, max_edges=idx_ref.size)
    w = work.cpu().numpy()
    report("build_schedule", int(n.cpu().numpy()[0]) == len(work_ref)
           and np.array_equal(w[:len(work_ref)], work_ref))
    return work, q_ind, slots


def check_main(p, stages, idx_ref, work, q_ind, slots, report, attempt, bf, dev):
    """The main branch (K1 + K2, its backward), the KL, the layer's paths and a hostile
    selection: the groups of ``stages`` among attention, backward, backward_f32, kl, layer,
    hostile."""
    import torch

    import msa.cuda as C
    from msa import reference as R

    cq, ck, bk, k = p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, p.topk
    o_ref, lse_ref = R.sparse_attention(p.q, p.k, p.v, idx_ref, cq, ck, bk)
    for version, dtype in K1_VERSIONS if "attention" in stages else ():
        cast = dev if dtype == "float32" else bf

        def k1_k2(version=version, cast=cast, dtype=dtype):
            op, lp = C.attention_partials(cast(p.q), cast(p.k), cast(p.v), work, q_ind, slots,
                                          dev(cq), dev(ck), bk, k, version=version)
            o, _ = C.combine_partials(op, lp)
            err = float((o.float().cpu() - torch.from_numpy(o_ref)).abs().max())
            return err < (1e-4 if dtype == "float32" else 3e-2)

        attempt(f"K1 v{version} + K2", k1_k2)
    if "attention" in stages:
        o, lse = C.sparse_attention(bf(p.q), bf(p.k), bf(p.v), dev(idx_ref), dev(cq), dev(ck), bk)
        report("sparse_attention bf16",
               float((o.float().cpu() - torch.from_numpy(o_ref)).abs().max()) < 3e-2)

    # The main branch's backward, float32 against the reference, with a part size that splits
    # the hottest rows (scratch parts + their in-order sum).
    rng = np.random.default_rng(2)
    do_ref = rng.standard_normal(p.q.shape).astype(np.float32)
    rb = lambda a: bf(a).float().cpu().numpy()  # noqa: E731
    if "backward_f32" in stages:
        grads_ref = R.sparse_attention_backward(p.q, p.k, p.v, o_ref, lse_ref, do_ref, idx_ref,
                                                cq, ck, bk)
        for part_size in (None, 5):
            grads = C.sparse_attention_backward(dev(p.q), dev(p.k), dev(p.v), dev(o_ref),
                                                dev(lse_ref), dev(do_ref), dev(idx_ref), dev(cq),
                                                dev(ck), bk, part_size=part_size)
            report(f"backward part_size={part_size}", all(
                np.allclose(g.cpu().numpy(), w, rtol=1e-3, atol=1e-4)
                for g, w in zip(grads, grads_ref)))
    if "backward" in stages:
        # Versions 2 and 3 (tensor cores, wgmma; bf16) against the reference on the bf16-rounded
        # inputs, relative to the largest reference value; in two query chunks, with split hot
        # rows, and so with bf16 dQ partials. Version 3 where it runs: Bk of 64 or 128 (--paper)
        # on compute capability 9.0.
        from msa.cuda._core.wgmma import why_not_available

        qb, kb, vb, ob, dob = rb(p.q), rb(p.k), rb(p.v), rb(o_ref), rb(do_ref)
        grads_ref = R.sparse_attention_backward(qb, kb, vb, ob, lse_ref, dob, idx_ref, cq, ck, bk)
        versions = (2, 3) if bk in (64, 128) and why_not_available() is None else (2,)
        for version in versions:
            for part_size, budget, pdt in ((None, None, None), (5, k * 300 * 8 * 64 * 4, None),
                                           (5, k * 300 * 8 * 64 * 2, "bfloat16")):
                grads = C.sparse_attention_backward(
                    bf(p.q), bf(p.k), bf(p.v), bf(o_ref), dev(lse_ref), bf(do_ref),
                    dev(idx_ref), dev(cq), dev(ck), bk, version=version, part_size=part_size,
                    max_partial_bytes=budget, partial_dtype=pdt)
                report(f"backward v{version} part_size={part_size} partials={pdt or 'f32'}", all(
                    float(np.abs(g.cpu().numpy() - w).max()) <= 2e-2 * float(np.abs(w).max())
                    for g, w in zip(grads, grads_ref)))

    if not stages & {"kl", "layer", "hostile"}:
        return
    # The tensor-core KL (bf16 only; v3 is the default there), against the reference on the
    # bf16-rounded inputs: relative to the largest reference value.
    qb, kb, qib, kib = rb(p.q), rb(p.k), rb(p.q_idx), rb(p.k_idx)
    _, lse_b = R.sparse_attention(qb, kb, rb(p.v), idx_ref, cq, ck, bk)
    kl_b, _ = R.kl_loss(qb, kb, qib, kib, idx_ref, lse_b, cq, ck, bk)
    dq_b, dk_b = R.kl_backward(qb, kb, qib, kib, idx_ref, lse_b, cq, ck, bk)
    close = lambda got, ref: float(np.abs(got.float().cpu().numpy() - ref).max()) <= (  # noqa: E731
        2e-2 * max(float(np.abs(ref).max()), 1e-6))
    args = (bf(p.q), bf(p.k), bf(p.q_idx), bf(p.k_idx), dev(idx_ref), dev(lse_b),
            dev(cq), dev(ck), bk)
    if "kl" in stages:
        kl_ref, loss_ref = R.kl_loss(p.q, p.k, p.q_idx, p.k_idx, idx_ref, lse_ref, cq, ck, bk)
        kl, loss = C.kl_loss(dev(p.q), dev(p.k), dev(p.q_idx), dev(p.k_idx), dev(idx_ref),
                             dev(lse_ref), dev(cq), dev(ck), bk)
        report("kl_loss", np.allclose(kl.cpu().numpy(), kl_ref, rtol=1e-3, atol=1e-5))
        dq, dk = C.kl_backward(dev(p.q), dev(p.k), dev(p.q_idx), dev(p.k_idx), dev(idx_ref),
                               dev(lse_ref), dev(cq), dev(ck), bk)
        dq_ref, dk_ref = R.kl_backward(p.q, p.k, p.q_idx, p.k_idx, idx_ref, lse_ref, cq, ck, bk)
        report("kl_backward", np.allclose(dk.cpu().numpy(), dk_ref, rtol=1e-3, atol=1e-6))
        for version in KL_VERSIONS:
            def kl_bf16(version=version):
                kl, _ = C.kl_loss(*args, version=version)
                dq, dk = C.kl_backward(*args, version=version)
                return close(kl, kl_b) and close(dq, dq_b) and close(dk, dk_b)

            attempt(f"kl v{version} bf16", kl_bf16)

    if "layer" in stages:  # the layer's paths: the prefill and the one-pass KL
        def prefill():
            o, _lse, I = C.msa_prefill(bf(p.q), bf(p.k), bf(p.v), bf(p.q_idx), bf(p.k_idx), cq,
                                      ck, bk, k)
            o_b, _ = R.sparse_attention(rb(p.q), rb(p.k), rb(p.v), I.cpu().numpy(), cq, ck, bk)
            return float(np.abs(o.float().cpu().numpy() - o_b).max()) < 3e-2

        attempt("msa_prefill bf16", prefill)

        def kl_one_pass():
            kl, _loss, dq, dk = C.kl_loss_and_backward(*args)
            return close(kl, kl_b) and close(dq, dq_b) and close(dk, dk_b)

        attempt("kl_loss_and_backward bf16", kl_one_pass)

    if "hostile" in stages:
        attempt("hostile ids, validate=False",
                lambda: hostile(p, idx_ref, do_ref, args, bf, dev))


def hostile(p, idx_ref, do_ref, args, bf, dev):
    """A hostile selection with validate=False through the bf16 forward, backward and KL: memory
    safe, and the damage stays in its rows (every other query's results bitwise the clean
    selection's)."""
    import torch

    import msa.cuda as C
    from msa.cuda.kl import _kl_backward

    cq, ck, bk = p.cu_seqlens_q, p.cu_seqlens_k, p.block_size
    J = idx_ref.copy()
    nb0 = -(-int(ck[1] - ck[0]) // bk)
    damage = ([0, nb0, nb0 + 3], [INT32_MAX, 0, INT32_MIN], [-5, -2, 0], [0, 0, 0], [-1, 0, -1])
    lq0 = int(cq[1] - cq[0])
    rows = [lq0 - 1 - 7 * i for i in range(len(damage))]  # queries of the first sequence
    for t, row in zip(rows, damage):
        J[t, 0, :] = -1
        J[t, 0, :len(row)] = row
    others = torch.from_numpy(~np.isin(np.arange(p.q.shape[0]), rows)).cuda()

    def run(sel, validate):
        """Each query's own results: o, lse, dq (o and lse of the clean run), kl, dq_idx."""
        o, lse = C.sparse_attention(bf(p.q), bf(p.k), bf(p.v), dev(sel), cq, ck, bk,
                                    validate=validate)
        dq = C.sparse_attention_backward(bf(p.q), bf(p.k), bf(p.v), o1, l1, bf(do_ref), dev(sel),
                                         cq, ck, bk, validate=validate)[0]
        kl = _kl_backward(*args[:4], dev(sel), l1, cq, ck, bk, with_kl=True, validate=validate)
        return {"o": o, "lse": lse, "dq": dq, "kl": kl[0], "dq_idx": kl[2]}

    o1, l1 = C.sparse_attention(bf(p.q), bf(p.k), bf(p.v), dev(idx_ref), cq, ck, bk)
    clean = run(idx_ref, True)
    good = True
    # the clean selection twice (the kernels are deterministic), then the damaged one
    for what, got in (("rerun", run(idx_ref, True)), ("damaged", run(J, False))):
        for name, ref in clean.items():
            differ = (ref[others] != got[name][others]).reshape(int(others.sum()), -1).any(1)
            if differ.any():  # NaN != NaN: a NaN counts as a difference
                good = False
                where = torch.nonzero(others).flatten()[differ].tolist()
                print(f"  {what}: {name} differs on {len(where)} undamaged queries, "
                      f"e.g. {where[:8]}", flush=True)
    return good


def check_decode(p, attempt, bf, dev):
    """A decode step on a paged cache (pages shuffled, the last page part full), Lq = 1 and 4,
    against ``msa.reference.decode_attention`` on the step's own selection."""
    from msa import reference as R
    # msa.cuda.decode is a stage of its own (not re-exported by msa.cuda)
    from msa.cuda import decode as CD
    from msa.reference import decode as RD

    cq, ck, bk, k = p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, p.topk
    rb = lambda a: bf(a).float().cpu().numpy()  # noqa: E731

    lens = np.array([int(ck[1] - ck[0])] + ([int(ck[2] - ck[1])] if len(ck) > 2 else []),
                    np.int32)
    hkv, d, di = p.k.shape[1], p.k.shape[2], p.k_idx.shape[1]
    npages = -(-lens // bk)
    perm = np.random.default_rng(4).permutation(int(npages.sum()))
    table = np.full((len(lens), int(npages.max())), -1, np.int32)
    kc = np.zeros((perm.size, hkv, bk, d), np.float32)
    vc = np.zeros_like(kc)
    kic = np.zeros((perm.size, bk, di), np.float32)
    page = 0
    for b, n in enumerate(lens):
        for j in range(int(npages[b])):
            table[b, j] = perm[page]
            lo, hi = int(ck[b]) + j * bk, min(int(ck[b]) + (j + 1) * bk, int(ck[b]) + int(n))
            kc[perm[page], :, : hi - lo] = p.k[lo:hi].transpose(1, 0, 2)
            vc[perm[page], :, : hi - lo] = p.v[lo:hi].transpose(1, 0, 2)
            kic[perm[page], : hi - lo] = p.k_idx[lo:hi]
            page += 1
    for lq in (1, 4):
        def decode_step(lq=lq):
            rows_q = np.concatenate([int(cq[b + 1]) - lq + np.arange(lq)
                                     for b in range(len(lens))])
            o, _lse, I = CD.decode_step(bf(p.q[rows_q]), bf(p.q_idx[rows_q]), bf(kc), bf(vc),
                                       bf(kic), dev(table), dev(lens), bk, k)
            o_b, _ = R.decode_attention(rb(p.q[rows_q]), rb(kc), rb(vc), I.cpu().numpy(),
                                        table, lens, bk)
            return float(np.abs(o.float().cpu().numpy() - o_b).max()) < 3e-2

        attempt(f"decode_step Lq={lq}", decode_step)

    def prefill_chunk():  # K1 reading K and V through the block table
        c = np.minimum(lens, 37)  # the chunk: each request's last (up to) 37 positions
        rows_q = np.concatenate([int(cq[b + 1]) - int(c[b]) + np.arange(int(c[b]))
                                 for b in range(len(lens))])
        cu_c = np.concatenate([[0], np.cumsum(c)]).astype(np.int32)
        o, _lse, I = CD.prefill_chunk(bf(p.q[rows_q]), bf(p.q_idx[rows_q]), bf(kc), bf(vc),
                                      bf(kic), dev(table), dev(lens), cu_c, bk, k)
        gk, gv, _, cu_k = RD.gather_cache(rb(kc), rb(vc), None, table, lens)
        o_b, _ = R.sparse_attention(rb(p.q[rows_q]), gk, gv, I.cpu().numpy(), cu_c, cu_k, bk)
        return float(np.abs(o.float().cpu().numpy() - o_b).max()) < 3e-2

    attempt("prefill_chunk (paged K1)", prefill_chunk)

    def wide_merge():  # the merge over several warps a row, on synthetic candidate lists
        import torch

        from msa.cuda.decode import v2_split_index as v2i

        splits, rows, kk = 140, 4, 16
        rng = np.random.default_rng(5)
        # split s owns blocks s, s + splits, ... (as the split kernels do): ids unique in a row
        blocks = np.stack([s_ + splits * rng.permutation(29)[:kk - 1]
                           for s_ in range(splits) for _ in range(rows)])
        scores = rng.integers(-4, 5, blocks.shape).astype(np.float32)
        order = np.lexsort((blocks, -scores), axis=-1)
        cand_i = np.take_along_axis(blocks, order, -1).astype(np.int32).reshape(splits, rows, 1, kk - 1)
        cand_s = np.take_along_axis(scores, order, -1).reshape(splits, rows, 1, kk - 1)
        seqlens = torch.full((rows,), 4096 * 16 + 1, dtype=torch.int32, device="cuda")
        outs = []
        wm = v2i.merge_warps(kk)  # the one-warp merge: wm rows (warps) a CTA
        for kernel, grid, block in ((v2i.merge_kernel(16, kk), -(-rows // wm), 32 * wm),
                                    (v2i.merge_kernel_wide(16, kk, 5), rows, 160)):
            out = torch.full((rows, 1, kk), -7, dtype=torch.int32, device="cuda")
            kernel[grid, block](dev(cand_s), dev(cand_i), seqlens, 1, 4097 * 16, out)
            outs.append(out.cpu().numpy())
        return np.array_equal(*outs)

    attempt("decode merge over 5 warps a row", wide_merge)


if __name__ == "__main__":
    sys.exit(main())
