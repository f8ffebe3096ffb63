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
# # §3.2 Training the index branch (eq 9-11)
#
# Top-k returns integers. Moving a block score from 3.7 to 3.8 changes nothing until the ranking
# flips, and then the output jumps: its derivative is zero almost everywhere, so the language-model
# loss never reaches $W_q^{idx}, W_k^{idx}$. The paper gives the index branch its own teacher
# instead, through four mechanisms: a KL alignment loss, stop-gradients, an indexer warmup and the
# forced local block.
#
# **The KL loss.** On the support $\mathcal{I}_{i,tok}^{(r)}$, the causally visible tokens of the
# blocks group $r$ selected for query $i$ (1929 tokens for the $i = 5000$ example of notebook 03),
# the student is the index branch's softmax and the teacher the *average of the probabilities* of
# the group's $G$ heads:
#
# $$P_{i,j}^{idx,(r)} = \frac{\exp(S_{i,j}^{idx,(r)})}{\sum_{u \in \mathcal{I}_{i,tok}^{(r)}} \exp(S_{i,u}^{idx,(r)})}, \qquad
#   P_{i,j}^{(r)} = \frac{1}{G} \sum_{\ell \in \mathcal{H}_r}
#   \frac{\exp(S_{i,j}^{(\ell)})}{\sum_{u \in \mathcal{I}_{i,tok}^{(r)}} \exp(S_{i,u}^{(\ell)})} \tag{9}$$
#
# $$\mathcal{L}_{KL} = \frac{1}{N H_{kv}} \sum_{i=1}^{N} \sum_{r=1}^{H_{kv}}
#   D_{KL}\big(\mathrm{stopgrad}(P_{i,\cdot}^{(r)}) \,\|\, P_{i,\cdot}^{idx,(r)}\big) \tag{10}$$
#
# $$Q^{idx} = \mathrm{stopgrad}(X) W_q^{idx}, \qquad K^{idx} = \mathrm{stopgrad}(X) W_k^{idx} \tag{11}$$
#
# With the teacher held constant, the gradient with respect to the student's logits is
#
# $$\frac{\partial D_{KL}(P \| P^{idx})}{\partial S_j^{idx}} = P_j^{idx} - P_j ,$$
#
# raising the tokens the teacher values and the student underrates. msa: `student_probs`,
# `teacher_probs` (eq 9, dense, small problems), `kl_loss` (eq 10), `kl_backward` (its gradient
# into `q_idx`, `k_idx` only), `msa_layer` (Algorithm 1 with the warmup switch).

# %%
import nbtools  # first: picks the GPU or Numba's simulator before numba is imported

import matplotlib.pyplot as plt
import numpy as np

from msa import make_problem
from msa import reference as R

# %% [markdown]
# ## Why average probabilities, not logits
#
# One query, 8 keys, a group of $G = 2$ heads: head 0 is sure of token 3, head 1, with larger
# logits, of token 7. Averaging the probabilities keeps at least $1/G$ of the mass wherever some
# head looks; averaging the logits lets the head with the larger scale drown the other. We let
# `teacher_probs` compute the group mean on one-hot keys, so that a head's scores are exactly the
# logits we choose (scale 1).

# %%
logits = np.zeros((2, 8))
logits[0, 3], logits[1, 7] = 6.0, 12.0
one_query = np.array([0, 1], dtype=np.int32)
eight_keys = np.array([0, 8], dtype=np.int32)
P_mean = R.teacher_probs(logits[None], np.eye(8)[:, None, :], None, None, one_query, eight_keys, 8,
                         scale=1.0)[0, 0]  # [8]
mean_logits = logits.mean(axis=0)
P_logit_mean = np.exp(mean_logits - mean_logits.max()) / np.exp(mean_logits - mean_logits.max()).sum()
nbtools.table(["teacher", "P[token 3]", "P[token 7]"],
              [("mean of the heads' probabilities (eq 9)", P_mean[3], P_mean[7]),
               ("softmax of the mean logits", P_logit_mean[3], P_logit_mean[7])])

