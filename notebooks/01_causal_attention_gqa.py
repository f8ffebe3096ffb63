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
# # §2.1 Causal attention and GQA (eq 1)
#
# MiniMax Sparse Attention (MSA, arXiv 2606.13392) makes standard attention cheaper, so it starts
# from standard attention. §2.1 of the paper (paraphrased): the query at position $t$ takes an inner
# product with every key at a position $i \le t$, a softmax over those scores, and the
# softmax-weighted sum of the values:
#
# $$o_t^{(h)} = \sum_{i \le t} \alpha_{t,i}^{(h)} v_i^{(h)}, \qquad
#   \alpha_{t,i}^{(h)} = \frac{\exp(\langle q_t^{(h)}, k_i^{(h)} \rangle / \sqrt{d_h})}
#                             {\sum_{j \le t} \exp(\langle q_t^{(h)}, k_j^{(h)} \rangle / \sqrt{d_h})}
#   \tag{1}$$
#
# It costs $\Theta(2 H_q N^2 d_h)$ FLOPs, quadratic in the length $N$: *every query must read every
# earlier key*. The only way to save is to let a query read a subset of the keys, which raises the
# two questions the rest of the paper answers: which subset, and who decides.
#
# **GQA** (grouped-query attention) keeps $H_q$ query heads but only $H_{kv}$ key/value heads; the
# $G = H_q / H_{kv}$ adjacent query heads $h = rG, \dots, rG + G - 1$ share KV head $r$ and form
# *GQA group* $r$. The paper's model has $H_q = 64$, $H_{kv} = 4$, so $G = 16$. MSA will later let
# each group, not each head, choose its keys.
#
# This notebook runs `msa.reference.attention.dense_attention` (eq 1 on a packed batch) and checks
# it against a direct softmax written out below.

# %%
import nbtools  # first: picks the GPU or Numba's simulator before numba is imported

import matplotlib.pyplot as plt
import numpy as np

import msa
from msa import reference as R

print("msa", msa.__version__, "| kernels run on", nbtools.DEVICE)

# %% [markdown]
# ## GQA groups (eq 3)
#
# `gqa_group(Hq, Hkv)` gives the KV head $r = \lfloor h / G \rfloor$ of every query head.

# %%
print("Hq=8,  Hkv=2 :", R.gqa_group(8, 2))
print("paper Hq=64, Hkv=4 -> G =", 64 // 4, "; heads of group 1:",
      np.flatnonzero(R.gqa_group(64, 4) == 1))

# %% [markdown]
# ## A packed batch
#
# msa takes FlashAttention-style packed batches: sequences are concatenated, `cu_seqlens_q` and
# `cu_seqlens_k` are prefix sums of their lengths. A sequence's $L_q$ queries are the **last**
# $L_q$ of its $L_k$ key positions (bottom-right alignment): a prefill has $L_q = L_k$, a decode step
# $L_q = 1$. Below, sequence 0 is a prefill of 40 tokens and sequence 1 continues a 24-token
# context with its last 8 queries.

# %%
p = msa.make_problem(seq_lens_k=(40, 24), seq_lens_q=(40, 8), num_q_heads=4, num_kv_heads=2,
                     head_dim=16, seed=1)
cu_q, cu_k = p.cu_seqlens_q, p.cu_seqlens_k
Tq, Hq, D = p.q.shape
Tk, Hkv, _ = p.k.shape
G = Hq // Hkv
batch_q, pos_q = R.query_positions(cu_q, cu_k, Tq, Tk)
batch_k, pos_k = R.key_positions(cu_k, Tk)
print(f"q {p.q.shape}, k {p.k.shape}, v {p.v.shape}, G = {G}")
print("cu_seqlens_q", cu_q, " cu_seqlens_k", cu_k)
print("sequence 1's queries sit at key positions", pos_q[batch_q == 1])

# %% [markdown]
# Query $t$ sees key $j$ when both belong to the same sequence and $pos_j \le pos_t$:

# %%
visible = (batch_q[:, None] == batch_k[None, :]) & (pos_k[None, :] <= pos_q[:, None])  # [Tq, Tk]
fig, ax = plt.subplots(figsize=(5, 4))
ax.imshow(visible, cmap="Greys", interpolation="nearest")
ax.set(title="causal visibility of a packed batch", xlabel="packed key j", ylabel="packed query t")
plt.show()

