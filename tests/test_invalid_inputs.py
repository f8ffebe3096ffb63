"""Invalid inputs to every public function of msa.reference, msa.torch and msa.cuda
(docs/design.md §7).

Each public function is a ``Spec``: its arguments in order, each with a kind (a float array, a
selection, offsets, a size, a scale, ...). Every kind has a list of mutations, what users get
wrong: the wrong dtype, rank, length or heads, a foreign array type, a non-contiguous view,
out-of-range, repeated or wrapped indices, decreasing or shifted offsets, ``block_size=16.9``,
``'16'`` or ``True``, a ``topk`` of ``10**9``, a NaN scale, a non-finite LSE, a knob passed
positionally. For each mutation the test knows the outcome:

* ``raises``: a ``ValueError`` or ``TypeError`` whose message names the argument (or the one it
  must agree with: ``q``'s length names ``cu_seqlens_q`` too), nothing else (no ``IndexError``,
  no ``MemoryError``, no ``OverflowError``);
* ``same``: the input is valid after all (a list for ``cu_seqlens``, a non-contiguous view,
  ``np.int64`` sizes) and the result is the unmutated call's, bit for bit;
* ``fast``: a huge size that needs no allocation (``block_size = 10**9``) either works or is
  refused by name, within seconds;
* ``runs``: non-finite data (NaN or inf in ``q``, ``k``, ``v``, scores): no error. That each
  query's output then depends only on the keys it sees is ``tests/test_masked_keys.py``;
* ``unsupported`` (``unsupported_dtype``: a ``TypeError``): what the reference takes and msa.cuda
  does not (G = 3, float64 attention): raised by name, saying that msa.cuda lacks it and that
  msa.reference accepts it (``msa._checks.unsupported``).

Hypothesis draws the problem (sizes, G, ``Lq < Lk``, dtypes); every mutation of every argument
runs on each drawn problem. ``BACKENDS`` has an entry per backend: ``msa.cuda`` (the simulator,
or a GPU with NumPy copied each way) reuses the reference's specs on ``Backend("cuda")``'s stage
functions, adds the mutations it answers otherwise (float64, G = 3) and draws fewer, smaller,
float32 problems (the simulator runs a Python thread per CUDA thread). Its limits that one
mutation cannot reach (``topk = 65`` where NB > 64, D > 256) are pinned at the end.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
import types
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import msa.reference as R
from msa.problems import make_problem
from msa.testing.backends import Backend, cuda_runnable

torch = pytest.importorskip("torch")

import msa.torch as MT  # noqa: E402

EXAMPLES = max(2, settings.default.max_examples // 5)  # problems per function (x every mutation)
CUDA_EXAMPLES = max(2, settings.default.max_examples // 10)  # msa.cuda: the simulator is slow
FAST_SECONDS = 10.0


# --- the problems -------------------------------------------------------------------------------

class Problem(types.SimpleNamespace):
    def __init__(self, label, **arrays):
        super().__init__(**arrays)
        self._label = label

    def __repr__(self):
        return f"build({self._label})"


@functools.lru_cache(maxsize=64)
def build(lq, lk, g, hkv, bk, topk, d, dtype_name, seed):
    """Every array of a consistent problem, read-only (a function that writes into its inputs
    fails too)."""
    dtype = np.dtype(dtype_name)
    p = make_problem(lk, lq, num_q_heads=g * hkv, num_kv_heads=hkv, head_dim=d, index_dim=4,
                     block_size=bk, topk=topk, dtype=dtype, seed=seed)
    P = Problem(f"Lq={lq}, Lk={lk}, G={g}, Hkv={hkv}, Bk={bk}, K={topk}, D={d}, {dtype_name}, "
                f"seed={seed}", q=p.q, k=p.k, v=p.v, q_idx=p.q_idx, k_idx=p.k_idx,
                              cu_q=p.cu_seqlens_q, cu_k=p.cu_seqlens_k, bk=bk, topk=topk,
                              hq=g * hkv, hkv=hkv, d=d, tq=p.q.shape[0], tk=p.k.shape[0])
    P.M = R.block_scores(p.q_idx, p.k_idx, P.cu_q, P.cu_k, bk)
    P.I = R.select_blocks(P.M, P.cu_q, P.cu_k, bk, topk)
    P.o, P.lse = R.sparse_attention(p.q, p.k, p.v, P.I, P.cu_q, P.cu_k, bk)
    P.do = np.random.default_rng(seed).standard_normal(P.o.shape).astype(P.o.dtype)
    P.counts = R.csr_histogram(P.I, P.cu_q, P.cu_k, bk)
    P.row_ptr, P.q_indices, P.slots = R.build_csr(P.I, P.cu_q, P.cu_k, bk)
    P.work = R.build_schedule(P.row_ptr, P.cu_k, bk, 5)
    P.o_part, P.lse_part = R.attention_partials(p.q, p.k, p.v, P.work, P.q_indices, P.slots,
                                                P.cu_q, P.cu_k, bk, topk)
    P.params = R.init_params(8, g * hkv, hkv, d, 4, seed=seed, dtype=dtype)
    P.x = np.random.default_rng(seed + 1).standard_normal((P.tk, 8)).astype(dtype)
    for name, value in vars(P).items():
        if isinstance(value, np.ndarray):
            value.setflags(write=False)
    return P


@st.composite
def problems(draw, dtypes=("float64", "float32"), max_len=20, max_queries=20):
    """A drawn problem: one or two sequences of at most ``max_len`` keys and ``max_queries``
    queries (the last of the keys), G in {1, 2, 4}."""
    n = draw(st.integers(1, 2))
    lk = tuple(draw(st.lists(st.integers(1, max_len), min_size=n, max_size=n)))
    lq = tuple(draw(st.integers(1, min(x, max_queries))) for x in lk)
    return build(lq, lk, draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 2)),
                 draw(st.sampled_from([4, 8])), draw(st.integers(1, 3)),
                 draw(st.sampled_from([4, 8])), draw(st.sampled_from(list(dtypes))),
                 draw(st.integers(0, 3)))


# --- arrays of either backend -------------------------------------------------------------------

class NumpyOps:
    """Mutations of NumPy arrays (msa.reference, msa.cuda under the simulator)."""

    name = "numpy"

    @staticmethod
    def wrap(x):
        return x

    @staticmethod
    def cast(x, kind):
        with np.errstate(invalid="ignore"):  # -inf scores to int
            return np.asarray(x).astype({"int": np.int32, "float": np.float32,
                                         "complex": np.complex64, "bool": bool,
                                         "uint64": np.uint64}[kind])

    @staticmethod
    def foreign(x):
        return torch.from_numpy(np.array(x))

    @staticmethod
    def strided(x):
        """The same values as a non-contiguous view."""
        return np.repeat(x, 2, axis=0)[::2]

    @staticmethod
    def with_value(x, index, value):
        y = np.array(x, copy=True)
        y[index] = value
        return y


class TorchOps:
    """Mutations of CPU tensors (msa.torch)."""

    name = "torch"

    @staticmethod
    def wrap(x):
        return torch.from_numpy(np.array(x))

    @staticmethod
    def cast(x, kind):
        if kind == "uint64":
            return torch.from_numpy(np.asarray(x.numpy()).astype(np.uint64))
        return x.to({"int": torch.int32, "float": torch.float32, "complex": torch.complex64,
                     "bool": torch.bool}[kind])

    @staticmethod
    def foreign(x):
        return x.numpy()

    @staticmethod
    def strided(x):
        return torch.repeat_interleave(x, 2, dim=0)[::2]

    @staticmethod
    def with_value(x, index, value):
        y = x.numpy().copy()
        y[index] = value
        return torch.from_numpy(y)


# --- mutations, by kind of argument -------------------------------------------------------------
# Each yields (label, value, outcome, names): outcome "raises" | "same" | "fast" | "runs", and the
# names one of which the error message must contain (the argument's own name is always allowed).

def float_array(name, x, ops, *, related=(), finite=False, rows=True):
    """A float array; ``finite``: NaN or inf in it is an error (an LSE for a backward)."""
    yield "int", ops.cast(x, "int"), "raises", related
    yield "complex", ops.cast(x, "complex"), "raises", related
    yield "bool", ops.cast(x, "bool"), "raises", related
    yield "rank+1", x[..., None], "raises", related
    yield "rank-1", x[..., 0], "raises", related
    if rows and x.shape[0] > 0:
        yield "one row short", x[:-1], "raises", related
    yield "list", x.tolist(), "raises", related
    yield "foreign", ops.foreign(x), ("same_or_type" if ops.name == "numpy" else "raises"), related
    if ops.name == "numpy":  # a tensor that requires grad: its values, or a named TypeError
        yield "foreign, requires grad", ops.foreign(x).requires_grad_(), "same_or_type", related
    if x.shape[0] > 0:
        yield "strided view", ops.strided(x), "same", ()
        first = (0,) * len(x.shape)
        for v in (np.nan, np.inf, -np.inf):
            yield f"{v} at {first}", ops.with_value(x, first, v), \
                ("raises" if finite else "runs"), related


def index_array(name, x, ops, *, related=(), rows=True, values=True, big="raises"):
    """An integer array (a selection, a CSR, a schedule); ``big``: the outcome of a 10**6."""
    yield "float", ops.cast(x, "float"), "raises", related
    yield "bool", ops.cast(x, "bool"), "raises", related
    yield "rank+1", x[..., None], "raises", related
    yield "rank-1", x[..., 0], "raises", related
    if rows and x.shape[0] > 0:
        yield "one row short", x[:-1], "raises", related
    yield "list", x.tolist(), "raises", related
    if x.shape[0] > 0 and values:
        first = (0,) * len(x.shape)
        yield "strided view", ops.strided(x), "same", ()
        yield "10**6", ops.with_value(x, first, 10**6), big, related
        yield "-5", ops.with_value(x, first, -5), "raises", related
        y = ops.cast(ops.with_value(x, first, 0), "uint64")
        y = ops.with_value(y, first, np.uint64(2**64 - 1))
        yield "uint64 2**64-1 (no wrap to -1)", y, "raises", related


def selection(name, x, ops, *, related=(), P=None):
    yield from index_array(name, x, ops, related=related)
    host = np.asarray(x)
    if P is not None:
        # the first block past its own sequence (a valid id of a longer one, if any)
        bq, _ = R.query_positions(P.cu_q, P.cu_k, P.tq, P.tk)
        nb_seq = np.diff(R.block_row_offsets(P.cu_k, P.bk))[bq]  # [Tq]
        past = host.copy()
        past[-1, 0, 0] = nb_seq[-1]
        yield "past its sequence", ops.wrap(past) if ops.name == "torch" else past, "raises", \
            related
    real = np.argwhere(host[..., 0] >= 0)
    if host.shape[-1] >= 2 and real.size:
        t, r = real[0]
        dup = host.copy()
        dup[t, r, 1] = dup[t, r, 0]
        yield "a block twice", ops.wrap(dup) if ops.name == "torch" else dup, "raises", related
        hole = host.copy()
        hole[t, r, 0] = -1
        hole[t, r, 1] = max(int(host[t, r, 0]), 0)
        yield "-1 before a block", ops.wrap(hole) if ops.name == "torch" else hole, "raises", \
            related


def offsets(name, cu, ops, *, related=(), total=True):
    """Offsets; ``total``: their end must match an array's length (else another end is a
    valid batch, or one that the other arguments refuse by name)."""
    cu = np.asarray(cu)
    end = int(cu[-1])
    yield "list", cu.tolist(), "same", ()
    yield "tuple", tuple(int(c) for c in cu), "same", ()
    yield "int64", cu.astype(np.int64), "same", ()
    yield "torch tensor", torch.from_numpy(cu.astype(np.int64)), "same", ()
    yield "decreasing", np.array([0, end + 1, end], np.int32), "raises", related
    yield "shifted", cu + 1, "raises", related
    yield "2-D", cu[None], "raises", related
    yield "float", cu.astype(np.float64), "raises", related
    yield "float list", [float(c) for c in cu], "raises", related
    yield "bool", np.ones(cu.shape, bool), "raises", related
    yield "string", "0," + str(end), "raises", related
    yield "one entry", cu[:1], "raises", related
    yield "wrong end", np.append(cu[:-1], end + 1).astype(np.int32), \
        ("raises" if total else "fast"), related
    yield "uint64 2**64-1", np.array([0, 2**64 - 1], np.uint64), "raises", related


def size(name, value, ops, *, low=1, related=(), huge=None):
    """An integer size. ``huge``: the outcome of ``10**9`` and ``10**30`` (None: not tried, the
    caller asked for an output of that size)."""
    yield "float", float(value) + 0.9, "raises", related
    yield "whole float", float(value), "raises", related
    yield "string", str(value), "raises", related
    yield "bool", True, "raises", related
    yield "numpy int", np.int64(value), "same", ()
    yield "below the minimum", low - 1, "raises", related
    yield "array", np.array([value]), "raises", related
    if huge is not None:
        yield "10**9", 10**9, huge, related
        yield "10**30", 10**30, huge, related


def scale(name, value, ops, *, related=()):
    for bad in (-1.0, 0.0, float("nan"), float("inf")):
        yield repr(bad), bad, "raises", related
    yield "string", "0.5", "raises", related
    yield "complex", 0.5j, "raises", related
    yield "bool", True, "raises", related
    yield "numpy float", np.float64(0.5), "fast", ()


def choice(name, value, ops, *, related=()):
    yield "unknown", "median-of-three", "raises", related
    yield "None", None, "raises", related


def real(name, value, ops, *, related=()):
    yield "nan", float("nan"), "raises", related
    yield "string", "1", "raises", related
    yield "bool", True, "raises", related


def dtype_arg(name, value, ops, *, related=()):
    yield "int32", np.int32, "raises", related
    yield "complex", np.complex64, "raises", related
    yield "nonsense", "float-ish", "raises", related


def torch_dtype(name, value, ops, *, related=()):
    yield "int32", torch.int32, "raises", related
    yield "complex", torch.complex64, "raises", related
    yield "numpy float", np.float32, "raises", related


def params_arg(name, value, ops, *, related=()):
    yield "dict", dataclasses.asdict(value), "raises", related
    yield "None", None, "raises", related


def device_arg(name, value, ops, *, related=()):
    if not torch.cuda.is_available():  # on a GPU machine "cuda" is a valid device
        yield "cuda on this CPU-only torch", "cuda", "raises_any", related
    yield "nonsense", "gpu0", "raises", related


# --- the functions -----------------------------------------------------------------------------

@dataclasses.dataclass
class Spec:
    """A public function: ``args(P, ops)`` gives ``[(name, value, mutations)]`` in order and
    ``keywords`` how many of the last ones are keyword-only."""

    fn: object
    args: object
    keywords: int = 0
    knob: tuple | None = None  # (name, valid value) of a keyword-only knob, tried positionally


def _offsets2(P, ops, related_q=(), related_k=(), *, q_total=True, k_total=True):
    """``cu_seqlens_q, cu_seqlens_k``; ``*_total``: an array's length fixes their end."""
    return [("cu_seqlens_q", P.cu_q, functools.partial(offsets, total=q_total,
                                                       related=("cu_seqlens_k",) + related_q)),
            ("cu_seqlens_k", P.cu_k, functools.partial(offsets, total=k_total,
                                                       related=("cu_seqlens_q",) + related_k))]