# %% [markdown]
# ## Teacher, student, KL on a small problem
#
# A float64 problem, selection from the index branch, and the main branch's sparse attention, whose
# LSE is exactly the normaliser the teacher needs (the GPU reuses it instead of a second softmax
# pass, §4.3).

# %%
p = make_problem(seq_lens_k=(40, 25), num_q_heads=4, num_kv_heads=2, head_dim=8, index_dim=4,
                 block_size=8, topk=3, seed=5)
args = (p.cu_seqlens_q, p.cu_seqlens_k, p.block_size)
Tq, Hkv = p.q.shape[0], p.num_kv_heads
M = R.block_scores(p.q_idx, p.k_idx, *args)
I = R.select_blocks(M, p.cu_seqlens_q, p.cu_seqlens_k, p.block_size, p.topk)
o, lse = R.sparse_attention(p.q, p.k, p.v, I, *args)
kl, loss = R.kl_loss(p.q, p.k, p.q_idx, p.k_idx, I, lse, *args)
P = R.teacher_probs(p.q, p.k, I, lse, *args)  # [Hkv, Tq, Tk], 0 off the support
P_idx = R.student_probs(p.q_idx, p.k_idx, I, *args)  # [Hkv, Tq, Tk]
on = P_idx > 0  # the support (the student is positive on all of it)
kl_direct = np.where(on, P * (np.log(np.where(on, P, 1)) - np.log(np.where(on, P_idx, 1))), 0).sum(axis=-1).T
print(f"L_KL = {loss:.6f};  KL per (query, group): min {kl.min():.3g}, max {kl.max():.3g}")

# %% [markdown]
# ## The gradient $P^{idx} - P$
#
# `kl_backward` returns $\partial \mathcal{L}_{KL} / \partial Q^{idx}$ and
# $\partial \mathcal{L}_{KL} / \partial K^{idx}$. By the chain rule through
# $S^{idx} = s\, Q^{idx} K^{idx\top}$ they must equal
# $s \sum_j \frac{P^{idx}_j - P_j}{N H_{kv}} K^{idx}_j$ and its transpose, built here from the
# dense distributions, and a central finite difference of `kl_loss` along a random direction
# (the selection $\mathcal{I}$ held fixed: it is not differentiable, and it is not meant to be).

# %%
dq_idx, dk_idx = R.kl_backward(p.q, p.k, p.q_idx, p.k_idx, I, lse, *args)
s_idx = 1 / np.sqrt(p.q_idx.shape[-1])
dS = (P_idx - P) / (Tq * Hkv)  # [Hkv, Tq, Tk]: the gradient with respect to the student logits
dq_chain = s_idx * np.einsum("rtj,jd->trd", dS, p.k_idx)
dk_chain = s_idx * np.einsum("rtj,trd->jd", dS, p.q_idx)

rng = np.random.default_rng(0)
E_q, E_k = rng.standard_normal(p.q_idx.shape), rng.standard_normal(p.k_idx.shape)
step = 1e-5


def L(q_idx, k_idx):
    return R.kl_loss(p.q, p.k, q_idx, k_idx, I, lse, *args)[1]


fd_q = (L(p.q_idx + step * E_q, p.k_idx) - L(p.q_idx - step * E_q, p.k_idx)) / (2 * step)
fd_k = (L(p.q_idx, p.k_idx + step * E_k) - L(p.q_idx, p.k_idx - step * E_k)) / (2 * step)
nbtools.table(["direction", "finite difference", "<gradient, direction>"],
              [("Q_idx", f"{fd_q:.10f}", f"{(dq_idx * E_q).sum():.10f}"),
               ("K_idx", f"{fd_k:.10f}", f"{(dk_idx * E_k).sum():.10f}")])

