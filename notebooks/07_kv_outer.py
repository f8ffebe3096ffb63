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
# # §4.2 KV-outer sparse attention: reverse index, scheduler, two-phase combine
#
# The main branch (eq 8) is exact softmax attention on the selected blocks. §4.2 changes only the
# **loop order** on the GPU:
#
# * **Q-outer**: fix a query, load each of the blocks it selected. Simple, but a block chosen by
#   many queries (the sink, local blocks, popular remote blocks) is loaded again for each of them,
#   and one query position of one group gives a matrix multiply only $G = 16$ rows tall.
# * **KV-outer**: fix a (KV block, KV head), gather every query that selected it, and serve them all
#   from one load of the block. The paper concatenates $\lceil 128 / G \rceil = 8$ query positions
#   $\times$ 16 heads into a $128 \times 128$ score tile, the shape tensor cores want.
#
# Both orders compute the same FLOPs,
#
# $$\mathrm{FLOPs} = 4 H_q N d_h k B_k , \tag{13}$$
#
# but move different bytes (2 bytes per element):
#
# $$\mathrm{IO}_{Q\text{-outer}} = \underbrace{2 \cdot 2 \cdot H_q N d_h}_{\text{read } Q + \text{write } O}
#   + \underbrace{2 \cdot 2 \cdot H_{kv} N k B_k d_h}_{\text{read } K + V \text{ per query}} \tag{14}$$
#
# $$\mathrm{IO}_{KV\text{-outer}} = \underbrace{2 \cdot 2 \cdot H_{kv} N d_h}_{\text{read } K + V \text{ once}}
#   + \underbrace{2 \cdot 2 \cdot H_q N k d_h}_{\text{read } Q + \text{write } O_{buf}}
#   + \underbrace{2 \cdot H_q N (k + 1) d_h}_{\text{read } O_{buf} + \text{write } O} \tag{16}$$
#
# so the arithmetic intensity goes from about $G = 16$ to about $\frac{2}{3} B_k = 85.3$ FLOPs per
# byte. The price: a reverse index (k2q CSR), a scheduler for hot blocks, and a second kernel that
# combines each query's per-block partial results exactly.

# %%
import nbtools  # first: picks the GPU or Numba's simulator before numba is imported

import math

import matplotlib.pyplot as plt
import numpy as np

from msa import make_problem
from msa import reference as R
from msa.testing.tolerance import assert_close_to_oracle, assert_exact, oracle_and_baseline

# %% [markdown]
# ## I/O and arithmetic intensity (`msa.reference.complexity`)
#
# Paper configuration at $N = 128$K. The paper's rounded intensities drop the smaller terms
# (Q-outer: the Q/O traffic; KV-outer: the K/V traffic and $k + 1 \approx k$); the exact values of
# eq 13/14 and eq 13/16 are a little lower.

# %%
cfg = dict(Hq=64, Hkv=4, d_h=128, topk=16)
N = 131072
qo = R.q_outer_io(N, block_size=128, **cfg)
ko = R.kv_outer_io(N, **cfg)
GiB = 2 ** 30
nbtools.table(["loop order", "I/O terms (GiB)", "total GiB", "FLOPs / byte", "paper"], [
    ("Q-outer", f"Q+O {qo.q_o / GiB:.1f}, K+V {qo.kv / GiB:.1f}", f"{qo.total / GiB:.1f}",
     f"{R.arithmetic_intensity(N, block_size=128, loop_order='q_outer', **cfg):.2f}", "~ G = 16"),
    ("KV-outer", f"K+V {ko.kv / GiB:.1f}, Q+O_buf {ko.q_obuf / GiB:.1f}, combine {ko.combine / GiB:.1f}",
     f"{ko.total / GiB:.1f}", f"{R.arithmetic_intensity(N, block_size=128, loop_order='kv_outer', **cfg):.2f}",
     "~ 2/3 Bk = 85.3"),
])
bks = [16, 32, 64, 128, 256]
fig, ax = plt.subplots(figsize=(5.5, 3.5))
for order in ("q_outer", "kv_outer"):
    ax.plot(bks, [R.arithmetic_intensity(N, block_size=b, loop_order=order, **cfg) for b in bks], marker="o",
            label=order.replace("_", "-"))
