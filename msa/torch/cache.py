"""A paged KV cache for MSA generation in PyTorch (docs/design.md §8): pages, requests, append, decode.

::

    cache = PagedKVCache(num_pages=4096, num_kv_heads=4, head_dim=128, index_dim=128,
                         block_size=128, max_requests=32, max_pages_per_request=512,
                         device="cuda", dtype=torch.bfloat16)
    slots = [cache.add_request() for _ in range(B)]
    cache.append(slots, k, v, k_idx, cu_seqlens=cu)   # the prompts (a prefill's K, V, K_idx)
    o, lse, I = cache.decode(slots, q, q_idx, topk=16)  # after appending the step's tokens
    cache.free_request(slots[0])                         # its pages go back to the pool

The cache owns ``k_cache, v_cache [P, Hkv, Bk, D]``, ``k_idx_cache [P, Bk, Didx]``, the block
table ``[max_requests, max_pages_per_request]`` int32 (-1 where no page is mapped) and the
lengths ``[max_requests]`` int32, on ``device``, and their host mirrors: page allocation is
host bookkeeping (a free list), done in ``reserve`` (``append`` reserves what it needs), and
the device copies are written only there, so that a decode step on reserved pages touches no
host memory. CUDA tensors run ``msa.cuda.decode``; CPU tensors (float16/32/64) the NumPy
reference, with the same results.

For serving with CUDA graphs, ``capture(slots, lq, num_q_heads, topk)`` returns a
:class:`CapturedDecode`: static input buffers for the step's new tokens and queries, and
``replay()``, one graph that advances the lengths by ``lq``, appends the new tokens and runs
the decode step; its outputs equal eager steps bit for bit. Reserve the pages the replays will
need first (``reserve(slots, n_steps * lq)``).

``decode_attention_step(layer, x, cache, slots)`` is what ``MSAAttention`` calls to generate:
the projections of the new tokens, the append, the decode step and the output projection.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from .._checks import (GQA_GROUP_SIZES, INT32_MAX, check_array, check_block_size, check_gqa,
                       check_offsets, check_positive_int, check_scale, check_topk, cu_to_host)
from ..reference import decode as _ref
from .functional import FLOAT_DTYPES, _check_tensor

__all__ = ["CapturedDecode", "PagedKVCache", "decode_attention_step"]


_MAX_DECODE_QUERIES = 8  # msa.cuda.decode.MAX_QUERIES: longer chunks run as a chunked prefill


def _gpu():
    from ..cuda import decode as gpu  # msa.cuda needs numba: imported for CUDA tensors only

    return gpu


def _check_device(device, *, types=("cpu", "cuda")):
    """``device`` as a ``torch.device`` (None stays None), one of ``types``; a CUDA device needs
    a usable GPU. ValueError naming ``device`` otherwise, before anything is allocated (the
    allocator's own error names nothing). Shared with ``MSAAttention`` (layer.py imports it:
    this module is below layer.py)."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device must be a torch.device or a device name such as 'cpu' or "
                         f"'cuda', got {device!r}") from None
    if dev.type not in types:
        raise ValueError(f"device must be of type {' or '.join(map(repr, types))} (CPU tensors "
                         f"run the NumPy reference, CUDA tensors msa.cuda), got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={device!r}, but torch.cuda.is_available() is False (torch "
                f"{torch.__version__} has no CUDA, or no GPU is visible); use device='cpu', which "
                "runs the NumPy reference")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise ValueError(f"device={device!r}, but this torch sees {n} CUDA device(s) "
                             f"(indices 0 to {n - 1})")
    return dev


def _check_dtype(dtype):
    """``dtype`` a torch float dtype or None (torch's default dtype); TypeError otherwise."""
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be a torch float dtype (float16, bfloat16, float32, "
                        f"float64) or None, got {dtype!r}")
    return dtype


