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
# # §3.1 The index branch (eq 5-7)
#
# The paper opens §3 with three promises: *"The Index Branch adds only two projection matrices to
# standard GQA, operates at block granularity, and makes selections independently for each GQA
# group."* The branch only outputs block ids; the main branch only runs standard attention on them.
#
# $$Q^{idx} = X W_q^{idx} \in \mathbb{R}^{N \times H_{kv} \times d_{idx}}, \qquad
#   K^{idx} = X W_k^{idx} \in \mathbb{R}^{N \times 1 \times d_{idx}} \tag{5}$$
#
# $$S_{i,j}^{idx,(r)} = \frac{Q_i^{idx,(r)} (K_j^{idx})^\top}{\sqrt{d_{idx}}}, \qquad
#   M_{i,b}^{idx,(r)} = \max_{j \in \mathcal{B}_b,\ j \le i} S_{i,j}^{idx,(r)} \tag{6}$$
#
# $$\mathcal{I}_i^{(r)} = \mathrm{TopK}_{b \in \{1..B\}}(M_{i,\cdot}^{idx,(r)}, k) \tag{7}$$
#
# One index query head per GQA group, **one** index key head shared by all groups (a key only
# describes what a token is about, whoever asks), token scores max-pooled per block, top-$k$ per
# (query, group). In msa: `index_projections` (eq 5), `index_scores` (eq 6 left, small problems
# only), `block_scores` (eq 6, never materialising $S$), `select_blocks` (eq 7 with the query's
# own local block always selected, the final recipe of §3.2).

# %%
import nbtools  # first: picks the GPU or Numba's simulator before numba is imported

import matplotlib.pyplot as plt
import numpy as np

from msa import make_problem
from msa import reference as R
from msa.testing.tolerance import assert_close_to_oracle, oracle_and_baseline

# %% [markdown]
# ## Promise one: two matrices
#
# In the paper's model ($d_{model} = 3072$, $H_q = 64$, $H_{kv} = 4$, $d_h = d_{idx} = 128$):

# %%
d_model, Hq_p, Hkv_p, d_h, d_idx = 3072, 64, 4, 128, 128
idx_params = d_model * Hkv_p * d_idx + d_model * d_idx  # W_q_idx, W_k_idx
attn_params = 2 * d_model * Hq_p * d_h + 2 * d_model * Hkv_p * d_h  # W_q, W_o, W_k, W_v
nbtools.table(["matrix", "shape", "parameters"], [
    ("W_q_idx", f"{d_model} x ({Hkv_p} x {d_idx})", f"{d_model * Hkv_p * d_idx:,}"),
    ("W_k_idx", f"{d_model} x {d_idx}", f"{d_model * d_idx:,}"),
    ("index branch", "", f"{idx_params:,}"),
    ("W_q, W_k, W_v, W_o", "", f"{attn_params:,}"),
])
print(f"index branch = {100 * idx_params / attn_params:.1f}% of the attention parameters of a layer")

# %% [markdown]
# ## The N = 8192 shape walk-through
#
# We run the branch on one sequence of $N = 8192$ tokens with the paper's $H_{kv} = 4$,
# $B_k = 128$, $k = 16$, but a smaller $d_{idx} = 32$ and $d_{model} = 64$ so that it takes
# seconds on a laptop. The inputs have planted structure, explained in the Figure 3 section below.
# `X` and the two index matrices are random; the structure is then planted in $Q^{idx}, K^{idx}$.

# %%
N, Hkv, Didx, Bk, K, dm = 8192, 4, 32, 128, 16, 64
NB = N // Bk
rng = np.random.default_rng(3)
cu = np.array([0, N], dtype=np.int32)
x = rng.standard_normal((N, dm)).astype(np.float32)
w_q_idx = (rng.standard_normal((dm, Hkv * Didx)) / np.sqrt(dm)).astype(np.float32)
w_k_idx = (rng.standard_normal((dm, Didx)) / np.sqrt(dm)).astype(np.float32)
q_idx, k_idx = R.index_projections(x, w_q_idx, w_k_idx, Hkv)  # eq 5 on sg(X)