def _bk(P, huge="fast"):
    """``block_size``: a huge one is one block per sequence (no allocation of its size); an
    error then names what it disagrees with."""
    return ("block_size", P.bk, functools.partial(
        size, huge="fast", related=("topk", "block_indices", "block_scores", "row_ptr", "work",
                                    "partial_slots", "q_indices")))


def _qkv(P, ops, names=("q", "k", "v")):
    # a length or head count must agree with the other arrays': the error may name either
    tq = ("cu_seqlens_q", "q", "q_idx", "o", "do", "lse", "block_indices", "Tq")
    tk = ("cu_seqlens_k", "k", "v", "k_idx", "Tk")
    rel = {"q": tq + ("k", "Hq", "Hkv", "num_q_heads"), "k": tk + ("q", "Hq", "Hkv", "q_idx"),
           "v": tk, "q_idx": tq + ("k_idx", "k"), "k_idx": tk + ("q_idx",)}
    return [(n, ops.wrap(getattr(P, n)), functools.partial(float_array, related=rel[n]))
            for n in names]


def _sel(P, ops):
    return ("block_indices", ops.wrap(P.I),
            functools.partial(selection, P=P, related=("cu_seqlens_q", "cu_seqlens_k", "topk")))


def _lse(P, ops):
    return ("lse", ops.wrap(P.lse), functools.partial(float_array, finite=True, related=("q",)))


