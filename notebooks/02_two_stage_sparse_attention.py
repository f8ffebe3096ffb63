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
# # §2.2-2.3 The two-stage abstraction, block and group sharing
#
# §2.2 proposes no method; it fixes the frame every sparse attention fills in. Each query first
# **selects** a set of positions, then runs **ordinary** softmax attention on them:
#
# $$\mathcal{I}_i = \mathrm{Index}_\varphi(q_i, K_{\le i}), \qquad
#   o_i = \mathrm{Attn}(q_i, K[\mathcal{I}_i], V[\mathcal{I}_i]) \tag{2}$$
#
# with $\mathcal{I}_i \subseteq \{1, \dots, i\}$ (causal). The second step has no approximation: it is
# scaled dot-product attention on fewer keys, so the FlashAttention machinery is reused as is.
# Indexers differ by $\varphi$:
#
# | indexer | $\varphi$ | decides by | examples |
# |---|---|---|---|
# | fixed rule | empty | position only | sliding window, attention sink |
# | trainable | learned | the query's content | MSA, NSA, MoBA, DSA |
#
# The paper's appendix B.6 compares MSA with a sliding window of exactly the same FLOPs: the
# window's perplexity is clearly worse, so *which* keys are read matters, not only how many.
# This notebook rebuilds that comparison on a toy retrieval problem.
#
# §2.3 adds the two coarsenings that make selection fast on a GPU. The paper: *"Per-head
# token-level selection offers the finest granularity, but such fine-grained computation is
# difficult to map efficiently to GPU matrix operations."* So MSA shares one selection per GQA group
# (eq 3) and selects contiguous blocks of $B_k$ keys (eq 4), which *"reduces routing overhead and
# makes sparse attention more regular"*:
#
# $$\mathcal{I}_i^{(r)} = \mathcal{I}_i^{(h)} = \mathcal{I}_i^{(h')},\ h, h' \in \mathcal{H}_r \tag{3}$$
#
# $$\mathcal{B}_b = \{(b-1)B_k + 1, \dots, \min(bB_k, N)\},\ b = 1, \dots, B,\ B = \lceil N / B_k \rceil \tag{4}$$

# %%
import nbtools  # first: picks the GPU or Numba's simulator before numba is imported

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from msa import make_problem
from msa import reference as R

# %% [markdown]
# ## Blocks (eq 4) and the selection layout
#
# msa numbers blocks from 0 inside each sequence: block $b$ holds key positions
# $[bB_k, \min((b+1)B_k, N))$, and the last block may be partial. A selection is
# `I [Tq, Hkv, K]` int32: for every query and GQA group, $K$ block ids, ascending, `-1` only as
# tail padding. The query's own (usually incomplete) **local block** is always one of them.

# %%
print("eq 4, N = 300, Bk = 128:", R.block_partition(300, 128).tolist(),
      " B =", R.num_blocks(300, 128))

# %% [markdown]
# ## The second stage is exact
#
# Selecting every block a query can see must give dense attention (eq 1) back, to rounding.

# %%
p = make_problem(seq_lens_k=(200, 77), num_q_heads=4, num_kv_heads=2, head_dim=16,
                 block_size=16, seed=2)
