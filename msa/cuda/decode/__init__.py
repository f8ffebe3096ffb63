"""docs/design.md §8 on the GPU: decode on a paged KV cache, split into ``plan`` (host) and ``run`` (launches).

Same functions and arguments as ``msa.reference.decode`` (read its docstring for the layout and
semantics), plus keyword-only knobs, plus ``plan`` and ``run`` for serving:

* ``p = plan(q, q_idx, k_cache, v_cache, k_idx_cache, block_table, cache_seqlens, block_size,
  topk, *, scale, index_scale, k=None, v=None, k_idx=None, version=None)`` runs on the host
  once per batch shape: it validates every input (and, with ``validate=True``, the page ids
  and lengths the arrays hold now), picks the rung and the split counts, allocates the outputs
  ``p.o [B*Lq, Hq, D]``, ``p.lse [B*Lq, Hq]`` float32, ``p.block_indices [B*Lq, Hkv, K]`` int32
  and every workspace, and compiles each kernel for the arrays' types. Given ``k, v, k_idx``
  (the step's new tokens, ``[B*Lq, ...]``), the plan also appends them first.
* ``run(p, q, q_idx, k_cache, v_cache, k_idx_cache, block_table, cache_seqlens, *, k=None,
  v=None, k_idx=None, stream=None)`` only launches, on ``stream`` (default: the caller's
  current torch or CuPy stream; never the legacy default stream for those): no host read, no
  allocation, no validation. The arrays must have the shapes, dtypes and device the plan was
  made with; their contents may change between runs (``cache_seqlens`` grows, the block table
  gets new pages), and a run inside ``torch.cuda.graph`` (or CuPy's stream capture) records
  the whole step. Replays equal eager runs bit for bit (no float atomics anywhere). ``run``
  returns ``(p.o, p.lse, p.block_indices)``, the same arrays every time.

What ``run`` trusts: pages outside ``[0, P)`` are skipped and lengths above ``max_pages * Bk``
clamped (no read or write out of bounds), but results are only specified for inputs that
``plan(validate=True)`` would accept.

Stale slots (docs/decode.md): a query's output, LSE and selection do not depend on any cache
slot it cannot see, whatever it holds (NaN and infinities included): the slots past its
request's length, pages its block table does not list for the request's blocks, the later
drafts' keys, and K and V of the blocks only other drafts selected. Every rung, bit for bit.

Rungs (``version=``; ``None`` takes 3 where it applies, else 2, else 1):

=====  ==========================  ===========================================================
v      file                        kernels
=====  ==========================  ===========================================================
1      ``v1_simple.py``            CUDA cores, one thread per output, any dtype: append; block
                                   maxima ``M`` of every (query, group, block) into a
                                   workspace; a per-row arg-max top-k; attention by one thread
                                   per (query, head) with its O accumulator in global memory
2      ``v2_split_index.py``,      bf16/fp16, ``D``, ``Didx``, ``Bk`` multiples of 16 (``D <=
       ``v2_split_attention.py``   128``), ``K <= 64``. Index: the context of each request
                                   split over CTAs, each page of index keys loaded once
                                   (``cp.async``, four stages) for all ``Lq x Hkv`` index
                                   queries, scored by ``mma.sync`` with the queries as the B
                                   operand, block maxima straight into a per-row heap
                                   (``_core.heap``); a merge kernel takes the splits' lists
                                   with the paper's warp heap and shuffle merge (§4.1), forces
                                   the local block, pads with -1. Attention: Q-outer per
                                   (decode query, KV head, page split), a draft's own
                                   selection, its ``G`` query rows as the MMA rows, each
                                   selected page loaded once (16-byte ``cp.async``, a ring
                                   of three stages), online softmax in registers; splits
                                   combined by LSE in a second kernel. H200, paper
                                   configuration, Lq = 1, CUDA graph:
                                   0.275 ms at B = 32 x 64K (3.4x SDPA decode), 0.161 ms at 8 x
                                   128K (3.0x). The default where rung 3 does not apply
3      ``v3_register_index.py``    rung 2 with ``Didx`` a multiple of 32: the index kernel
       (+ rung 2's merge and       streams each warp's pages from HBM straight into the mma's
       attention)                  A registers (three m-tiles of 16 keys in flight a warp, no
                                   shared-memory stage, no barrier), each warp its own heaps,
                                   merged in the CTA. Run V (docs/performance.md): 0.226 ms at
                                   32 x 64K (4.11x dense decode, 1.43x its HBM floor), 0.141
                                   ms at 8 x 128K (3.44x), 0.295 ms at 128 x 8K (1.66x), 1.20
                                   ms at 128 x 128K (6.20x); Lq = 8 at 32 x 64K 0.532 ms (3.38x)
=====  ==========================  ===========================================================

``prefill_chunk`` (chunked prefill into the cache, any number of new tokens a request): the fused
index + top-k on the requests' gathered index keys, then the KV-outer sparse attention reading K
and V from their pages (``msa.cuda.attention.sparse_attention(..., block_table=...)``).

Bad input raises ``TypeError``/``ValueError`` naming the argument before anything is allocated
(``msa.reference.decode.check_cache``'s checks, plus device, contiguity, ``Lq <= 8``, ``K <=
64``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..._checks import (GQA_GROUP_SIZES, check_array, check_flag, check_gqa, check_offsets,
                        check_positive_int, check_scale, check_version, dtype_name, dtype_of)
from ...reference import decode as _ref
from ...reference.select import check_block_indices
from .._core.arrays import SIMULATOR, ArrayContext, float_kind, is_c_contiguous
from .._core.memops import is_aligned16
from .._core.streams import stream_handle
from ..attention import sparse_attention
from ..select import check_topk, select_blocks_fused
from . import v1_simple as v1
from . import v2_split_attention as v2a
from . import v2_split_index as v2i
from . import v3_register_index as v3i
from ._plan import Kernel, arg, grid_1d

VERSIONS = (1, 2, 3)
MAX_QUERIES = 8  # Lq: new queries per request (MTP drafts)
MAX_TOPK = 64
_FLOAT_OR_BF16 = ("float", np.uint16)  # bf16 tensors read as uint16 (float_kind tells them apart)


# -- validation ---------------------------------------------------------------------------------

@dataclass
class _Step:
    """The validated shape of a decode step (what a plan is made for)."""

    layout: _ref.CacheLayout
    lq: int
    hq: int
    kind: str
    lib: str
    topk: int
    scale: float
    index_scale: float

    @property
    def group(self) -> int:
        return self.hq // self.layout.num_kv_heads if self.hq else 0


def _check_kernel_arrays(**named) -> None:
    """What the kernels add to ``check_cache``'s checks: int32 ``block_table`` and
    ``cache_seqlens`` (as the kernels read them) and C-contiguous arrays, each error naming its
    argument (``None`` entries are skipped)."""
    for name in ("block_table", "cache_seqlens"):
        x = named.get(name)
        if x is not None and dtype_of(x) != np.int32:
            raise TypeError(f"{name} must have dtype int32 in msa.cuda, got {dtype_name(x)}")
    for name, x in named.items():
        if x is not None and not is_c_contiguous(x):
            raise ValueError(f"{name} must be C-contiguous (a strided view: pass a contiguous "
                             f"copy), got shape {tuple(x.shape)}")


def _validate(q, q_idx, k_cache, v_cache, k_idx_cache, block_table, cache_seqlens, block_size,
              topk, scale, index_scale, validate: bool) -> _Step:
    validate = check_flag("validate", validate)
    layout = _ref.check_cache(k_cache, v_cache, k_idx_cache, block_table, cache_seqlens,
                              block_size=block_size, dtypes=_FLOAT_OR_BF16, values=validate)
    _check_kernel_arrays(q=q, q_idx=q_idx, k_cache=k_cache, v_cache=v_cache,
                         k_idx_cache=k_idx_cache, block_table=block_table,
                         cache_seqlens=cache_seqlens)
    arrays = [x for x in (q, q_idx, k_cache, v_cache, k_idx_cache, block_table, cache_seqlens)
              if x is not None]
    ctx = ArrayContext(*arrays)
    kinds = {float_kind(name, x) for name, x in (("q", q), ("q_idx", q_idx), ("k_cache", k_cache),
                                                 ("v_cache", v_cache),
                                                 ("k_idx_cache", k_idx_cache)) if x is not None}
    if len(kinds) != 1:
        raise TypeError(f"q, q_idx and the caches must share one float dtype, got {sorted(kinds)}")
    kind = kinds.pop()
    first = next(x for x in (k_cache, v_cache, k_idx_cache) if x is not None)
    lq = _ref.check_queries(q, q_idx, layout, dtype_of(first), _FLOAT_OR_BF16)
    if lq > MAX_QUERIES:
        raise ValueError(f"q must have at most {MAX_QUERIES} new queries a request (Lq = rows / B "
                         f"= {lq}); longer chunks are a prefill")
    topk = 0 if topk is None else check_topk(topk, high=_ref.MAX_TOPK)
    hq = int(q.shape[1]) if q is not None else 0
    scale = check_scale("scale", scale, 1.0 / math.sqrt(max(layout.head_dim, 1)))
    index_scale = check_scale("index_scale", index_scale, 1.0 / math.sqrt(max(layout.index_dim, 1)))
    return _Step(layout, lq, hq, kind, ctx.lib, topk, scale, index_scale)


def _v2_blockers(step: _Step, arrays) -> list[str]:
    """Why rung 2 does not apply (empty: it does)."""
    lay = step.layout
    why = []
    if step.kind not in ("float16", "bfloat16"):
        why.append(f"dtype {step.kind} (bf16/fp16 only)")
    if lay.block_size % 16 or lay.block_size > 128:
        why.append(f"Bk = {lay.block_size} (a multiple of 16 up to 128)")
    if lay.head_dim and (lay.head_dim % 16 or lay.head_dim > 128):
        why.append(f"D = {lay.head_dim} (a multiple of 16 up to 128)")
    if lay.index_dim and (lay.index_dim % 16 or lay.index_dim > 128):
        why.append(f"Didx = {lay.index_dim} (a multiple of 16 up to 128)")
    if step.lq * lay.num_kv_heads > 32:
        why.append(f"Lq * Hkv = {step.lq * lay.num_kv_heads} (at most 32 index queries)")
    if not SIMULATOR and not all(is_aligned16(x) for x in arrays if x is not None):
        why.append("arrays not 16-byte aligned")
    return why


def _v3_blockers(step: _Step) -> list[str]:
    """Why rung 3's index kernel does not apply where rung 2 does (empty: it does)."""
    lay = step.layout
    why = []
    if lay.index_dim % 32:
        why.append(f"Didx = {lay.index_dim} (a multiple of 32)")
    if not v3i.heaps_fit(step.lq, lay.num_kv_heads, step.topk or 1):
        why.append(f"Lq * Hkv * (K - 1) = {step.lq * lay.num_kv_heads * (step.topk - 1)} "
                   "(the warps' heaps exceed static shared memory)")
    return why


