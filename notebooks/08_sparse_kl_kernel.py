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
# # §4.3 The sparse KL kernel
#
# Line 7 of Algorithm 1, `L_KL <- KLdiv(Q_idx, K_idx, sg(Q), sg(K), I)`, is the third heavy step of
# a training layer (lines 3-4 are §4.1, line 5 is §4.2). Note what it takes: $Q$ and $K$ but no
# $V$, because the teacher of eq 9 needs attention *weights* only, and those are
# $\exp(S^{(h)}_{i,j} - \mathrm{LSE}^{(h)}_i)$, where $\mathrm{LSE}^{(h)}_i$ is the log-sum-exp of head
# $h$'s scores over the selected support, which the sparse attention forward has already computed.
# §4.3 therefore has the main branch write its LSE to memory and skips a separate KL-forward pass
# that would redo the teacher's softmax; a custom backward rebuilds $P$ from the logits and the
# stored LSE and injects the gradient $P^{idx} - P$ (notebook 04) into $Q^{idx}$ and $K^{idx}$.
# The paper pairs it with persistent, load-balanced scheduling, since the work per (block, head)
# is as skewed as in §4.2.
#
# msa's reference (`msa.reference.kl`) already follows that structure: `kl_loss` and `kl_backward`
# take the main branch's `lse`, never build the `[Hkv, Tq, Tk]` scores, and visit each selected
# (group, block) once with all the queries that selected it (the KV-outer order), so a block's
# keys are read once and $\partial K^{idx}$ of the block is one product $dS^\top Q^{idx}$ rather than
# a scatter. The GPU kernels are in `msa.cuda.kl` (its module docstring describes their versions:
# how the student's LSE is computed online in the same pass as the KL, and how the backward is
# split into a per-query pass for $\partial Q^{idx}$ and a per-key pass over the k2q CSR for
# $\partial K^{idx}$, without float atomics).

# %%
import nbtools  # first: picks the GPU or Numba's simulator before numba is imported

import matplotlib.pyplot as plt
import numpy as np

from msa import make_problem
from msa import reference as R
from msa.testing.tolerance import assert_close_to_oracle, oracle_and_baseline

# %% [markdown]
# ## Reusing the main branch's LSE
#
# The teacher is normalised by the LSE of the **same** support: the LSE that `sparse_attention`
# returns makes every teacher row sum to one, and `kl_loss` given that LSE equals `kl_loss` that
# computes its own (`lse=None`). The dense LSE belongs to another support: with it the "teacher"
# no longer sums to one, which is why the selection and the LSE must come from the same forward.

# %%
p = make_problem(seq_lens_k=(96, 50), num_q_heads=4, num_kv_heads=2, head_dim=16, index_dim=8,
                 block_size=8, topk=3, seed=11)
args = (p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
M = R.block_scores(p.q_idx, p.k_idx, *args)
I = R.select_blocks(M, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, p.topk)
_, lse_sparse = R.sparse_attention(p.q, p.k, p.v, I, *args)
_, lse_dense = R.dense_attention(p.q, p.k, p.v, p.cu_seqlens_q, p.cu_seqlens_k)
kl_reused, loss_reused = R.kl_loss(p.q, p.k, p.q_idx, p.k_idx, I, lse_sparse, *args)
kl_own, loss_own = R.kl_loss(p.q, p.k, p.q_idx, p.k_idx, I, None, *args)
row_sum = {name: R.teacher_probs(p.q, p.k, I, lse, *args).sum(axis=-1)
           for name, lse in [("sparse LSE (same support)", lse_sparse), ("dense LSE (wrong support)", lse_dense)]}
nbtools.table(["teacher normalised with", "min row sum", "max row sum"],
              [(name, f"{s.min():.6f}", f"{s.max():.6f}") for name, s in row_sum.items()])
print(f"L_KL with the reused LSE {loss_reused:.15f}, with its own {loss_own:.15f}")

# %% [markdown]
# What the backward injects, for the (query, group) with the largest KL: teacher and student on the
# support, and their difference $P^{idx} - P$, the gradient with respect to the index logits.

# %%
P = R.teacher_probs(p.q, p.k, I, lse_sparse, *args)  # [Hkv, Tq, Tk]
P_idx = R.student_probs(p.q_idx, p.k_idx, I, *args)  # [Hkv, Tq, Tk]
t_worst, r_worst = np.unravel_index(np.argmax(kl_reused), kl_reused.shape)
on = np.flatnonzero(P_idx[r_worst, t_worst] > 0)  # the support: packed key ids
fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(10, 4.5), sharex=True)
ax0.plot(P[r_worst, t_worst, on], ".-", label="teacher $P$ (group mean, main branch's LSE)")
ax0.plot(P_idx[r_worst, t_worst, on], ".-", label="student $P^{idx}$")
ax0.set(ylabel="probability", title=f"query {t_worst}, group {r_worst}: support of {on.size} keys, "
                                       f"KL = {kl_reused[t_worst, r_worst]:.3f}")
