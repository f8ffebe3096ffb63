"""msa.torch.PagedKVCache: page bookkeeping, append/decode against the reference, generation
with MSAAttention equal to the layer's prefill, and (GPU) CUDA-graph steps equal to eager ones."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import msa.reference as R  # noqa: E402
from msa.torch import MSAAttention, PagedKVCache, decode_attention_step  # noqa: E402


def small_cache(**kw):
    args = dict(num_pages=12, num_kv_heads=2, head_dim=8, index_dim=8, block_size=4,
                max_requests=3, max_pages_per_request=5, dtype=torch.float64)
    args.update(kw)
    return PagedKVCache(**args)


def test_pages_are_allocated_grown_and_freed():
    c = small_cache()
    a, b = c.add_request(), c.add_request()
    c.reserve([a, b], [5, 1])  # 2 pages and 1 page
    assert c.num_free_pages == 9
    assert (c.block_table[a, :2] >= 0).all() and c.block_table[a, 2] == -1
    c.reserve([a], 3)  # 8 tokens still fit in 2 pages
    assert c.num_free_pages == 9
    c.free_request(a)
    assert c.num_free_pages == 11 and (c.block_table[a] == -1).all()
    with pytest.raises(RuntimeError, match="max_pages_per_request"):
        c.reserve([b], 100)
    with pytest.raises(ValueError, match="not an active request"):
        c.seqlen(a)
    with pytest.raises(ValueError, match="distinct"):
        c.reserve([b, b], 1)
    c.add_request(), c.add_request()
    with pytest.raises(RuntimeError, match="slots"):
        c.add_request()


def assert_equals_the_prefill(got, q, q_idx, k, v, k_idx, cu_q, cu_k, topk):
    """A cache step's ``(o, lse, idx)`` against the prefill functions on the packed sequences
    (the queries their last ``Lq`` positions), not the paged reference the CPU path runs."""
    M = R.block_scores(q_idx.numpy(), k_idx, cu_q, cu_k, 4)
    I = R.select_blocks(M, cu_q, cu_k, topk=topk, block_size=4)
    o2, lse2 = R.sparse_attention(q.numpy(), k, v, I, cu_q, cu_k, 4)
    o, lse, idx = got
    np.testing.assert_array_equal(idx.numpy(), I)
    np.testing.assert_allclose(o.numpy(), o2, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), lse2, rtol=1e-12, atol=1e-12)


def test_append_and_decode_equal_the_reference_on_the_gathered_cache():
    rng = np.random.default_rng(0)
    c = small_cache()
    slots = [c.add_request(), c.add_request()]
    lens = np.array([7, 10])
    cu = np.concatenate([[0], np.cumsum(lens)])
    k, v = (torch.from_numpy(rng.standard_normal((17, 2, 8))) for _ in range(2))
    k_idx = torch.from_numpy(rng.standard_normal((17, 8)))
    c.append(slots, k, v, k_idx, cu_seqlens=cu)
    assert [c.seqlen(s) for s in slots] == [7, 10]
    gk, gv, gi, gcu = c.gather(slots)
    np.testing.assert_array_equal(gk.numpy(), k.numpy())
    np.testing.assert_array_equal(gv.numpy(), v.numpy())
    np.testing.assert_array_equal(gi.numpy(), k_idx.numpy())
    assert gcu.tolist() == cu.tolist()
    # one decode step: two new tokens a request
    kn, vn = (torch.from_numpy(rng.standard_normal((4, 2, 8))) for _ in range(2))
    kin = torch.from_numpy(rng.standard_normal((4, 8)))
    c.append(slots, kn, vn, kin)
    # the whole sequences, packed: each request's prompt, then its two new tokens
    whole = [np.concatenate([x[cu[b]:cu[b + 1]], y[2 * b:2 * b + 2]]) for x, y in
             ((k.numpy(), kn.numpy()), (v.numpy(), vn.numpy()), (k_idx.numpy(), kin.numpy()))
             for b in range(2)]
    kw, vw, iw = (np.concatenate(whole[2 * i:2 * i + 2]) for i in range(3))
    cu_k = np.array([0, 9, 21])
    for got, want in zip(c.gather(slots)[:3], (kw, vw, iw)):
        np.testing.assert_array_equal(got.numpy(), want)
    q = torch.from_numpy(rng.standard_normal((4, 4, 8)))
    q_idx = torch.from_numpy(rng.standard_normal((4, 2, 8)))
    assert_equals_the_prefill(c.decode(slots, q, q_idx, 3), q, q_idx, kw, vw, iw,
                              np.array([0, 2, 4]), cu_k, 3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_freed_requests_pages_do_not_reach_the_next_one(device):
    # pages are handed back without clearing: the stale K, V and K_idx (NaN, infinities) of a
    # freed request past the new one's length must not change its step, bit for bit
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    kw = dict(num_pages=8, num_kv_heads=2, head_dim=16, index_dim=16, block_size=16,
              max_requests=2, max_pages_per_request=4, device=device, dtype=dtype)
    rng = np.random.default_rng(4)

    def rand(*shape):
        return torch.from_numpy(rng.standard_normal(shape)).to(device, dtype)

    used, fresh = PagedKVCache(**kw), PagedKVCache(**kw)
    old = used.add_request()
    bad = torch.tensor([np.nan, np.inf, -np.inf], dtype=torch.float64)
    used.append([old], *(bad[torch.from_numpy(rng.integers(0, 3, s))].to(device, dtype)
                         for s in ((60, 2, 16), (60, 2, 16), (60, 16))))
    used.free_request(old)
    k, v, k_idx = rand(21, 2, 16), rand(21, 2, 16), rand(21, 16)  # 19 tokens, then 2 drafts
    q, q_idx = rand(2, 8, 16), rand(2, 2, 16)
    results = []
    for c in (used, fresh):
        slot = c.add_request()
        c.append([slot], k[:19], v[:19], k_idx[:19])
        c.append([slot], k[19:], v[19:], k_idx[19:])
        results.append(c.decode([slot], q, q_idx, 2))
    assert torch.equal(*(c.block_table[0] for c in (used, fresh)))  # the same pages
    page = int(used.block_table[0, 1])  # the last page: slots 5.. are past the length, stale
    assert not torch.isfinite(used.v_cache[page, :, 5:].float()).any()
    for got, want in zip(*results):
        bits = {torch.bfloat16: torch.int16, torch.float64: torch.int64,
                torch.float32: torch.int32}.get(got.dtype)
        assert torch.equal(got.view(bits) if bits else got, want.view(bits) if bits else want)


def test_generation_with_the_layer_equals_its_prefill():
    """Prefill 9 + 12 tokens into the cache, then decode the next 3 tokens one at a time: each
    step's output equals the layer's forward over the whole sequence at that position."""
    params = R.init_params(16, 4, 2, 8, 8, seed=3)
    layer = MSAAttention.from_params(params, block_size=4, topk=3)
    rng = np.random.default_rng(1)
    prompt, extra = np.array([9, 12]), 3
    full = [torch.from_numpy(rng.standard_normal((n + extra, 16))) for n in prompt]
    c = small_cache(max_pages_per_request=6)
    slots = [c.add_request(), c.add_request()]
    with torch.no_grad():  # the prompts' K, V, K_idx, as a prefill computes them
        xs = torch.cat([f[:n] for f, n in zip(full, prompt)])
        k = (xs @ layer.w_k).view(-1, 2, 8)
        v = (xs @ layer.w_v).view(-1, 2, 8)
        c.append(slots, k, v, xs @ layer.w_k_idx, cu_seqlens=np.concatenate([[0], np.cumsum(prompt)]))
    for step in range(extra):
        x = torch.stack([f[n + step] for f, n in zip(full, prompt)])  # [B*1, d_model]
        out, idx = decode_attention_step(layer, x, c, slots)
        for b in range(2):
            n = int(prompt[b]) + step + 1
            want = layer(full[b][:n], torch.tensor([0, n]))
            np.testing.assert_allclose(out[b].numpy(), want.output[-1].detach().numpy(),
                                       rtol=1e-10, atol=1e-12)
            np.testing.assert_array_equal(idx[b].numpy(), want.block_indices[-1].numpy())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_layer_prefills_a_prompt_in_chunks_then_decodes(device):
    """A prompt of 20 tokens a request through ``decode_attention_step`` in chunks of 12 and 8
    (a chunk above 8 tokens runs as a chunked prefill, ``PagedKVCache.prefill``), then one
    decode step: every output row equals the layer's forward over the sequence so far."""
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    params = R.init_params(32, 4, 2, 16, 16, seed=5)
    layer = MSAAttention.from_params(params, block_size=16, topk=2).to(device, dtype)
    rng = np.random.default_rng(7)
    full = [torch.from_numpy(rng.standard_normal((21, 32))).to(device, dtype) for _ in range(2)]
    c = PagedKVCache(num_pages=8, num_kv_heads=2, head_dim=16, index_dim=16, block_size=16,
                     max_requests=2, max_pages_per_request=2, device=device, dtype=dtype)
    slots = [c.add_request(), c.add_request()]
    tol = dict(rtol=1e-10, atol=1e-12) if device == "cpu" else dict(rtol=0.05, atol=0.05)
    at = 0
    for chunk in (12, 8, 1):
        x = torch.cat([f[at:at + chunk] for f in full])  # [B*chunk, d_model], request-major
        out, idx = decode_attention_step(layer, x, c, slots)
        at += chunk
        for b in range(2):
            want = layer(full[b][:at], torch.tensor([0, at], dtype=torch.int32))
            got = out[b * chunk:(b + 1) * chunk]
            np.testing.assert_allclose(got.float().cpu().numpy(),
                                       want.output[-chunk:].detach().float().cpu().numpy(), **tol)
            np.testing.assert_array_equal(idx[b * chunk:(b + 1) * chunk].cpu().numpy(),
                                          want.block_indices[-chunk:].cpu().numpy())
    assert [c.seqlen(s) for s in slots] == [21, 21]