# Planted structure (see the Figure 3 section): a sink direction every group's query shares,
# and one direction per group that a few "stripe" tokens carry. The projections give entries of
# unit variance; the query keeps half of its own as noise.
W, _ = np.linalg.qr(rng.standard_normal((Didx, Hkv + 1)))
w_sink, w_group = W[:, 0], W[:, 1:].T  # [Didx], [Hkv, Didx], orthonormal
q_idx = (0.5 * q_idx + 3.0 * w_sink + 3.0 * w_group[None]).astype(np.float32)  # [N, Hkv, Didx]
k_idx[:4] += 10.0 * w_sink  # the first tokens: an attention sink
stripes = [np.sort(rng.choice(np.arange(1, NB), 8, replace=False)) for _ in range(Hkv)]
for r in range(Hkv):
    k_idx[stripes[r] * Bk + rng.integers(0, Bk, size=8)] += 12.0 * w_group[r]  # one token per stripe block

M = R.block_scores(q_idx, k_idx, cu, cu, Bk)  # eq 6: [Hkv, N, NB], S never materialised
I = R.select_blocks(M, cu, cu, Bk, K)  # eq 7: [N, Hkv, K]

# %% [markdown]
# msa's layouts: `q_idx [N, Hkv, Didx]`, the shared `k_idx [N, Didx]` (the paper's
# $(N, 1, d_{idx})$), `M [Hkv, N, NB]` (the paper's $(N, H_{kv}, B)$ with the group axis first),
# `I [N, Hkv, K]`.

# %%
MiB = 2 ** 20
nbtools.table(["step", "tensor", "paper shape (N=8192)", "this run", "paper size"], [
    ("input", "X", "(8192, 3072)", x.shape, "stopgrad before the index branch"),
    ("project (eq 5)", "Q_idx", "(8192, 4, 128)", q_idx.shape, "one index query head per group"),
    ("project (eq 5)", "K_idx", "(8192, 1, 128)", k_idx.shape, "one shared index key head"),
    ("score (eq 6)", "S_idx", "(8192, 4, 8192)", "never built", f"{N * 4 * N * 2 / MiB:.0f} MiB in bf16"),
    ("block max (eq 6)", "M_idx", "(8192, 4, 64)", M.shape, f"{N * 4 * NB * 4 / MiB:.0f} MiB in fp32"),
    ("top-k (eq 7)", "I", "(8192, 4, 16)", I.shape, f"{N * 4 * K * 4 / MiB:.0f} MiB in int32"),
])

# %% [markdown]
# Steps 3-5 of the walk-through on a small problem, materialised: `index_scores` builds the token
# scores $S^{idx}$ with $-\infty$ on future keys, a reshape views the key axis as
# (block, position in block) without moving data, and a max over the last axis is eq 6. It must be
# what `block_scores` computes tile by tile without ever holding $S^{idx}$.

# %%
sp = make_problem(seq_lens_k=(100,), num_kv_heads=2, num_q_heads=2, index_dim=8, block_size=16, seed=3)
S_small = R.index_scores(sp.q_idx, sp.k_idx, sp.cu_seqlens_q, sp.cu_seqlens_k)  # [Hkv, Tq, Tk]
nb_small = R.num_blocks(100, 16)
S_pad = np.pad(S_small, ((0, 0), (0, 0), (0, nb_small * 16 - 100)), constant_values=-np.inf)
M_small = S_pad.reshape(2, 100, nb_small, 16).max(axis=-1)  # [Hkv, Tq, NB]
print("S_idx", S_small.shape, "-> view", S_pad.reshape(2, 100, nb_small, 16).shape, "-> max ->", M_small.shape)

# %% [markdown]
# ## Promise two: why a block **max**, not a mean
#
# The paper's example. Block A holds one strongly matching token (score $+8.0$) and 127
# unrelated ones ($-1.0$); block B holds 128 mediocre tokens ($+0.5$):
#
# $$\text{A: } \max = 8.00,\ \text{mean} = \tfrac{8.0 + 127 \times (-1.0)}{128} = -0.93 \qquad
#   \text{B: } \max = \text{mean} = 0.50$$
#
# Ranking by mean picks B: the needle is diluted by its 127 neighbours. Long-context retrieval is
# needle-in-a-haystack, so MSA takes the max. We build exactly these scores ($d_{idx} = 1$,
# scale 1, so a score is the key's value) and let a query in a third block choose one block
# besides its local one. `block_scores(..., pool="mean")` is MoBA's score: by linearity,
# $q \cdot \mathrm{mean}(k) = \mathrm{mean}(q \cdot k)$, so MoBA and MSA differ in exactly this operator
# and MSA cannot fold the block into one mean key: it pays for every token score.