def _scale(name="scale"):
    return (name, None, scale)


def _ref_specs():
    N = dict(N=1024, Hq=8, Hkv=2, d_h=16, d_idx=16, block_size=16, topk=4)

    def csize(name):
        return (name, N[name], functools.partial(size, huge="fast", related=("Hq", "Hkv")))

    def cx(*names, kw=()):
        return lambda P, ops: [csize(n) for n in names] + list(kw)

    bpe = ("bytes_per_element", 2, functools.partial(size, huge="fast"))
    heads = functools.partial(size, related=("num_q_heads", "num_kv_heads", "Hq", "Hkv"))
    return {
        "gqa_group": Spec(R.gqa_group, lambda P, ops: [("num_q_heads", P.hq, heads),
                                                        ("num_kv_heads", P.hkv, heads)]),
        "num_blocks": Spec(R.num_blocks, lambda P, ops: [
            ("length", P.tk, functools.partial(size, low=0)), _bk(P)]),
        "block_partition": Spec(R.block_partition, lambda P, ops: [
            ("length", P.tk, functools.partial(size, low=0)), _bk(P)]),
        "query_positions": Spec(R.query_positions, lambda P, ops: _offsets2(P, ops, ("total_q",), ("total_k",)) + [
            ("total_q", P.tq, functools.partial(size, low=0, related=("cu_seqlens_q",))),
            ("total_k", P.tk, functools.partial(size, low=0, related=("cu_seqlens_k",)))]),
        "key_positions": Spec(R.key_positions, lambda P, ops: [
            ("cu_seqlens_k", P.cu_k, functools.partial(offsets, related=("total_k",))),
            ("total_k", P.tk, functools.partial(size, low=0, related=("cu_seqlens_k",)))]),
        "local_blocks": Spec(R.local_blocks, lambda P, ops: _offsets2(P, ops, ("total_q",), ("total_k",)) + [
            ("total_q", P.tq, functools.partial(size, low=0, related=("cu_seqlens_q",))),
            ("total_k", P.tk, functools.partial(size, low=0, related=("cu_seqlens_k",))), _bk(P)]),
        "block_row_offsets": Spec(R.block_row_offsets, lambda P, ops: [
            ("cu_seqlens_k", P.cu_k, functools.partial(offsets, total=False)), _bk(P)]),
        "max_blocks": Spec(R.max_blocks, lambda P, ops: [
            ("cu_seqlens_k", P.cu_k, functools.partial(offsets, total=False)), _bk(P)]),
        "index_projections": Spec(R.index_projections, lambda P, ops: [
            ("x", P.x, functools.partial(float_array, rows=False, related=("w_q_idx", "w_k_idx"))),
            ("w_q_idx", P.params.w_q_idx, functools.partial(float_array, rows=False, related=("x",))),
            ("w_k_idx", P.params.w_k_idx, functools.partial(float_array, rows=False, related=("x", "w_q_idx"))),
            ("num_kv_heads", P.hkv, functools.partial(size, huge="fast", related=("w_q_idx",)))]),
        "index_scores": Spec(R.index_scores, lambda P, ops: _qkv(P, ops, ("q_idx", "k_idx"))
                             + _offsets2(P, ops, ("q_idx",), ("k_idx",)) + [_scale()], keywords=1,
                             knob=("scale", 0.5)),
        "block_scores": Spec(R.block_scores, lambda P, ops: _qkv(P, ops, ("q_idx", "k_idx"))
                             + _offsets2(P, ops, ("q_idx",), ("k_idx",)) + [_bk(P), _scale(),
                                                                           ("pool", "max", choice)],
                             keywords=2, knob=("scale", 0.5)),
        "select_blocks": Spec(R.select_blocks, lambda P, ops: [
            ("block_scores", P.M, functools.partial(float_array, rows=False,
                                                    related=("cu_seqlens_q", "cu_seqlens_k"))),
            *_offsets2(P, ops, ("block_scores",), ("block_scores",), k_total=False),
            _bk(P, huge="raises_named"),
            ("topk", P.topk, functools.partial(size, huge="raises_named"))]),
        "fixed_blocks": Spec(R.fixed_blocks, lambda P, ops: [
            *_offsets2(P, ops, q_total=False, k_total=False), _bk(P),
            ("topk", P.topk, functools.partial(size, huge="raises_named")),
            ("num_kv_heads", P.hkv, functools.partial(size, huge="raises_named")),
            ("num_sink", 1, functools.partial(size, low=0, huge="fast"))], keywords=2,
            knob=("num_kv_heads", 1)),
        "check_block_indices": Spec(R.check_block_indices, lambda P, ops: [
            _sel(P, ops), *_offsets2(P, ops, ("block_indices",), k_total=False),
            _bk(P, huge="raises_named")]),
        "dense_attention": Spec(R.dense_attention, lambda P, ops: _qkv(P, ops) + _offsets2(P, ops, ("q",), ("k",))
                                + [_scale()], keywords=1, knob=("scale", 0.5)),
        "sparse_attention": Spec(R.sparse_attention, lambda P, ops: _qkv(P, ops) + [_sel(P, ops)]
                                 + _offsets2(P, ops, ("q", "block_indices"), ("k",))
                                 + [_bk(P, huge="raises_named"), _scale()], keywords=1, knob=("scale", 0.5)),
        "sparse_attention_backward": Spec(R.sparse_attention_backward, lambda P, ops: _qkv(P, ops) + [
            ("o", P.o, float_array), _lse(P, ops), ("do", P.do, float_array), _sel(P, ops),
            *_offsets2(P, ops, ("q", "block_indices"), ("k",)), _bk(P, huge="raises_named"),
            _scale()], keywords=1, knob=("scale", 0.5)),
        "attention_partials": Spec(R.attention_partials, lambda P, ops: _qkv(P, ops) + [
            ("work", P.work, functools.partial(index_array, rows=False, related=("q_indices", "partial_slots"))),
            ("q_indices", P.q_indices, functools.partial(index_array, related=("work", "partial_slots"))),
            ("partial_slots", P.slots, functools.partial(index_array, related=("q_indices", "work"))),
            *_offsets2(P, ops, ("q",), ("k", "work")), _bk(P, huge="raises_named"),
            ("topk", P.topk, functools.partial(size, huge="raises_named", related=("partial_slots",))),
            _scale()], keywords=1, knob=("scale", 0.5)),
        "combine_partials": Spec(R.combine_partials, lambda P, ops: [
            ("o_part", P.o_part, functools.partial(float_array, related=("lse_part",))),
            ("lse_part", P.lse_part, functools.partial(float_array, related=("o_part",))),
            ("out_dtype", None, dtype_arg)], keywords=1, knob=("out_dtype", np.float32)),
        "csr_histogram": Spec(R.csr_histogram, lambda P, ops: [
            _sel(P, ops), *_offsets2(P, ops, ("block_indices",), k_total=False),
            _bk(P, huge="raises_named")]),
        "exclusive_prefix_sum": Spec(R.exclusive_prefix_sum, lambda P, ops: [
            ("counts", P.counts, functools.partial(index_array, rows=False, big="runs"))]),
        "csr_scatter": Spec(R.csr_scatter, lambda P, ops: [
            _sel(P, ops), ("row_ptr", P.row_ptr, functools.partial(index_array, related=("block_indices",))),
            *_offsets2(P, ops, ("block_indices",), ("row_ptr",), k_total=False),
            _bk(P, huge="raises_named")]),
        "build_csr": Spec(R.build_csr, lambda P, ops: [
            _sel(P, ops), *_offsets2(P, ops, ("block_indices",), k_total=False),
            _bk(P, huge="raises_named")]),
        "build_schedule": Spec(R.build_schedule, lambda P, ops: [
            ("row_ptr", P.row_ptr, functools.partial(index_array, rows=False, related=("cu_seqlens_k",))),
            ("cu_seqlens_k", P.cu_k, functools.partial(offsets, total=False, related=("row_ptr",))),
            _bk(P, huge="raises_named"), ("chunk_size", 5, functools.partial(size, huge="fast"))]),
        "schedule_stats": Spec(R.schedule_stats, lambda P, ops: [
            ("work", P.work, functools.partial(index_array, rows=False, values=False))]),
        **{name: Spec(getattr(R, name), (lambda P, ops: _qkv(P, ops, ("q", "k", "q_idx", "k_idx")) + [
            _sel(P, ops), _lse(P, ops), *_offsets2(P, ops, ("q", "q_idx", "block_indices", "lse"),
                                                   ("k", "k_idx")),
            _bk(P, huge="raises_named"), _scale(), _scale("index_scale")]), keywords=2,
            knob=("scale", 0.5)) for name in ("kl_loss", "kl_backward", "kl_loss_and_backward")},
        "student_probs": Spec(R.student_probs, lambda P, ops: _qkv(P, ops, ("q_idx", "k_idx")) + [
            _sel(P, ops), *_offsets2(P, ops, ("q_idx", "block_indices"), ("k_idx",)),
            _bk(P, huge="raises_named"), _scale("index_scale")], keywords=1, knob=("index_scale", 0.5)),
        "teacher_probs": Spec(R.teacher_probs, lambda P, ops: _qkv(P, ops, ("q", "k")) + [
            _sel(P, ops), _lse(P, ops), *_offsets2(P, ops, ("q", "block_indices", "lse"), ("k",)),
            _bk(P, huge="raises_named"), _scale()], keywords=1, knob=("scale", 0.5)),
        "gqa_flops": Spec(R.gqa_flops, cx("N", "Hq", "d_h")),
        "attention_flops": Spec(R.attention_flops, cx("N", "Hq", "d_h", "block_size", "topk")),
        "msa_flops": Spec(R.msa_flops, cx("N", "Hq", "Hkv", "d_h", "d_idx", "block_size", "topk")),
        "crossover_length": Spec(R.crossover_length, cx("Hq", "Hkv", "d_h", "d_idx", "block_size", "topk")),
        "speedup_limit": Spec(R.speedup_limit, cx("Hq", "Hkv", "d_h", "d_idx")),
        "q_outer_io": Spec(R.q_outer_io, cx("N", "Hq", "Hkv", "d_h", "block_size", "topk", kw=[bpe]),
                           keywords=1, knob=("bytes_per_element", 2)),
        "kv_outer_io": Spec(R.kv_outer_io, cx("N", "Hq", "Hkv", "d_h", "topk", kw=[bpe]), keywords=1,
                            knob=("bytes_per_element", 2)),
        "arithmetic_intensity": Spec(R.arithmetic_intensity, cx(
            "N", "Hq", "Hkv", "d_h", "block_size", "topk",
            kw=[("loop_order", "kv_outer", choice), bpe]), keywords=2, knob=("loop_order", "q_outer")),
        "init_params": Spec(R.init_params, lambda P, ops: [
            ("d_model", 8, size), ("num_q_heads", P.hq, heads), ("num_kv_heads", P.hkv, heads),
            ("head_dim", P.d, size), ("index_dim", 4, size),
            ("seed", 0, functools.partial(size, low=0)), ("dtype", np.float64, dtype_arg)],
            keywords=2, knob=("seed", 1)),
        "msa_layer": Spec(R.msa_layer, lambda P, ops: [
            ("x", P.x, functools.partial(float_array, related=("cu_seqlens",))),
            ("params", P.params, params_arg),
            ("cu_seqlens", P.cu_k, offsets), _bk(P, huge="raises_named"),
            ("topk", P.topk, functools.partial(size, huge="raises_named")), _scale(),
            _scale("index_scale")], keywords=2, knob=("scale", 0.5)),
    }