def _pick_version(step: _Step, version, arrays) -> int:
    why = _v2_blockers(step, arrays)
    if version is None:
        return 1 if why else (2 if _v3_blockers(step) else 3)
    version = check_version("version", version, VERSIONS)
    if version >= 2 and why:
        raise ValueError(f"version {version} does not apply here: {'; '.join(why)}")
    if version == 3 and _v3_blockers(step):
        raise ValueError(f"version 3 does not apply here: {'; '.join(_v3_blockers(step))}")
    return version


# -- plans --------------------------------------------------------------------------------------

@dataclass
class DecodePlan:
    """What ``plan`` fixed for a batch shape; ``run`` launches ``steps`` with it.

    Attributes: ``o``, ``lse``, ``block_indices`` (the outputs, overwritten by every run),
    ``version``, ``index_splits``, ``attention_splits``, ``workspace`` (name -> array) and
    ``steps``: ``(kernel, argument spec)`` in launch order.
    """

    version: int
    lq: int
    topk: int
    lib: str
    o: object = None
    lse: object = None
    block_indices: object = None
    index_splits: int = 0
    attention_splits: int = 0
    append: bool = False
    workspace: dict = field(default_factory=dict)
    steps: list = field(default_factory=list)

    def workspace_bytes(self) -> int:
        """Device bytes the plan holds besides its outputs (split candidates, partials, LSEs)."""
        return sum(int(np.prod(x.shape)) * _itemsize(x) for x in self.workspace.values())