def test_prefill_with_ragged_chunks_equals_the_reference():
    rng = np.random.default_rng(3)
    c = small_cache()
    slots = [c.add_request(), c.add_request()]
    new = np.array([6, 11])  # new tokens a request, on top of 3 and 0 cached ones
    cached = [rng.standard_normal(s) for s in ((3, 2, 8), (3, 2, 8), (3, 8))]
    c.append([slots[0]], *(torch.from_numpy(x) for x in cached))
    cu = np.concatenate([[0], np.cumsum(new)])
    chunk = [rng.standard_normal(s) for s in ((17, 2, 8), (17, 2, 8), (17, 8))]
    c.append(slots, *(torch.from_numpy(x) for x in chunk), cu_seqlens=cu)
    q = torch.from_numpy(rng.standard_normal((17, 4, 8)))
    q_idx = torch.from_numpy(rng.standard_normal((17, 2, 8)))
    # the packed sequences: request 0 its 3 cached tokens, then 6 new; request 1 11 new
    kw, vw, iw = (np.concatenate([a, b]) for a, b in zip(cached, chunk))
    assert_equals_the_prefill(c.prefill(slots, q, q_idx, 2, cu_seqlens=cu), q, q_idx, kw, vw,
                              iw, cu, np.array([0, 9, 20]), 2)
    with pytest.raises(ValueError, match="cu_seqlens"):
        c.prefill(slots, q, q_idx, 2, cu_seqlens=[0, 5, 16])