def _torch_specs():
    def forward(x, cu_seqlens, *, _P):
        return _layer_cache(_P)(x, cu_seqlens)

    heads = functools.partial(size, related=("num_q_heads", "num_kv_heads", "Hq", "Hkv"))
    return {
        "sparse_attention": Spec(MT.sparse_attention, lambda P, ops: _qkv(P, ops) + [_sel(P, ops)]
                                 + _offsets2(P, ops, ("q", "block_indices"), ("k",))
                                 + [_bk(P, huge="raises_named"), _scale(), ("backward", "auto", choice)],
                                 keywords=2, knob=("scale", 0.5)),
        "sparse_attention_backward": Spec(MT.sparse_attention_backward, lambda P, ops: _qkv(P, ops) + [
            ("o", ops.wrap(P.o), float_array), _lse(P, ops), ("do", ops.wrap(P.do), float_array),
            _sel(P, ops), *_offsets2(P, ops, ("q", "block_indices"), ("k",)),
            _bk(P, huge="raises_named"), _scale()], keywords=1, knob=("scale", 0.5)),
        "dense_attention": Spec(MT.dense_attention, lambda P, ops: _qkv(P, ops)
                                + _offsets2(P, ops, ("q",), ("k",)) + [_scale()], keywords=1,
                                knob=("scale", 0.5)),
        "kl_loss": Spec(MT.kl_loss, lambda P, ops: _qkv(P, ops, ("q", "k", "q_idx", "k_idx")) + [
            _sel(P, ops), _lse(P, ops), *_offsets2(P, ops, ("q", "q_idx", "block_indices", "lse"),
                                                   ("k", "k_idx")),
            _bk(P, huge="raises_named"), _scale(), _scale("index_scale")], keywords=2,
            knob=("scale", 0.5)),
        "MSAAttention": Spec(MT.MSAAttention, lambda P, ops: [
            ("d_model", 8, size), ("num_q_heads", P.hq, heads), ("num_kv_heads", P.hkv, heads),
            ("head_dim", P.d, size), ("index_dim", 4, size), _bk(P, huge="raises_named"),
            ("topk", P.topk, size), _scale(), _scale("index_scale"),
            ("main_backward", "auto", choice), ("device", None, device_arg),
            ("dtype", torch.float64, torch_dtype)], keywords=7, knob=("block_size", 8)),
        "MSAAttention.forward": Spec(forward, lambda P, ops: [
            ("x", ops.wrap(P.x), functools.partial(float_array, related=("cu_seqlens",))),
            ("cu_seqlens", P.cu_k, offsets), ("_P", P, None)], keywords=1),
        "MSAAttention.from_params": Spec(MT.MSAAttention.from_params, lambda P, ops: [
            ("params", P.params, params_arg), _bk(P, huge="raises_named"),
            ("topk", P.topk, size), ("dtype", None, torch_dtype)], keywords=3,
            knob=("block_size", 8)),
    }