nb = R.max_blocks(p.cu_seqlens_k, p.block_size)
local = R.local_blocks(p.cu_seqlens_q, p.cu_seqlens_k, p.q.shape[0], p.k.shape[0], p.block_size)
everything = np.where(np.arange(nb)[None, :] <= local[:, None], np.arange(nb)[None, :], -1)  # [Tq, NB]
everything = np.repeat(everything[:, None, :], p.num_kv_heads, axis=1).astype(np.int32)  # [Tq, Hkv, NB]
o_all, lse_all = R.sparse_attention(p.q, p.k, p.v, everything, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
o_dense, lse_dense = R.dense_attention(p.q, p.k, p.v, p.cu_seqlens_q, p.cu_seqlens_k)
eps = np.finfo(np.float64).eps
nbtools.check("sparse attention over all visible blocks == dense attention",
              np.abs(o_all - o_dense).max() <= 64 * eps * np.abs(o_dense).max()
              and np.abs(lse_all - lse_dense).max() <= 64 * eps * np.abs(lse_dense).max(),
              f"max |diff| o {np.abs(o_all - o_dense).max():.1e}, lse {np.abs(lse_all - lse_dense).max():.1e}")

# %% [markdown]
# ## A toy retrieval problem: fixed rule vs content, same budget
#
# One sequence of $N = 1024$ tokens, $B_k = 16$ (64 blocks), $K = 4$ blocks per query and group:
# every query reads at most $K B_k = 64$ keys, 6% of the context. Two GQA groups of two heads.
#
# * 16 **needle** keys sit at random positions in blocks 1-31, far back; needle $f$ points along
#   its own direction $u_f$ and is planted in both KV heads. All other keys are noise.
# * Every query of the second half **asks** about one needle per group (its heads' queries point
#   along $u_f$, group 0 and group 1 ask different needles). The first half's queries are noise.
#
# The **teacher** is dense attention: for an asking query it puts almost all its mass on the
# needle. The two selectors have the same budget of $K$ blocks:
#
# * `fixed_blocks`: the attention sink (block 0) and the sliding window of the 3 most recent
#   blocks, the local one included. It cannot depend on content.
# * `select_blocks` on content scores: an idealised index branch that scores key $j$ for group
#   $r$ with the group's mean query, $S^{idx}_{t,r,j} = \bar q_{t,r} \cdot k_{j,r}$, through
#   msa's `block_scores` (block max, eq 6) and `select_blocks` (top-$k$, eq 7). Here it borrows
#   the main branch's own projections; notebook 04 shows an index branch *learning* such scores.
#
# A selector is good when the selected keys carry the teacher's mass. For head $h$, the mass of the
# dense softmax on the support is $\exp(\mathrm{LSE}_{sparse} - \mathrm{LSE}_{dense})$ (the sparse
# normaliser is a partial sum of the dense one); the group's **recall** averages it over its heads.

# %%
N, Bk, K, Hq, Hkv, D = 1024, 16, 4, 4, 2, 32
G = Hq // Hkv
rng = np.random.default_rng(0)
cu = np.array([0, N], dtype=np.int32)
n_needles, a, b = 16, 8.0, 8.0  # needle key norm a, asking query norm b

u = rng.standard_normal((n_needles, D))
u /= np.linalg.norm(u, axis=1, keepdims=True)  # needle directions
needle_pos = rng.choice(np.arange(Bk, 32 * Bk), size=n_needles, replace=False)
k = rng.standard_normal((N, Hkv, D))
k[needle_pos] = a * u[:, None, :]  # the same needle in both KV heads
v = rng.standard_normal((N, Hkv, D))
q = rng.standard_normal((N, Hq, D))
askers = np.arange(N // 2, N)
asked = rng.integers(0, n_needles, size=(askers.size, Hkv))  # needle asked by each group
for r in range(Hkv):
    for h in range(r * G, (r + 1) * G):
        q[askers, h] = b * u[asked[:, r]] + rng.standard_normal((askers.size, D))

# Content scores: group r's mean query against KV head r, via one shared index key of Hkv*D dims.
q_idx = np.zeros((N, Hkv, Hkv * D))
for r in range(Hkv):
    q_idx[:, r, r * D:(r + 1) * D] = q[:, r * G:(r + 1) * G].mean(axis=1)
k_idx = k.reshape(N, Hkv * D)
M = R.block_scores(q_idx, k_idx, cu, cu, Bk)  # [Hkv, Tq, NB]
I_content = R.select_blocks(M, cu, cu, Bk, K)  # [Tq, Hkv, K]
I_fixed = R.fixed_blocks(cu, cu, Bk, K, num_kv_heads=Hkv, num_sink=1)  # [Tq, Hkv, K]
print("query 900, group 0: content", I_content[900, 0], " fixed", I_fixed[900, 0],
      " asked needle in block", needle_pos[asked[900 - N // 2, 0]] // Bk)

# %%
o_dense, lse_dense = R.dense_attention(q, k, v, cu, cu)


def recall(I):
    """Teacher's mass on the support of I, per (query, group): mean over heads of exp(LSE_I - LSE_dense)."""
    _, lse_I = R.sparse_attention(q, k, v, I, cu, cu, Bk)
    return np.exp(lse_I - lse_dense).reshape(N, Hkv, G).mean(axis=2)  # [Tq, Hkv]


rec = {"content (select_blocks)": recall(I_content), "fixed (sink + window)": recall(I_fixed)}
nbtools.table(["selector", "recall, asking queries", "recall, other queries"],
              [(name, f"{x[askers].mean():.3f}", f"{x[: N // 2].mean():.3f}") for name, x in rec.items()])

# %%
fig, axes = plt.subplots(1, 3, figsize=(14, 4))
needle_block = needle_pos[asked[:, 0]] // Bk  # [askers] the block group 0 asks for
colours = ListedColormap(["white", "black", "tab:red", "tab:blue"])
for ax, (name, I) in zip(axes, [("fixed (sink + window)", I_fixed), ("content (select_blocks)", I_content)]):
    img = np.zeros((N, N // Bk), dtype=int)  # [Tq, NB]: 0 not selected, 1 selected
    t, s = np.nonzero(I[:, 0] >= 0)
    img[t, I[t, 0, s]] = 1
    img[askers, needle_block] += 2  # 2: asked needle missed, 3: asked needle selected
    ax.imshow(img.T, aspect="auto", cmap=colours, vmin=0, vmax=3, interpolation="nearest", origin="lower",
              extent=(0, N, 0, N // Bk))
    ax.set(title=f"group 0: {name}", xlabel="query position", ylabel="block")
axes[0].legend(handles=[Patch(color="tab:blue", label="asked needle selected"),
                        Patch(color="tab:red", label="asked needle missed")], loc="upper left", fontsize=8)
for name, x in rec.items():
    axes[2].plot(x[:, 0], lw=0.8, label=name)
axes[2].axvline(N // 2, color="k", ls=":", lw=0.8)
axes[2].set(title="recall of the teacher's mass, group 0", xlabel="query position", ylim=(0, 1.05))
axes[2].legend(fontsize=8)
fig.tight_layout()
nbtools.savefig(fig, "02_fixed_vs_content")
plt.show()

# %% [markdown]
# Same number of blocks, very different value: the window reads only recent noise and misses the
# needle; content-based selection finds the asked needle's block for each group separately
# (groups ask different needles, eq 3 lets them choose differently) and keeps nearly all of the
# teacher's mass. On the first half, where attention is diffuse, no 6% budget can hold most of the
# mass and both selectors are similar.
#
# ## Agreement check
#
# The recall computed from the two LSEs equals the teacher's mass summed token by token
# (`teacher_probs` with the dense LSE gives the dense group-mean softmax restricted to the support).

# %%
mass = R.teacher_probs(q, k, I_content, lse_dense, cu, cu, Bk).sum(axis=-1).T  # [Tq, Hkv]
count = {name: (I >= 0).sum(axis=-1) for name, I in [("content", I_content), ("fixed", I_fixed)]}
err_o = {name: np.linalg.norm(R.sparse_attention(q, k, v, I, cu, cu, Bk)[0][askers] - o_dense[askers])
         / np.linalg.norm(o_dense[askers]) for name, I in [("content", I_content), ("fixed", I_fixed)]}
nbtools.check("recall from LSEs == teacher mass summed over the support",
              np.abs(mass - rec["content (select_blocks)"]).max() < 1e-12)
nbtools.check("both selectors use the same budget (blocks per query and group)",
              np.array_equal(count["content"], count["fixed"]))
nbtools.check("every selection holds the query's local block",
              all((I == (np.arange(N) // Bk)[:, None, None]).any(axis=-1).all() for I in (I_content, I_fixed)))
nbtools.check("content-based selection keeps > 90% of the teacher's mass for asking queries",
              rec["content (select_blocks)"][askers].mean() > 0.9,
              f"{rec['content (select_blocks)'][askers].mean():.3f}")
nbtools.check("the sliding window keeps < 10% of it", rec["fixed (sink + window)"][askers].mean() < 0.1,
              f"{rec['fixed (sink + window)'][askers].mean():.3f}")
nbtools.check("so the content-selected output is closer to dense attention",
              err_o["content"] < err_o["fixed"],
              f"relative error {err_o['content']:.3f} vs {err_o['fixed']:.3f}")