# %% [markdown]
# ## The main branch's gradient (eq 8 backward)
#
# The language-model loss trains $W_q, W_k, W_v$ through eq 8. Its backward is FlashAttention's
# rule on the same support: with $P = e^{S - \mathrm{LSE}}$ (0 off the support) and
# $D_t = \sum_d dO_{t,d} O_{t,d}$,
# $dV = P^\top dO$, $dS = P \circ (dO\,V^\top - D)$, $dQ = s\,dS\,K$, $dK = s\,dS^\top Q$,
# summed over the $G$ heads of a group. `sparse_attention_backward` reuses the forward's LSE, so no
# softmax is recomputed from scratch. A central difference of $\sum dO \circ O$ checks it.

# %%
dO = rng.standard_normal(o.shape)
dq_main, dk_main, dv_main = R.sparse_attention_backward(p.q, p.k, p.v, o, lse, dO, I, *args)
fd_main, an_main = [], []
for i, (name, grad) in enumerate((("Q", dq_main), ("K", dk_main), ("V", dv_main))):
    E = rng.standard_normal(grad.shape)

    def main_loss(sign, i=i, E=E):
        qkv = [p.q, p.k, p.v]
        qkv[i] = qkv[i] + sign * step * E
        return (R.sparse_attention(*qkv, I, *args)[0] * dO).sum()

    fd_main.append((main_loss(1) - main_loss(-1)) / (2 * step))
    an_main.append((grad * E).sum())
nbtools.table(["direction", "finite difference", "<gradient, direction>"],
              [(n, f"{a:.10f}", f"{b:.10f}") for n, a, b in zip("QKV", fd_main, an_main)])

# %% [markdown]
# ## Stop-gradient: what the KL may train
#
# | cut | blocks |
# |---|---|
# | $\mathrm{stopgrad}(X)$ (eq 11) | the KL gradient flowing through the index projections into the residual stream |
# | $\mathrm{stopgrad}(P)$ (eq 10) | the KL gradient flowing into the main branch's $W_q, W_k$ |
# | top-k itself | the LM gradient flowing into the index branch (not a design choice) |
#
# So $\mathcal{L}_{KL}$ trains exactly $W_q^{idx}, W_k^{idx}$ and $\mathcal{L}_{LM}$ everything else;
# the total loss $\mathcal{L} = \mathcal{L}_{LM} + \lambda \sum_{layers} \mathcal{L}_{KL}$ is
# *"assembled by the training loop"* (the paper gives no $\lambda$). Without the cuts the paper's
# appendix B.3 sees gradient spikes, or worse, the backbone flattening its own attention so that
# the KL is easy to match. NumPy has no autograd, so msa states the cut in its API: `kl_backward`
# returns gradients for `q_idx` and `k_idx` and nothing for `q` or `k`, and the weight gradients
# are $\partial W_q^{idx} = X^\top \partial Q^{idx}$, $\partial W_k^{idx} = X^\top \partial K^{idx}$,
# with no $\partial X$ term.
#
# ## Warmup
#
# At the start of training the main branch's attention entropy collapses within a few hundred
# steps. A random indexer would route the main branch to useless tokens, the teacher would get
# worse, and the KL would teach the indexer that. So for the first $T_{warm}$ steps (40B tokens in
# the paper) both branches run **dense**: the main branch attends to everything, and the KL is
# taken over the full causal support, the indexer watching without routing. `kl_loss(...,
# block_indices=None, lse=<dense LSE>)` is that warmup KL; it must equal the sparse KL of a
# selection that contains every visible block.