_LAYERS = {}


def _layer_cache(P):
    """One layer per drawn problem (problems are cached, so their ids are stable)."""
    if id(P) not in _LAYERS:
        _LAYERS[id(P)] = MT.MSAAttention.from_params(P.params, block_size=P.bk, topk=P.topk)
    return _LAYERS[id(P)]


# --- msa.cuda: the reference's specs on Backend("cuda"), with what it accepts less of ----------

def _related(mutations):
    """The names a mutation's error may give besides the argument's own (its ``related``)."""
    return getattr(mutations, "keywords", {}).get("related", ())


def with_float64(outcome):
    """The argument as float64 too: ``unsupported_dtype`` where msa.cuda has no float64 kernel,
    ``raises`` where another argument's dtype then disagrees, ``runs`` where it computes in
    float64."""
    def extra(mutations, P):
        def gen(name, x, ops):
            yield from mutations(name, x, ops)
            yield "float64", np.asarray(x).astype(np.float64), outcome, _related(mutations)
        return gen
    return extra


def with_group3(more=None):
    """``q`` with ``Hq = 3 Hkv`` heads too (then ``more``'s mutations): G = 3, which the
    reference takes and msa.cuda's attention does not (its tiles hold G in {1, 2, 4, 8, 16})."""
    def extra(mutations, P):
        inner = more(mutations, P) if more else mutations

        def gen(name, x, ops):
            yield from inner(name, x, ops)
            yield "G = 3", np.repeat(x[:, :1], 3 * P.hkv, axis=1), "unsupported", ()
        return gen
    return extra


def _cuda_specs():
    """Every public launcher of msa.cuda that a reference function mirrors (decode has its own
    tests): the reference's arguments and mutations on msa.cuda's function, plus the mutations
    that msa.cuda answers otherwise (float64, G = 3)."""
    C = Backend("cuda")
    ref = _ref_specs()

    def cuda(name, fn, extra=None, spec=None):
        """``spec`` (default the reference's ``name``) on ``fn``; ``extra`` maps an argument to
        ``f(mutations, P)``, its mutations with msa.cuda's own added."""
        base = spec or ref[name]
        extra = extra or {}

        def args(P, ops):
            return [(n, v, extra[n](m, P) if n in extra else m) for n, v, m in base.args(P, ops)]
        return dataclasses.replace(base, fn=fn, args=args)

    no64, mismatch64 = with_float64("unsupported_dtype"), with_float64("raises")
    attention = {"q": with_group3(no64), "k": no64, "v": no64}
    kl = {n: no64 for n in ("q", "k", "q_idx", "k_idx", "lse")}
    index = {"q_idx": mismatch64, "k_idx": mismatch64}

    def topk_arg(P):  # select_blocks' topk
        return ("topk", P.topk, functools.partial(size, huge="raises_named"))

    fused = Spec(None, lambda P, ops: _qkv(P, ops, ("q_idx", "k_idx"))
                 + _offsets2(P, ops, ("q_idx",), ("k_idx",))
                 + [_bk(P), topk_arg(P), _scale()], keywords=1, knob=("scale", 0.5))
    prefill = Spec(None, lambda P, ops: _qkv(P, ops, ("q", "k", "v", "q_idx", "k_idx"))
                   + _offsets2(P, ops, ("q", "q_idx"), ("k", "k_idx"))
                   + [_bk(P), topk_arg(P), _scale(), _scale("index_scale")], keywords=2,
                   knob=("scale", 0.5))
    return {
        "block_scores": cuda("block_scores", C.index.block_scores, index),
        "select_blocks": cuda("select_blocks", C.select.select_blocks,
                              {"block_scores": with_float64("runs")}),
        "select_blocks_fused": cuda("select_blocks_fused", C.select.select_blocks_fused, index,
                                    fused),
        "csr_histogram": cuda("csr_histogram", C.csr.csr_histogram),
        "exclusive_prefix_sum": cuda("exclusive_prefix_sum", C.csr.exclusive_prefix_sum),
        "csr_scatter": cuda("csr_scatter", C.csr.csr_scatter),
        "build_csr": cuda("build_csr", C.csr.build_csr),
        "build_schedule": cuda("build_schedule", C.schedule.build_schedule),
        "attention_partials": cuda("attention_partials", C.attention.attention_partials,
                                   attention),
        "combine_partials": cuda("combine_partials", C.combine.combine_partials,
                                 {"o_part": no64, "lse_part": no64}),
        "sparse_attention": cuda("sparse_attention", C.attention.sparse_attention, attention),
        "sparse_attention_backward": cuda(
            "sparse_attention_backward", C.attention.sparse_attention_backward,
            dict(attention, o=no64, do=no64, lse=no64)),
        "msa_prefill": cuda("msa_prefill", C.attention.msa_prefill, dict(attention, **index),
                            prefill),
        **{name: cuda(name, getattr(C.kl, name), kl)
           for name in ("kl_loss", "kl_backward", "kl_loss_and_backward")},
    }


@dataclasses.dataclass
class BackendCase:
    """One backend of the fuzz: its specs, how its arrays mutate, and the problems it draws."""

    specs: dict
    ops: object
    problems: object
    examples: int
    skip: str = ""  # why it cannot run here ("" if it can)


REFERENCE = _ref_specs()
TORCH = _torch_specs()
CUDA_RUNNABLE, CUDA_WHY_NOT = cuda_runnable()
BACKENDS = {
    "reference": BackendCase(REFERENCE, NumpyOps, problems(), EXAMPLES),
    "torch": BackendCase(TORCH, TorchOps, problems(), EXAMPLES),
    # float32 problems (msa.cuda's attention and KL have no float64; the float64 mutations say
    # so), few queries and few problems a function: the simulator runs every CUDA thread as a
    # Python thread, and its time grows with the queries
    "cuda": BackendCase(_cuda_specs(), NumpyOps,
                        problems(dtypes=("float32",), max_len=12, max_queries=3),
                        CUDA_EXAMPLES, "" if CUDA_RUNNABLE else CUDA_WHY_NOT),
}
CASES = [pytest.param(b, name, id=f"{b}-{name}",
                      marks=[pytest.mark.skipif(bool(case.skip), reason=case.skip)])
         for b, case in BACKENDS.items() for name in case.specs]


