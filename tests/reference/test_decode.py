"""msa.reference.decode (docs/design.md §8): the paged cache, append, gather, and the decode step.

The decode step is defined as the prefill reference on the gathered sequences, so the tests here
check the cache plumbing (pages out of order, shared unused entries, NaN in every slot no token
owns), the property "append then decode equals a prefill of the whole sequence, last Lq rows",
and the named errors. The caches come from ``tests.paged_cases.paged_problem``, which builds
them through ``append_to_cache``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from msa.reference import attention, decode, index, select
from msa.testing.strategies import offsets
from tests.paged_cases import paged_problem, prefill_last_rows


def test_gather_returns_the_appended_sequences_from_shuffled_pages():
    p = paged_problem([1, 16, 17, 40], 1, bk=16, seed=1)
    k, v, k_idx, cu_k = decode.gather_cache(*p.cache)
    assert cu_k.dtype == np.int32 and cu_k.tolist() == p.cu_k.tolist()
    np.testing.assert_array_equal(k, p.k)
    np.testing.assert_array_equal(v, p.v)
    np.testing.assert_array_equal(k_idx, p.k_idx)


def test_append_one_token_at_a_time_equals_append_at_once():
    p = paged_problem([5, 33], 1, bk=8, seed=2)
    k_cache = np.full_like(p.k_cache, np.nan)
    v_cache = np.full_like(p.v_cache, np.nan)
    i_cache = np.full_like(p.k_idx_cache, np.nan)
    lens = np.zeros(2, dtype=np.int32)
    for step in range(33):
        grow = (np.array([5, 33]) > step).astype(np.int32)
        lens = lens + grow
        rows = [p.cu_k[b] + step for b in range(2) if grow[b]]
        cu = offsets(grow)
        decode.append_to_cache(p.k[rows], p.v[rows], p.k_idx[rows], k_cache, v_cache, i_cache,
                               p.block_table, lens, cu_seqlens=cu)
    for got, want in ((k_cache, p.k_cache), (v_cache, p.v_cache), (i_cache, p.k_idx_cache)):
        np.testing.assert_array_equal(got, want)  # NaN where no token is, in both


def test_append_rejects_two_tokens_on_one_slot():
    p = paged_problem([4, 4], 1, bk=4, seed=3, spare_pages=0)
    table = p.block_table.copy()
    table[1, 0] = table[0, 0]  # both requests' block 0 on one page
    with pytest.raises(ValueError, match="two new tokens to one cache slot"):
        decode.append_to_cache(p.k[:2], p.v[:2], p.k_idx[:2], p.k_cache, p.v_cache,
                               p.k_idx_cache, table, p.cache_seqlens)


def test_shared_prefix_pages_are_read_by_every_request():
    # Two requests whose first block is one page (prefix sharing): reading is fine.
    p = paged_problem([20, 20], 1, bk=16, seed=4)
    table = p.block_table.copy()
    table[1, 0] = table[0, 0]
    k, _, _, _ = decode.gather_cache(p.k_cache, p.v_cache, p.k_idx_cache, table, p.cache_seqlens)
    np.testing.assert_array_equal(k[20:36], p.k[0:16])


# -- the decode step ----------------------------------------------------------------------------

CASES = {
    # seqlens (ragged: below one block, exact multiples of Bk, one over), Lq, G, Hkv, topk
    "Lq1-G1": ([3, 16, 17], 1, 1, 2, 3),
    "Lq2-G2": ([16, 32, 33], 2, 2, 2, 4),
    "Lq3-G4": ([8, 48], 3, 4, 1, 2),
    "Lq4-G8": ([4, 17, 64], 4, 8, 1, 5),
    "Lq5-G16": ([65, 5], 5, 16, 1, 3),
    "Lq6-topk-above-blocks": ([31, 6], 6, 2, 2, 9),
    "Lq7-K1": ([47, 7], 7, 1, 3, 1),
    "Lq8-G16": ([8, 96, 9], 8, 16, 1, 6),
}


@pytest.mark.parametrize("seqlens,lq,g,hkv,topk", CASES.values(), ids=CASES.keys())
def test_append_then_decode_equals_prefill_of_the_whole_sequence(seqlens, lq, g, hkv, topk):
    p = paged_problem(seqlens, lq, hq=g * hkv, hkv=hkv, bk=16, topk=topk, seed=len(seqlens) + lq)
    o, lse, I = decode.decode_step(p.q, p.q_idx, *p.cache, 16, topk)
    o_ref, lse_ref, I_ref = prefill_last_rows(p)
    assert I.dtype == np.int32 and I.shape == (len(seqlens) * lq, hkv, topk)
    np.testing.assert_array_equal(I, I_ref)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-12)


def test_decode_step_is_its_two_halves():
    p = paged_problem([40, 9], 3, hq=8, hkv=2, bk=8, topk=3, seed=9, integer_index=True)
    o, lse, I = decode.decode_step(p.q, p.q_idx, *p.cache, 8, 3, scale=0.3, index_scale=0.7)
    I2 = decode.decode_block_indices(p.q_idx, p.k_idx_cache, p.block_table, p.cache_seqlens, 8,
                                     3, index_scale=0.7)
    o2, lse2 = decode.decode_attention(p.q, p.k_cache, p.v_cache, I2, p.block_table,
                                       p.cache_seqlens, 8, scale=0.3)
    np.testing.assert_array_equal(I, I2)
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(lse, lse2)


def test_every_block_selected_is_dense_decode():
    # topk >= blocks: the selection is every visible block, so sparse is dense attention.
    p = paged_problem([50, 23], 2, hq=4, hkv=2, bk=8, topk=7, seed=5)
    o, lse, _ = decode.decode_step(p.q, p.q_idx, *p.cache, 8, 7)
    cu_q = np.arange(3) * 2
    o_d, lse_d = attention.dense_attention(p.q, p.k, p.v, cu_q, p.cu_k)
    np.testing.assert_allclose(o, o_d, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_d, rtol=1e-12, atol=1e-12)


@given(lens=st.lists(st.integers(1, 70), min_size=1, max_size=3), lq=st.integers(1, 8),
       g=st.sampled_from([1, 2, 4, 8, 16]), hkv=st.integers(1, 2), topk=st.integers(1, 6),
       bk=st.sampled_from([4, 8, 16]), seed=st.integers(0, 2**31 - 1))
@example(lens=[1], lq=1, g=1, hkv=1, topk=1, bk=4, seed=0)
def test_decode_equals_prefill_property(lens, lq, g, hkv, topk, bk, seed):
    lens = [max(n, lq) for n in lens]
    p = paged_problem(lens, lq, hq=g * hkv, hkv=hkv, d=4, d_idx=4, bk=bk, topk=topk, seed=seed,
                      integer_index=seed % 2 == 0)
    o, lse, I = decode.decode_step(p.q, p.q_idx, *p.cache, bk, topk)
    o_ref, lse_ref, I_ref = prefill_last_rows(p)
    np.testing.assert_array_equal(I, I_ref)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-12)


def test_prefill_chunk_equals_the_whole_sequence_prefill_on_its_rows():
    # chunks of 5 and 17 new tokens (the second one over a page boundary), already appended
    p = paged_problem([30, 40], 1, hq=4, hkv=2, bk=8, topk=3, seed=12)
    chunk = np.array([5, 17])
    rows = np.concatenate([np.arange(p.cu_k[b + 1] - chunk[b], p.cu_k[b + 1]) for b in range(2)])
    o, lse, I = decode.prefill_chunk(p.q_full[rows], p.q_idx_full[rows], *p.cache,
                                     offsets(chunk), 8, 3)
    cu = p.cu_k
    M = index.block_scores(p.q_idx_full, p.k_idx, cu, cu, 8)
    I_full = select.select_blocks(M, cu, cu, topk=3, block_size=8)
    o_full, lse_full = attention.sparse_attention(p.q_full, p.k, p.v, I_full, cu, cu, 8)
    np.testing.assert_array_equal(I, I_full[rows])
    np.testing.assert_allclose(o, o_full[rows], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_full[rows], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="more queries than keys"):
        decode.prefill_chunk(p.q_full[:41], p.q_idx_full[:41], *p.cache, np.array([0, 41, 41]),
                             8, 3)


# -- inputs users get wrong ---------------------------------------------------------------------

def _step(p, **change):
    args = dict(q=p.q, q_idx=p.q_idx, k_cache=p.k_cache, v_cache=p.v_cache,
                k_idx_cache=p.k_idx_cache, block_table=p.block_table,
                cache_seqlens=p.cache_seqlens, block_size=p.bk, topk=p.topk)
    args.update(change)
    kw = {k: args.pop(k) for k in ("scale", "index_scale") if k in args}
    return decode.decode_step(*args.values(), **kw)


BAD = {
    "block_size-not-page-size": (dict(block_size=8), ValueError, "block_size must equal"),
    "block_size-float": (dict(block_size=16.0), TypeError, "block_size"),
    "topk-0": (dict(topk=0), ValueError, "topk"),
    "topk-huge": (dict(topk=10**9), ValueError, "topk"),
    "q-rows-not-multiple-of-B": (dict(q="drop"), ValueError, "q must have B \\* Lq rows"),
    "q-idx-rows": (dict(q_idx="drop"), ValueError, "q_idx must have"),
    "q-dtype": (dict(q="f32"), TypeError, "q must have the dtype"),
    "page-out-of-range": (dict(block_table="bad-page"), ValueError, "block_table\\[1, 0\\]"),
    "seqlen-over-capacity": (dict(cache_seqlens="over"), ValueError, "cache_seqlens\\[0\\]"),
    "seqlen-below-Lq": (dict(cache_seqlens="short"), ValueError, "cache_seqlens\\[1\\]"),
    "table-float": (dict(block_table="float"), TypeError, "block_table"),
    "v-cache-shape": (dict(v_cache="short"), ValueError, "v_cache"),
    "k-idx-cache-pages": (dict(k_idx_cache="short"), ValueError, "k_idx_cache"),
    "gqa": (dict(q="heads"), ValueError, "multiple of kv heads"),
    "scale-negative": (dict(scale=-1.0), ValueError, "scale"),
    "index-scale-nan": (dict(index_scale=float("nan")), ValueError, "index_scale"),
}


@pytest.mark.parametrize("change,exc,match", BAD.values(), ids=BAD.keys())
def test_decode_step_rejects_bad_input(change, exc, match):
    p = paged_problem([20, 5], 2, hq=4, hkv=2, bk=16, topk=3, seed=6)
    fixes = {
        "drop": lambda x: x[:-1],
        "f32": lambda x: x.astype(np.float32),
        "heads": lambda x: x[:, :3],
        "short": lambda x: x[:-1] if x.ndim == 3 else x[:, :1],
        "float": lambda x: x.astype(np.float64),
    }
    for name, value in list(change.items()):
        if value == "bad-page":
            t = p.block_table.copy()
            t[1, 0] = p.k_cache.shape[0]
            change[name] = t
        elif value == "over":
            change[name] = np.array([p.block_table.shape[1] * 16 + 1, 5], dtype=np.int32)
        elif value == "short" and name == "cache_seqlens":
            change[name] = np.array([20, 1], dtype=np.int32)
        elif isinstance(value, str):
            change[name] = fixes[value](getattr(p, name))
    with pytest.raises(exc, match=match):
        _step(p, **change)


def test_positional_scale_is_an_error():
    p = paged_problem([20], 1, seed=7)
    with pytest.raises(TypeError):
        decode.decode_step(p.q, p.q_idx, *p.cache, p.bk, p.topk, 0.5)


def test_append_rejects_bad_input():
    p = paged_problem([6, 6], 2, bk=4, seed=8)
    with pytest.raises(ValueError, match="multiple of B"):
        decode.append_to_cache(p.k[:3], None, None, p.k_cache, p.v_cache, p.k_idx_cache,
                               p.block_table, p.cache_seqlens)
    with pytest.raises(ValueError, match="cache_seqlens counts the new tokens"):
        decode.append_to_cache(p.k[:4], None, None, p.k_cache, p.v_cache, p.k_idx_cache,
                               p.block_table, np.array([1, 6], np.int32),
                               cu_seqlens=np.array([0, 2, 4]))
    with pytest.raises(ValueError, match="k must have shape"):
        decode.append_to_cache(p.k[:2, :1], None, None, p.k_cache, p.v_cache, p.k_idx_cache,
                               p.block_table, p.cache_seqlens)
    with pytest.raises(TypeError, match="k_cache"):
        decode.append_to_cache(p.k[:2].astype(np.float32), None, None, p.k_cache, p.v_cache,
                               p.k_idx_cache, p.block_table, p.cache_seqlens)
    with pytest.raises(ValueError, match="at least one"):
        decode.append_to_cache(None, None, None, p.k_cache, p.v_cache, p.k_idx_cache,
                               p.block_table, p.cache_seqlens)
    frozen = np.array(p.v_cache)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="^v_cache must be writeable"):
        decode.append_to_cache(p.k[:2], p.v[:2], None, p.k_cache, frozen, p.k_idx_cache,
                               p.block_table, p.cache_seqlens)


def test_prefill_chunk_names_the_argument_that_is_wrong():
    """The chunk's q and q_idx are checked against the cache before anything is gathered, so
    the error names them (not the gathered k the user never passed); offsets may be a list."""
    p = paged_problem([20, 9], 1, hq=4, hkv=2, bk=16, topk=3, seed=11)
    args = (p.q, p.q_idx, *p.cache)
    cu = np.array([0, 1, 2])
    for bad, exc, match in [
            ((p.q.astype(np.float32),) + args[1:], TypeError,
             r"^q must have the dtype of the cache"),
            ((p.q[..., :8],) + args[1:], ValueError, r"^q must have shape"),
            (args[:1] + (p.q_idx[:, :1],) + args[2:], ValueError, r"^q_idx must have shape"),
            (args[:2] + (None,) + args[3:], TypeError, r"^k_cache must be an array"),
            ((None,) + args[1:], TypeError, r"^q must be an array")]:
        with pytest.raises(exc, match=match):
            decode.prefill_chunk(*bad, cu, p.bk, p.topk)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must have B\+1 = 3 entries"):
        decode.prefill_chunk(*args, np.array([0, 2]), p.bk, p.topk)
    got = decode.prefill_chunk(*args, [0, 1, 2], p.bk, p.topk)
    want = decode.prefill_chunk(*args, cu, p.bk, p.topk)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_decode_functions_name_a_missing_array():
    p = paged_problem([20], 1, seed=12)
    I = np.zeros((1, p.cache[0].shape[1], 1), np.int32)
    with pytest.raises(TypeError, match=r"^q must be an array, got NoneType"):
        decode.decode_attention(None, *p.cache[:2], I, *p.cache[3:], p.bk)
    with pytest.raises(TypeError, match=r"^q_idx must be an array, got NoneType"):
        decode.decode_step(p.q, None, *p.cache, p.bk, p.topk)
    with pytest.raises(TypeError, match=r"^k_idx_cache must be an array, got NoneType"):
        decode.decode_block_indices(p.q_idx, None, *p.cache[3:], p.bk, p.topk)


def test_append_takes_offsets_as_a_list():
    p = paged_problem([6, 6], 2, bk=4, seed=8)
    caches = [np.array(c) for c in p.cache[:3]]
    decode.append_to_cache(p.k[:4], None, None, *caches, p.block_table,
                           np.array([7, 7], np.int32), cu_seqlens=[0, 1, 4])
    want = [np.array(c) for c in p.cache[:3]]
    decode.append_to_cache(p.k[:4], None, None, *want, p.block_table,
                           np.array([7, 7], np.int32), cu_seqlens=np.array([0, 1, 4]))
    np.testing.assert_array_equal(caches[0], want[0])
    with pytest.raises(ValueError, match=r"cu_seqlens must have B\+1 = 3 entries"):
        decode.append_to_cache(p.k[:4], None, None, *caches, p.block_table,
                               np.array([7, 7], np.int32), cu_seqlens=[0, 4])
    with pytest.raises(TypeError, match="cu_seqlens must hold integers"):
        decode.append_to_cache(p.k[:4], None, None, *caches, p.block_table,
                               np.array([7, 7], np.int32), cu_seqlens=[0, 1.0, 4])