# %%
o_dense, lse_dense = R.dense_attention(p.q, p.k, p.v, p.cu_seqlens_q, p.cu_seqlens_k)
kl_warm, loss_warm = R.kl_loss(p.q, p.k, p.q_idx, p.k_idx, None, lse_dense, *args)
nb = R.max_blocks(p.cu_seqlens_k, p.block_size)
local = R.local_blocks(p.cu_seqlens_q, p.cu_seqlens_k, Tq, p.k.shape[0], p.block_size)
every = np.where(np.arange(nb)[None, :] <= local[:, None], np.arange(nb)[None, :], -1)
every = np.repeat(every[:, None, :], Hkv, axis=1).astype(np.int32)  # [Tq, Hkv, NB]
_, lse_every = R.sparse_attention(p.q, p.k, p.v, every, *args)
kl_every, loss_every = R.kl_loss(p.q, p.k, p.q_idx, p.k_idx, every, lse_every, *args)
print(f"warmup KL {loss_warm:.12f}  sparse KL with every block {loss_every:.12f}")

# %% [markdown]
# ## Experiment: an index branch learns its teacher
#
# One sequence of 512 tokens in 32 blocks of 16, $H_q = 4$, $H_{kv} = 2$, $k = 4$ blocks per query.
# Each block is *about* one of 16 topics, and each token *asks* about a random topic. The main
# branch's weights are fixed so that a token's query matches the keys of the topic it asks about:
# the teacher's mass sits on the few blocks of that topic, anywhere in the past. The index
# branch starts from random $W_q^{idx}, W_k^{idx}$ ($d_{idx} = 8$) and is trained by Adam on
# $\mathcal{L}_{KL}$ alone: every step runs Algorithm 1 (`msa_layer`), gets
# $\partial Q^{idx}, \partial K^{idx}$ from `kl_backward`, and multiplies by $X^\top$. The first 10
# steps are the warmup (dense main branch, full-support KL); then the index branch routes.
#
# We measure the **recall**: the share of the teacher's dense attention mass that falls on the
# selected blocks, $\exp(\mathrm{LSE}_{sparse} - \mathrm{LSE}_{dense})$ averaged over heads,
# queries and groups (notebook 02).