def _itemsize(x) -> int:
    return int(x.element_size()) if hasattr(x, "element_size") else int(x.dtype.itemsize)


_INPUTS = ("q", "q_idx", "k_cache", "v_cache", "k_idx_cache", "block_table", "cache_seqlens",
           "k", "v", "k_idx")


def _resolve(p: DecodePlan, env: dict, spec):
    """One kernel argument from its spec: ``(source, name, view)`` or a plain scalar."""
    if not isinstance(spec, tuple):
        return spec
    source, name, view = spec
    key = (source, name, view)
    got = env.get(key)
    if got is None:
        x = env[name] if source == "in" else (p.workspace[name] if source == "ws"
                                              else getattr(p, name))
        got = env[key] = arg(x, view)
    return got


def _build(step: _Step, version: int, arrays: dict, *, parts, block_indices=None) -> DecodePlan:
    """The plan of ``parts`` (``"append"``, ``"index"``, ``"attention"``) for this step."""
    lay = step.layout
    ctx = ArrayContext(*[x for x in arrays.values() if x is not None])
    b, lq, hkv = lay.batch, step.lq, lay.num_kv_heads
    rows = b * lq
    p = DecodePlan(version, lq, step.topk, step.lib, append="append" in parts)
    wide = step.kind == "float64"
    f_dtype = np.float64 if wide else np.float32
    scale = np.float64(step.scale) if wide else float(step.scale)
    index_scale = np.float64(step.index_scale) if wide else float(step.index_scale)
    bits = "bits" if step.kind in ("float16", "bfloat16") else None
    if "append" in parts:
        _plan_append(p, ctx, step, arrays, bits)
    if "index" in parts:
        p.block_indices = ctx.empty((rows, hkv, step.topk), np.int32)
        if version == 1:
            p.workspace["M"] = ctx.empty((hkv, rows, lay.max_pages), f_dtype)
            p.steps.append((Kernel(v1.scores_kernel(step.kind, lay.block_size),
                                   grid_1d(hkv * rows * lay.max_pages, v1.THREADS),
                                   v1.THREADS),
                            [("in", "q_idx", bits), ("in", "k_idx_cache", bits),
                             ("in", "block_table", None), ("in", "cache_seqlens", None), lq,
                             index_scale, ("ws", "M", None)]))
            p.steps.append((Kernel(v1.topk_kernel(lay.block_size), grid_1d(rows * hkv, v1.THREADS),
                                   v1.THREADS),
                            [("ws", "M", None), ("in", "cache_seqlens", None), lq,
                             ("out", "block_indices", None)]))
        else:
            rung = v2i if version == 2 else v3i
            p.index_splits = rung.plan_index(p, ctx, step, index_scale)
    if "attention" in parts:
        if block_indices is not None:
            p.block_indices = block_indices
        out_kind = "bfloat16" if step.kind == "bfloat16" else step.kind
        p.o = ctx.empty((rows, step.hq, lay.head_dim), out_kind)
        p.lse = ctx.empty((rows, step.hq), f_dtype)
        if version == 1:
            p.workspace["acc"] = ctx.empty((rows, step.hq, lay.head_dim), f_dtype)
            p.steps.append((Kernel(v1.attention_kernel(step.kind, lay.block_size),
                                   grid_1d(rows * step.hq, v1.THREADS), v1.THREADS),
                            [("in", "q", bits), ("in", "k_cache", bits), ("in", "v_cache", bits),
                             ("out", "block_indices", None), ("in", "block_table", None),
                             ("in", "cache_seqlens", None), lq, step.group, scale,
                             ("ws", "acc", None), ("out", "o", bits), ("out", "lse", None)]))
        else:
            p.attention_splits = v2a.plan_attention(p, ctx, step, scale)
    _compile(p, arrays)
    return p


