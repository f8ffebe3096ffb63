"""Bad input to msa.torch's layer and paged cache: a TypeError or ValueError naming the argument,
raised before anything is allocated or changed (the audit's F6-F10, F13, F15)."""

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import msa.reference as R  # noqa: E402
from msa.torch import MSAAttention, PagedKVCache, decode_attention_step  # noqa: E402

LAYER = (32, 2, 1, 16, 16)  # d_model, Hq, Hkv, D, Didx
CACHE = (4, 1, 16, 16)  # num_pages, Hkv, D, Didx

# a CUDA device this torch cannot use: "cuda" without a GPU, one index past the last with one
BAD_CUDA = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


def layer(**kw):
    return MSAAttention(*LAYER, **{"block_size": 16, "topk": 2, **kw})


def cache(**kw):
    return PagedKVCache(*CACHE, **{"block_size": 16, "dtype": torch.float32,
                                   "max_pages_per_request": 4, **kw})


@pytest.mark.parametrize("device, match", [
    (BAD_CUDA, "device='cuda"), ("gpu0", "device must be"), ("mps", "device must be of type"),
])
def test_f6_layer_device(device, match):
    with pytest.raises(ValueError, match=match):
        layer(device=device)


@pytest.mark.parametrize("device, match", [
    (BAD_CUDA, "device='cuda"), ("gpu0", "device must be"), ("meta", "device must be of type"),
])
def test_f7_cache_device(device, match):
    with pytest.raises(ValueError, match=match):
        cache(device=device)


def _state(c):
    """Everything a call may change: host mirrors, the device copies, the pages' contents."""
    return ([c.seqlen(s) for s in np.nonzero(c._active)[0]], c.num_free_pages,
            c._table.copy(), c._pages.copy(), c.block_table.clone(), c.seqlens.clone(),
            c.k_cache.clone(), c.v_cache.clone(), c.k_idx_cache.clone())


def _rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def _kv(t=5, d=16, dtype=torch.float32):
    return _rand(t, 1, d, dtype=dtype), _rand(t, 1, d, dtype=dtype), _rand(t, 16, dtype=dtype)


# (call on (cache, slot a, slot b), error, match): every argument of every method that changes
# the cache, plus decode (which must not change it either)
MUTATIONS = {
    "append: k of the wrong D (the audit's F8)": (
        lambda c, a, b: c.append([a], _rand(5, 1, 8), _rand(5, 1, 8), _rand(5, 16)),
        ValueError, "k must have shape"),
    "append: k of the wrong dtype": (
        lambda c, a, b: c.append([a], *_kv(dtype=torch.float64)), TypeError, "k must have"),
    "append: int k": (
        lambda c, a, b: c.append([a], torch.ones(5, 1, 16, dtype=torch.int32), *_kv()[1:]),
        TypeError, "k must have a float dtype"),
    "append: numpy k": (
        lambda c, a, b: c.append([a], _kv()[0].numpy(), *_kv()[1:]), TypeError,
        "k must be a torch.Tensor"),
    "append: v of other rows": (
        lambda c, a, b: c.append([a], _kv()[0], _rand(4, 1, 16), _kv()[2]), ValueError,
        "v must have shape"),
    "append: k_idx of the wrong Didx": (
        lambda c, a, b: c.append([a], *_kv()[:2], _rand(5, 8)), ValueError,
        "k_idx must have shape"),
    "append: float cu_seqlens": (
        lambda c, a, b: c.append([a, b], *_kv(), cu_seqlens=[0, 2.0, 5]), TypeError,
        "cu_seqlens must hold integers"),
    "append: cu_seqlens of other B": (
        lambda c, a, b: c.append([a, b], *_kv(), cu_seqlens=[0, 5]), ValueError,
        r"cu_seqlens must be \[B\+1\]"),
    "append: rows not a multiple of B": (
        lambda c, a, b: c.append([a, b], *_kv()), ValueError, "k must have a multiple of B"),
    "append: an inactive slot": (
        lambda c, a, b: c.append([a, 2], *_kv(6)), ValueError, "slot 2 is not an active"),
    "append: pages run out": (
        lambda c, a, b: c.append([a], *_kv(70)), RuntimeError, "max_pages_per_request"),
    "reserve: float tokens": (
        lambda c, a, b: c.reserve([a], 2.5), TypeError, "tokens must be an integer"),
    "reserve: negative tokens": (
        lambda c, a, b: c.reserve([a, b], [-20, 3]), ValueError, r"tokens\[0\] must be"),
    "reserve: tokens of other B": (
        lambda c, a, b: c.reserve([a, b], np.array([1, 2, 3])), ValueError,
        "tokens must have shape"),
    "reserve: tokens past int32": (
        lambda c, a, b: c.reserve([a], 2**40), ValueError, "tokens must be in"),
    "decode: q of the wrong dtype": (
        lambda c, a, b: c.decode([a], _rand(1, 2, 16, dtype=torch.float64), _rand(1, 1, 16), 2),
        TypeError, "q must have the cache's dtype"),
    "decode: q_idx of the wrong Hkv": (
        lambda c, a, b: c.decode([a], _rand(1, 2, 16), _rand(1, 2, 16), 2), ValueError,
        "q_idx must have shape"),
    "decode_attention_step: x of the wrong d_model": (
        lambda c, a, b: decode_attention_step(layer(dtype=torch.float32), _rand(1, 8), c, [a]),
        ValueError, "x must have shape"),
    "decode_attention_step: a layer of other heads": (
        lambda c, a, b: decode_attention_step(MSAAttention(32, 4, 2, 16, 16, block_size=16,
                                                           dtype=torch.float32), _rand(1, 32),
                                              c, [a]),
        ValueError, "cache must have the layer's"),
    "decode_attention_step: a float64 layer": (
        lambda c, a, b: decode_attention_step(layer(dtype=torch.float64),
                                              _rand(1, 32, dtype=torch.float64), c, [a]),
        TypeError, "cache must have the layer's dtype"),
    "decode_attention_step: rows not a multiple of B": (
        lambda c, a, b: decode_attention_step(layer(dtype=torch.float32), _rand(3, 32), c,
                                              [a, b]),
        ValueError, "x must have B\\*Lq rows"),
}