# %%
scores = np.concatenate([[8.0], -np.ones(127), np.full(128, 0.5), [0.0]])  # blocks A, B, and the query's token
ab_k = scores[:, None]  # [257, 1]
ab_q = np.ones((1, 1, 1))  # one query at position 256, one group
cu_q1, cu_k1 = np.array([0, 1], dtype=np.int32), np.array([0, 257], dtype=np.int32)
pooled = {pool: R.block_scores(ab_q, ab_k, cu_q1, cu_k1, 128, scale=1.0, pool=pool)[0, 0] for pool in ("max", "mean")}
chosen = {pool: R.select_blocks(m[None, None], cu_q1, cu_k1, 128, 2)[0, 0] for pool, m in pooled.items()}
names = {0: "A", 1: "B", 2: "local"}
nbtools.table(["pool", "M[A]", "M[B]", "selected (K=2)"],
              [(pool, f"{m[0]:+.2f}", f"{m[1]:+.2f}", [names[b] for b in chosen[pool]]) for pool, m in pooled.items()])
moba = (ab_q[0, 0] @ ab_k[:128].mean(axis=0), ab_q[0, 0] @ ab_k[128:256].mean(axis=0))
print("MoBA's mean key scores:", np.round(moba, 4))

# %% [markdown]
# ## Promise three and causality: query $i = 5000$
#
# The paper walks through $N = 8192$ ($B = 64$ blocks), query $i = 5000$:
#
# 1. local block $\lfloor 5000 / 128 \rfloor = 39$, covering tokens 4992-5119;
# 2. blocks 40-63 lie wholly in the future: their scores are $-\infty$; in block 39 only tokens
#    4992-5000, 9 of them, are visible;
# 3. so each group has 40 finite block scores;
# 4. top-$k$ keeps 16 blocks, block 39 forced, 15 chosen freely;
# 5. the gather reads $15 \times 128 + 9 = 1929$ tokens, not 2048: the budget is *at most*
#    $kB_k$.
#
# We read these numbers off our run. The token count comes from the KL student of eq 9
# (`student_probs`), whose support is exactly the visible tokens of the selected blocks; for one
# query at position 5000 it is a sequence of 5001 keys whose last key is the query itself.

# %%
i = 5000
row = M[:, i]  # [Hkv, NB]
local_i = R.local_blocks(cu, cu, N, N, Bk)[i]
P_idx = R.student_probs(q_idx[i:i + 1].astype(np.float64), k_idx[:i + 1].astype(np.float64),
                        I[i:i + 1], cu_q1, np.array([0, i + 1], dtype=np.int32), Bk)  # [Hkv, 1, 5001]
support = (P_idx[:, 0] > 0).sum(axis=-1)  # [Hkv]
nbtools.table(["group", "finite M", "-inf M", "selected blocks", "visible tokens"],
              [(r, int(np.isfinite(row[r]).sum()), int(np.isneginf(row[r]).sum()), I[i, r].tolist(), int(support[r]))
               for r in range(Hkv)])

# %% [markdown]
# ## A selection map per group, like the paper's Figure 3
#
# Figure 3 of the paper shows, for one query range, which blocks each of the 4 groups selects:
# all groups share block 0 (an attention sink that *emerged*: the final recipe forces only the
# local block) and the diagonal of recent blocks, while at long range the groups pick different
# stripes. For query 5000 the paper counts 26 of the 40 visible blocks hit by some group and 6
# hit by all four.
#
# Random index weights would give a map of random speckle, so our inputs plant what a trained
# indexer learns: the first 4 tokens carry a *sink* direction that every group's index query
# contains, and for each group 8 random blocks hold one token along that group's own direction.
# Nothing in msa knows about either; `select_blocks` sees only the scores.

# %%
sel = np.zeros((Hkv, N, NB), dtype=bool)  # [Hkv, N, NB]
t, r_, s = np.nonzero(I >= 0)
sel[r_, t, I[t, r_, s]] = True
fig, axes = plt.subplots(1, Hkv, figsize=(14, 3.6), sharey=True)
for r, ax in enumerate(axes):
    ax.imshow(sel[r].T, aspect="auto", origin="lower", cmap="Greys", interpolation="nearest",
              extent=(0, N, 0, NB))
    ax.axvline(i, color="tab:red", lw=0.6)
    ax.set(title=f"group {r}", xlabel="query position")