ax.plot(bks, [2 * b / 3 for b in bks], ":", color="0.5", label="$\\frac{2}{3} B_k$")
ax.set(xscale="log", xticks=bks, xticklabels=bks, xlabel="block size $B_k$", ylabel="FLOPs per byte",
       title="arithmetic intensity, $G$ = 16, $k$ = 16")
ax.legend()
plt.show()
print("query concatenation: ceil(128 / G) =", math.ceil(128 / 16), "positions x 16 heads =",
      math.ceil(128 / 16) * 16, "rows per score tile")

# %% [markdown]
# ## The reverse index, step by step, on the paper's four queries
#
# The paper's example: `q0 -> A, C`, `q1 -> A, D`, `q2 -> A, C`, `q3 -> A, B`. Q-outer loads block A
# four times and C twice. We make it an msa problem: one sequence of 16 keys in blocks of 4 (A-D
# are blocks 0-3), the four queries are its last four positions, one KV head, $k = 2$. The selection
# is written by hand (it is not `select_blocks`' output: that would force each query's local block),
# and `check_block_indices` accepts it.
#
# The top-k output is q2k (query -> blocks); KV-outer needs k2q (block -> queries), a CSR matrix
# built in three data-parallel steps: count the queries per block (`csr_histogram`), scan the
# counts into row pointers (`exclusive_prefix_sum`), and write every query id into its row
# (`csr_scatter`), ascending; `slots` records which of the query's $k$ partial-output slots the
# block fills.

# %%
names = "ABCD"
I4 = np.array([[0, 2], [0, 3], [0, 2], [0, 1]], dtype=np.int32)[:, None, :]  # [Tq=4, Hkv=1, K=2]
cu_q4, cu_k4, bk4 = np.array([0, 4], dtype=np.int32), np.array([0, 16], dtype=np.int32), 4
R.check_block_indices(I4, cu_q4, cu_k4, bk4)
counts = R.csr_histogram(I4, cu_q4, cu_k4, bk4)  # [Hkv, rows]
row_ptr = R.exclusive_prefix_sum(counts)  # [Hkv, rows+1]
q_indices, slots = R.csr_scatter(I4, row_ptr, cu_q4, cu_k4, bk4)  # [Hkv, Tq*K] each
print("1. histogram   counts  =", dict(zip(names, counts[0].tolist())))
print("2. prefix sum  row_ptr =", row_ptr[0].tolist())
print("3. scatter     q_indices =", q_indices[0].tolist(), " slots =", slots[0].tolist())
k2q = {names[r]: [f"q{t}" for t in q_indices[0, row_ptr[0, r]:row_ptr[0, r + 1]]] for r in range(4)}
for block, queries in k2q.items():
    print(f"   {block} -> {', '.join(queries)}")
print(f"block loads: Q-outer {int((I4 >= 0).sum())}, KV-outer {int((counts > 0).sum())}")

# %% [markdown]
# ## The scheduler on a skewed selection
#
# Block popularity is very uneven: a sink block is chosen by almost every query, most remote blocks
# by a few. One CTA per (block, head) would leave the GPU waiting on the hot rows' CTAs long after
# the others finish. The scheduler (`build_schedule`) cuts each k2q row into chunks of at most
# `chunk_size` queries, one work item (CTA) each; the paper uses about $2kB_k$. Because every
# (query, block) partial already has its own slot, the chunks need no atomics.
#
# Here: 1024 tokens, $B_k = 16$, $k = 4$, two groups; the scores favour block 0 (a sink) and a few
# hot blocks. `schedule_stats` reports the imbalance, the largest item over the mean item.