def _plan_append(p: DecodePlan, ctx, step: _Step, arrays: dict, bits):
    lay = step.layout
    t_new = step.lq * lay.batch
    for name, shape in (("k", (t_new, lay.num_kv_heads, lay.head_dim)),
                        ("v", (t_new, lay.num_kv_heads, lay.head_dim)),
                        ("k_idx", (t_new, lay.index_dim))):
        x = arrays.get(name)
        if x is None:
            raise TypeError(f"a plan that appends needs {name}, the new tokens' rows, got None")
        check_array(name, x, shape=shape)
        if float_kind(name, x) != step.kind:
            raise TypeError(f"{name} must have the cache's dtype ({step.kind}), got "
                            f"{float_kind(name, x)}")
    cu_new = np.arange(lay.batch + 1, dtype=np.int32) * step.lq
    p.workspace["cu_new"] = _device_ints(ctx, cu_new)
    nk = lay.num_kv_heads * lay.head_dim
    total = t_new * (2 * nk + lay.index_dim)
    p.steps.append((Kernel(v1.append_kernel, grid_1d(total, v1.THREADS), v1.THREADS),
                    [("in", "k", bits), ("in", "v", bits), ("in", "k_idx", bits),
                     ("in", "k_cache", bits), ("in", "v_cache", bits), ("in", "k_idx_cache", bits),
                     ("in", "block_table", None), ("in", "cache_seqlens", None),
                     ("ws", "cu_new", None), nk, nk, lay.index_dim, lay.block_size,
                     lay.num_pages]))