class PagedKVCache:
    """Pages of ``block_size`` tokens for up to ``max_requests`` requests (module docstring).

    Args:
        num_pages: P, pages in the pool. num_kv_heads, head_dim, index_dim: Hkv, D, Didx.
        block_size: Bk, tokens a page (= one selectable block). max_requests: rows of the
            block table. max_pages_per_request: its columns (a request's longest context is
            ``max_pages_per_request * Bk`` tokens).
        device, dtype: of the caches (bf16 or fp16 on a GPU for the fast kernels; float32 or
            float64 on the CPU, where the reference runs: it has no bfloat16, so a CPU cache
            must be given another float dtype than the default).

    Raises:
        TypeError/ValueError naming the argument, before anything is allocated: sizes that are
        not positive integers, ``num_pages`` or ``block_size`` past int32 (page ids and
        offsets are int32), ``max_pages_per_request * block_size`` past int32 (lengths are),
        a device this torch cannot use, a dtype that is not a float dtype, bfloat16 on the CPU.
    """

    def __init__(self, num_pages: int, num_kv_heads: int, head_dim: int, index_dim: int, *,
                 block_size: int = 128, max_requests: int = 1, max_pages_per_request: int = 1,
                 device=None, dtype=torch.bfloat16):
        p = check_positive_int("num_pages", num_pages, high=INT32_MAX)  # int32 page ids
        hkv = check_positive_int("num_kv_heads", num_kv_heads)
        d = check_positive_int("head_dim", head_dim)
        d_idx = check_positive_int("index_dim", index_dim)
        bk = check_block_size(block_size)
        max_requests = check_positive_int("max_requests", max_requests, high=INT32_MAX)
        max_pages = check_positive_int("max_pages_per_request", max_pages_per_request,
                                       high=INT32_MAX)
        if max_pages * bk > INT32_MAX:  # cache_seqlens are int32
            raise ValueError(f"max_pages_per_request * block_size (a request's longest context) "
                             f"must be <= {INT32_MAX}, got {max_pages} * {bk} = {max_pages * bk}")
        device, dtype = _check_device(device), _check_dtype(dtype)
        on = (device if device is not None else torch.get_default_device()).type
        if on == "cpu" and (dtype if dtype is not None else torch.get_default_dtype()) \
                == torch.bfloat16:
            raise TypeError(f"dtype must be float16, float32 or float64 for a CPU cache (the NumPy "
                            f"reference runs it and has no bfloat16), got {dtype!r}; bfloat16 "
                            "needs device='cuda'")
        self.block_size, self.max_requests, self.max_pages = bk, max_requests, max_pages
        kw = dict(device=device, dtype=dtype)
        self.k_cache = torch.zeros((p, hkv, bk, d), **kw)
        self.v_cache = torch.zeros((p, hkv, bk, d), **kw)
        self.k_idx_cache = torch.zeros((p, bk, d_idx), **kw)
        dev = self.k_cache.device
        self.block_table = torch.full((self.max_requests, self.max_pages), -1, dtype=torch.int32,
                                      device=dev)
        self.seqlens = torch.zeros(self.max_requests, dtype=torch.int32, device=dev)
        self._table = np.full((self.max_requests, self.max_pages), -1, dtype=np.int32)
        self._lens = np.zeros(self.max_requests, dtype=np.int64)
        self._pages = np.zeros(self.max_requests, dtype=np.int64)  # pages mapped per request
        self._free_pages = list(range(p - 1, -1, -1))  # a stack: page 0 is handed out first
        self._free_slots = list(range(self.max_requests - 1, -1, -1))
        self._active = np.zeros(self.max_requests, dtype=bool)

    # -- requests and pages -------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    def seqlen(self, slot: int) -> int:
        """Tokens in request ``slot``'s cache (host mirror)."""
        return int(self._lens[self._slot(slot)])

    def add_request(self) -> int:
        """A free slot for a new request (length 0, no pages); RuntimeError when all are taken."""
        if not self._free_slots:
            raise RuntimeError(f"all {self.max_requests} request slots are in use")
        slot = self._free_slots.pop()
        self._active[slot] = True
        return slot

    def free_request(self, slot: int) -> None:
        """End request ``slot``: its pages return to the pool, its row of the table to -1."""
        slot = self._slot(slot)
        n = int(self._pages[slot])
        self._free_pages.extend(int(x) for x in self._table[slot, :n][::-1])
        self._table[slot] = -1
        self._lens[slot] = 0
        self._pages[slot] = 0
        self._active[slot] = False
        self._free_slots.append(slot)
        self._upload([slot])

    def reserve(self, slots, tokens) -> None:
        """Map pages so that each request in ``slots`` can take ``tokens`` (an int, or one per
        slot, each in ``[0, 2**31 - 1]``) more tokens; writes the device block table once.
        RuntimeError if the pool or a request's row of the table runs out; nothing is changed
        then, nor on a bad argument (TypeError/ValueError)."""
        slots = self._slots(slots)
        more = self._tokens(tokens, slots.size)
        need = -(-(self._lens[slots] + more) // self.block_size) - self._pages[slots]
        need = np.maximum(need, 0)
        over = np.nonzero(self._pages[slots] + need > self.max_pages)[0]
        if over.size:
            s = int(slots[over[0]])
            raise RuntimeError(f"request {s} would need {int(self._pages[s] + need[over[0]])} "
                               f"pages, more than max_pages_per_request = {self.max_pages}")
        if int(need.sum()) > len(self._free_pages):
            raise RuntimeError(f"the cache needs {int(need.sum())} more pages, "
                               f"{len(self._free_pages)} are free")
        for s, n in zip(slots, need):
            for _ in range(int(n)):
                self._table[s, self._pages[s]] = self._free_pages.pop()
                self._pages[s] += 1
        if need.any():
            self._upload(slots)

    def _upload(self, slots):
        """Host mirrors of the given rows to the device (outside any step: a copy that waits)."""
        rows = torch.as_tensor(np.asarray(slots, dtype=np.int64), device=self.block_table.device)
        self.block_table[rows] = torch.from_numpy(self._table[slots]).to(self.block_table.device)
        self.seqlens[rows] = torch.from_numpy(self._lens[slots].astype(np.int32)).to(
            self.seqlens.device)

    def _slot(self, slot) -> int:
        slot = check_positive_int("slot", slot, low=0, high=self.max_requests - 1)
        if not self._active[slot]:
            raise ValueError(f"slot {slot} is not an active request (add_request first)")
        return slot

    def _slots(self, slots) -> np.ndarray:
        items = (list(slots) if isinstance(slots, (list, tuple))  # no bool -> int on the way
                 else np.atleast_1d(np.asarray(slots)).tolist())
        out = np.array([self._slot(s) for s in items], dtype=np.int64)
        if out.size == 0 or np.unique(out).size != out.size:
            raise ValueError(f"slots must be distinct active requests, got {out.tolist()}")
        return out

    @staticmethod
    def _tokens(tokens, b: int) -> np.ndarray:
        """``reserve``'s ``tokens`` as ``[B]`` int64: an integer, or B of them (a list, tuple
        or integer array), each in ``[0, 2**31 - 1]`` (lengths are int32); no floats, no bools."""
        if isinstance(tokens, numbers.Integral) and not isinstance(tokens, bool):
            return np.full(b, check_positive_int("tokens", tokens, low=0, high=INT32_MAX),
                           dtype=np.int64)
        if isinstance(tokens, (list, tuple)):
            if len(tokens) != b:
                raise ValueError(f"tokens must be an integer or one per slot (B = {b}), got "
                                 f"{len(tokens)} values")
            return np.array([check_positive_int(f"tokens[{i}]", x, low=0, high=INT32_MAX)
                             for i, x in enumerate(tokens)], dtype=np.int64)
        if not (hasattr(tokens, "shape") and hasattr(tokens, "dtype")):
            raise TypeError(f"tokens must be an integer or one per slot, got "
                            f"{type(tokens).__name__} {tokens!r}")
        check_array("tokens", tokens, ndim=1, dtypes=("int",), shape=(b,))
        host = np.asarray(cu_to_host(tokens))
        if host.size and (host.min() < 0 or host.max() > INT32_MAX):
            raise ValueError(f"tokens must be in [0, {INT32_MAX}], got {host.tolist()}")
        return host.astype(np.int64)

    def views(self, slots):
        """``(block_table [B, max_pages], cache_seqlens [B])`` of the requests ``slots``, as the
        decode functions take them (a view for slots ``0..B-1`` in order, a copy otherwise)."""
        slots = self._slots(slots)
        if np.array_equal(slots, np.arange(slots.size)):
            return self.block_table[: slots.size], self.seqlens[: slots.size]
        rows = torch.as_tensor(slots, device=self.block_table.device)
        return self.block_table[rows].contiguous(), self.seqlens[rows].contiguous()

    # -- append, decode, gather ---------------------------------------------------------------
    def _check_new(self, name, x, shape) -> int:
        """``x`` a float tensor of ``shape`` (None: any size) with the cache's dtype and device,
        checked before the cache changes (no silent cast, no copy across devices); its rows."""
        _check_tensor(name, x, len(shape), kind="float")
        check_array(name, x, shape=shape)
        if x.dtype != self.k_cache.dtype:
            raise TypeError(f"{name} must have the cache's dtype {self.k_cache.dtype}, got "
                            f"{x.dtype}")
        if x.device != self.k_cache.device:
            raise ValueError(f"{name} must be on the cache's device {self.k_cache.device}, got "
                             f"{x.device}")
        return int(x.shape[0])

    @staticmethod
    def _new_tokens(slots: np.ndarray, t: int, cu_seqlens):
        """How ``append``'s ``t`` new rows split over the requests ``slots``: ``(n_new [B]
        int64, cu [B+1] int64 or None)``, by ``cu_seqlens [B+1]`` (None: ``t / B`` each)."""
        b = slots.size
        if cu_seqlens is None:
            if t % b:
                raise ValueError(f"k must have a multiple of B = {b} rows when "
                                 f"cu_seqlens is None, got {t}")
            return np.full(b, t // b, dtype=np.int64), None
        cu = check_offsets("cu_seqlens", cu_seqlens, t)  # integers only: no silent cast
        if cu.shape != (b + 1,):
            raise ValueError(f"cu_seqlens must be [B+1] = [{b + 1}] offsets (B = len(slots)), "
                             f"got {cu.tolist()}")
        return np.diff(cu), cu

    def append(self, slots, k, v, k_idx, *, cu_seqlens=None) -> None:
        """Append new tokens ``k, v [T, Hkv, D]``, ``k_idx [T, Didx]`` (request-major over
        ``slots``; ``cu_seqlens [B+1]`` their offsets, None: ``T / B`` each) to the requests'
        caches, reserving pages as needed. The tokens have the cache's dtype and device.

        Every argument is checked before the cache changes: a TypeError/ValueError (or the
        ``RuntimeError`` of ``reserve`` when pages run out) leaves lengths and pages as they
        were."""
        slots = self._slots(slots)
        _, hkv, _, d = self.k_cache.shape
        t = self._check_new("k", k, (None, hkv, d))
        self._check_new("v", v, (t, hkv, d))
        self._check_new("k_idx", k_idx, (t, self.k_idx_cache.shape[2]))
        n_new, cu = self._new_tokens(slots, t, cu_seqlens)
        self.reserve(slots, n_new)
        self._lens[slots] += n_new
        self._upload(slots)
        table, lens = self.views(slots)
        cu_arg = None if cu is None else cu.astype(np.int32)
        if self.k_cache.is_cuda:
            with torch.cuda.device(self.k_cache.device):
                _gpu().append_to_cache(k.contiguous(), v.contiguous(), k_idx.contiguous(),
                                       self.k_cache, self.v_cache, self.k_idx_cache, table, lens,
                                       cu_seqlens=cu_arg)
        else:
            _ref.append_to_cache(k.detach().numpy(), v.detach().numpy(), k_idx.detach().numpy(),
                                 self.k_cache.numpy(), self.v_cache.numpy(),
                                 self.k_idx_cache.numpy(), table.numpy(), lens.numpy(),
                                 cu_seqlens=cu_arg)

    def decode(self, slots, q, q_idx, topk: int, *, scale=None, index_scale=None):
        """The decode step of ``q [B*Lq, Hq, D]``, ``q_idx [B*Lq, Hkv, Didx]``, the last ``Lq``
        positions of each request (append them first): ``(o, lse, block_indices)``. ``q`` and
        ``q_idx`` have the cache's dtype and device; their shapes, ``topk`` and the scales are
        checked by the backend (``msa.cuda.decode`` or the reference), with named errors."""
        _, hkv, _, d = self.k_cache.shape
        self._check_new("q", q, (None, None, d))
        self._check_new("q_idx", q_idx, (None, hkv, self.k_idx_cache.shape[2]))
        table, lens = self.views(slots)
        if self.k_cache.is_cuda:
            with torch.cuda.device(self.k_cache.device):
                return _gpu().decode_step(q.contiguous(), q_idx.contiguous(), self.k_cache,
                                          self.v_cache, self.k_idx_cache, table, lens,
                                          self.block_size, topk, scale=scale,
                                          index_scale=index_scale)
        o, lse, idx = _ref.decode_step(q.detach().numpy(), q_idx.detach().numpy(),
                                       self.k_cache.numpy(), self.v_cache.numpy(),
                                       self.k_idx_cache.numpy(), table.numpy(), lens.numpy(),
                                       self.block_size, topk, scale=scale,
                                       index_scale=index_scale)
        return (torch.from_numpy(o).to(q.dtype), torch.from_numpy(lse),
                torch.from_numpy(idx))

    def prefill(self, slots, q, q_idx, topk: int, *, cu_seqlens=None, scale=None,
                index_scale=None):
        """Chunked prefill into the cache: ``q [T, Hq, D]``, ``q_idx [T, Hkv, Didx]`` are the last
        positions of each request (append them first), any number a request, ``cu_seqlens
        [B+1]`` their offsets over ``slots`` (None: ``T / B`` each). Returns ``(o, lse,
        block_indices)`` as ``decode``. On a GPU ``msa.cuda.decode.prefill_chunk``: the fused
        index + top-k on the gathered index keys, the KV-outer attention reading K and V from
        their pages; on the CPU the reference's ``prefill_chunk``."""
        _, hkv, _, d = self.k_cache.shape
        slots = self._slots(slots)
        t = self._check_new("q", q, (None, None, d))
        self._check_new("q_idx", q_idx, (t, hkv, self.k_idx_cache.shape[2]))
        n_new, cu = self._new_tokens(slots, t, cu_seqlens)
        cu_q = (np.concatenate([[0], np.cumsum(n_new)]) if cu is None else cu).astype(np.int32)
        table, lens = self.views(slots)
        if self.k_cache.is_cuda:
            with torch.cuda.device(self.k_cache.device):
                return _gpu().prefill_chunk(q.contiguous(), q_idx.contiguous(), self.k_cache,
                                            self.v_cache, self.k_idx_cache, table, lens, cu_q,
                                            self.block_size, topk, scale=scale,
                                            index_scale=index_scale)
        o, lse, idx = _ref.prefill_chunk(q.detach().numpy(), q_idx.detach().numpy(),
                                         self.k_cache.numpy(), self.v_cache.numpy(),
                                         self.k_idx_cache.numpy(), table.numpy(), lens.numpy(),
                                         cu_q, self.block_size, topk, scale=scale,
                                         index_scale=index_scale)
        return (torch.from_numpy(o).to(q.dtype), torch.from_numpy(lse),
                torch.from_numpy(idx))

    def gather(self, slots):
        """``(k, v, k_idx, cu_seqlens_k)``: the requests' caches as packed sequences."""
        table, lens = self.views(slots)
        if self.k_cache.is_cuda:
            with torch.cuda.device(self.k_cache.device):
                return _gpu().gather_cache(self.k_cache, self.v_cache, self.k_idx_cache, table,
                                           lens)
        k, v, k_idx, cu = _ref.gather_cache(self.k_cache.numpy(), self.v_cache.numpy(),
                                            self.k_idx_cache.numpy(), table.numpy(), lens.numpy())
        return torch.from_numpy(k), torch.from_numpy(v), torch.from_numpy(k_idx), cu

    def capture(self, slots, lq: int, num_q_heads: int, topk: int, *, scale=None,
                index_scale=None) -> CapturedDecode:
        """A CUDA-graph decode step for the requests ``slots`` (``lq`` new tokens each)."""
        return CapturedDecode(self, slots, lq, num_q_heads, topk, scale=scale,
                              index_scale=index_scale)


class CapturedDecode:
    """One decode step of fixed requests captured in a CUDA graph (``PagedKVCache.capture``).

    Write the step's new tokens into ``k, v [B*Lq, Hkv, D]``, ``k_idx [B*Lq, Didx]`` and its
    queries into ``q [B*Lq, Hq, D]``, ``q_idx [B*Lq, Hkv, Didx]``, then ``replay()``: the
    lengths advance by ``lq``, the tokens are appended, and ``o, lse, block_indices`` hold the
    step. Pages must be reserved ahead (``PagedKVCache.reserve``): ``replay`` checks the host
    mirror and raises before running a step whose tokens have no page.
    """

    def __init__(self, cache: PagedKVCache, slots, lq: int, num_q_heads: int, topk: int, *,
                 scale=None, index_scale=None):
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache must be an msa.torch.PagedKVCache, got {type(cache).__name__}")
        if not cache.k_cache.is_cuda:
            raise TypeError("CUDA graphs need a cache on a CUDA device")
        gpu = _gpu()
        # every argument before the buffers are allocated (the plan checks them only after)
        slots = cache._slots(slots)
        lq = check_positive_int("lq", lq, high=gpu.MAX_QUERIES)
        p, hkv, bk, d = cache.k_cache.shape
        d_idx = cache.k_idx_cache.shape[2]
        check_gqa(num_q_heads, hkv)
        check_positive_int("topk", topk, high=gpu.MAX_TOPK)
        check_scale("scale", scale, 1.0)
        check_scale("index_scale", index_scale, 1.0)
        self.cache, self.slots, self.lq = cache, slots, lq
        b = slots.size
        kw = dict(device=cache.k_cache.device, dtype=cache.k_cache.dtype)
        self.q = torch.zeros((b * lq, num_q_heads, d), **kw)
        self.q_idx = torch.zeros((b * lq, hkv, d_idx), **kw)
        self.k = torch.zeros((b * lq, hkv, d), **kw)
        self.v = torch.zeros((b * lq, hkv, d), **kw)
        self.k_idx = torch.zeros((b * lq, d_idx), **kw)
        dev = cache.block_table.device
        self._rows = torch.as_tensor(self.slots, device=dev)
        self._step_len = torch.full((b,), lq, dtype=torch.int32, device=dev)
        self.table = cache.block_table[self._rows].contiguous()
        self.lens = cache.seqlens[self._rows].contiguous()
        with torch.cuda.device(dev):
            # the lengths change every replay: the plan checks shapes, not values
            self.plan = gpu.plan(self.q, self.q_idx, cache.k_cache, cache.v_cache,
                                 cache.k_idx_cache, self.table, self.lens, bk, topk, scale=scale,
                                 index_scale=index_scale, k=self.k, v=self.v, k_idx=self.k_idx,
                                 validate=False)
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._step(gpu)
        self.o, self.lse, self.block_indices = self.plan.o, self.plan.lse, self.plan.block_indices

    def _step(self, gpu):
        c = self.cache
        c.seqlens.index_add_(0, self._rows, self._step_len)
        torch.index_select(c.block_table, 0, self._rows, out=self.table)
        torch.index_select(c.seqlens, 0, self._rows, out=self.lens)
        gpu.run(self.plan, self.q, self.q_idx, c.k_cache, c.v_cache, c.k_idx_cache, self.table,
                self.lens, k=self.k, v=self.v, k_idx=self.k_idx)

    def replay(self):
        """Run the captured step (see the class docstring); returns ``(o, lse, block_indices)``."""
        c = self.cache
        after = c._lens[self.slots] + self.lq
        short = np.nonzero(after > c._pages[self.slots] * c.block_size)[0]
        if short.size:
            s = int(self.slots[short[0]])
            raise RuntimeError(f"request {s} has no page for its next tokens: reserve(slots, "
                               f"steps * lq) before replaying")
        self.graph.replay()
        c._lens[self.slots] = after
        return self.o, self.lse, self.block_indices


def decode_attention_step(layer, x: torch.Tensor, cache: PagedKVCache, slots):
    """One generation step of an ``msa.torch.MSAAttention`` layer on a paged cache.

    ``x [B*Lq, d_model]``: the hidden states of each request's ``Lq`` new tokens (request-major
    over ``slots``). Projects them (Algorithm 1 lines 1-2; the index branch on ``x`` as is: no
    gradient flows in generation), appends their K, V and K_idx to the cache, runs lines 3-5 on
    the cache (``PagedKVCache.decode`` for ``Lq <= 8``, MTP drafts; ``PagedKVCache.prefill``, a
    chunked prefill, for a longer chunk such as a prompt) and the output projection (line 6).

    Returns ``(output [B*Lq, d_model], block_indices [B*Lq, Hkv, K])``. The hook is
    ``MSAAttention.decode(self, x, cache, slots): return decode_attention_step(self, x, cache,
    slots)``.

    Raises TypeError/ValueError naming the argument before the cache changes: ``x`` as
    ``MSAAttention.forward`` takes it, a cache whose heads, dims, block size, dtype or device are
    not the layer's, slots that are not distinct active requests, ``x`` not ``B*Lq`` rows with
    ``Lq >= 1``, the layer's ``topk`` above the backend's limit (the reference's ``max(NB,
    64)`` on the lengths after the append), a group size the GPU's chunked prefill does not
    take; ``reserve``'s RuntimeError when pages run out.
    """
    from .layer import MSAAttention  # here: layer.py imports this module

    if not isinstance(layer, MSAAttention):
        raise TypeError(f"layer must be an msa.torch.MSAAttention, got {type(layer).__name__}")
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be an msa.torch.PagedKVCache, got {type(cache).__name__}")
    layer._check_input(x)
    hq, hkv, d, d_idx = layer.num_q_heads, layer.num_kv_heads, layer.head_dim, layer.index_dim
    # the append happens before the decode step: everything the step would reject, now
    got = (*cache.k_cache.shape[1::2], cache.k_idx_cache.shape[2])
    if tuple(int(n) for n in got) != (hkv, d, d_idx):
        raise ValueError(f"cache must have the layer's (num_kv_heads, head_dim, index_dim) = "
                         f"{(hkv, d, d_idx)}, got {tuple(int(n) for n in got)}")
    if cache.k_cache.dtype != layer.w_q.dtype:
        raise TypeError(f"cache must have the layer's dtype {layer.w_q.dtype}, got "
                        f"{cache.k_cache.dtype}")
    if cache.k_cache.device != layer.w_q.device:
        raise ValueError(f"cache must be on the layer's device {layer.w_q.device}, got "
                         f"{cache.k_cache.device}")
    if cache.block_size != layer.block_size:
        raise ValueError(f"cache must have the layer's block_size {layer.block_size}, got "
                         f"{cache.block_size}")
    slot_ids = cache._slots(slots)
    t, b = int(x.shape[0]), slot_ids.size
    lq = t // b
    if t % b or lq < 1:
        raise ValueError(f"x must have B*Lq rows (B = {b} slots, Lq >= 1), got {t} rows")
    # a decode step up to msa.cuda.decode's Lq limit, a chunked prefill above it
    step = cache.decode if lq <= _MAX_DECODE_QUERIES else cache.prefill
    if cache.k_cache.is_cuda:
        check_positive_int("topk", layer.topk, high=_gpu().MAX_TOPK)
        if lq > _MAX_DECODE_QUERIES:  # the chunked prefill's attention kernels
            check_gqa(hq, hkv, allowed=GQA_GROUP_SIZES, what="the layer's G = Hq/Hkv")
    else:  # the reference's bounds, on the lengths after the append
        check_positive_int("topk", layer.topk, high=_ref.MAX_TOPK)
        longest = int((cache._lens[slot_ids] + lq).max())
        check_topk(layer.topk, -(-longest // cache.block_size), cache.block_size)
    with torch.no_grad():
        q = (x @ layer.w_q).view(t, hq, d)
        k = (x @ layer.w_k).view(t, hkv, d)
        v = (x @ layer.w_v).view(t, hkv, d)
        q_idx = (x @ layer.w_q_idx).view(t, hkv, d_idx)
        k_idx = x @ layer.w_k_idx
        cache.append(slots, k, v, k_idx)
        o, _, idx = step(slots, q, q_idx, layer.topk, scale=layer.scale,
                         index_scale=layer.index_scale)
        return o.reshape(t, hq * d) @ layer.w_o, idx