# %%
Ns, Bks, Ks, Hkvs = 1024, 16, 4, 2
rng = np.random.default_rng(8)
cu_s = np.array([0, Ns], dtype=np.int32)
NBs = Ns // Bks
pop = np.zeros(NBs)
pop[0] = 6.0  # sink
pop[rng.choice(np.arange(1, NBs), 5, replace=False)] = 2.0  # hot blocks
M_s = pop[None, None, :] + rng.standard_normal((Hkvs, Ns, NBs))
M_s[:, np.arange(Ns)[:, None] // Bks < np.arange(NBs)[None, :]] = -np.inf  # only the visible blocks
I_s = R.select_blocks(M_s, cu_s, cu_s, Bks, Ks)
row_ptr_s, q_idx_s, slots_s = R.build_csr(I_s, cu_s, cu_s, Bks)
per_row = np.diff(row_ptr_s, axis=1)  # [Hkv, rows] queries per (head, block)
chunk = 2 * Ks * Bks  # the paper's rule: 128 queries here
work_whole = R.build_schedule(row_ptr_s, cu_s, Bks, chunk_size=Ns)  # one item per row
work_split = R.build_schedule(row_ptr_s, cu_s, Bks, chunk_size=chunk)
stats = {name: R.schedule_stats(w) for name, w in [("one item per row", work_whole),
                                                   (f"chunks of <= {chunk}", work_split)]}
nbtools.table(["schedule", "items", "edges", "max q_count", "mean q_count", "imbalance"],
              [(name, s["items"], s["edges"], s["max_q_count"], f"{s['mean_q_count']:.1f}", f"{s['imbalance']:.1f}")
               for name, s in stats.items()])
print("work items [kv_head, row, q_begin, q_count, batch, kv_block], largest first:\n", work_split[:4])

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 3.5))
ax0.bar(np.arange(NBs), per_row[0], width=1.0)
ax0.set(title="queries per k2q row (head 0)", xlabel="KV block", ylabel="queries")
for name, w in [("one item per row", work_whole), (f"chunks of <= {chunk}", work_split)]:
    ax1.step(np.arange(w.shape[0]), w[:, 3], where="post", label=name)
ax1.set(title="work items, largest first", xlabel="item (CTA)", ylabel="q_count", yscale="log")
ax1.legend()
fig.tight_layout()
nbtools.savefig(fig, "07_scheduler")
plt.show()

# %% [markdown]
# ## Two-phase forward: K1 partials, K2 exact combine
#
# One query's $k$ blocks are processed by different CTAs, none of which sees the whole softmax. K1
# (`attention_partials`) writes, for every (query, head) and each selected block $s$ with token set
# $\mathcal{J}_s$, a locally normalised partial into slot $s$:
#
# $$L_s = \log \sum_{j \in \mathcal{J}_s} \exp S_j, \qquad O_s = \sum_{j \in \mathcal{J}_s} \exp(S_j - L_s) V_j .$$
#
# K2 (`combine_partials`) merges them with $L = \log \sum_s \exp L_s$, $w_s = \exp(L_s - L)$,
# $O = \sum_s w_s O_s = \sum_s \sum_{j \in \mathcal{J}_s} \exp(S_j - L) V_j$: one softmax over the union
# of the blocks, i.e. eq 8 exactly. The split changes the order of the work, not the result. We
# check it on a float64 problem with the selection of the index branch (two sequences; larger on a
# GPU, where the kernels below run on the same problem), and that the slot order does not matter.

# %%
if nbtools.ON_GPU:
    p = make_problem(seq_lens_k=(2048, 1000), num_q_heads=16, num_kv_heads=4, head_dim=64, index_dim=32,
                     block_size=64, topk=4, seed=9)
else:
    p = make_problem(seq_lens_k=(40, 25), num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
                     topk=3, seed=9)
pargs = (p.cu_seqlens_q, p.cu_seqlens_k)
M = R.block_scores(p.q_idx, p.k_idx, *pargs, p.block_size)
I = R.select_blocks(M, *pargs, p.block_size, p.topk)
rp, qi, sl = R.build_csr(I, *pargs, p.block_size)
work = R.build_schedule(rp, p.cu_seqlens_k, p.block_size, chunk_size=2 * p.topk * p.block_size)
o_part, lse_part = R.attention_partials(p.q, p.k, p.v, work, qi, sl, *pargs, p.block_size, p.topk)  # K1
o_2phase, lse_2phase = R.combine_partials(o_part, lse_part)  # K2
o_q_outer, lse_q_outer = R.sparse_attention(p.q, p.k, p.v, I, *pargs, p.block_size)  # eq 8, Q-outer
perm = rng.permutation(p.topk)
o_perm, lse_perm = R.combine_partials(o_part[perm], lse_part[perm])
t0, h0 = p.cu_seqlens_q[1] - 1, 1  # the last query of sequence 0
w = np.exp(lse_part[:, t0, h0] - lse_2phase[t0, h0])
print(f"query {t0}, head {h0}: blocks {I[t0, h0 // p.group_size].tolist()}, "
      f"L_s = {np.round(lse_part[:, t0, h0], 3).tolist()}, w_s = {np.round(w, 3).tolist()} (sum {w.sum():.12f})")