def _device_ints(ctx, host):
    """A small int32 host array as a plan-owned array of the caller's library."""
    out = ctx.empty(host.shape, np.int32)
    if SIMULATOR:
        out[...] = host
    elif ctx.lib == "torch":
        import torch

        out.copy_(torch.from_numpy(np.ascontiguousarray(host)))
    elif ctx.lib == "cupy":
        import cupy

        out.set(np.ascontiguousarray(host)) if hasattr(out, "set") else out.__setitem__(
            Ellipsis, cupy.asarray(host))
    else:
        out.copy_to_device(np.ascontiguousarray(host))
    return out


def _compile(p: DecodePlan, arrays: dict):
    env = dict(arrays)
    for kernel, specs in p.steps:
        kernel.compile(*(_resolve(p, env, s) for s in specs))


def plan(q, q_idx, k_cache, v_cache, k_idx_cache, block_table, cache_seqlens, block_size, topk, *,
         scale=None, index_scale=None, k=None, v=None, k_idx=None, version=None,
         validate: bool = True) -> DecodePlan:
    """Plan a decode step (module docstring): validate, choose, allocate, compile. Host only.

    Args: as ``decode_step``; ``k, v, k_idx`` the step's new tokens to append first (all three
    or none); ``version`` one of ``VERSIONS`` (None: the module docstring's default);
    ``validate`` reads the block table and lengths once to check them (``run`` never does).
    """
    step = _validate(q, q_idx, k_cache, v_cache, k_idx_cache, block_table, cache_seqlens,
                     block_size, topk, scale, index_scale, validate)
    if v_cache is None or k_idx_cache is None or q is None or q_idx is None:
        raise TypeError("plan needs q, q_idx, k_cache, v_cache and k_idx_cache arrays")
    if step.lib == "numpy" and not SIMULATOR:
        raise TypeError("plan and run take device arrays (torch, CuPy, Numba) on a GPU; the "
                        "one-shot decode_step also takes NumPy")
    arrays = dict(zip(_INPUTS, (q, q_idx, k_cache, v_cache, k_idx_cache, block_table,
                                cache_seqlens, k, v, k_idx)))
    appending = any(x is not None for x in (k, v, k_idx))
    version = _pick_version(step, version, arrays.values())
    parts = ("append", "index", "attention") if appending else ("index", "attention")
    return _build(step, version, arrays, parts=parts)


def run(p: DecodePlan, q, q_idx, k_cache, v_cache, k_idx_cache, block_table, cache_seqlens, *,
        k=None, v=None, k_idx=None, stream=None):
    """Launch a planned decode step on ``stream`` (module docstring); returns ``(o, lse,
    block_indices)``, the plan's arrays. Checks nothing, reads nothing, allocates nothing."""
    env = dict(zip(_INPUTS, (q, q_idx, k_cache, v_cache, k_idx_cache, block_table,
                             cache_seqlens, k, v, k_idx)))
    _launch(p, env, stream)
    return p.o, p.lse, p.block_indices


def _launch(p: DecodePlan, env: dict, stream):
    handle = stream_handle(stream, p.lib)
    for kernel, specs in p.steps:
        kernel.launch(handle, *(_resolve(p, env, s) for s in specs))


# -- one-shot launchers (the reference's functions) ---------------------------------------------

def _device_inputs(ctx, named: dict) -> dict:
    """NumPy inputs on a GPU go to the device once (the one-shot convenience); else as given."""
    if ctx.lib != "numpy" or SIMULATOR:
        return named
    return {n: (None if x is None else ctx.input(n, np.ascontiguousarray(x)))
            for n, x in named.items()}


