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
# # §3.3 Computational complexity (eq 12)
#
# $$F_{GQA}(N) = 2 H_q d_h N^2, \qquad
#   F_{MSA}(N) = \underbrace{H_{kv} d_{idx} N^2}_{\text{index branch}}
#              + \underbrace{4 H_q d_h N k B_k}_{\text{main branch}} \tag{12}$$
#
# Dense causal attention does $QK^\top$ and $PV$ for half of the $N^2$ pairs. MSA's main branch reads
# at most $kB_k = 2048$ keys per query whatever $N$ is: linear. Its index branch still scores
# every causal pair, once per group with one shared key head: still quadratic, but with a
# coefficient $H_{kv} d_{idx} = 512$ instead of $2 H_q d_h = 16384$ (paper configuration:
# $H_q = 64$, $H_{kv} = 4$, $d_h = d_{idx} = 128$, $B_k = 128$, $k = 16$). The paper reports a
# **28.4x** reduction of attention FLOPs per token at 1M context; the measured end-to-end speedups
# on H800 are smaller (14.2x prefill, 7.6x decode, quoted from the paper, not measured here)
# because indexing, top-k, the reverse index, gathers and load balancing cost time too.
#
# Everything below is `msa.reference.complexity`, exact integer arithmetic.

# %%
import nbtools  # first: picks the GPU or Numba's simulator before numba is imported

from fractions import Fraction

import matplotlib.pyplot as plt
import numpy as np

from msa import reference as R

cfg = dict(Hq=64, Hkv=4, d_h=128, d_idx=128, topk=16, block_size=128)


def ratio(N):
    """F_GQA(N) / F_MSA(N) as an exact fraction."""
    return Fraction(R.gqa_flops(N, cfg["Hq"], cfg["d_h"]), R.msa_flops(N, **cfg).total)


# %% [markdown]
# ## N = 8192, step by step
#
# At 8K the sparse budget $kB_k = 2048$ is a quarter of the context: MSA is barely faster than GQA.
# The table adds the index projections (eq 5), which eq 12 leaves out, as the paper's
# walk-through does ($d_{model} = 3072$).

# %%
N, d_model = 8192, 3072
f = R.msa_flops(N, **cfg)
proj_q, proj_k = 2 * N * d_model * cfg["Hkv"] * cfg["d_idx"], 2 * N * d_model * cfg["d_idx"]
gqa = R.gqa_flops(N, cfg["Hq"], cfg["d_h"])
nbtools.table(["step", "formula", "FLOPs"], [
    ("Q_idx projection", "2 N d_model Hkv d_idx", f"{proj_q:.3e}"),
    ("K_idx projection", "2 N d_model d_idx", f"{proj_k:.3e}"),
    ("index scores S_idx (causal)", "Hkv d_idx N^2", f"{f.index:.3e}"),
    ("block max, top-k", "comparisons", "-"),
    ("main branch", "4 Hq d_h N k Bk", f"{f.main:.3e}"),
    ("MSA total", "", f"{proj_q + proj_k + f.total:.3e}"),
    ("GQA dense attention", "2 Hq d_h N^2", f"{gqa:.3e}"),
])
print(f"GQA / MSA at N = 8192: {gqa / (proj_q + proj_k + f.total):.2f}x with the projections, "
      f"{float(ratio(N)):.2f}x by eq 12 alone")

# %% [markdown]
# ## The curves
#
# Below $N^* = 4 H_q d_h k B_k / (H_{kv} d_{idx})$ the main branch dominates MSA's cost, above it the
# quadratic index branch does. The FLOP ratio tends to $2 H_q d_h / (H_{kv} d_{idx}) = 32$:
# MSA shrinks the quadratic term 32-fold, it does not remove it. With these numbers the ratio has
# a closed form, $F_{GQA} / F_{MSA} = 32N / (N + N^*)$. (The main term is an upper bound: a query at
# position $i < kB_k$ reads only $i + 1$ keys. Below $N \approx 2kB_k$ the bound even exceeds GQA's
# cost; eq 12 is a model for long contexts.)

