"""msa.cuda.decode against msa.reference.decode (docs/design.md §8, §5), in the simulator and on a GPU.

The caches come from ``tests.paged_cases.paged_problem``: pages shuffled, spare pages,
-1 in unused block-table entries, NaN in every slot no token owns. Selections compare exactly
where the index scores are exact (``integer_index``: small integers, every score exact in
float32, many ties, so the tie rule is exercised); with Gaussian index data a near tie may swap
two blocks, and the selected blocks' float64 scores are compared with the reference's (K-1)-th
best instead. Attention is fed the reference's selection (test selection on its own) and
compared with a float64 oracle within twice the float32 reference's error, plus the rounding
of the 16-bit P (rung 2) and of the 16-bit output (``msa.testing.tolerance``). Outputs start as
NaN (the cuda conftest's poison).

Masking by selection (docs/design.md §3): every slot a draft may not see is poisoned (NaN,
infinities, 1e30) and its O, LSE and selection must stay bitwise those of the clean run, in the
reference and both rungs; a NaN or infinity a row does see must give the reference's NaN or
infinity, element by element, also where rung 2 cleaned the tile for the rows that do not.

Shapes stay tiny in the simulator (Bk = D = Didx = 16); ``big`` tests run the paper
configuration on a GPU, and ``gpu`` tests capture a step in a CUDA graph.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from msa.cuda import decode as gpu
from msa.cuda._core.arrays import SIMULATOR
from msa.reference import decode as ref
from msa.reference import index as ref_index
from msa.testing import variants
from msa.testing.backends import to_numpy
from msa.testing.ptx import assert_no_f64_or_local, sm90_ptx
from msa.testing.tolerance import assert_close_to_oracle, assert_exact, oracle_and_baseline
from tests.paged_cases import Paged, paged_problem, prefill_last_rows

U16 = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def device(x):
    """A cache array the GPU append can write (NumPy as it is in the simulator)."""
    from numba import cuda

    return x if SIMULATOR else cuda.to_device(x)


def f32(x):
    return np.asarray(x, dtype=np.float32)


def widened(p):
    """The cache and queries as the float32 values the kernel got (16-bit widened exactly)."""
    return {n: f32(getattr(p, n)) for n in ("q", "q_idx", "k_cache", "v_cache", "k_idx_cache")}


def check_attention(o, lse, p, I, kind, version, scale=None):
    """(o, lse) of the kernel against the float64 oracle of ``decode_attention`` on ``I``."""
    w = widened(p)
    oracle, baseline = oracle_and_baseline(ref.decode_attention, w["q"], w["k_cache"],
                                           w["v_cache"], I, p.block_table, p.cache_seqlens, p.bk,
                                           scale=scale)
    check_against_oracle(o, lse, oracle, baseline, w["v_cache"], kind, version)


def check_against_oracle(o, lse, oracle, baseline, v, kind, version):
    """(o, lse) against ``oracle_and_baseline``'s pair for a function returning (o, lse, ...);
    ``v`` the values the kernel read (the bound of rung 2's 16-bit P rounding)."""
    o_base = baseline[0]
    if kind == "float16":  # the output is rounded to q's dtype: so is the baseline
        o_base = o_base.astype(np.float16)
    o_ref = np.asarray(oracle[0], np.float64)
    finite = np.isfinite(o_ref)
    scale = float(np.abs(o_ref[finite]).max()) if finite.any() else 0.0
    # rung 2 rounds P to 16 bits before P V: |sum p_j d_j v_j| / l <= u max|v| (twice, as floor)
    u = U16[kind] if version >= 2 and kind in U16 else 0.0
    vmax = float(np.nanmax(np.abs(v)))
    floor = max(4.0, 2 * u * vmax / (scale * np.finfo(np.float32).eps)) if scale and u else 4.0
    lse_factor = 2.0 if SIMULATOR else 4.0  # ex2.approx on the GPU: 2 ulp
    assert_close_to_oracle(to_numpy(lse), oracle[1], baseline[1], name="lse", factor=lse_factor)
    assert_close_to_oracle(f32(to_numpy(o)), o_ref, o_base, name="o", floor_ulps=floor,
                           dtype=np.float32)


def near_tie_equivalent(I, p, w, topk, factor=4.0):
    """A selection from kernel-computed scores, judged on the float64 block scores: same
    structure as the reference's, and every selected block scores at least the reference's
    (K-1)-th best minus a float32-derived tolerance."""
    want = ref.decode_block_indices(w["q_idx"].astype(np.float64),
                                    w["k_idx_cache"].astype(np.float64), p.block_table,
                                    p.cache_seqlens, p.bk, topk)
    got = to_numpy(I)
    assert got.shape == want.shape and got.dtype == np.int32
    assert_exact(got == -1, want == -1, name="padding")
    assert_exact(got.max(axis=-1), want.max(axis=-1), name="local block")
    for row in got.reshape(-1, got.shape[-1]):  # ids below the local block (checked): distinct
        valid = row[row >= 0]
        assert np.unique(valid).size == valid.size, f"a block selected twice: {row}"
    _, _, k_idx, cu_k = ref.gather_cache(None, None, w["k_idx_cache"], p.block_table,
                                         p.cache_seqlens)
    cu_q = np.arange(len(p.cache_seqlens) + 1) * p.lq
    M64 = ref_index.block_scores(w["q_idx"].astype(np.float64), k_idx.astype(np.float64), cu_q,
                                 cu_k, p.bk)
    M32 = ref_index.block_scores(w["q_idx"], k_idx, cu_q, cu_k, p.bk)
    with np.errstate(invalid="ignore"):
        err = np.where(np.isfinite(M64), np.abs(M32.astype(np.float64) - M64), 0.0)
    eps = np.finfo(np.float32).eps
    for t in range(got.shape[0]):
        for r in range(got.shape[1]):
            g = [b for b in got[t, r] if b >= 0][:-1]
            wnt = [b for b in want[t, r] if b >= 0][:-1]
            if not wnt:
                continue
            kth = min(M64[r, t, b] for b in wnt)
            fin = M64[r, t][np.isfinite(M64[r, t])]
            tol = factor * err[r, t].max() + 4 * eps * np.abs(fin).max()
            assert min(M64[r, t, b] for b in g) >= kth - tol, (t, r, g, wnt)


def versions_for(kind):
    return (1, 2, 3) if kind in ("float16", "bfloat16") else (1,)


# -- the decode step ----------------------------------------------------------------------------

CASES = {
    # seqlens (below one block, exact multiples of Bk = 16, one over), Lq, G, Hkv, topk
    "Lq1-G16-ragged": ([3, 16, 17], 1, 16, 1, 3),
    "Lq2-G1-Hkv3": ([32, 33], 2, 1, 3, 4),
    "Lq3-G2-topk-above-blocks": ([8, 48], 3, 2, 2, 9),
    "Lq4-G4": ([4, 17, 64], 4, 4, 2, 3),
    "Lq5-G8-K1": ([65, 5], 5, 8, 1, 1),
    "Lq6-G2": ([31, 96], 6, 2, 2, 4),
    "Lq7-G1": ([47, 7], 7, 1, 2, 3),
    "Lq8-G16": ([8, 80], 8, 16, 1, 4),
}


@pytest.mark.parametrize("kind", ["float16", "float32"])
@pytest.mark.parametrize("seqlens,lq,g,hkv,topk", CASES.values(), ids=CASES.keys())
def test_decode_step_equals_the_reference(seqlens, lq, g, hkv, topk, kind):
    if kind == "float32" and lq not in ((1, 4) if SIMULATOR else (1, 4, 8)):
        pytest.skip("float32 (rung 1 alone) at Lq = 1, 4 (and 8 on a GPU) only: each Lq costs "
                    "rung 1 anew; float16 runs every rung at every Lq")
    # Didx = 32: rung 3's register-streamed index kernel applies (a multiple of 32), as do 1, 2
    p = paged_problem(seqlens, lq, hq=g * hkv, hkv=hkv, bk=16, d_idx=32, topk=topk,
                      dtype=np.dtype(kind), seed=lq + 10 * g, integer_index=True)
    w = widened(p)
    I_ref = ref.decode_block_indices(w["q_idx"], w["k_idx_cache"], p.block_table,
                                     p.cache_seqlens, 16, topk)
    for version in versions_for(kind):
        if version == 1 and kind != "float32" and lq * g > 64 and SIMULATOR:
            continue  # CI time (52 of this case's 56 s): rung 1 at Lq x G = 128 rows; its
            # other cases (Lq 1-7, G 1-16) run in the simulator, this one on a GPU
        if version == 3 and lq > 4:  # rung 3 adds an index kernel (its attention is rung 2's):
            I = gpu.decode_block_indices(p.q_idx, p.k_idx_cache, p.block_table,  # CI time
                                         p.cache_seqlens, 16, topk, version=3)
            assert_exact(I, I_ref, name="block_indices v3")
            continue
        o, lse, I = gpu.decode_step(p.q, p.q_idx, *p.cache, 16, topk, version=version)
        assert_exact(I, I_ref, name=f"block_indices v{version}")
        check_attention(o, lse, p, I_ref, kind, version)


@pytest.mark.parametrize("stages", [2, 3])
def test_pages_of_several_stages(stages):
    # Bk = 32: two key stages a page in the simulator's rung 2 (64 keys a stage on a GPU: the
    # paper's Bk = 128 has two there), ragged lengths, Lq = 3; a split's four stages go round
    # a ring of 2 or 3 buffers (the plan's attention launch rebuilt with `stages`)
    import dataclasses

    from msa.cuda.decode import v2_split_attention as v2a
    from msa.cuda.decode._plan import Kernel

    p = paged_problem([31, 64, 65], 3, hq=4, hkv=2, bk=32, topk=3, dtype=np.float16, seed=11,
                      integer_index=True)
    args = tuple(device(x) for x in (p.q, p.q_idx, *p.cache))
    pl = gpu.plan(*args, 32, 3, version=2)
    steps = []
    for kernel, spec in pl.steps:
        for direct in (False, True):
            if kernel.dispatcher is v2a.split_kernel(32, 16, 2, 3, False, direct, 3,
                                                     stages=v2a.stages_for(32, 16, 2)):
                rebuilt = v2a.split_kernel(32, 16, 2, 3, False, direct, 3, stages=stages)
                kernel = Kernel(rebuilt, kernel.grid, kernel.block,
                                v2a.layout(32, 16, 2, stages)[-1])
                steps.append("rebuilt")
        steps.append((kernel, spec))
    assert steps.count("rebuilt") == 1
    pl = dataclasses.replace(pl, steps=[x for x in steps if x != "rebuilt"])
    o, lse, I = gpu.run(pl, *args)
    w = widened(p)
    I_ref = ref.decode_block_indices(w["q_idx"], w["k_idx_cache"], p.block_table,
                                     p.cache_seqlens, 32, 3)
    assert_exact(to_numpy(I), I_ref, name="block_indices")
    check_attention(to_numpy(o), to_numpy(lse), p, I_ref, "float16", 2)


@pytest.mark.parametrize("version", [1, 2, 3])
def test_selection_up_to_near_ties_on_gaussian_scores(version):
    # rung 3 sums each score's products in another order (its permuted index dimensions)
    p = paged_problem([40, 70], 2, hq=4, hkv=2, bk=16, d_idx=32 if version == 3 else 16, topk=4,
                      dtype=np.float16, seed=3)
    I = gpu.decode_block_indices(p.q_idx, p.k_idx_cache, p.block_table, p.cache_seqlens, 16, 4,
                                 version=version)
    near_tie_equivalent(I, p, widened(p), 4)


@pytest.mark.parametrize("warps,topk", [(2, 3), (3, 3), (2, 5)])
def test_rung3_merges_its_warps_heaps(warps, topk, monkeypatch):
    # On a GPU rung 3's CTA has 4 warps, each keeping the top K - 1 of its own pages of the
    # split, merged into the split's list at the end; the simulator runs one warp a CTA, so
    # this runs 2 and 3 there (splits of 4 pages: with K - 1 = 2 the warps' heaps hold more
    # than the list keeps). The selection is the reference's.
    from msa.cuda.decode import v3_register_index as v3i

    monkeypatch.setattr(v3i, "WARPS", warps)
    v3i.split_kernel.cache_clear()
    try:
        p = paged_problem([300, 200], 2, hq=4, hkv=2, bk=16, d_idx=32, topk=topk,
                          dtype=np.float16, seed=warps + topk, integer_index=True)
        w = widened(p)
        want = ref.decode_block_indices(w["q_idx"], w["k_idx_cache"], p.block_table,
                                        p.cache_seqlens, 16, topk)
        got = gpu.decode_block_indices(p.q_idx, p.k_idx_cache, p.block_table,
                                       p.cache_seqlens, 16, topk, version=3)
        assert_exact(to_numpy(got), want, name="block_indices")
    finally:
        v3i.split_kernel.cache_clear()  # the next test builds it with the module's WARPS


def test_attention_on_the_references_selection_with_gaussian_data():
    p = paged_problem([17, 50, 3], 3, hq=8, hkv=2, bk=16, topk=3, dtype=np.float16, seed=4)
    w = widened(p)
    I = ref.decode_block_indices(w["q_idx"], w["k_idx_cache"], p.block_table, p.cache_seqlens,
                                 16, 3)
    for version in (1, 2):
        o, lse = gpu.decode_attention(p.q, p.k_cache, p.v_cache, I, p.block_table,
                                      p.cache_seqlens, 16, version=version, scale=0.2)
        check_attention(o, lse, p, I, "float16", version, scale=0.2)


def test_attention_takes_selections_in_any_order_and_beyond_the_local_block():
    # decode_attention accepts any valid selection: unsorted rows, a block after a query's
    # local block (it holds only future keys: nothing), the same block for every draft.
    p = paged_problem([50, 40], 2, hq=4, hkv=2, bk=16, topk=3, dtype=np.float16, seed=5)
    I = np.array([[[2, 0, -1], [1, 3, 0]], [[3, 1, -1], [0, 2, 1]],
                  [[2, 1, 0], [0, -1, -1]], [[1, 2, -1], [2, 0, 1]]], dtype=np.int32)
    for version in (1, 2):
        o, lse = gpu.decode_attention(p.q, p.k_cache, p.v_cache, I, p.block_table,
                                      p.cache_seqlens, 16, version=version)
        check_attention(o, lse, p, I, "float16", version)


def test_append_then_decode_equals_a_prefill_of_the_whole_sequence():
    p = paged_problem([30, 47], 3, hq=8, hkv=2, bk=16, topk=3, dtype=np.float16, seed=6,
                      integer_index=True)
    # the cache rebuilt by the GPU append: the prompt without its last Lq tokens, then the step
    prompt = p.cache_seqlens - p.lq
    caches = [device(np.full_like(x, np.nan)) for x in (p.k_cache, p.v_cache, p.k_idx_cache)]
    rows = np.concatenate([np.arange(p.cu_k[b], p.cu_k[b] + prompt[b]) for b in range(2)])
    table = device(p.block_table)
    gpu.append_to_cache(*(device(x[rows]) for x in (p.k, p.v, p.k_idx)), *caches, table,
                        device(prompt.astype(np.int32)),
                        cu_seqlens=np.concatenate([[0], np.cumsum(prompt)]))
    gpu.append_to_cache(*(device(x[p.last]) for x in (p.k, p.v, p.k_idx)), *caches, table,
                        device(p.cache_seqlens))
    for got, want in zip(caches, (p.k_cache, p.v_cache, p.k_idx_cache)):
        np.testing.assert_array_equal(to_numpy(got), want)
    q, q_idx, lens = (device(x) for x in (p.q, p.q_idx, p.cache_seqlens))
    o, lse, I = (to_numpy(x) for x in gpu.decode_step(q, q_idx, *caches, table, lens, 16, 3))
    w = {n: f32(getattr(p, n)) for n in ("q_full", "q_idx_full", "k", "v", "k_idx")}
    full = Paged(**{**p.__dict__, **w})
    o_pre, lse_pre, I_pre = prefill_last_rows(full)
    assert_exact(I, I_pre, name="block_indices")
    check_attention(o, lse, p, I_pre, "float16", 2)  # on the cache the appends built
    assert np.abs(f32(o) - o_pre).max() < 3e-3 and np.abs(lse - lse_pre).max() < 1e-5


def test_prefill_chunk_equals_the_reference():
    p = paged_problem([30, 40], 1, hq=4, hkv=2, bk=16, topk=3, dtype=np.float16, seed=13,
                      integer_index=True)
    chunk = np.array([5, 17])
    rows = np.concatenate([np.arange(p.cu_k[b + 1] - chunk[b], p.cu_k[b + 1]) for b in range(2)])
    cu_q = np.concatenate([[0], np.cumsum(chunk)]).astype(np.int32)
    q, q_idx = (np.ascontiguousarray(x[rows]) for x in (p.q_full, p.q_idx_full))
    o, lse, I = gpu.prefill_chunk(q, q_idx, *p.cache, cu_q, 16, 3)
    w = {n: f32(x) for n, x in (("q", q), ("q_idx", q_idx), ("k_cache", p.k_cache),
                                ("v_cache", p.v_cache), ("k_idx_cache", p.k_idx_cache))}
    oracle, baseline = oracle_and_baseline(ref.prefill_chunk, w["q"], w["q_idx"], w["k_cache"],
                                           w["v_cache"], w["k_idx_cache"], p.block_table,
                                           p.cache_seqlens, cu_q, 16, 3)
    assert_exact(to_numpy(I), baseline[2], name="block_indices")
    assert_exact(baseline[2], oracle[2], name="block_indices (float64)")
    check_against_oracle(o, lse, oracle, baseline, w["v_cache"], "float16", 2)


def test_gather_is_the_references():
    p = paged_problem([1, 16, 33], 1, bk=16, dtype=np.float16, seed=7)
    for got, want in zip(gpu.gather_cache(*p.cache), ref.gather_cache(*p.cache)):
        np.testing.assert_array_equal(got, want)


# -- masking by selection: nothing a query cannot see reaches it -------------------------------

POISONS = (np.nan, np.inf, -np.inf, 1e30)
DRAFTS_AND_GROUPS = [(lq, g) for lq in (1, 2, 4) for g in (1, 4, 16)]


def with_finite_slots(p, seed):
    """``p`` with every cache slot no token owns (NaN in ``paged_problem``) given finite random
    values: the clean run against which a poisoned one must be bitwise equal."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in ("k_cache", "v_cache", "k_idx_cache"):
        x = getattr(p, name).copy()
        stale = np.isnan(x)
        x[stale] = rng.integers(-3, 4, int(stale.sum())) if name == "k_idx_cache" else (
            rng.standard_normal(int(stale.sum())))
        out[name] = x
    return Paged(**{**p.__dict__, **out})


def hidden_slots(p, I, i):
    """``(kv [P, Hkv, Bk], idx [P, Bk])`` bool: the slots draft ``i`` of every request may not
    see. Its keys are the positions up to its own (``cache_seqlens[b] - Lq + i``) in the pages
    its block table lists; the K and V of KV head ``r`` count only in the blocks that
    ``I[b*Lq + i, r]`` selected. Everything else is hidden: the slots past the request's length,
    the later drafts' keys, unlisted pages, and (K and V) the blocks only other drafts chose."""
    num_pages, hkv, bk = p.k_cache.shape[:3]
    kv_seen = np.zeros((num_pages, hkv, bk), bool)
    idx_seen = np.zeros((num_pages, bk), bool)
    for b, n in enumerate(p.cache_seqlens.tolist()):
        t = b * p.lq + i
        pos = n - p.lq + i
        for j in range(-(-n // bk)):
            upto = min(bk, pos - j * bk + 1)  # keys of block j at positions <= pos
            if upto <= 0:
                continue
            page = p.block_table[b, j]
            idx_seen[page, :upto] = True
            for r in range(hkv):
                if j in I[t, r]:
                    kv_seen[page, r, :upto] = True
    return ~kv_seen, ~idx_seen


def poisoned(x, hidden, values, rng):
    """``x`` with every element of a hidden slot drawn from ``values`` (NaN, infinities, 1e30;
    in float16 1e30 is +inf)."""
    y = x.copy()
    shape = y[hidden].shape
    with np.errstate(over="ignore"):
        y[hidden] = rng.choice(np.asarray(values, np.float64), size=shape).astype(y.dtype)
    return y


def bits(x):
    x = np.ascontiguousarray(to_numpy(x))
    return x.view(np.dtype(f"u{x.itemsize}"))


def step_of(version):
    """``decode_step`` of the reference or of one rung, NumPy out."""
    def step(q, q_idx, k_cache, v_cache, k_idx_cache, table, lens, bk, topk):
        if version == "reference":
            return ref.decode_step(q, q_idx, k_cache, v_cache, k_idx_cache, table, lens, bk, topk)
        return tuple(to_numpy(x) for x in gpu.decode_step(q, q_idx, k_cache, v_cache, k_idx_cache,
                                                           table, lens, bk, topk,
                                                           version=version))
    return step


@st.composite
def stale_cases(draw, lq, g):
    """Ragged lengths (one below a block, one a multiple of Bk, one a block and one over), the
    sizes, and the poison: which of ``POISONS`` fill the hidden slots and the seed."""
    bk = draw(st.sampled_from([16, 32] if g < 16 else [16]))
    lens = [draw(st.integers(lq, bk - 1)), bk * draw(st.integers(1, 3)),
            bk * draw(st.integers(1, 3)) + 1]
    return dict(lens=lens, bk=bk, hkv=draw(st.integers(1, 2 if g < 16 else 1)),
                topk=draw(st.integers(1, 3)),
                values=draw(st.lists(st.sampled_from(POISONS), min_size=1, max_size=4,
                                     unique_by=str)),
                seed=draw(st.integers(0, 2**31 - 1)))


def _stale_params():
    """(version, Lq, G) for the reference and every rung."""
    for version in ("reference", 1, 2, 3):
        for lq, g in DRAFTS_AND_GROUPS:
            # sim_heavy (20 s or more each, where cheaper cases run the same code): rung 1 at
            # Lq = 4 and at G = 16 (one thread an output: G changes only the count); at Lq = 4
            # rung 3 at G = 4 alone (G = 1 and 4 give the same tiles, one m-tile; G = 16 runs at
            # Lq = 2), and rung 2 not at all (rung 3 runs the same attention kernel, and rung 2's
            # index runs several drafts at Lq = 2)
            heavy = ((version == 1 and (lq == 4 or g == 16))
                     or (version == 2 and lq == 4)
                     or (version == 3 and lq == 4 and g != 4))
            marks = [pytest.mark.sim_heavy] if heavy else []
            yield pytest.param(version, lq, g, marks=marks, id=f"{version}-Lq{lq}-G{g}")


@pytest.mark.parametrize("version,lq,g", list(_stale_params()))
@settings(max_examples=2 if SIMULATOR else 10)
@given(data=st.data())
def test_a_query_never_reads_a_slot_it_cannot_see(version, lq, g, data):
    # docs/design.md §3 and §8: every slot draft i may not see (past the lengths, unlisted pages
    # and pages listed past a request's blocks, the later drafts' keys, the blocks only other
    # drafts selected) holds NaN, +-inf or 1e30, and draft i's O, LSE and selection are bitwise
    # those of the run with finite values there
    case = data.draw(stale_cases(lq, g), label="case")
    bk, topk = case["bk"], case["topk"]
    p = paged_problem(case["lens"], lq, hq=g * case["hkv"], hkv=case["hkv"], bk=bk, topk=topk,
                      d_idx=32 if version == 3 else 16, dtype=np.float16,
                      seed=case["seed"] % 1000, integer_index=True)
    clean = with_finite_slots(p, case["seed"])
    unused = p.block_table < 0  # past each request's blocks: page ids too, never to be read
    p.block_table[unused] = np.random.default_rng(case["seed"]).integers(
        0, p.k_cache.shape[0], int(unused.sum()))
    step = step_of(version)
    o, lse, I = step(p.q, p.q_idx, clean.k_cache, clean.v_cache, clean.k_idx_cache,
                     p.block_table, p.cache_seqlens, bk, topk)
    rng = np.random.default_rng(case["seed"])
    for i in range(lq):
        kv, idx = hidden_slots(p, I, i)
        dirty = [poisoned(getattr(clean, n), m, case["values"], rng)
                 for n, m in (("k_cache", kv), ("v_cache", kv), ("k_idx_cache", idx))]
        o2, lse2, I2 = step(p.q, p.q_idx, *dirty, p.block_table, p.cache_seqlens, bk, topk)
        rows = np.arange(len(case["lens"])) * lq + i
        assert_exact(I2[rows], I[rows], name=f"block_indices of draft {i}")
        assert_exact(bits(lse2)[rows], bits(lse)[rows], name=f"lse bits of draft {i}")
        assert_exact(bits(o2)[rows], bits(o)[rows], name=f"o bits of draft {i}")


@pytest.mark.parametrize("lq,g", [(1, 4), (2, 1), (4, 4), (4, 16)])
def test_a_seen_non_finite_value_gives_what_the_reference_gives(lq, g):
    # rung 2 cleans the V tiles that rows which cannot see a key multiply (Lq > 1), and must
    # not hide a value that a row does see: the rows that see a NaN or an infinity get NaN or
    # that infinity exactly where the reference does, element by element; the rest is close
    p = paged_problem([40, 49], lq, hq=g, hkv=1, bk=16, topk=2, dtype=np.float16, seed=21,
                      integer_index=True)
    w = widened(p)
    I = ref.decode_block_indices(w["q_idx"], w["k_idx_cache"], p.block_table, p.cache_seqlens,
                                 16, 2)
    v = p.v_cache.copy()
    for b, n in enumerate(p.cache_seqlens.tolist()):
        last = n - 1  # seen by the last draft only
        other = int(I[b * lq, 0, 0]) * 16 + 3  # in draft 0's first block, maybe no one else's
        for pos, values in ((last, {0: np.nan, 1: np.inf, 2: -np.inf}),
                            (other, {1: -np.inf, 5: np.inf})):
            page, slot = p.block_table[b, pos // 16], pos % 16
            for d, x in values.items():
                v[page, 0, slot, d] = x
    want, _ = ref.decode_attention(w["q"], w["k_cache"], f32(v), I, p.block_table,
                                   p.cache_seqlens, 16)
    assert np.isnan(want).any() and np.isinf(want).any()
    for version in (1, 2):
        o, _ = gpu.decode_attention(p.q, p.k_cache, v, I, p.block_table, p.cache_seqlens, 16,
                                    version=version)
        got = f32(to_numpy(o))
        for what, cls in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
            assert_exact(cls(got), cls(want), name=f"{what} in o of v{version}")
        fin = np.isfinite(want)
        assert np.abs(got[fin] - want[fin]).max() < 3e-3


# -- plan and run -------------------------------------------------------------------------------

def test_one_plan_runs_many_steps_as_the_cache_grows():
    # The caches start with the two tokens still to come poisoned (NaN): each run must append
    # its token into the right slot, then decode on it; the selection must be the reference's
    # on the true cache, and o and LSE those of an eager decode_step on the caches run built.
    p = paged_problem([30, 46], 1, hq=4, hkv=2, bk=16, topk=3, dtype=np.float16, seed=8,
                      integer_index=True, max_pages=4)
    lens = p.cache_seqlens - 2  # two tokens to go
    host = [x.copy() for x in (p.k_cache, p.v_cache, p.k_idx_cache)]
    to_come = [(b, pos) for b in range(2) for pos in range(lens[b], p.cache_seqlens[b])]
    for b, pos in to_come:
        page, slot = p.block_table[b, pos // 16], pos % 16
        for x in host:
            x[page, ..., slot, :] = np.nan
    caches = [device(x) for x in host]
    table, lens_d = device(p.block_table), device(lens.copy())
    new = [device(np.ascontiguousarray(x[p.last])) for x in (p.k, p.v, p.k_idx)]
    new += [device(p.q), device(p.q_idx)]
    pl = gpu.plan(new[3], new[4], *caches, table, lens_d, 16, 3, k=new[0], v=new[1], k_idx=new[2])
    assert pl.version == 2 and pl.append
    w = widened(p)
    for step in (1, 2):
        lens = lens + 1
        if SIMULATOR:
            lens_d[:] = lens
        else:
            lens_d.copy_to_device(lens)
        rows = np.array([p.cu_k[b] + lens[b] - 1 for b in range(2)])
        k_new, v_new, i_new, q_new, qi_new = (device(np.ascontiguousarray(x[rows])) for x in (
            p.k, p.v, p.k_idx, p.q_full, p.q_idx_full))
        got = [to_numpy(x).copy() for x in gpu.run(pl, q_new, qi_new, *caches, table, lens_d,
                                                    k=k_new, v=v_new, k_idx=i_new)]
        for b in range(2):  # the token appended where the true cache has it
            pos = lens[b] - 1
            page, slot = p.block_table[b, pos // 16], pos % 16
            for got_cache, want_cache in zip(caches, (p.k_cache, p.v_cache, p.k_idx_cache)):
                np.testing.assert_array_equal(to_numpy(got_cache)[page, ..., slot, :],
                                              want_cache[page, ..., slot, :])
        I_ref = ref.decode_block_indices(f32(p.q_idx_full[rows]), w["k_idx_cache"],
                                         p.block_table, lens, 16, 3)
        assert_exact(got[2], I_ref, name=f"block_indices, step {step}")
        assert np.isfinite(got[0]).all() and np.isfinite(got[1]).all()
        want = [to_numpy(x) for x in gpu.decode_step(q_new, qi_new, *caches, table, lens_d, 16, 3)]
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        now = Paged(**{**p.__dict__, "q": np.ascontiguousarray(p.q_full[rows]),
                       "cache_seqlens": lens})
        check_attention(got[0], got[1], now, I_ref, "float16", 2)


# -- inputs users get wrong ---------------------------------------------------------------------

def test_bad_inputs_raise_named_errors():
    p = paged_problem([20, 9], 2, hq=4, hkv=2, bk=16, topk=3, dtype=np.float16, seed=9)
    step = (p.q, p.q_idx, *p.cache)
    with pytest.raises(ValueError, match="topk"):
        gpu.decode_step(*step, 16, 65)
    # 69 blocks: the reference takes K = 65, msa.cuda says it does not and points there
    long = paged_problem([1100], 1, hq=2, hkv=1, bk=16, topk=3, dtype=np.float16, seed=9)
    with pytest.raises(ValueError, match="topk = 65 is not supported by msa.cuda.*msa.reference"):
        gpu.decode_step(long.q, long.q_idx, *long.cache, 16, 65)
    with pytest.raises(ValueError, match="block_size"):
        gpu.decode_step(*step, 8, 3)
    with pytest.raises(ValueError, match="version 2 does not apply.*float32"):
        q32 = widened(p)
        gpu.decode_step(q32["q"], q32["q_idx"], q32["k_cache"], q32["v_cache"],
                        q32["k_idx_cache"], p.block_table, p.cache_seqlens, 16, 3, version=2)
    with pytest.raises(ValueError, match="version 3 does not apply.*Didx = 16") as why:
        gpu.decode_step(*step, 16, 3, version=3)
    assert "heaps" not in str(why.value)  # only the reason that holds
    with pytest.raises(ValueError, match="version must be"):
        gpu.decode_step(*step, 16, 3, version=4)
    with pytest.raises(TypeError, match="dtype"):
        gpu.decode_step(p.q.astype(np.float32), *step[1:], 16, 3)
    bad = p.block_table.copy()
    bad[1, 0] = 10**6
    with pytest.raises(ValueError, match="block_table\\[1, 0\\]"):
        gpu.decode_step(p.q, p.q_idx, *p.cache[:3], bad, p.cache_seqlens, 16, 3)
    with pytest.raises(ValueError, match="cache_seqlens\\[1\\]"):
        gpu.decode_step(*step[:-1], np.array([20, 1], np.int32), 16, 3)
    q9 = np.concatenate([p.q] * 5)[:18]
    qi9 = np.concatenate([p.q_idx] * 5)[:18]
    with pytest.raises(ValueError, match="at most 8 new queries"):
        gpu.decode_step(q9, qi9, *p.cache[:4], np.array([20, 16], np.int32), 16, 3)
    with pytest.raises(TypeError):
        gpu.decode_step(*step, 16, 3, 0.5)  # a positional scale
    with pytest.raises(ValueError, match="two new tokens to one cache slot"):
        t = p.block_table.copy()
        t[1, 0] = t[0, 1]
        gpu.append_to_cache(p.k[:2], p.v[:2], p.k_idx[:2], *p.cache[:3], t,
                            np.array([20, 4], np.int32))  # both at slot 3 of one page
    # what the kernels add to the reference's checks, before anything is allocated
    strided = np.repeat(p.q, 2, axis=0)[::2]
    with pytest.raises(ValueError, match=r"^q must be C-contiguous"):
        gpu.plan(strided, *step[1:], 16, 3)
    for name, bad in (("cache_seqlens", p.cache_seqlens.astype(np.int64)),
                      ("block_table", p.block_table.astype(np.int16))):
        cache = dict(zip(("block_table", "cache_seqlens"), p.cache[3:]), **{name: bad})
        with pytest.raises(TypeError, match=rf"^{name} must have dtype int32"):
            gpu.decode_step(*step[:5], cache["block_table"], cache["cache_seqlens"], 16, 3)
    with pytest.raises(ValueError, match=r"^q's heads over k_cache's, G = Hq/Hkv = 3"):
        q3 = np.ascontiguousarray(np.repeat(p.q[:, :1], 6, axis=1))  # Hq 6 over Hkv 2
        gpu.prefill_chunk(q3, *step[1:], [0, 2, 4], 16, 3)


# -- offline PTX (no GPU needed; not the simulator) --------------------------------------------

@pytest.mark.skipif(SIMULATOR, reason="compiles PTX for sm_90 (NVVM), not the simulator")
@pytest.mark.parametrize("name", [n for n, _, _ in variants.of("decode")] if not SIMULATOR
                         else ["-"])
def test_ptx_has_no_f64_and_no_local_memory(name):
    kernel, sig = next((k, s) for n, k, s in variants.of("decode") if n == name)
    ptx = sm90_ptx(kernel, sig)
    assert_no_f64_or_local(ptx)
    if "split" in name:
        assert "mma.sync.aligned.m16n8k16" in ptx and "cp.async" in ptx
    if "register" in name:  # rung 3's index: keys straight from global memory into the mma
        assert "mma.sync.aligned.m16n8k16" in ptx and "ld.global.nc.v4" in ptx
        assert "cp.async" not in ptx


# -- GPU only: the paper configuration, CUDA graphs ---------------------------------------------

def _paper_problem(torch, b, n, lq, seed=0, integer_index=False):
    """bf16 torch tensors: B requests of n tokens, Hq 64, Hkv 4, D = Didx = 128, Bk 128."""
    p = paged_problem([n] * b, lq, hq=64, hkv=4, d=128, d_idx=128, bk=128, topk=16,
                      dtype=np.float32, seed=seed, integer_index=integer_index)
    cuda = {n_: torch.from_numpy(np.nan_to_num(getattr(p, n_), nan=0.0)).to(
        "cuda", torch.bfloat16) for n_ in ("q", "q_idx", "k_cache", "v_cache", "k_idx_cache")}
    meta = {n_: torch.from_numpy(getattr(p, n_)).cuda() for n_ in ("block_table", "cache_seqlens")}
    return p, cuda, meta


@pytest.mark.big
@pytest.mark.parametrize("b, n, lq, seed", [(2, 3000, 1, 1), (2, 3000, 4, 4), (2, 3000, 8, 8),
                                           (33, 2000, 1, 33)])
def test_paper_configuration_against_the_reference(b, n, lq, seed):
    # B = 33: B Hkv = 132 (query, KV head) pairs, as many as an H100's or H200's SMs, so the
    # attention plans one split a pair, which writes O and LSE itself (no combine kernel)
    torch = pytest.importorskip("torch")
    p, c, m = _paper_problem(torch, b, n, lq, seed=seed, integer_index=True)
    as32 = {k: v.float().cpu().numpy() for k, v in c.items()}
    I_ref = ref.decode_block_indices(as32["q_idx"], as32["k_idx_cache"], p.block_table,
                                     p.cache_seqlens, 128, 16)
    o, lse, I = gpu.decode_step(c["q"], c["q_idx"], c["k_cache"], c["v_cache"], c["k_idx_cache"],
                                m["block_table"], m["cache_seqlens"], 128, 16)
    assert_exact(I.cpu().numpy(), I_ref, name="block_indices")
    wo, wl = ref.decode_attention(as32["q"], as32["k_cache"], as32["v_cache"], I_ref,
                                  p.block_table, p.cache_seqlens, 128)
    o32 = o.float().cpu().numpy()
    assert np.abs(o32 - wo).max() <= 2e-2 * np.abs(wo).max()
    assert np.abs(lse.cpu().numpy() - wl).max() < 1e-3


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager_bitwise():
    torch = pytest.importorskip("torch")
    p, c, m = _paper_problem(torch, 4, 2000, 2, seed=1)
    args = (c["q"], c["q_idx"], c["k_cache"], c["v_cache"], c["k_idx_cache"], m["block_table"],
            m["cache_seqlens"])
    pl = gpu.plan(*args, 128, 16)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        eager = [x.clone() for x in gpu.run(pl, *args)]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gpu.run(pl, *args)
    for x in (pl.o, pl.lse):
        x.fill_(float("nan"))
    pl.block_indices.fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip((pl.o, pl.lse, pl.block_indices), eager):
        assert torch.equal(got.view(torch.int16) if got.dtype == torch.bfloat16 else got,
                           want.view(torch.int16) if want.dtype == torch.bfloat16 else want)
    # the graph follows the cache: one more token, replay == a fresh eager step
    m["cache_seqlens"] += 1
    graph.replay()
    fresh = gpu.decode_step(*args[:-1], m["cache_seqlens"], 128, 16)
    torch.cuda.synchronize()
    assert torch.equal(pl.block_indices, fresh[2])
    assert torch.equal(pl.o.view(torch.int16), fresh[0].view(torch.int16))


@pytest.mark.parametrize("version", [2, 3])
def test_a_long_context_takes_the_wide_merge(version):
    """A request of 140 pages: more than 32 index splits, so the merge runs several warps a row
    (``v2_split_index.wide_warps``); the selection is the reference's bit for bit."""
    from msa.cuda.decode import v2_split_index as v2i

    p = paged_problem([140 * 16 - 3, 20], 1, hq=2, hkv=1, bk=16, d_idx=32, topk=4,
                      dtype=np.float16, seed=21, integer_index=True, spare_pages=0)
    args = tuple(device(x) for x in (p.q, p.q_idx, *p.cache))  # plan/run: device arrays
    pl = gpu.plan(*args, 16, 4, version=version)
    assert pl.index_splits > 32 and v2i.wide_warps(pl.index_splits, 4) > 1
    I = gpu.run(pl, *args)[2]
    w = widened(p)
    I_ref = ref.decode_block_indices(w["q_idx"], w["k_idx_cache"], p.block_table,
                                     p.cache_seqlens, 16, 4)
    assert_exact(to_numpy(I), I_ref, name="block_indices")



@pytest.mark.big
@pytest.mark.parametrize("lq", [1, 8])
def test_paper_configuration_long_context_takes_the_wide_merge(lq):
    """One request of 20000 tokens (157 pages): 40 index splits on a GPU of 20 or more SMs,
    so the merge runs several warps a row; the selection is the reference's bit for bit."""
    torch = pytest.importorskip("torch")
    from msa.cuda.decode import v2_split_index as v2i

    p, c, m = _paper_problem(torch, 1, 20000, lq, seed=lq + 20, integer_index=True)
    args = (c["q"], c["q_idx"], c["k_cache"], c["v_cache"], c["k_idx_cache"], m["block_table"],
            m["cache_seqlens"])
    pl = gpu.plan(*args, 128, 16)
    assert v2i.wide_warps(pl.index_splits, 16) > 1, pl.index_splits
    I = gpu.run(pl, *args)[2]
    as32 = {k: v.float().cpu().numpy() for k, v in c.items()}
    I_ref = ref.decode_block_indices(as32["q_idx"], as32["k_idx_cache"], p.block_table,
                                     p.cache_seqlens, 128, 16)
    assert_exact(I.cpu().numpy(), I_ref, name="block_indices")


# -- the merge of the splits' lists: one warp a row, and several -----------------------------

def split_lists(splits, rows, hkv, topk, loc_blocks, seed, low=-4, high=4):
    """``cand_s, cand_i [S, rows, Hkv, K-1]`` as the split kernels leave them: each list the
    best of its own blocks (split s owns blocks s, s + S, ...), sorted best first by
    ``(score, -id)``, padded with ``(-inf, -1)``; scores from the integers ``low .. high``, so
    that ties across splits are common."""
    rng = np.random.default_rng(seed)
    km = topk - 1
    cand_s = np.full((splits, rows, hkv, km), -np.inf, np.float32)
    cand_i = np.full((splits, rows, hkv, km), -1, np.int32)
    for sp in range(splits):
        for t in range(rows):
            for r in range(hkv):
                blocks = np.arange(sp, loc_blocks[t], splits)
                scores = rng.integers(low, high + 1, blocks.size).astype(np.float32)
                order = np.lexsort((blocks, -scores))[:km]
                cand_s[sp, t, r, :order.size] = scores[order]
                cand_i[sp, t, r, :order.size] = blocks[order]
    return cand_s, cand_i


def merged_rows(cand_s, cand_i, loc_blocks, topk):
    """The rows the merge must write: the best K-1 of every list's entries ascending, the local
    block, -1 padding."""
    splits, rows, hkv, _ = cand_s.shape
    out = np.full((rows, hkv, topk), -1, np.int32)
    for t in range(rows):
        for r in range(hkv):
            s, i = cand_s[:, t, r].ravel(), cand_i[:, t, r].ravel()
            keep = i >= 0
            s, i = s[keep], i[keep]
            best = np.sort(i[np.lexsort((i, -s))[:topk - 1]])
            out[t, r, :best.size] = best
            out[t, r, best.size] = loc_blocks[t]
    return out


@pytest.mark.parametrize("splits, topk, signed_zeros", [(33, 4, False), (140, 16, False),
                                                         (70, 32, False), (40, 16, True)])
def test_wide_merge_equals_the_one_warp_merge(splits, topk, signed_zeros):
    """Where a lane of the one-warp merge would take more than one list, the merge runs with
    several warps a row (``wide_warps``): the same rows, bit for bit, and the reference's. Ties
    are common; with ``signed_zeros`` the zero scores of every other split are ``-0.0``, which
    tie with ``+0.0`` (to the smaller id) as in ``_core.heap.better``."""
    from msa.cuda.decode import v2_split_index as v2i

    bk, lq, hkv = 16, 1, 2
    lens = np.array([300 * bk + 5, 40 * bk + 1], np.int32)  # 2 requests
    rows = lens.size * lq
    pos = np.repeat(lens, lq) - np.tile(np.arange(lq, 0, -1), lens.size)
    loc = pos // bk
    cand_s, cand_i = split_lists(splits, rows, hkv, topk, loc, seed=splits + topk,
                                 high=0 if signed_zeros else 4)
    if signed_zeros:  # most of the best are zeros: the row is decided among them by id
        odd = cand_s[1::2]
        odd[odd == 0] = -0.0
        assert np.signbit(cand_s[cand_s == 0]).any() and (~np.signbit(cand_s[cand_s == 0])).any()
    want = merged_rows(cand_s, cand_i, loc, topk)
    w = v2i.wide_warps(splits, topk)
    assert w > 1
    capacity = int(lens.max())
    got = {}
    for name, kernel, grid, block in (
            ("one warp", v2i.merge_kernel(bk, topk), -(-rows * hkv // v2i.merge_warps(topk)),
             32 * v2i.merge_warps(topk)),
            ("wide", v2i.merge_kernel_wide(bk, topk, w), rows * hkv, 32 * w)):
        out = np.full((rows, hkv, topk), -7, np.int32)
        kernel[grid, block](cand_s, cand_i, lens, lq, capacity, out)
        got[name] = out
    assert_exact(got["one warp"], want, name="one-warp merge")
    assert_exact(got["wide"], want, name="wide merge")


def test_decode_knobs_parses_its_configs():
    """benchmarks/dev/decode_knobs: a config names planner constants of the decode modules and
    optionally the rung; ``base`` changes nothing."""
    from benchmarks.dev.decode_knobs import parse_config
    from msa.cuda.decode import _plan
    from msa.cuda.decode import v2_split_attention as v2a

    assert parse_config("base") == ([], None)
    settings, version = parse_config("v2_split_attention.STAGES=2, _plan.CTAS_PER_SM=3,version=2")
    assert version == 2
    assert settings == [(v2a, "STAGES", 2), (_plan, "CTAS_PER_SM", 3)]
    with pytest.raises(ModuleNotFoundError):
        parse_config("no_such_module.X=1")


def test_decode_knobs_rebuilds_kernels_after_a_config():
    """decode_knobs drops the kernels the decode factories memoised, which read module
    constants when they build: a kernel built under one config is not reused under the next."""
    from benchmarks.dev.decode_knobs import forget_kernels
    from msa.cuda.decode import v2_split_attention as v2a

    first = v2a.split_kernel(32, 16, 2, 3, False, False, 1)
    assert v2a.split_kernel(32, 16, 2, 3, False, False, 1) is first  # memoised
    forget_kernels()
    assert v2a.split_kernel.cache_info().currsize == 0
    assert v2a.split_kernel(32, 16, 2, 3, False, False, 1) is not first