# %% [markdown]
# ## The kernels
#
# `msa.cuda.csr`, `msa.cuda.schedule`, `msa.cuda.attention` (K1 and the whole main branch) and
# `msa.cuda.combine` (K2) against the reference: integers exactly, floats within twice the error of
# the float32 reference against a float64 oracle. Tiny problems in the simulator.

# %%
kernel_checks = []

build_csr_cuda, why = nbtools.cuda_function("csr", "build_csr")
if build_csr_cuda is None:
    print(why)
else:
    import msa.cuda.csr as ccsr

    c_counts = ccsr.csr_histogram(I4, cu_q4, cu_k4, bk4)
    c_row_ptr = ccsr.exclusive_prefix_sum(c_counts)
    c_q, c_slots = ccsr.csr_scatter(I4, c_row_ptr, cu_q4, cu_k4, bk4)
    for name, got, ref in [("counts", c_counts, counts), ("row_ptr", c_row_ptr, row_ptr),
                           ("q_indices", c_q, q_indices), ("slots", c_slots, slots)]:
        assert_exact(got, ref, name=name)
    for name, got, ref in zip(("row_ptr", "q_indices", "slots"), build_csr_cuda(I, *pargs, p.block_size), (rp, qi, sl)):
        assert_exact(got, ref, name=name)
    kernel_checks.append("csr")
    print("msa.cuda.csr: histogram, prefix sum, scatter and build_csr equal the reference")

schedule_cuda, why = nbtools.cuda_function("schedule", "build_schedule")
if schedule_cuda is None:
    print(why)
else:
    for name, (r_ptr, cu, bk, ch, ref) in {
            "skewed": (row_ptr_s, cu_s, Bks, chunk, work_split),
            "small": (rp, p.cu_seqlens_k, p.block_size, 2 * p.topk * p.block_size, work)}.items():
        w_dev, n_items = schedule_cuda(r_ptr, cu, bk, ch, max_edges=int(r_ptr[:, -1].max()))
        assert_exact(np.asarray(w_dev)[: int(np.asarray(n_items)[0])], ref, name=f"work ({name})")
    kernel_checks.append("schedule")
    print("msa.cuda.schedule.build_schedule: the same work items as the reference (skewed and small)")

# float32 inputs for the kernels; the float64 oracle sees the same rounded values
q32, k32, v32 = (x.astype(np.float32) for x in (p.q, p.k, p.v))
partials_cuda, why = nbtools.cuda_function("attention", "attention_partials")
if partials_cuda is None:
    print(why)
else:
    oracle, baseline = oracle_and_baseline(R.attention_partials, q32, k32, v32, work, qi, sl, *pargs,
                                           p.block_size, p.topk)
    got = partials_cuda(q32, k32, v32, work, qi, sl, *pargs, p.block_size, p.topk)
    for i, name in enumerate(("o_part", "lse_part")):
        rep = assert_close_to_oracle(got[i], oracle[i], baseline[i], name=name)
        print(f"K1 {name}: error {rep.error:.2e}, float32 reference {rep.baseline_error:.2e}")
    kernel_checks.append("attention_partials")

combine_cuda, why = nbtools.cuda_function("combine", "combine_partials")
if combine_cuda is None:
    print(why)
else:
    part32 = (o_part.astype(np.float32), lse_part.astype(np.float32))
    oracle, baseline = oracle_and_baseline(R.combine_partials, *part32)
    got = combine_cuda(*part32)
    for i, name in enumerate(("o", "lse")):
        rep = assert_close_to_oracle(got[i], oracle[i], baseline[i], name=name)
        print(f"K2 {name}: error {rep.error:.2e}, float32 reference {rep.baseline_error:.2e}")
    kernel_checks.append("combine_partials")

sparse_cuda, why = nbtools.cuda_function("attention", "sparse_attention")
if sparse_cuda is None:
    print(why)
else:
    oracle, baseline = oracle_and_baseline(R.sparse_attention, q32, k32, v32, I, *pargs, p.block_size)
    got = sparse_cuda(q32, k32, v32, I, *pargs, p.block_size)
    for i, name in enumerate(("o", "lse")):
        rep = assert_close_to_oracle(got[i], oracle[i], baseline[i], name=name)
        print(f"sparse_attention (CSR -> schedule -> K1 -> K2) {name}: error {rep.error:.2e}, "
              f"float32 reference {rep.baseline_error:.2e}")
    kernel_checks.append("sparse_attention")