# %%
T, dm, Bk, K, Hq, Hkv, D, Didx, n_topics = 512, 48, 16, 4, 4, 2, 16, 8, 16
steps, n_warm, lr = 40, 10, 0.05
G = Hq // Hkv
rng = np.random.default_rng(0)
cu = np.array([0, T], dtype=np.int32)
topic = np.repeat(rng.integers(0, n_topics, T // Bk), Bk)  # what each block is about
ask = rng.integers(0, n_topics, T)  # what each token asks about
EF, _ = np.linalg.qr(rng.standard_normal((dm, 2 * n_topics)))
E, F = EF[:, :n_topics], EF[:, n_topics:]  # "is about" and "asks about" embeddings
x = 2.0 * E[:, topic].T + 2.0 * F[:, ask].T + 0.3 * rng.standard_normal((T, dm))
code = np.linalg.qr(rng.standard_normal((D, n_topics)))[0].T  # [n_topics, D] orthonormal rows
w_q = np.concatenate([3.0 * F @ code + 0.3 * rng.standard_normal((dm, D)) for _ in range(Hq)], axis=1)
w_k = np.concatenate([3.0 * E @ code for _ in range(Hkv)], axis=1)
params = R.MSAParams(
    w_q=w_q, w_k=w_k, w_v=rng.standard_normal((dm, Hkv * D)) / np.sqrt(dm),
    w_o=rng.standard_normal((Hq * D, dm)) / np.sqrt(Hq * D),
    w_q_idx=rng.standard_normal((dm, Hkv * Didx)) / np.sqrt(dm),
    w_k_idx=rng.standard_normal((dm, Didx)) / np.sqrt(dm), num_q_heads=Hq, num_kv_heads=Hkv)

q, k, v = ((x @ w).reshape(T, -1, D) for w in (params.w_q, params.w_k, params.w_v))
_, lse_teacher = R.dense_attention(q, k, v, cu, cu)  # the main branch is fixed in this experiment


def recall(I):
    _, lse_I = R.sparse_attention(q, k, v, I, cu, cu, Bk)
    return float(np.exp(lse_I - lse_teacher).mean())


w_idx0 = (params.w_q_idx.copy(), params.w_k_idx.copy())  # the start, for the PyTorch run below
adam = {name: [0.0, 0.0] for name in ("w_q_idx", "w_k_idx")}
history = []
for step in range(steps):
    warmup = step < n_warm
    _, loss_kl, aux = R.msa_layer(x, params, cu, Bk, K, warmup=warmup)  # Algorithm 1, lines 1-7
    I_step = aux["block_indices"]
    dq, dk = R.kl_backward(aux["q"], aux["k"], aux["q_idx"], aux["k_idx"], None if warmup else I_step,
                           aux["lse"], cu, cu, Bk)
    grads = {"w_q_idx": x.T @ dq.reshape(T, Hkv * Didx), "w_k_idx": x.T @ dk}  # dW = X^T dQ_idx
    for name, g in grads.items():  # Adam
        m, s = adam[name]
        m, s = 0.9 * m + 0.1 * g, 0.999 * s + 0.001 * g * g
        adam[name] = [m, s]
        w = getattr(params, name)
        w -= lr * (m / (1 - 0.9 ** (step + 1))) / (np.sqrt(s / (1 - 0.999 ** (step + 1))) + 1e-8)
    history.append((step, warmup, loss_kl, recall(I_step)))

fixed = R.fixed_blocks(cu, cu, Bk, K, num_kv_heads=Hkv)
print(f"recall: step 0 {history[0][3]:.3f}, last step {history[-1][3]:.3f}; "
      f"sink + sliding window with the same budget {recall(fixed):.3f}")

# %%
h = np.array([(s, l, r) for s, _, l, r in history])
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.5))
ax0.plot(h[:, 0], h[:, 1], marker=".")
ax0.set(title="$\\mathcal{L}_{KL}$ (full support in warmup, selected support after)", xlabel="step", yscale="log")
ax1.plot(h[:, 0], h[:, 2], marker=".", label="learned index branch")
ax1.axhline(recall(fixed), color="tab:orange", ls="--", label="sink + sliding window")
ax1.set(title="recall of the teacher's mass by the selected blocks", xlabel="step", ylim=(0, 1))
for ax in (ax0, ax1):
    ax.axvspan(-0.5, n_warm - 0.5, color="0.9", zorder=0)
ax1.text(n_warm / 2, 0.05, "warmup", ha="center")
ax1.legend(loc="lower right")
fig.tight_layout()
nbtools.savefig(fig, "04_index_learning")
plt.show()

# %% [markdown]
# ## The same training in PyTorch: `msa.torch.MSAAttention`
#
# The loop above writes Adam and $dW = X^\top dQ^{idx}$ by hand. A model builder writes
# `loss.backward()`: `msa.torch.MSAAttention` is Algorithm 1 as an `nn.Module` whose `loss_kl`
# backpropagates into $W_q^{idx}, W_k^{idx}$ only (the teacher and $X$ are detached, eq 10-11),
# and whose `output` backpropagates into $W_q, W_k, W_v, W_o$ through the main branch. On CUDA
# tensors it runs the kernels (fused index + top-k, KV-outer attention, the KL kernel and its
# backward); on CPU tensors, as here, the reference, so the run below must retrace the loop
# above: same start, same warmup, same Adam.

# %%
try:
    import torch

    from msa.torch import MSAAttention
except ImportError:
    torch = None
    print("PyTorch is not installed (pip install -e '.[torch]'): this section needs it")