# %% [markdown]
# ## Eq 1 in msa, and eq 1 written out
#
# `dense_attention` returns the output $o$ `[Tq, Hq, D]` and the log-sum-exp
# $\mathrm{LSE} = \log \sum_{j \le t} \exp(S_{t,j})$ `[Tq, Hq]` of the scaled scores, which later
# stages reuse (the exact combine of §4.2, the KL teacher of §3.2). The direct version below loops
# over heads and materialises every score: fine for 48 queries.

# %%
o, lse = R.dense_attention(p.q, p.k, p.v, cu_q, cu_k)

scale = 1 / np.sqrt(D)
o_direct = np.zeros_like(o)
lse_direct = np.zeros_like(lse)
alpha = np.zeros((Hq, Tq, Tk))  # the attention weights of eq 1, for the picture
for h in range(Hq):
    r = h // G  # eq 3: query head h reads KV head r
    S = p.q[:, h] @ p.k[:, r].T * scale  # [Tq, Tk]
    S = np.where(visible, S, -np.inf)
    m = S.max(axis=1, keepdims=True)
    e = np.exp(S - m)
    alpha[h] = e / e.sum(axis=1, keepdims=True)
    o_direct[:, h] = alpha[h] @ p.v[:, r]
    lse_direct[:, h] = m[:, 0] + np.log(e.sum(axis=1))

fig, axes = plt.subplots(1, Hq, figsize=(12, 3))
for h, ax in enumerate(axes):
    ax.imshow(alpha[h], cmap="viridis", interpolation="nearest")
    ax.set(title=f"head {h} (KV head {h // G})", xticks=[], yticks=[])
fig.suptitle("attention weights $\\alpha_{t,i}^{(h)}$: heads of a group share K, V, not their weights")
plt.show()

# %% [markdown]
# ## GQA is multi-head attention with repeated KV heads
#
# Repeating each KV head $G$ times turns GQA into ordinary multi-head attention with
# $H_{kv} = H_q$; the output must not change. GQA's gain is memory: the KV cache holds
# $H_{kv}$ heads instead of $H_q$ ($16\times$ less in the paper's model), and one K/V load serves
# $G$ query heads, the property MSA builds on.

# %%
o_mha, lse_mha = R.dense_attention(p.q, np.repeat(p.k, G, axis=1), np.repeat(p.v, G, axis=1),
                                   cu_q, cu_k)

# %% [markdown]
# ## Cost
#
# `msa.reference.complexity.gqa_flops` is $F_{GQA}(N) = 2 H_q d_h N^2$ (the causal half of
# $4 H_q d_h N^2$ for $QK^\top$ and $PV$), in the paper's configuration:

# %%
nbtools.table(["N", "F_GQA(N) FLOPs", "per query (FLOPs)"],
              [(n, f"{R.gqa_flops(n, 64, 128):.3e}", f"{R.gqa_flops(n, 64, 128) / n:.3e}")
               for n in (8192, 131072, 1 << 20)])

# %% [markdown]
# ## Agreement check
#
# Both computations are float64 and differ only in the order of the additions, so they agree to
# a few units in the last place; we allow 64 ulps of the largest value.

# %%
eps = np.finfo(np.float64).eps
err_o = np.abs(o - o_direct).max()
err_lse = np.abs(lse - lse_direct).max()
nbtools.check("dense_attention o == direct softmax (eq 1)", err_o <= 64 * eps * np.abs(o_direct).max(),
              f"max |diff| = {err_o:.1e}")
nbtools.check("dense_attention LSE == direct log-sum-exp", err_lse <= 64 * eps * np.abs(lse_direct).max(),
              f"max |diff| = {err_lse:.1e}")
nbtools.check("GQA == MHA with each KV head repeated G times",
              np.abs(o - o_mha).max() <= 64 * eps * np.abs(o).max() and np.array_equal(np.isinf(lse), np.isinf(lse_mha)),
              f"max |diff| = {np.abs(o - o_mha).max():.1e}")
nbtools.check("each query's weights sum to 1 over exactly its visible keys",
              np.allclose(alpha.sum(axis=-1), 1.0, rtol=0, atol=Tk * eps) and not (alpha[:, ~visible] > 0).any())