# %% [markdown]
# Finally `msa_prefill` runs lines 3-5 of Algorithm 1 in one call on the GPU: fused block scores and
# top-$k$ (§4.1), then this whole main branch. Its selection must be the reference's, and its output
# the reference's eq 8 on that selection.

# %%
prefill_cuda, why = nbtools.cuda_function("attention", "msa_prefill")
if prefill_cuda is None:
    print(why)
else:
    qi32, ki32 = p.q_idx.astype(np.float32), p.k_idx.astype(np.float32)
    o_pf, lse_pf, I_pf = prefill_cuda(q32, k32, v32, qi32, ki32, *pargs, p.block_size, p.topk)
    I_pf_ref = R.select_blocks(R.block_scores(qi32, ki32, *pargs, p.block_size), *pargs, p.block_size, p.topk)
    assert_exact(I_pf, I_pf_ref, name="msa_prefill block_indices")
    oracle, baseline = oracle_and_baseline(R.sparse_attention, q32, k32, v32, I_pf_ref, *pargs, p.block_size)
    for name, got, o_, b_ in (("o", o_pf, oracle[0], baseline[0]), ("lse", lse_pf, oracle[1], baseline[1])):
        rep = assert_close_to_oracle(got, o_, b_, name=name)
        print(f"msa_prefill {name}: error {rep.error:.2e}, float32 reference {rep.baseline_error:.2e}")
    kernel_checks.append("msa_prefill")

# %% [markdown]
# ## The backward: the same reverse index, KV-outer again
#
# Training needs eq 8's gradient. Given $dO$ and the forward's LSE, $P$ is rebuilt block by block
# without a second softmax pass, and with $D_t = \sum_d dO_{t,d} O_{t,d}$:
# $dS = P \circ (dO\,V^\top - D)$, $dQ = s\,dS\,K$, $dK = s\,dS^\top Q$, $dV = P^\top dO$.
# $dK$ and $dV$ of a block sum over every query that picked it: exactly a k2q CSR row, so
# `msa.cuda.attention.sparse_attention_backward` walks each row KV-outer (one CTA per part of a
# row: a hot row is cut into parts like the scheduler's chunks, whose sums a second kernel adds in
# a fixed order, so no atomics), while $dQ$ walks each query's own $K$ blocks (Q-outer).
# Against `msa.reference.attention.sparse_attention_backward`, on the problem above:

# %%
backward_cuda, why = nbtools.cuda_function("attention", "sparse_attention_backward")
if backward_cuda is None:
    print(why)
else:
    o32, lse32 = R.sparse_attention(q32, k32, v32, I, *pargs, p.block_size)  # float32 forward
    dO32 = rng.standard_normal(o32.shape).astype(np.float32)
    oracle, baseline = oracle_and_baseline(R.sparse_attention_backward, q32, k32, v32, o32, lse32,
                                           dO32, I, *pargs, p.block_size)
    for part_size in (None, 2):  # the default cut, and every row of more than 2 queries split
        got = backward_cuda(q32, k32, v32, o32, lse32, dO32, I, *pargs, p.block_size, part_size=part_size)
        for name, g, o_, b_ in zip(("dq", "dk", "dv"), got, oracle, baseline):
            rep = assert_close_to_oracle(g, o_, b_, name=name)
            print(f"backward (part_size={part_size}) {name}: error {rep.error:.2e}, "
                  f"float32 reference {rep.baseline_error:.2e}")
    kernel_checks.append("sparse_attention_backward")

# %% [markdown]
# On fp16/bf16 inputs (D and $B_k$ multiples of 16 up to 128) the default is version 2 on tensor
# cores: one kernel per part of a row does all five products with `mma.sync`, keeps the block's
# $dK$ and $dV$ in registers, and writes each (query, head, slot)'s share of $dQ$ to a partial that
# a second kernel sums in slot order (the forward's K1/K2 split again, no atomics). $P$ and $dS$
# are rounded to 16 bits before their products, as in FlashAttention's backward, so it is compared
# with the reference on the same fp16 inputs, relative to the largest gradient (the simulator's
# problem above has $B_k = 8$, so it gets one with $B_k = 16$):

