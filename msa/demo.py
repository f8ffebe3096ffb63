"""Run the whole MSA reference pipeline on a small random problem and say what each stage did.

    python -m msa.demo            # two sequences, 640 and 300 tokens, Bk=32, K=4
    python -m msa.demo --small    # a few hundred tokens in all (what CI runs)

Every stage is the NumPy reference (``msa.reference``); the demo checks the two identities the
paper relies on: KV-outer K1 + K2 equals the Q-outer eq 8, and sparse attention with every block
selected equals dense attention.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from msa import reference as R
from msa.problems import make_problem


def _say(stage: str, what: str, seconds: float) -> None:
    print(f"  {stage:<28s} {what}  ({seconds * 1e3:.1f} ms)")


def run(seq_lens=(640, 300), num_q_heads=8, num_kv_heads=2, head_dim=32, index_dim=16,
        block_size=32, topk=4, chunk_size=None, seed=0) -> dict:
    p = make_problem(seq_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, index_dim=index_dim, block_size=block_size, topk=topk,
                     seed=seed)
    cq, ck, bk = p.cu_seqlens_q, p.cu_seqlens_k, p.block_size
    tq = p.q.shape[0]
    chunk_size = chunk_size or 2 * topk * block_size
    print(f"MSA reference pipeline: sequences {list(seq_lens)}, Hq={num_q_heads}, Hkv={num_kv_heads} "
          f"(G={num_q_heads // num_kv_heads}), D={head_dim}, Didx={index_dim}, Bk={bk}, K={topk}")
    out = {}

    t0 = time.perf_counter()
    m = R.block_scores(p.q_idx, p.k_idx, cq, ck, bk)
    _say("eq 6  block scores", f"M {tuple(m.shape)}, {np.isfinite(m).mean():.0%} visible", time.perf_counter() - t0)

    t0 = time.perf_counter()
    idx = R.select_blocks(m, cq, ck, bk, topk)
    sel = (idx >= 0).sum(axis=-1)
    _say("eq 7  top-k + local block", f"I {tuple(idx.shape)}, {sel.mean():.2f} blocks/query on average",
         time.perf_counter() - t0)

    t0 = time.perf_counter()
    row_ptr, q_indices, slots = R.build_csr(idx, cq, ck, bk)
    nnz = row_ptr[:, -1]
    _say("§4.2 k2q CSR", f"{row_ptr.shape[1] - 1} rows, nnz per head {nnz.tolist()}", time.perf_counter() - t0)

    t0 = time.perf_counter()
    work = R.build_schedule(row_ptr, ck, bk, chunk_size)
    _say("§4.2 hot-row schedule", f"{work.shape[0]} work items, largest {int(work[0, 3]) if len(work) else 0} "
         f"queries (chunk limit {chunk_size})", time.perf_counter() - t0)

    t0 = time.perf_counter()
    o_part, lse_part = R.attention_partials(p.q, p.k, p.v, work, q_indices, slots, cq, ck, bk, topk)
    _say("K1  KV-outer partials", f"O_part {tuple(o_part.shape)}", time.perf_counter() - t0)

    t0 = time.perf_counter()
    o, lse = R.combine_partials(o_part, lse_part)
    _say("K2  exact LSE combine", f"O {tuple(o.shape)}, LSE {tuple(lse.shape)}", time.perf_counter() - t0)

    t0 = time.perf_counter()
    o8, lse8 = R.sparse_attention(p.q, p.k, p.v, idx, cq, ck, bk)
    err = float(np.abs(o - o8).max())
    _say("eq 8  Q-outer check", f"max |K1+K2 - eq 8| = {err:.2e}", time.perf_counter() - t0)

    t0 = time.perf_counter()
    od, lsed = R.dense_attention(p.q, p.k, p.v, cq, ck)
    nb = R.max_blocks(ck, bk)
    all_idx = R.select_blocks(m, cq, ck, bk, max(nb, 1))
    oa, _ = R.sparse_attention(p.q, p.k, p.v, all_idx, cq, ck, bk)
    err_dense = float(np.abs(oa - od).max())
    _say("eq 1  dense check", f"max |sparse(all blocks) - dense| = {err_dense:.2e}, "
         f"max |sparse(K={topk}) - dense| = {float(np.abs(o - od).max()):.2f}", time.perf_counter() - t0)

    t0 = time.perf_counter()
    kl, loss = R.kl_loss(p.q, p.k, p.q_idx, p.k_idx, idx, lse, cq, ck, bk)
    dq_idx, dk_idx = R.kl_backward(p.q, p.k, p.q_idx, p.k_idx, idx, lse, cq, ck, bk)
    _say("eq 9-10 sparse KL", f"L_KL = {float(loss):.4f}, |dQidx| = {np.linalg.norm(dq_idx):.3e}, "
         f"|dKidx| = {np.linalg.norm(dk_idx):.3e}", time.perf_counter() - t0)

    flops = R.msa_flops(tq, num_q_heads, num_kv_heads, head_dim, index_dim, bk, topk)
    gqa = R.gqa_flops(tq, num_q_heads, head_dim)
    print(f"  eq 12 FLOPs at N={tq}: GQA {gqa:.3g}, MSA {flops.total:.3g} ({gqa / flops.total:.2f}x); "
          f"paper config at N=2^20: {R.gqa_flops(2**20, 64, 128) / R.msa_flops(2**20, 64, 4, 128, 128, 128, 16).total:.1f}x")
    out.update(err_k1k2=err, err_dense=err_dense, loss=float(loss))
    ok = err < 1e-10 and err_dense < 1e-10 and np.isfinite(loss)
    print("all checks passed" if ok else "CHECK FAILED")
    out["ok"] = ok
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="a tiny problem (CI)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.small:
        res = run(seq_lens=(130, 70), num_q_heads=4, num_kv_heads=2, head_dim=16, index_dim=8,
                  block_size=16, topk=3, seed=args.seed)
    else:
        res = run(seed=args.seed)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