def _host_result(ctx, *xs):
    return tuple(None if x is None else ctx.output(x) for x in xs)


def decode_step(q, q_idx, k_cache, v_cache, k_idx_cache, block_table, cache_seqlens, block_size,
                topk, *, scale=None, index_scale=None, version=None, stream=None):
    """``msa.reference.decode.decode_step`` on the GPU: ``(o [B*Lq, Hq, D] in q's dtype, lse
    [B*Lq, Hq] float32, block_indices [B*Lq, Hkv, K] int32)``; ``plan`` then ``run``."""
    _ref.require_arrays(q=q, q_idx=q_idx, k_cache=k_cache, v_cache=v_cache,
                        k_idx_cache=k_idx_cache)
    step = _validate(q, q_idx, k_cache, v_cache, k_idx_cache, block_table, cache_seqlens,
                     block_size, topk, scale, index_scale, True)
    ctx = ArrayContext(q, q_idx, k_cache, v_cache, k_idx_cache, block_table, cache_seqlens)
    arrays = _device_inputs(ctx, dict(zip(_INPUTS[:7], (q, q_idx, k_cache, v_cache, k_idx_cache,
                                                         block_table, cache_seqlens))))
    version = _pick_version(step, version, arrays.values())
    p = _build(step, version, arrays, parts=("index", "attention"))
    _launch(p, arrays, stream)
    return _host_result(ctx, p.o, p.lse, p.block_indices)


def decode_block_indices(q_idx, k_idx_cache, block_table, cache_seqlens, block_size, topk, *,
                         index_scale=None, version=None, stream=None):
    """``msa.reference.decode.decode_block_indices`` on the GPU: ``I [B*Lq, Hkv, K]`` int32,
    equal to the reference's where the index scores are exact (ties included)."""
    _ref.require_arrays(q_idx=q_idx, k_idx_cache=k_idx_cache)
    step = _validate(None, q_idx, None, None, k_idx_cache, block_table, cache_seqlens,
                     block_size, topk, None, index_scale, True)
    step.layout = step.layout._replace(num_kv_heads=int(q_idx.shape[1]))
    ctx = ArrayContext(q_idx, k_idx_cache, block_table, cache_seqlens)
    arrays = _device_inputs(ctx, dict(q_idx=q_idx, k_idx_cache=k_idx_cache,
                                      block_table=block_table, cache_seqlens=cache_seqlens))
    version = _pick_version(step, version, arrays.values())
    p = _build(step, version, arrays, parts=("index",))
    _launch(p, arrays, stream)
    return _host_result(ctx, p.block_indices)[0]


def decode_attention(q, k_cache, v_cache, block_indices, block_table, cache_seqlens, block_size, *,
                     scale=None, version=None, stream=None):
    """``msa.reference.decode.decode_attention`` on the GPU: ``(o, lse)`` for a given selection
    ``block_indices [B*Lq, Hkv, K]`` (validated on the host like the reference's)."""
    _ref.require_arrays(q=q, k_cache=k_cache, v_cache=v_cache)
    step = _validate(q, None, k_cache, v_cache, None, block_table, cache_seqlens, block_size,
                     None, scale, None, True)
    lay = step.layout
    check_array("block_indices", block_indices, ndim=3, dtypes=("int",),
                shape=(int(q.shape[0]), lay.num_kv_heads, None))
    topk = check_topk(int(block_indices.shape[2]), name="topk (block_indices.shape[2])",
                      high=_ref.MAX_TOPK)
    cu_q, cu_k = _ref.decode_offsets(lay, step.lq)
    check_block_indices(block_indices, cu_q, cu_k, lay.block_size)
    step.topk = topk
    ctx = ArrayContext(q, k_cache, v_cache, block_indices, block_table, cache_seqlens)
    arrays = _device_inputs(ctx, dict(q=q, k_cache=k_cache, v_cache=v_cache,
                                      block_table=block_table, cache_seqlens=cache_seqlens,
                                      block_indices=block_indices))
    I = arrays.pop("block_indices")
    if ctx.lib == "torch" and I.dtype != __import__("torch").int32:
        I = I.to(__import__("torch").int32)
    elif ctx.lib != "torch" and np.dtype(I.dtype) != np.int32:
        I = I.astype(np.int32)
    version = _pick_version(step, version, arrays.values())
    p = _build(step, version, arrays, parts=("attention",), block_indices=I)
    _launch(p, arrays, stream)
    return _host_result(ctx, p.o, p.lse)