@pytest.mark.parametrize("call, error, match", MUTATIONS.values(), ids=MUTATIONS.keys())
def test_f8_a_failed_call_changes_nothing(call, error, match):
    c = cache(max_requests=3)  # slot 2 is never added
    a, b = c.add_request(), c.add_request()
    c.append([a, b], *_kv(), cu_seqlens=[0, 3, 5])  # some content to keep
    before = _state(c)
    with pytest.raises(error, match=match):
        call(c, a, b)
    for got, want in zip(_state(c), before):
        if isinstance(got, torch.Tensor):
            assert torch.equal(got, want)
        else:
            np.testing.assert_array_equal(got, want)
    c.append([a], *_kv())  # and the cache still works
    assert (c.seqlen(a), c.seqlen(b), c.num_free_pages) == (8, 2, 2)


@pytest.mark.parametrize("kw, error, match", [
    (dict(dtype=torch.int32), TypeError, "dtype must be a torch float dtype"),
    (dict(dtype=np.float32), TypeError, "dtype must be a torch float dtype"),
    (dict(dtype=torch.bfloat16), TypeError, "dtype must be float16, float32 or float64"),
    (dict(num_pages=10**12), ValueError, "num_pages must be in"),
    (dict(num_pages=0), ValueError, "num_pages must be"),
    (dict(block_size=2**40), ValueError, "block_size must be in"),
    (dict(block_size=16.0), TypeError, "block_size must be an integer"),
    (dict(max_requests=True), TypeError, "max_requests must be an integer"),
    (dict(max_pages_per_request=2**28), ValueError, "max_pages_per_request \\* block_size"),
    (dict(head_dim=-1), ValueError, "head_dim must be"),
], ids=["int32", "numpy dtype", "bf16 on the CPU", "num_pages 10**12", "num_pages 0",
        "block_size 2**40", "block_size 16.0", "max_requests True", "lengths past int32",
        "head_dim -1"])
def test_f9_cache_sizes_and_dtype(kw, error, match):
    args = dict(zip(("num_pages", "num_kv_heads", "head_dim", "index_dim"), CACHE))
    with pytest.raises(error, match=match):
        PagedKVCache(**{**args, "block_size": 16, "dtype": torch.float32, **kw})