ax0.legend(fontsize=8)
ax1.bar(np.arange(on.size), (P_idx - P)[r_worst, t_worst, on], color="tab:red")
ax1.set(xlabel="key of the support (in order)", ylabel="$P^{idx} - P$")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## What the kernel computes
#
# Per (query $i$, group $r$) on its support of at most $kB_k$ tokens: the student's LSE over the index
# scores, then, token by token, $P_j = \frac1G \sum_{h} \exp(S^{(h)}_j - \mathrm{LSE}^{(h)})$,
# $P^{idx}_j = \exp(S^{idx}_j - \mathrm{LSE}^{idx})$, the KL term $P_j \log(P_j / P^{idx}_j)$ and
# $dS_j = (P^{idx}_j - P_j) / (N H_{kv})$, accumulated into $\partial Q^{idx}_i$ and
# $\partial K^{idx}_j$. In the paper's configuration its FLOPs per layer are those of the main
# branch's $QK^\top$ plus the index scores on the support, twice for the two gradients:

# %%
Nc, Hq, Hkv, d_h, d_idx, kBk = 2 ** 20, 64, 4, 128, 128, 16 * 128
teacher_scores = 2 * Hq * Nc * kBk * d_h  # S^(h) on the support, every head of every group
student = 2 * Hkv * Nc * kBk * d_idx  # S^idx on the support
grads = 2 * (2 * Hkv * Nc * kBk * d_idx)  # dQ_idx = dS K_idx and dK_idx = dS^T Q_idx
nbtools.table(["part (N = 2^20)", "FLOPs"], [("teacher scores Q K^T", f"{teacher_scores:.2e}"),
                                             ("student scores", f"{student:.2e}"),
                                             ("gradients", f"{grads:.2e}"),
                                             ("main branch forward (eq 13), for scale",
                                              f"{R.attention_flops(Nc, Hq, d_h, 128, 16):.2e}")])

# %% [markdown]
# ## The kernel against the reference
#
# `msa.cuda.kl.kl_loss` and `kl_backward` must match the reference within twice the error of the
# float32 reference against a float64 oracle, with a selection (sparse phase) and without one
# (warmup: the full causal support, normalised by the dense LSE).

# %%
kl_loss_cuda, why_loss = nbtools.cuda_function("kl", "kl_loss")
kl_backward_cuda, why_backward = nbtools.cuda_function("kl", "kl_backward")
kernel_checks = []
if kl_loss_cuda is not None:
    import msa.cuda.kl as cuda_kl

    print("msa.cuda.kl versions:", getattr(cuda_kl, "VERSIONS", "?"), "; the default runs below")
for name, why in (("kl_loss", why_loss), ("kl_backward", why_backward)):
    if why:
        print(f"msa.cuda.kl.{name}: {why}")
if kl_loss_cuda is not None or kl_backward_cuda is not None:
    if nbtools.ON_GPU:
        kp = make_problem(seq_lens_k=(4096, 1500), num_q_heads=16, num_kv_heads=4, head_dim=64, index_dim=64,
                          block_size=64, topk=8, dtype=np.float32, seed=12)
    else:
        kp = make_problem(seq_lens_k=(24, 14), num_q_heads=2, num_kv_heads=1, head_dim=16, index_dim=16,
                          block_size=8, topk=2, dtype=np.float32, seed=12)
    kargs = (kp.cu_seqlens_q, kp.cu_seqlens_k, kp.block_size)
    kI = R.select_blocks(R.block_scores(kp.q_idx, kp.k_idx, *kargs), kp.cu_seqlens_q, kp.cu_seqlens_k,
                         kp.block_size, kp.topk)
    for phase, sel in (("sparse", kI), ("warmup", None)):
        if sel is None:
            klse = R.dense_attention(kp.q, kp.k, kp.v, kp.cu_seqlens_q, kp.cu_seqlens_k)[1]
        else:
            klse = R.sparse_attention(kp.q, kp.k, kp.v, sel, *kargs)[1]
        inputs = (kp.q, kp.k, kp.q_idx, kp.k_idx, sel, klse, *kargs)
        for fn, ref, names in ((kl_loss_cuda, R.kl_loss, ("kl", "loss")),
                               (kl_backward_cuda, R.kl_backward, ("dq_idx", "dk_idx"))):
            if fn is None:
                continue
            oracle, baseline = oracle_and_baseline(ref, *inputs)
            got = fn(*inputs)
            for i, out in enumerate(names):
                rep = assert_close_to_oracle(np.asarray(got[i]), np.asarray(oracle[i]), np.asarray(baseline[i]),
                                             name=f"{out} ({phase})")
                print(f"{phase:6s} {out:7s}: error {rep.error:.2e}, float32 reference {rep.baseline_error:.2e}")
            kernel_checks.append((ref.__name__, phase))

# %% [markdown]
# ## Agreement check

# %%
nbtools.check("with the main branch's LSE every teacher row sums to 1",
              np.abs(row_sum["sparse LSE (same support)"] - 1).max() < 1e-12)
nbtools.check("with the dense LSE (another support) it does not", row_sum["dense LSE (wrong support)"].min() < 0.99)
nbtools.check("kl_loss(lse = sparse_attention's LSE) == kl_loss(lse = None)",
              np.abs(kl_reused - kl_own).max() < 1e-12, f"|diff| {abs(loss_reused - loss_own):.1e}")
if why_loss or why_backward:
    print("kernel check skipped:", "; ".join(w for w in (why_loss, why_backward) if w))
for fn_name, fn in (("kl_loss", kl_loss_cuda), ("kl_backward", kl_backward_cuda)):
    if fn is not None:
        nbtools.check(f"msa.cuda.kl.{fn_name} == reference (sparse and warmup)",
                      {(fn_name, "sparse"), (fn_name, "warmup")} <= set(kernel_checks))