def append_to_cache(k, v, k_idx, k_cache, v_cache, k_idx_cache, block_table, cache_seqlens, *,
                    cu_seqlens=None, stream=None):
    """``msa.reference.decode.append_to_cache`` on the GPU: one kernel writes the new tokens'
    K, V and K_idx rows (any of them None: left alone) into their pages, in place; returns the
    caches. Validated on the host like the reference's (no two tokens on one slot)."""
    ref = k if k is not None else (v if v is not None else k_idx)
    if ref is None:
        raise ValueError("append_to_cache needs at least one of k, v, k_idx")
    layout = _ref.check_cache(k_cache, v_cache, k_idx_cache, block_table, cache_seqlens,
                              dtypes=_FLOAT_OR_BF16)
    t_new = int(ref.shape[0])
    _ref.new_token_slots(layout, t_new, cu_seqlens)
    named = dict(k=k, v=v, k_idx=k_idx, k_cache=k_cache, v_cache=v_cache,
                 k_idx_cache=k_idx_cache, block_table=block_table, cache_seqlens=cache_seqlens)
    _check_kernel_arrays(**named)
    for name, x, cache, per_head in (("k", k, k_cache, True), ("v", v, v_cache, True),
                                     ("k_idx", k_idx, k_idx_cache, False)):
        if x is None:
            continue
        if cache is None:
            raise ValueError(f"{name} given but its cache is None")
        shape = ((t_new, layout.num_kv_heads, layout.head_dim) if per_head
                 else (t_new, layout.index_dim))
        check_array(name, x, ndim=len(shape), dtypes=_FLOAT_OR_BF16, shape=shape)
        if float_kind(name, x) != float_kind(f"{name}_cache", cache):
            raise TypeError(f"{name} must have the dtype of {name}_cache "
                            f"({float_kind(f'{name}_cache', cache)}), got {float_kind(name, x)}")
    ctx = ArrayContext(*[x for x in named.values() if x is not None])
    if ctx.lib == "numpy" and not SIMULATOR:
        raise TypeError("append_to_cache writes device caches in place: pass torch, CuPy or "
                        "Numba arrays on a GPU")
    cu = (np.arange(layout.batch + 1) * (t_new // layout.batch) if cu_seqlens is None
          else check_offsets("cu_seqlens", cu_seqlens, t_new))
    cu_dev = _device_ints(ctx, cu.astype(np.int32))
    # stand-ins for what is not appended (their element counts are 0)
    stand = next(x for x in (k_cache, v_cache, k_idx_cache) if x is not None)
    args = [arg(named[n] if named[n] is not None else stand, "bits" if _is16(stand) else None)
            for n in ("k", "v", "k_idx", "k_cache", "v_cache", "k_idx_cache")]
    nk = layout.num_kv_heads * layout.head_dim
    counts = (nk if k is not None else 0, nk if v is not None else 0,
              layout.index_dim if k_idx is not None else 0)
    total = t_new * sum(counts)
    kernel = Kernel(v1.append_kernel, grid_1d(total, v1.THREADS), v1.THREADS)
    kernel.launch(stream_handle(stream, ctx.lib), *args, arg(block_table), arg(cache_seqlens),
                  arg(cu_dev), *counts, layout.block_size, layout.num_pages)
    return k_cache, v_cache, k_idx_cache


def _is16(x) -> bool:
    return float_kind("cache", x) in ("float16", "bfloat16")


def gather_cache(k_cache, v_cache, k_idx_cache, block_table, cache_seqlens, *, stream=None):
    """``msa.reference.decode.gather_cache`` on the GPU: ``(k, v, k_idx, cu_seqlens_k)``, the
    packed sequences (any cache None: None), copies in the cache's dtype."""
    layout = _ref.check_cache(k_cache, v_cache, k_idx_cache, block_table, cache_seqlens,
                              dtypes=_FLOAT_OR_BF16)
    _check_kernel_arrays(k_cache=k_cache, v_cache=v_cache, k_idx_cache=k_idx_cache,
                         block_table=block_table, cache_seqlens=cache_seqlens)
    return _gather(layout, k_cache, v_cache, k_idx_cache, block_table, cache_seqlens, stream)


def _gather(layout, k_cache, v_cache, k_idx_cache, block_table, cache_seqlens, stream=None):
    """``gather_cache`` on a cache ``check_cache`` already read (``layout``): no second host
    copy of the table and lengths."""
    ctx = ArrayContext(*[x for x in (k_cache, v_cache, k_idx_cache, block_table, cache_seqlens)
                         if x is not None])
    named = _device_inputs(ctx, dict(k_cache=k_cache, v_cache=v_cache, k_idx_cache=k_idx_cache,
                                     block_table=block_table))
    cu_k = np.concatenate([[0], np.cumsum(layout.seqlens)]).astype(np.int32)
    tk = int(cu_k[-1])
    cu_dev = _device_ints(ctx, cu_k)
    handle = stream_handle(stream, ctx.lib)
    outs = []
    for name, per_head in (("k_cache", True), ("v_cache", True), ("k_idx_cache", False)):
        cache = named[name]
        if cache is None:
            outs.append(None)
            continue
        kind = float_kind(name, cache)
        shape = ((tk, layout.num_kv_heads, layout.head_dim) if per_head else (tk, layout.index_dim))
        out = ctx.empty(shape, kind)
        view = "bits" if kind in ("float16", "bfloat16") else None
        kernel = v1.gather_kernel if per_head else v1.gather_index_kernel
        if tk:
            Kernel(kernel, min(grid_1d(int(np.prod(shape)), v1.THREADS), 1 << 16),
                   v1.THREADS).launch(handle, arg(cache, view), arg(out, view),
                                      arg(named["block_table"]), arg(cu_dev))
        outs.append(out)
    k, v, k_idx = _host_result(ctx, *outs)
    return k, v, k_idx, cu_k


def prefill_chunk(q, q_idx, k_cache, v_cache, k_idx_cache, block_table, cache_seqlens,
                  cu_seqlens_q, block_size, topk, *, scale=None, index_scale=None):
    """``msa.reference.decode.prefill_chunk`` on the GPU: the chunk's queries against their whole
    caches. The index branch runs on the requests' index keys gathered into packed sequences
    (``gather_cache`` of ``k_idx_cache`` only: an eighth of K + V in the paper configuration)
    with ``msa.cuda.select.select_blocks_fused``; the main branch reads K and V from their pages
    through the block table, with no copy (``msa.cuda.attention.sparse_attention(...,
    block_table=...)``: the KV-outer path, each K1 block one page). Returns ``(o, lse,
    block_indices)``."""
    _ref.require_arrays(q=q, q_idx=q_idx, k_cache=k_cache, v_cache=v_cache,
                        k_idx_cache=k_idx_cache)
    layout = _ref.check_cache(k_cache, v_cache, k_idx_cache, block_table, cache_seqlens,
                              block_size=block_size, dtypes=_FLOAT_OR_BF16)
    check_positive_int("topk", topk, high=MAX_TOPK)
    cu_q, cu_k = _ref.chunk_offsets(layout, cu_seqlens_q, q, q_idx, dtype_of(k_cache),
                                    _FLOAT_OR_BF16)
    check_gqa(int(q.shape[1]), layout.num_kv_heads, allowed=GQA_GROUP_SIZES,
              what="q's heads over k_cache's, G = Hq/Hkv")  # sparse_attention's, before the gather
    _check_kernel_arrays(q=q, q_idx=q_idx, k_cache=k_cache, v_cache=v_cache,
                         k_idx_cache=k_idx_cache, block_table=block_table,
                         cache_seqlens=cache_seqlens)
    _, _, k_idx, _ = _gather(layout, None, None, k_idx_cache, block_table, cache_seqlens)
    block_indices = select_blocks_fused(q_idx, k_idx, cu_q, cu_k, block_size, topk,
                                        scale=index_scale)
    # the cache and the selection were checked above: validate=False reads nothing back
    o, lse = sparse_attention(q, k_cache, v_cache, block_indices, cu_q, cu_k, block_size,
                              scale=scale, block_table=block_table, validate=False)
    return o, lse, block_indices


__all__ = ["DecodePlan", "append_to_cache", "decode_attention", "decode_block_indices",
           "decode_step", "gather_cache", "plan", "prefill_chunk", "run"]