if torch is not None:
    layer = MSAAttention.from_params(params, block_size=Bk, topk=K)  # float64 weights, CPU
    with torch.no_grad():
        layer.w_q_idx.copy_(torch.from_numpy(w_idx0[0]))
        layer.w_k_idx.copy_(torch.from_numpy(w_idx0[1]))
    opt = torch.optim.Adam([layer.w_q_idx, layer.w_k_idx], lr=lr)
    x_t = torch.from_numpy(x)
    torch_history = []
    for step in range(steps):
        layer.warmup = step < n_warm
        out = layer(x_t, cu)  # out.output, out.loss_kl, out.block_indices, out.lse
        opt.zero_grad()
        out.loss_kl.backward()  # L = L_LM + lambda L_KL in a real model; L_KL alone here
        opt.step()
        torch_history.append((float(out.loss_kl.detach()), recall(out.block_indices.numpy())))
    print(f"msa.torch: recall step 0 {torch_history[0][1]:.3f}, last step {torch_history[-1][1]:.3f} "
          f"(hand-written loop: {history[0][3]:.3f} -> {history[-1][3]:.3f})")

# %% [markdown]
# ## Agreement check

# %%
support_rows = on.any(axis=-1)  # [Hkv, Tq]
nbtools.check("teacher and student each sum to 1 on every non-empty support",
              np.allclose(P.sum(-1)[support_rows], 1, rtol=0, atol=1e-12)
              and np.allclose(P_idx.sum(-1)[support_rows], 1, rtol=0, atol=1e-12))
p_heads = np.exp(logits - logits.max(axis=1, keepdims=True))
p_heads /= p_heads.sum(axis=1, keepdims=True)  # each head's own softmax
nbtools.check("teacher_probs == mean of the heads' softmaxes", np.abs(P_mean - p_heads.mean(axis=0)).max() < 1e-15)
nbtools.check("so each head's favourite keeps at least 1/G of that head's mass; the logit mean drops token 3",
              P_mean[3] >= p_heads[0, 3] / 2 and P_mean[7] >= p_heads[1, 7] / 2 and P_logit_mean[3] < 0.1)
nbtools.check("kl_loss == sum_j P log(P / P_idx) from the dense distributions", np.abs(kl - kl_direct).max() < 1e-12,
              f"max |diff| = {np.abs(kl - kl_direct).max():.1e}")
nbtools.check("KL >= 0", (kl >= -1e-15).all())
nbtools.check("kl_backward == chain rule through dS = (P_idx - P) / (N Hkv)",
              np.abs(dq_idx - dq_chain).max() < 1e-14 and np.abs(dk_idx - dk_chain).max() < 1e-14,
              f"max |diff| {max(np.abs(dq_idx - dq_chain).max(), np.abs(dk_idx - dk_chain).max()):.1e}")
rel = max(abs(fd_q - (dq_idx * E_q).sum()) / abs(fd_q), abs(fd_k - (dk_idx * E_k).sum()) / abs(fd_k))
nbtools.check("kl_backward == central finite differences of kl_loss", rel < 1e-6, f"relative error {rel:.1e}")
rel_main = max(abs(a - b) / abs(a) for a, b in zip(fd_main, an_main))
nbtools.check("sparse_attention_backward == central finite differences of eq 8", rel_main < 1e-6,
              f"relative error {rel_main:.1e}")
nbtools.check("warmup KL (full support) == sparse KL with every visible block", abs(loss_warm - loss_every) < 1e-14,
              f"|diff| = {abs(loss_warm - loss_every):.1e}")
nbtools.check("training on L_KL alone raises the recall of the teacher's mass by > 0.3",
              history[-1][3] > history[0][3] + 0.3, f"{history[0][3]:.3f} -> {history[-1][3]:.3f}")
nbtools.check("and the learned selection beats the same-budget sink + window", history[-1][3] > recall(fixed))
if torch is not None:
    nbtools.check("msa.torch.MSAAttention + torch.optim.Adam retrace the hand-written loop (same L_KL at every step)",
                  all(abs(a[0] - b[2]) <= 1e-9 * abs(b[2]) for a, b in zip(torch_history, history)),
                  f"max relative difference {max(abs(a[0] - b[2]) / abs(b[2]) for a, b in zip(torch_history, history)):.1e}")