@pytest.mark.parametrize("name, value, error", [
    ("warmup", "no", TypeError), ("warmup", 0, TypeError), ("warmup", None, TypeError),
    ("main_backward", "fast", ValueError), ("main_backward", None, ValueError),
    ("main_backward_partials", "float16", ValueError),
    ("main_backward_partials", torch.bfloat16, ValueError),
])
@pytest.mark.parametrize("when", ["construction", "set later"])
def test_f10_flags_are_checked_when_set(name, value, error, when):
    with pytest.raises(error, match=name):
        if when == "construction":
            layer(**{name: value})
        else:
            setattr(layer(), name, value)


def test_f10_good_flags_set_later_take_effect():
    m = layer(warmup=np.bool_(True))
    assert m.warmup is True
    m.warmup, m.main_backward, m.main_backward_partials = False, "torch", "bfloat16"
    assert (m.warmup, m.main_backward, m.main_backward_partials) == (False, "torch", "bfloat16")
    assert "main_backward_partials=bfloat16" in repr(m)


def _params(**change):
    """``msa.reference`` float32 weights with fields reassigned after ``MSAParams`` checked them
    (a dataclass's fields may be; ``dataclasses.replace`` would check them again)."""
    p = R.init_params(*LAYER, dtype=np.float32)
    for name, fn in change.items():
        setattr(p, name, fn(getattr(p, name)))
    return p


@pytest.mark.parametrize("params, error, match", [
    (_params(w_q=lambda w: w.astype(np.float64)), TypeError, "w_k must have w_q's dtype"),
    (_params(w_k=lambda w: w.astype(np.int32)), TypeError, "w_k must have w_q's dtype"),
    (_params(**{n: (lambda w: w.astype(np.int32)) for n in
                ("w_q", "w_k", "w_v", "w_o", "w_q_idx", "w_k_idx")}), TypeError, "w_q must have"),
    (_params(w_k=lambda w: w[:, :8]), ValueError, "w_k must have shape"),
    (_params(w_o=lambda w: w[:, :16]), ValueError, "w_o must have shape"),
    (_params(w_q_idx=lambda w: w[:16]), ValueError, "w_q_idx must have shape"),
    (dataclasses.asdict(R.init_params(*LAYER)), TypeError, "params must be"),
], ids=["mixed dtypes", "int32 w_k", "all int32", "w_k [:, :8]", "w_o [:, :16]",
        "w_q_idx [:16]", "a dict"])
def test_f13_from_params_checks_the_weights(params, error, match):
    with pytest.raises(error, match=match):
        MSAAttention.from_params(params, block_size=16, topk=2)


def test_f13_from_params_keeps_the_weights():
    p = _params(w_v=lambda w: w[::-1])  # a reversed view: copied, not refused
    m = MSAAttention.from_params(p, block_size=16, topk=2)
    assert m.w_q.dtype == torch.float32
    np.testing.assert_array_equal(m.w_v.detach().numpy(), p.w_v)


@pytest.mark.parametrize("name, value, error", [
    ("process_group", "abc", TypeError), ("process_group", 0, TypeError),
    ("cp_chunk_size", -5, ValueError), ("cp_chunk_size", 0, ValueError),
    ("cp_chunk_size", 2.5, TypeError), ("cp_chunk_size", True, TypeError),
])
@pytest.mark.parametrize("when", ["construction", "set later"])
def test_f15_context_parallel_arguments(name, value, error, when):
    with pytest.raises(error, match=name):
        if when == "construction":
            layer(**{name: value})
        else:
            setattr(layer(), name, value)


@pytest.mark.parametrize("name, value, error", [
    ("block_size", 16.5, TypeError), ("block_size", 0, ValueError),
    ("block_size", 2**40, ValueError), ("topk", 0, ValueError), ("topk", "3", TypeError),
])
def test_block_size_and_topk_set_later(name, value, error):
    m = layer(dtype=torch.float64)
    with pytest.raises(error, match=name):
        setattr(m, name, value)
    assert (m.block_size, m.topk) == (16, 2)
    x = torch.randn(20, 32, dtype=torch.float64)
    assert m(x, [0, 20]).block_indices.shape == (20, 1, 2)  # the layer still runs