# --- the checks --------------------------------------------------------------------------------

def same(a, b) -> bool:
    """Bitwise-equal results (NaN equal to NaN), through tuples, dicts and dataclasses."""
    if isinstance(a, torch.nn.Module):
        return isinstance(b, torch.nn.Module) and a.extra_repr() == b.extra_repr()
    if dataclasses.is_dataclass(a):
        return same(dataclasses.astuple(a), dataclasses.astuple(b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        a, b = a.detach().numpy(), b.detach().numpy()
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.kind in "fc":
        return bool(np.array_equal(a, b, equal_nan=True))
    return bool(np.array_equal(a, b))


def names(arg, related):
    return (arg,) + tuple(related)


UNSUPPORTED = re.compile(r"not supported by msa\.cuda.*msa\.reference accepts it")


def check(fn, args, keywords, arg, label, value, outcome, related, baseline):
    call = dict(args)
    call[arg] = value
    what = f"{arg} = {label}"
    named = re.compile("|".join(rf"(?<![\w]){re.escape(n)}(?![\w])" for n in names(arg, related)))
    start = time.perf_counter()
    try:
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = fn(**call)
    except (ValueError, TypeError) as e:
        if outcome in ("same", "runs"):
            raise AssertionError(f"{what}: valid input refused: {type(e).__name__}: {e}") from e
        if outcome == "same_or_type" and not isinstance(e, TypeError):
            raise AssertionError(f"{what}: {type(e).__name__}: {e}") from e
        if outcome == "unsupported_dtype" and not isinstance(e, TypeError):
            raise AssertionError(f"{what}: {type(e).__name__} (a dtype is a TypeError): {e}") from e
        if outcome.startswith("unsupported") and not UNSUPPORTED.search(str(e)):
            raise AssertionError(f"{what}: the error does not say that msa.cuda lacks it and "
                                 f"msa.reference has it: {type(e).__name__}: {e}") from e
        if outcome != "raises_any" and not named.search(str(e)):
            raise AssertionError(f"{what}: the error does not name {names(arg, related)}: "
                                 f"{type(e).__name__}: {e}") from e
        return
    except RuntimeError as e:
        if outcome == "raises_any" and "device" in str(e):
            return
        raise AssertionError(f"{what}: raw {type(e).__name__}: {e}") from e
    except Exception as e:  # IndexError, MemoryError, OverflowError, a Numba error, ...: never
        raise AssertionError(f"{what}: raw {type(e).__name__}: {e}") from e
    elapsed = time.perf_counter() - start
    if outcome in ("raises", "raises_named", "raises_any") or outcome.startswith("unsupported"):
        raise AssertionError(f"{what}: accepted (expected a ValueError/TypeError)")
    if outcome in ("same", "same_or_type"):
        assert same(got, baseline), f"{what}: a different result"
    if outcome == "fast":
        assert elapsed < FAST_SECONDS, f"{what}: {elapsed:.1f} s"


def fuzz(spec, ops, P):
    """Every mutation of every argument of ``spec`` on problem ``P``."""
    arguments = spec.args(P, ops)
    args = {a: v for a, v, _ in arguments}
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        baseline = spec.fn(**args)
    for arg, value, mutations in arguments:
        if mutations is None:
            continue
        for label, bad, outcome, related in mutations(arg, value, ops):
            check(spec.fn, args, spec.keywords, arg, label, bad, outcome, related, baseline)


@pytest.mark.parametrize("backend,name", CASES)
def test_invalid_inputs_are_refused_by_name(backend, name):
    case = BACKENDS[backend]

    @settings(max_examples=case.examples)
    @given(P=case.problems)
    def run(P):
        fuzz(case.specs[name], case.ops, P)

    run()


@pytest.mark.parametrize("backend,name", [c for c in CASES
                                           if BACKENDS[c.values[0]].specs[c.values[1]].knob])
def test_knobs_are_keyword_only(backend, name):
    """A FlashAttention habit (``max_seqlen_q`` passed after the offsets) must not become a
    scale: every knob is keyword-only, so one more positional argument is a TypeError."""
    case = BACKENDS[backend]
    spec = case.specs[name]
    P = build((3,), (5,), 2, 1, 4, 2, 4, "float64" if backend != "cuda" else "float32", 0)
    arguments = spec.args(P, case.ops)
    positional = [v for _, v, _ in arguments[:len(arguments) - spec.keywords]]
    knob, value = spec.knob
    with pytest.raises(TypeError, match="positional"):
        spec.fn(*positional, value)


# --- single bad inputs, pinned: each call and the error it must raise -------------------------

def _pinned_problem():
    return build((6, 5), (10, 5), 2, 2, 4, 2, 4, "float64", 1)


def _torch_args(P, **change):
    a = dict(q=T(P.q), k=T(P.k), v=T(P.v), block_indices=T(P.I), cu_seqlens_q=P.cu_q,
             cu_seqlens_k=P.cu_k, block_size=P.bk)
    a.update(change)
    return a


def T(x):
    return torch.from_numpy(np.array(x))


PINNED = {
    "torch backward: a block twice": (lambda P: MT.sparse_attention_backward(
        T(P.q), T(P.k), T(P.v), T(P.o), T(P.lse), T(P.do),
        T(np.where(np.arange(P.topk) == 1, P.I[..., :1], P.I)), P.cu_q, P.cu_k, P.bk),
        ValueError, "block_indices"),
    "torch backward: id 99": (lambda P: MT.sparse_attention_backward(
        T(P.q), T(P.k), T(P.v), T(P.o), T(P.lse), T(P.do), T(np.full_like(P.I, 99)), P.cu_q,
        P.cu_k, P.bk), ValueError, "block_indices"),
    "torch backward: int do": (lambda P: MT.sparse_attention_backward(
        T(P.q), T(P.k), T(P.v), T(P.o), T(P.lse), T(P.do).long(), T(P.I), P.cu_q, P.cu_k, P.bk),
        TypeError, "do"),
    "torch backward: -inf lse": (lambda P: MT.sparse_attention_backward(
        T(P.q), T(P.k), T(P.v), T(P.o), T(np.full_like(P.lse, -np.inf)), T(P.do), T(P.I), P.cu_q,
        P.cu_k, P.bk), ValueError, r"lse\[0, 0\] = -inf"),
    "reference backward: nan lse": (lambda P: R.sparse_attention_backward(
        P.q, P.k, P.v, P.o, np.full_like(P.lse, np.nan), P.do, P.I, P.cu_q, P.cu_k, P.bk),
        ValueError, r"lse\[0, 0\] = nan"),
    "torch dense: int64 q, k, v": (lambda P: MT.dense_attention(
        T(P.q).long(), T(P.k).long(), T(P.v).long(), P.cu_q, P.cu_k), TypeError, "q"),
    "torch dense: scale nan": (lambda P: MT.dense_attention(
        T(P.q), T(P.k), T(P.v), P.cu_q, P.cu_k, scale=float("nan")), ValueError, "scale"),
    "select_blocks: topk 10**9": (lambda P: R.select_blocks(P.M, P.cu_q, P.cu_k, P.bk, 10**9),
                                  ValueError, "topk"),
    "fixed_blocks: topk 10**8": (lambda P: R.fixed_blocks(P.cu_q, P.cu_k, P.bk, 10**8,
                                                          num_kv_heads=2), ValueError, "topk"),
    "attention_partials: topk 10**9": (lambda P: R.attention_partials(
        P.q, P.k, P.v, P.work, P.q_indices, P.slots, P.cu_q, P.cu_k, P.bk, 10**9), ValueError,
        "topk"),
    "torch sparse: block_size 16.9": (lambda P: MT.sparse_attention(
        **_torch_args(P, block_size=16.9)), TypeError, "block_size"),
    "torch sparse: block_size '16'": (lambda P: MT.sparse_attention(
        **_torch_args(P, block_size="16")), TypeError, "block_size"),
    "torch kl: block_size True": (lambda P: MT.kl_loss(
        T(P.q), T(P.k), T(P.q_idx), T(P.k_idx), T(P.I), T(P.lse), P.cu_q, P.cu_k, True),
        TypeError, "block_size"),
    "gqa_group(4.0, 2)": (lambda P: R.gqa_group(4.0, 2), TypeError, "num_q_heads"),
    "uint64 id 2**64-1": (lambda P: R.check_block_indices(
        np.where(np.arange(P.topk) == 0, np.uint64(2**64 - 1), P.I.astype(np.uint64)), P.cu_q,
        P.cu_k, P.bk), ValueError, "18446744073709551615"),
    "init_params(dtype=int32)": (lambda P: R.init_params(8, 4, 2, 4, 4, dtype=np.int32),
                                 TypeError, "dtype"),
    "max_blocks: decreasing": (lambda P: R.max_blocks(np.array([0, 5, 3]), 4), ValueError,
                               "cu_seqlens_k"),
    "block_row_offsets: shifted": (lambda P: R.block_row_offsets(np.array([1, 5]), 4), ValueError,
                                   "cu_seqlens_k"),
    "key_positions: 2-D": (lambda P: R.key_positions(np.array([[0, 5]]), 5), ValueError,
                           "cu_seqlens_k"),
    "max_blocks: float": (lambda P: R.max_blocks(np.array([0.0, 5.0]), 4), TypeError,
                          "cu_seqlens_k"),
    "dense_attention(q, k, v, cu_q, cu_k, max_seqlen_q)": (lambda P: R.dense_attention(
        P.q, P.k, P.v, P.cu_q, P.cu_k, 70), TypeError, "positional"),
    "MSAAttention: float32 x into a float64 layer": (lambda P: MT.MSAAttention.from_params(
        P.params, block_size=4, topk=2)(T(P.x).float(), P.cu_k), TypeError, r"\bx\b"),
    "MSAAttention(dtype=torch.int32)": (lambda P: MT.MSAAttention(8, 4, 2, 4, 4,
                                                                  dtype=torch.int32),
                                        TypeError, "dtype"),
    "MSAAttention: x with the wrong length": (lambda P: MT.MSAAttention.from_params(
        P.params, block_size=4, topk=2)(T(P.x)[:-1], P.cu_k), ValueError, r"cu_seqlens\b"),
    "MSAAttention(device='cuda') without CUDA": (lambda P: MT.MSAAttention(
        8, 4, 2, 4, 4, device="cuda"), ValueError, "device"),
    "reference kl: validate 'no'": (lambda P: R.kl_loss(
        P.q, P.k, P.q_idx, P.k_idx, P.I, P.lse, P.cu_q, P.cu_k, P.bk, validate="no"), TypeError,
        "validate"),
    "torch sparse: validate 'no'": (lambda P: MT.sparse_attention(
        **_torch_args(P), validate="no"), TypeError, "validate"),
    "msa_layer: warmup 'no'": (lambda P: R.msa_layer(P.x, P.params, P.cu_k, 4, 2, warmup="no"),
                               TypeError, "warmup"),
    "MSAParams: a float32 w_k beside float64 weights": (lambda P: dataclasses.replace(
        P.params, w_k=P.params.w_k.astype(np.float32)), TypeError, "w_k"),
    "MSAParams: w_k of the wrong width": (lambda P: dataclasses.replace(
        P.params, w_k=P.params.w_k[:, :1]), ValueError, "w_k"),
    "reference combine: out_dtype 'bfloat16'": (lambda P: R.combine_partials(
        P.o_part, P.lse_part, out_dtype="bfloat16"), TypeError, "out_dtype.*NumPy"),
    "reference sparse: bf16 torch offsets": (lambda P: R.sparse_attention(
        P.q, P.k, P.v, P.I, T(P.cu_q).bfloat16(), P.cu_k, P.bk), TypeError,
        r"^cu_seqlens_q must have dtype in \['int'\], got bfloat16"),
    "torch sparse: bf16 offsets": (lambda P: MT.sparse_attention(
        **_torch_args(P, cu_seqlens_q=T(P.cu_q).bfloat16())), TypeError,
        r"^cu_seqlens_q must have dtype in \['int'\], got bfloat16"),
}
if np.dtype(np.longdouble).itemsize > 8:  # an extended float (x86), not float16/32/64
    PINNED.update({
        "reference combine: out_dtype longdouble": (lambda P: R.combine_partials(
            P.o_part, P.lse_part, out_dtype=np.longdouble), TypeError, "out_dtype.*NumPy"),
        "reference sparse: longdouble q, k, v": (lambda P: R.sparse_attention(
            *(np.asarray(x, np.longdouble) for x in (P.q, P.k, P.v)), P.I, P.cu_q, P.cu_k, P.bk),
            TypeError, r"^q must have dtype in \['float'\], got float(80|96|128)"),
    })


@pytest.mark.parametrize("case", list(PINNED), ids=list(PINNED))
def test_pinned_bad_inputs_raise_their_error(case):
    run, error, match = PINNED[case]
    if "without CUDA" in case and torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(error, match=match):
        run(_pinned_problem())


def _cuda_pinned():
    """msa.cuda's limits, each where the reference accepts the input (so that the error must
    say that msa.cuda lacks it and point to msa.reference), and its bad inputs that a
    mutation of one argument does not reach."""
    C = Backend("cuda")
    unsupported = r"not supported by msa\.cuda.*msa\.reference accepts it"

    def f64(P):
        return [np.asarray(x, np.float64) for x in (P.q, P.k, P.v)]

    def many_blocks():  # NB = 70 > 64 blocks: topk = 65 is valid for the reference
        P = build((3,), (70,), 2, 1, 1, 2, 4, "float32", 0)
        R.select_blocks(P.M, P.cu_q, P.cu_k, 1, 65)  # the reference takes it
        return P

    def wide(P, d=272):  # D = 272 > 256
        rng = np.random.default_rng(0)
        q = rng.standard_normal((P.tq, P.hq, d)).astype(np.float32)
        kv = rng.standard_normal((P.tk, P.hkv, d)).astype(np.float32)
        return q, kv, kv

    return {
        "sparse_attention: float64 q, k, v": (lambda P: C.attention.sparse_attention(
            *f64(P), P.I, P.cu_q, P.cu_k, P.bk), TypeError, r"\bq\.dtype.*" + unsupported),
        "sparse_attention: D = 272": (lambda P: C.attention.sparse_attention(
            *wide(P), P.I, P.cu_q, P.cu_k, P.bk), ValueError, r"\bq's head dim.*" + unsupported),
        "sparse_attention_backward: float64 lse": (lambda P: C.attention.sparse_attention_backward(
            P.q, P.k, P.v, P.o, P.lse.astype(np.float64), P.do, P.I, P.cu_q, P.cu_k, P.bk),
            TypeError, r"\blse\.dtype.*" + unsupported),
        "kl_loss: float64": (lambda P: C.kl.kl_loss(
            *(np.asarray(x, np.float64) for x in (P.q, P.k, P.q_idx, P.k_idx)), P.I,
            P.lse.astype(np.float64), P.cu_q, P.cu_k, P.bk), TypeError,
            r"\bq\.dtype.*" + unsupported),
        "combine_partials: float64 partials": (lambda P: C.combine.combine_partials(
            P.o_part.astype(np.float64), P.lse_part.astype(np.float64)), TypeError,
            r"\bo_part\.dtype.*" + unsupported),
        "select_blocks: topk 65 with NB = 70": (lambda P: (lambda B: C.select.select_blocks(
            B.M, B.cu_q, B.cu_k, 1, 65))(many_blocks()), ValueError, r"\btopk.*" + unsupported),
        "select_blocks_fused: topk 65 with NB = 70": (lambda P: (
            lambda B: C.select.select_blocks_fused(B.q_idx, B.k_idx, B.cu_q, B.cu_k, 1, 65))(
            many_blocks()), ValueError, r"\btopk.*" + unsupported),
        "msa_prefill: topk 65 with NB = 70": (lambda P: (lambda B: C.attention.msa_prefill(
            B.q, B.k, B.v, B.q_idx, B.k_idx, B.cu_q, B.cu_k, 1, 65))(many_blocks()), ValueError,
            r"\btopk.*" + unsupported),
        "build_csr: uint64 selection": (lambda P: C.csr.build_csr(
            np.maximum(P.I, 0).astype(np.uint64)[:, :, :1], P.cu_q, P.cu_k, P.bk), TypeError,
            r"\bblock_indices\.dtype.*" + unsupported),
        "build_csr: uint32 selection": (lambda P: C.csr.build_csr(
            np.maximum(P.I, 0).astype(np.uint32)[:, :, :1], P.cu_q, P.cu_k, P.bk), TypeError,
            r"\bblock_indices\.dtype = 'uint32'.*" + unsupported),
        "sparse_attention: int16 selection": (lambda P: C.attention.sparse_attention(
            P.q, P.k, P.v, P.I.astype(np.int16), P.cu_q, P.cu_k, P.bk), TypeError,
            r"\bblock_indices\.dtype = 'int16'.*" + unsupported),
        "msa_prefill: float64 q_idx beside float32 q": (lambda P: C.attention.msa_prefill(
            P.q, P.k, P.v, P.q_idx.astype(np.float64), P.k_idx.astype(np.float64), P.cu_q,
            P.cu_k, P.bk, P.topk), TypeError, r"\bq_idx\b"),
        "ArrayContext: a torch CPU tensor beside NumPy": (lambda P: C.attention.sparse_attention(
            P.q, T(P.k), P.v, P.I, P.cu_q, P.cu_k, P.bk), TypeError, r"\bk is a torch tensor"),
        "sparse_attention: validate 'no'": (lambda P: C.attention.sparse_attention(
            P.q, P.k, P.v, P.I, P.cu_q, P.cu_k, P.bk, validate="no"), TypeError, "validate"),
        "kl_loss: validate 0": (lambda P: C.kl.kl_loss(
            P.q, P.k, P.q_idx, P.k_idx, P.I, P.lse, P.cu_q, P.cu_k, P.bk, validate=0), TypeError,
            "validate"),
        "sparse_attention: version True": (lambda P: C.attention.sparse_attention(
            P.q, P.k, P.v, P.I, P.cu_q, P.cu_k, P.bk, version=True), ValueError, "version"),
        "sparse_attention: version 1.0": (lambda P: C.attention.sparse_attention(
            P.q, P.k, P.v, P.I, P.cu_q, P.cu_k, P.bk, version=1.0), ValueError, "version"),
        "combine_partials: version 1.0": (lambda P: C.combine.combine_partials(
            P.o_part, P.lse_part, version=1.0), ValueError, "version"),
        "sparse_attention: block_size 10**6, one block a sequence": (
            lambda P: C.attention.sparse_attention(
                P.q, P.k, P.v, np.where(np.arange(P.topk) == 0, 0, -1) + 0 * P.I, P.cu_q, P.cu_k,
                10**6), ValueError, r"\bblock_size.*" + unsupported),
    }


CUDA_PINNED = _cuda_pinned()


@pytest.mark.skipif(not CUDA_RUNNABLE, reason=CUDA_WHY_NOT or "msa.cuda runs here")
@pytest.mark.parametrize("case", list(CUDA_PINNED), ids=list(CUDA_PINNED))
def test_cuda_pinned_bad_inputs_raise_their_error(case):
    run, error, match = CUDA_PINNED[case]
    P = build((6, 5), (10, 5), 2, 2, 4, 2, 4, "float32", 1)
    with pytest.raises(error, match=match):
        run(P)


@pytest.mark.skipif(not CUDA_RUNNABLE, reason=CUDA_WHY_NOT or "msa.cuda runs here")
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32, np.float16, "float32"])
def test_cuda_combine_takes_torch_and_numpy_out_dtypes(out_dtype):
    """``out_dtype`` as the docs allow it: a torch dtype, a NumPy dtype or a name."""
    P = build((6, 5), (10, 5), 2, 2, 4, 2, 4, "float32", 1)
    C = Backend("cuda")
    o, lse = C.combine.combine_partials(P.o_part, P.lse_part, out_dtype=out_dtype)
    want = np.dtype(str(out_dtype).replace("torch.", "") if isinstance(out_dtype, torch.dtype)
                    else out_dtype)
    assert np.asarray(o).dtype == want
    o32, lse32 = C.combine.combine_partials(P.o_part, P.lse_part)
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse32))
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o32).astype(want))