axes[0].set_ylabel("selected KV block")
fig.suptitle(f"selected blocks per query and GQA group (N={N}, Bk={Bk}, k={K}); red: query {i}")
fig.tight_layout()
nbtools.savefig(fig, "03_selection_map")
plt.show()
hit_any = set(np.unique(I[i][I[i] >= 0]))
hit_all = set.intersection(*(set(I[i, r]) for r in range(Hkv)))
print(f"query {i}: {len(hit_any)} of 40 visible blocks hit by some group, {len(hit_all)} by all: {sorted(map(int, hit_all))}")

# %% [markdown]
# ## The kernel: `msa.cuda.index.block_scores`
#
# The GPU computes eq 6 tile by tile (tensor cores for bf16/fp16), never holding $S$. It must
# equal the reference: its error against a float64 oracle at most twice that of the float32
# reference (`msa.testing.tolerance`). In the simulator we use a tiny problem; on a GPU the
# $N = 8192$ one above.

# %%
block_scores_cuda, why = nbtools.cuda_function("index", "block_scores")
kernel_checks = []
if block_scores_cuda is None:
    print(why)
else:
    if nbtools.ON_GPU:
        kq, kk, kcu_q, kcu_k, kbk = q_idx, k_idx, cu, cu, Bk
    else:
        tiny = make_problem(seq_lens_k=(50, 30), num_q_heads=2, num_kv_heads=2, index_dim=16,
                            block_size=16, dtype=np.float32, seed=4)
        kq, kk, kcu_q, kcu_k, kbk = tiny.q_idx, tiny.k_idx, tiny.cu_seqlens_q, tiny.cu_seqlens_k, 16
    for pool in ("max", "mean"):
        oracle, baseline = oracle_and_baseline(R.block_scores, kq, kk, kcu_q, kcu_k, kbk, pool=pool)
        got = block_scores_cuda(kq, kk, kcu_q, kcu_k, kbk, pool=pool)
        rep = assert_close_to_oracle(got, oracle, baseline, name=f"M ({pool})")
        kernel_checks.append((pool, kq.shape, rep))
        print(f"block_scores kernel, pool={pool}, q_idx {kq.shape}: error {rep.error:.2e}, "
              f"float32 reference's {rep.baseline_error:.2e} (ratio {rep.ratio:.2f})")

# %% [markdown]
# ## Agreement check

# %%
nbtools.check("block_scores == block max of the materialised index_scores (eq 6)",
              np.array_equal(M_small, R.block_scores(sp.q_idx, sp.k_idx, sp.cu_seqlens_q, sp.cu_seqlens_k, 16)))
nbtools.check("max pooling: A = 8.00, B = 0.50, picks A", np.allclose(pooled["max"][:2], [8.0, 0.5]) and chosen["max"].tolist() == [0, 2])
nbtools.check("mean pooling: A = -0.93, B = 0.50, picks B", round(pooled["mean"][0], 2) == -0.93 and chosen["mean"].tolist() == [1, 2])
nbtools.check("mean pooling == MoBA's mean key", np.allclose(pooled["mean"][:2], moba, rtol=1e-12, atol=0))
nbtools.check("query 5000: local block 39, 40 finite and 24 -inf block scores in every group",
              local_i == 39 and (np.isfinite(row).sum(axis=1) == 40).all() and (np.isneginf(row).sum(axis=1) == 24).all())
nbtools.check("query 5000: 16 blocks, block 39 among them, 15 x 128 + 9 = 1929 visible tokens",
              (I[i] >= 0).sum(axis=1).tolist() == [16] * Hkv and (I[i] == 39).any(axis=1).all()
              and support.tolist() == [15 * 128 + 9] * Hkv)
t_all = np.arange(N)
nbtools.check("every query keeps its local block (the diagonal of the map)", sel[:, t_all, t_all // Bk].all())
nbtools.check("the sink emerges from the scores: block 0 chosen by every group for > 99% of queries",
              sel[:, Bk:, 0].mean() > 0.99, f"{sel[:, Bk:, 0].mean():.4f}")
stripe_rate = [sel[r][:, stripes[r]][t_all[:, None] // Bk > stripes[r][None, :]].mean() for r in range(Hkv)]
union = sel[:, N // 2:].any(axis=0).sum(axis=-1)  # [N/2] blocks hit by some group
nbtools.check("groups choose differently: in the second half the 4 groups together hit > 1.5 k blocks",
              union.mean() > 1.5 * K, f"mean {union.mean():.1f} distinct blocks for k = {K}")
if block_scores_cuda is None:
    print("kernel check skipped:", why)
else:
    nbtools.check("msa.cuda.index.block_scores == reference (max and mean)", len(kernel_checks) == 2)
