# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Decode on a paged KV cache (docs/design.md §8)
#
# Generation adds a few tokens per request and step: $L_q = 1$ for plain decode, up to 8 for
# MTP drafts. A serving engine keeps every request's keys in **pages** of $B_k$ tokens, and in
# MSA one page is exactly one selectable block of eq 4, so a decode step is
#
# * the index branch: the new queries' causal block maxima over *all* cached index keys (eq 6),
#   and the top-$k$ with the forced local block (eq 7), one selection per query and group;
# * the main branch: exact attention of the $L_q \times G$ query rows of each (request, KV head)
#   on their selected pages (eq 8).
#
# Its memory traffic is the index keys once ($B N d_{idx}$ elements) plus the selected pages once
# per (request, KV head), against dense decode's whole K and V ($2 B N H_{kv} d_h$). At the paper
# configuration ($H_{kv} = 4$, $d_h = d_{idx} = 128$, $k = 16$, $B_k = 128$) the index keys are
# $1/8$ of K + V, and the pages $16 \cdot 128 / N$ of it: the floor of an MSA step is about
# $7\times$ below dense at long contexts.

# %%
import nbtools  # first: picks the GPU or Numba's simulator before numba is imported

import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from msa import reference as R
from msa.reference import decode as D
from msa.testing.tolerance import assert_close_to_oracle, assert_exact, oracle_and_baseline

# %% [markdown]
# ## The cache
#
# `k_cache, v_cache [P, Hkv, Bk, D]`, `k_idx_cache [P, Bk, Didx]`, a block table `[B, max_pages]`
# (page of block $j$ of request $b$; -1 where nothing is mapped) and the lengths `[B]`. Pages are
# handed out in any order; `append_to_cache` writes new tokens through the table, and
# `gather_cache` turns the pages back into the packed sequences every prefill function takes.

# %%
rng = np.random.default_rng(0)
P, HKV, BK, DH, DIDX, HQ, K = 12, 2, 16, 16, 16, 4, 3
lens = np.array([21, 40])  # tokens per request: 2 and 3 pages
table = np.full((2, 4), -1, np.int32)
pages = rng.permutation(P)
table[0, :2], table[1, :3] = pages[:2], pages[2:5]
k_cache, v_cache = (np.full((P, HKV, BK, DH), np.nan) for _ in range(2))
i_cache = np.full((P, BK, DIDX), np.nan)
cu = np.concatenate([[0], np.cumsum(lens)])
k, v = rng.standard_normal((2, cu[-1], HKV, DH))
k_idx = rng.integers(-3, 4, (cu[-1], DIDX)).astype(np.float64)  # exact scores: no near ties
D.append_to_cache(k, v, k_idx, k_cache, v_cache, i_cache, table, lens.astype(np.int32), cu_seqlens=cu)
print("block table (page ids, -1 unmapped):\n", table)
gk, gv, gi, gcu = D.gather_cache(k_cache, v_cache, i_cache, table, lens)
nbtools.check("gather_cache returns the appended sequences", np.array_equal(gk, k)
              and np.array_equal(gi, k_idx) and gcu.tolist() == cu.tolist())

# %% [markdown]
# ## One step by hand, against the reference
#
# Two new tokens per request (an MTP draft): append them, then the step's definition is the
# prefill reference on the gathered sequences with `cu_seqlens_q = [0, Lq, 2 Lq]`: the queries
# are the last $L_q$ positions of each cache (bottom-right causal).

# %%
LQ = 2
new_k, new_v = rng.standard_normal((2, 2 * LQ, HKV, DH))
new_i = rng.integers(-3, 4, (2 * LQ, DIDX)).astype(np.float64)
lens = lens + LQ
D.append_to_cache(new_k, new_v, new_i, k_cache, v_cache, i_cache, table, lens.astype(np.int32))
q = rng.standard_normal((2 * LQ, HQ, DH))
q_idx = rng.integers(-3, 4, (2 * LQ, HKV, DIDX)).astype(np.float64)

gk, gv, gi, cu_k = D.gather_cache(k_cache, v_cache, i_cache, table, lens)
cu_q = np.arange(3) * LQ
M = R.block_scores(q_idx, gi, cu_q, cu_k, BK)  # [Hkv, B*Lq, NB]
I_hand = R.select_blocks(M, cu_q, cu_k, topk=K, block_size=BK)  # [B*Lq, Hkv, K]
o_hand, lse_hand = R.sparse_attention(q, gk, gv, I_hand, cu_q, cu_k, BK)
o, lse, I = D.decode_step(q, q_idx, k_cache, v_cache, i_cache, table, lens, BK, K)
print("selection of request 1's two drafts (group 0):", I[2:, 0].tolist())
nbtools.check("decode_step is the prefill reference on the gathered sequences",
              np.array_equal(I, I_hand) and np.array_equal(o, o_hand) and np.array_equal(lse, lse_hand))

# %% [markdown]
# The same step on the GPU kernels (`msa.cuda.decode`; in Numba's simulator here unless a GPU is
# present), in float16: selections equal bit for bit (the index scores are small integers, exact
# in float32), outputs within the float32 reference's error plus the 16-bit rounding of P.

# %%
step, why = nbtools.cuda_function("decode", "decode_step")
if step is None:
    print("skipped:", why)