@pytest.mark.gpu
def test_captured_steps_equal_eager_steps_bitwise():
    rng = np.random.default_rng(2)
    kw = dict(num_pages=80, num_kv_heads=4, head_dim=128, index_dim=128, block_size=128,
              max_requests=4, max_pages_per_request=20, device="cuda", dtype=torch.bfloat16)
    caches = [PagedKVCache(**kw), PagedKVCache(**kw)]
    lens = np.array([1000, 1300, 700])

    def bf(*shape):
        return torch.from_numpy(rng.standard_normal(shape)).to("cuda", torch.bfloat16)

    k, v, k_idx = bf(3000, 4, 128), bf(3000, 4, 128), bf(3000, 128)
    slots = []
    for c in caches:
        slots = [c.add_request() for _ in range(3)]
        c.append(slots, k, v, k_idx, cu_seqlens=np.concatenate([[0], np.cumsum(lens)]))
    eager, graph_cache = caches
    graph_cache.reserve(slots, 3 * 2)
    captured = graph_cache.capture(slots, 2, 64, 16)
    for _ in range(3):
        new = [bf(6, 4, 128), bf(6, 4, 128), bf(6, 128)]
        q, q_idx = bf(6, 64, 128), bf(6, 4, 128)
        eager.append(slots, *new)
        o, lse, idx = eager.decode(slots, q, q_idx, 16)
        for dst, src in zip((captured.k, captured.v, captured.k_idx, captured.q, captured.q_idx),
                            (*new, q, q_idx)):
            dst.copy_(src)
        go, glse, gidx = captured.replay()
        torch.cuda.synchronize()
        assert torch.equal(gidx, idx)
        assert torch.equal(go.view(torch.int16), o.view(torch.int16))
        assert torch.equal(glse, lse)


def test_the_layer_takes_a_decode_step_up_to_msa_cuda_decodes_limit():
    from msa.cuda import decode as gpu
    from msa.torch import cache as cache_module

    assert cache_module._MAX_DECODE_QUERIES == gpu.MAX_QUERIES


def test_a_refused_layer_step_leaves_the_cache_as_it_was():
    """``MSAAttention.decode`` checks what the step would refuse before it appends: a ``topk``
    above the reference's ``max(NB, 64)`` on the lengths after the append, a layer whose
    block size is not the cache's; slots are integers (no bool read as slot 1)."""
    c = small_cache()
    slots = [c.add_request(), c.add_request()]
    x = torch.randn(2, 16, dtype=torch.float64)
    layer = MSAAttention(16, 4, 2, 8, 8, block_size=4, topk=2, dtype=torch.float64)
    layer.decode(x, c, slots)
    for bad, exc, match in [
            (MSAAttention(16, 4, 2, 8, 8, block_size=4, topk=65, dtype=torch.float64),
             ValueError, r"^topk must be in \[1, max\(NB, 64\)\] = \[1, 64\]"),
            (MSAAttention(16, 4, 2, 8, 8, block_size=8, topk=2, dtype=torch.float64),
             ValueError, r"^cache must have the layer's block_size 8, got 4")]:
        bad.load_state_dict(layer.state_dict())
        with pytest.raises(exc, match=match):
            bad.decode(x, c, slots)
        assert [c.seqlen(s) for s in slots] == [1, 1]
    with pytest.raises(TypeError, match="^slot must be an integer, got bool"):
        c.append([True, 0], *(torch.zeros(2, 2, 8, dtype=torch.float64),) * 2,
                  torch.zeros(2, 8, dtype=torch.float64))
    assert [c.seqlen(s) for s in slots] == [1, 1]