# %%
rel_v2 = None
if backward_cuda is not None:
    from msa.cuda.attention import default_backward_version

    p16 = p if p.block_size % 16 == 0 else make_problem(
        seq_lens_k=(40, 25), num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16, topk=2, seed=9)
    a16 = (p16.cu_seqlens_q, p16.cu_seqlens_k)
    I16 = R.select_blocks(R.block_scores(p16.q_idx, p16.k_idx, *a16, p16.block_size), *a16,
                          p16.block_size, p16.topk)
    q16, k16, v16 = (x.astype(np.float16) for x in (p16.q, p16.k, p16.v))
    o_f, lse16 = R.sparse_attention(*(x.astype(np.float32) for x in (q16, k16, v16)), I16, *a16,
                                    p16.block_size)
    o16, dO16 = o_f.astype(np.float16), rng.standard_normal(o_f.shape).astype(np.float16)
    want = R.sparse_attention_backward(*(x.astype(np.float64) for x in (q16, k16, v16, o16)), lse16,
                                       dO16.astype(np.float64), I16, *a16, p16.block_size)
    print("version for these inputs:", default_backward_version(q16, k16, v16, p16.block_size))
    got = backward_cuda(q16, k16, v16, o16, lse16, dO16, I16, *a16, p16.block_size)
    rel_v2 = max(float(np.abs(np.asarray(g) - w).max() / np.abs(w).max()) for g, w in zip(got, want))
    print(f"version 2 (fp16): max |error| / max |gradient| = {rel_v2:.1e} "
          f"(fp16 unit roundoff {2.0 ** -11:.1e})")

# %% [markdown]
# ## Agreement check

# %%
eps = np.finfo(np.float64).eps
nbtools.check("k2q CSR of the paper's example: A -> q0..q3, B -> q3, C -> q0, q2, D -> q1",
              k2q == {"A": ["q0", "q1", "q2", "q3"], "B": ["q3"], "C": ["q0", "q2"], "D": ["q1"]})
nbtools.check("row_ptr == [0, 4, 5, 7, 8] and slots say where each partial goes",
              row_ptr[0].tolist() == [0, 4, 5, 7, 8] and slots[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1])
nbtools.check("intensities: Q-outer ~ 16 (15.88), KV-outer ~ 85.3 (83.38)",
              round(R.arithmetic_intensity(N, block_size=128, loop_order="q_outer", **cfg), 2) == 15.88
              and round(R.arithmetic_intensity(N, block_size=128, loop_order="kv_outer", **cfg), 2) == 83.38)
nbtools.check("the scheduler keeps every edge and caps items at chunk_size",
              stats[f"chunks of <= {chunk}"]["edges"] == int((I_s >= 0).sum()) and work_split[:, 3].max() <= chunk)
nbtools.check("and cuts the imbalance of the skewed selection",
              stats[f"chunks of <= {chunk}"]["imbalance"] < stats["one item per row"]["imbalance"],
              f"{stats['one item per row']['imbalance']:.1f} -> {stats[f'chunks of <= {chunk}']['imbalance']:.1f}")
scale_o = np.abs(o_q_outer).max()
nbtools.check("K1 partials + K2 combine == eq 8 (Q-outer sparse_attention)",
              np.abs(o_2phase - o_q_outer).max() <= 64 * eps * scale_o
              and np.abs(lse_2phase - lse_q_outer).max() <= 64 * eps * np.abs(lse_q_outer).max(),
              f"max |diff| o {np.abs(o_2phase - o_q_outer).max():.1e}")
nbtools.check("the combine does not depend on the slot order",
              np.abs(o_perm - o_2phase).max() <= 64 * eps * scale_o)
nbtools.check("the combine weights w_s sum to 1", abs(w.sum() - 1) < 1e-12)
if rel_v2 is not None:
    nbtools.check("backward version 2 (tensor cores) == reference within fp16 rounding",
                  rel_v2 < 8 * 2.0 ** -11, f"{rel_v2:.1e}")
for stage in ("csr", "schedule", "attention_partials", "combine_partials", "sparse_attention", "msa_prefill",
              "sparse_attention_backward"):
    if stage in kernel_checks:
        nbtools.check(f"msa.cuda {stage} == reference", True)
    else:
        print(f"kernel check for {stage} skipped: kernel not available yet")