else:
    h = [x.astype(np.float16) for x in (q, q_idx, k_cache, v_cache, i_cache)]
    o_gpu, lse_gpu, I_gpu = step(*h, table, lens.astype(np.int32), BK, K)
    f32 = [x.astype(np.float32) for x in h]
    oracle, baseline = oracle_and_baseline(D.decode_attention, f32[0], f32[2], f32[3], I, table, lens, BK)
    assert_exact(np.asarray(I_gpu), I, name="block_indices")
    rep = assert_close_to_oracle(np.asarray(lse_gpu), oracle[1], baseline[1], name="lse")
    nbtools.check("msa.cuda.decode: the reference's indices, lse within 2x the float32 error",
                  rep.error <= rep.bound, f"lse error {rep.error:.2e}")
    err = float(np.abs(np.asarray(o_gpu, np.float32) - oracle[0]).max())
    nbtools.check("o within the 16-bit output's rounding", err < 2e-3, f"{err:.2e}")

# %% [markdown]
# ## Chunked prefill: K and V read where they lie
#
# A longer run of new tokens (a prompt arriving in pieces) is the same computation with more
# queries a request: `prefill_chunk`. On the GPU its KV-outer attention reads K and V straight
# from the pages. Viewed as `[P Hkv Bk, 1, D]`, the `Bk` rows of head $h$ in page $p$ are one run,
# as a packed block's rows are, so a work item only needs its page
# (`msa.cuda.attention.sparse_attention(..., block_table=...)`): no copy of the cache, and the
# result of the packed call on the gathered sequences, bit for bit. The NaN in the slots no token
# owns show that nothing else is read.

# %%
attend, why = nbtools.cuda_function("attention", "sparse_attention")
if attend is None:
    print("skipped:", why)
else:
    C = np.array([5, 9])  # the chunk: the last 5 and 9 positions of the two requests
    cu_c = np.concatenate([[0], np.cumsum(C)]).astype(np.int32)
    qc = rng.standard_normal((int(C.sum()), HQ, DH)).astype(np.float16)
    qc_idx = rng.integers(-3, 4, (int(C.sum()), HKV, DIDX)).astype(np.float64)
    Ic = R.select_blocks(R.block_scores(qc_idx, gi, cu_c, cu_k, BK), cu_c, cu_k, topk=K,
                         block_size=BK).astype(np.int32)
    h16 = [x.astype(np.float16) for x in (k_cache, v_cache, gk, gv)]
    cu_k32 = cu_k.astype(np.int32)
    o_paged, lse_paged = attend(qc, h16[0], h16[1], Ic, cu_c, cu_k32, BK, block_table=table)
    o_packed, lse_packed = attend(qc, h16[2], h16[3], Ic, cu_c, cu_k32, BK)
    nbtools.check("K and V read through the block table: the packed call's o and lse, bit for bit",
                  np.array_equal(np.asarray(o_paged), np.asarray(o_packed))
                  and np.array_equal(np.asarray(lse_paged), np.asarray(lse_packed))
                  and np.isfinite(np.asarray(o_paged)).all())

# %% [markdown]
# ## Speed-up against dense decode, as a function of the context
#
# The roofline model (`msa.reference.complexity`-style byte counts at the H200's measured copy
# bandwidth, 4.26 TB/s) and, where `benchmarks/results/bench_decode.json` exists, the measured
# H200 times: the msa step inside a CUDA graph against SDPA decode over the same cache.

# %%
TBPS = 4.26e12
cfg = dict(Hkv=4, d=128, d_idx=128, k=16, bk=128)


def floor_ms(b, n, msa):
    if not msa:
        return 2 * b * n * cfg["Hkv"] * cfg["d"] * 2 / TBPS * 1e3
    pages = b * cfg["Hkv"] * min(cfg["k"], -(-n // cfg["bk"]))
    return (b * n * cfg["d_idx"] * 2 + pages * 2 * cfg["bk"] * cfg["d"] * 2) / TBPS * 1e3


Ns = 2 ** np.arange(13, 21)
model = [floor_ms(32, int(n), False) / floor_ms(32, int(n), True) for n in Ns]
results = Path(nbtools.FIGURES).parent.parent / "benchmarks" / "results" / "bench_decode.json"
measured = []
if results.exists():
    rows = [r for r in json.loads(results.read_text())["results"] if "speedup" in r]
    measured = [r for r in rows if r["Lq"] == 1]
fig, ax = plt.subplots(figsize=(7, 4))
ax.semilogx(Ns, model, "k--", label="HBM floor ratio (model)")
for b in sorted({r["B"] for r in measured}):
    pts = sorted((r["N"], r["speedup"]) for r in measured if r["B"] == b)
    ax.semilogx(*zip(*pts), marker="o", label=f"H200, B = {b}, Lq = 1")
ax.axhline(1, color="0.6", lw=0.8)
ax.set(xlabel="context N (tokens per request)", ylabel="dense time / msa time",
       title="MSA decode step vs dense SDPA decode (paper configuration, bf16)")
ax.legend(fontsize=8)
nbtools.savefig(fig, "09_decode_speedup")
plt.show()
if measured:
    nbtools.table(["B", "N", "msa ms", "dense ms", "speed-up", "x floor"],
                  [(r["B"], r["N"], r["msa_ms"], r["dense_ms"], r["speedup"], r["floor_ratio"])
                   for r in sorted(measured, key=lambda r: (r["B"], r["N"]))])

# %%
nbtools.check("the floor ratio approaches (2 Hkv d_h) / d_idx = 8 at long contexts",
              7.5 < model[-1] < 8.0, f"{model[-1]:.2f} at N = 2^20")
nbtools.check("at N = k Bk = 2048 every block is selected: msa reads K, V and the index keys, "
              "8/9 of dense's floor speed", abs(floor_ms(1, 2048, False) / floor_ms(1, 2048, True)
                                                - 8 / 9) < 1e-9)