# %%
N_star = R.crossover_length(**{k: cfg[k] for k in ("Hq", "Hkv", "d_h", "d_idx", "topk", "block_size")})
ceiling = R.speedup_limit(cfg["Hq"], cfg["Hkv"], cfg["d_h"], cfg["d_idx"])
Ns = 2 ** np.arange(10, 25)
gqa_c = np.array([R.gqa_flops(int(n), cfg["Hq"], cfg["d_h"]) for n in Ns], dtype=float)
msa_c = [R.msa_flops(int(n), **cfg) for n in Ns]
idx_c = np.array([m.index for m in msa_c], dtype=float)
main_c = np.array([m.main for m in msa_c], dtype=float)

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4))
ax0.loglog(Ns, gqa_c, label="GQA $2H_qd_hN^2$")
ax0.loglog(Ns, idx_c + main_c, label="MSA total")
ax0.loglog(Ns, idx_c, "--", label="MSA index branch $H_{kv}d_{idx}N^2$")
ax0.loglog(Ns, main_c, ":", label="MSA main branch $4H_qd_hNkB_k$")
ax0.axvline(N_star, color="0.5", lw=0.8)
ax0.text(N_star * 1.1, gqa_c[0], "$N^*$ = 128K", color="0.3")
ax0.set(title="attention FLOPs per layer (eq 12)", xlabel="context length N", ylabel="FLOPs")
ax0.legend(fontsize=8)
ax1.semilogx(Ns, gqa_c / (idx_c + main_c), marker=".", label="$F_{GQA}/F_{MSA}$")
ax1.axhline(ceiling, color="tab:red", ls="--", label=f"ceiling {ceiling:g}x")
ax1.axvline(N_star, color="0.5", lw=0.8)
ax1.annotate(f"{float(ratio(2 ** 20)):.1f}x at 1M", (2 ** 20, float(ratio(2 ** 20))), xytext=(2 ** 13, 25),
             arrowprops=dict(arrowstyle="->"))
ax1.set(title="FLOP reduction", xlabel="context length N", ylim=(0, 34))
ax1.legend(loc="upper left", fontsize=8)
fig.tight_layout()
nbtools.savefig(fig, "05_complexity")
plt.show()

nbtools.table(["N", "GQA / MSA", "index share of MSA"],
              [(f"2^{int(np.log2(n))}" if n & (n - 1) == 0 else f"{n:,}", f"{float(ratio(n)):.2f}x",
                f"{R.msa_flops(n, **cfg).index / R.msa_flops(n, **cfg).total:.1%}")
               for n in (8192, 32768, 131072, 10 ** 6, 2 ** 20, 2 ** 22)])

# %% [markdown]
# At $N = 2^{20}$ the index branch, 0.07% of the model's parameters, is 89% of MSA's attention
# FLOPs: the bottleneck has moved from attending to *choosing*, which is why §4.1 works so hard on
# the selection kernel. (The paper's "28.4x at 1M" is $N = 2^{20}$; with $N = 10^6$ it is 28.3x.)
#
# ## Agreement check

# %%
nbtools.check("F_GQA / F_MSA == 32 N / (N + 131072) exactly, for every N of the plot",
              all(ratio(int(n)) == Fraction(32 * int(n), int(n) + 131072) for n in Ns))
nbtools.check("28.4x at N = 2^20", round(float(ratio(2 ** 20)), 1) == 28.4, f"{float(ratio(2 ** 20)):.4f}")
nbtools.check("28.3x at N = 10^6", round(float(ratio(10 ** 6)), 1) == 28.3, f"{float(ratio(10 ** 6)):.4f}")
nbtools.check("crossover N* = 131072 = 128K, where index FLOPs == main FLOPs",
              N_star == 131072 and R.msa_flops(131072, **cfg).index == R.msa_flops(131072, **cfg).main)
nbtools.check("ceiling 2 Hq d_h / (Hkv d_idx) = 32, approached but never reached",
              ceiling == 32 and all(ratio(int(n)) < 32 for n in Ns) and float(ratio(2 ** 40)) > 31.99)
nbtools.check("the index branch is ~88.9% of MSA's FLOPs at N = 2^20",
              round(R.msa_flops(2 ** 20, **cfg).index / R.msa_flops(2 ** 20, **cfg).total, 3) == 0.889)
nbtools.check("only 1.9x at N = 8192 by eq 12", round(float(ratio(8192)), 2) == 1.88, f"{float(ratio(8192)):.3f}")