@pytest.mark.skipif(not CUDA_RUNNABLE, reason=CUDA_WHY_NOT or "msa.cuda runs here")
@pytest.mark.parametrize("out_dtype", [torch.float64, np.float64, "float64"])
def test_cuda_combine_points_float64_to_the_reference(out_dtype):
    P = build((6, 5), (10, 5), 2, 2, 4, 2, 4, "float32", 1)
    with pytest.raises(TypeError, match="out_dtype = 'float64' is not supported by msa.cuda.*"
                                        "msa.reference accepts it"):
        Backend("cuda").combine.combine_partials(P.o_part, P.lse_part, out_dtype=out_dtype)


def test_a_nan_lse_from_the_forward_is_refused_with_its_cause():
    # A NaN value in a key that query t sees makes the forward's lse[t] NaN; the backward then
    # refuses that lse and says where a NaN lse comes from.
    P = build((6, 5), (10, 5), 2, 2, 4, 2, 4, "float64", 2)
    k = P.k.copy()
    k[3] = np.nan
    o, lse = R.sparse_attention(P.q, k, P.v, P.I, P.cu_q, P.cu_k, P.bk)
    assert np.isnan(lse).any()
    with pytest.raises(ValueError, match=r"lse\[\d+, \d+\] = nan .*sees a non-finite q, k or v"):
        R.sparse_attention_backward(P.q, k, P.v, o, lse, o, P.I, P.cu_q, P.cu_k, P.bk)


def test_from_params_keeps_the_params_dtype():
    P = build((3,), (5,), 2, 1, 4, 2, 4, "float32", 0)
    assert MT.MSAAttention.from_params(P.params, block_size=4, topk=2).w_q.dtype == torch.float32
    assert MT.MSAAttention.from_params(P.params, block_size=4, topk=2,
                                       dtype=torch.float64).w_q.dtype == torch.float64
