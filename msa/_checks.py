"""Input validation shared by ``msa.reference`` and ``msa.cuda``.

Every public function of msa checks its arguments through these helpers, so that a wrong input
raises a ``ValueError`` or ``TypeError`` naming the argument, the expected and the actual value,
before any arithmetic (and, on the GPU, before any launch). The helpers only look at ``shape``,
``dtype`` and ``ndim``, so they work for NumPy, CuPy, PyTorch and Numba device arrays alike;
the few that read values (``cu_seqlens``) are given host copies by their callers.
"""

from __future__ import annotations

import numbers

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
GQA_GROUP_SIZES = (1, 2, 4, 8, 16)


def dtype_of(x) -> np.dtype:
    """NumPy dtype of a NumPy/CuPy/Numba array or a torch tensor (bf16 maps to ``'bfloat16'``)."""
    dt = getattr(x, "dtype", None)
    if dt is None:
        raise TypeError(f"expected an array, got {type(x).__name__}")
    try:
        return np.dtype(dt)
    except TypeError:
        # torch dtypes are not NumPy dtypes: map by name.
        name = str(dt).replace("torch.", "")
        if name == "bfloat16":
            return np.dtype(np.uint16)  # callers that accept bf16 test for it explicitly
        return np.dtype(name)


def check_positive_int(name: str, value, *, low: int = 1, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]``; TypeError for non-integers, ValueError out of range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {rng}, got {value}")
    return value


def check_scale(name: str, value, default: float) -> float:
    """A softmax scale: ``None`` gives ``default``; otherwise a finite positive real."""
    if value is None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number or None, got {type(value).__name__}")
    value = float(value)
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value}")
    return value


def check_array(name: str, x, *, ndim: int | None = None, dtypes=None, shape=None):
    """Check rank, dtype family and (partially) the shape of an array.

    ``shape`` is a tuple whose entries are ints (must match) or ``None`` (any size).
    ``dtypes`` is a tuple of NumPy dtypes or the strings ``"float"`` / ``"int"``.
    Returns the array unchanged.
    """
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if ndim is not None and len(x.shape) != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if dtypes is not None:
        dt = dtype_of(x)
        ok = False
        for want in dtypes:
            if want == "float":
                ok |= dt.kind == "f"
            elif want == "int":
                ok |= dt.kind in "iu"
            else:
                ok |= dt == np.dtype(want)
        if not ok:
            raise TypeError(f"{name} must have dtype in {list(map(str, dtypes))}, got {dt}")
    if shape is not None:
        got = tuple(int(s) for s in x.shape)
        if len(got) != len(shape) or any(w is not None and w != g for w, g in zip(shape, got)):
            want = tuple("*" if w is None else w for w in shape)
            raise ValueError(f"{name} must have shape {want}, got {got}")
    return x


def check_same_dtype(**arrays) -> np.dtype:
    """All arrays share one dtype; returns it."""
    items = list(arrays.items())
    first_name, first = items[0]
    dt = dtype_of(first)
    for name, x in items[1:]:
        if dtype_of(x) != dt:
            raise TypeError(f"{name} must have the dtype of {first_name} ({dt}), got {dtype_of(x)}")
    return dt


def check_gqa(num_q_heads: int, num_kv_heads: int, *, allowed=None) -> int:
    """Group size ``G = Hq / Hkv`` (paper eq 3). ``allowed`` restricts G (kernels use 1..16)."""
    if num_kv_heads < 1 or num_q_heads < 1:
        raise ValueError(f"head counts must be >= 1, got Hq={num_q_heads}, Hkv={num_kv_heads}")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"q heads (Hq={num_q_heads}) must be a multiple of kv heads (Hkv={num_kv_heads})")
    g = num_q_heads // num_kv_heads
    if allowed is not None and g not in allowed:
        raise ValueError(f"GQA group size G=Hq/Hkv must be in {tuple(allowed)}, got {g}")
    return g


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int):
    """Validate packed-batch offsets; return them as int64 NumPy arrays.

    ``cu_seqlens_q``/``cu_seqlens_k``: [B+1] integer prefix sums starting at 0, non-decreasing,
    ending at ``total_q``/``total_k``, with every sequence having ``Lq <= Lk`` (a sequence's
    queries are the last ``Lq`` positions of its ``Lk`` keys).
    """
    cq = check_offsets("cu_seqlens_q", cu_seqlens_q, total_q)
    ck = check_offsets("cu_seqlens_k", cu_seqlens_k, total_k)
    if cq.shape != ck.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length B+1, got {cq.shape[0]} and {ck.shape[0]}")
    lq, lk = np.diff(cq), np.diff(ck)
    bad = np.nonzero(lq > lk)[0]
    if bad.size:
        b = int(bad[0])
        raise ValueError(
            f"sequence {b} has more queries than keys (Lq={lq[b]} > Lk={lk[b]}); queries are the last Lq of Lk keys")
    return cq, ck


def cu_to_host(x):
    """A host NumPy copy of a small index array from NumPy, CuPy, torch or a Numba device array."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    if hasattr(x, "get"):  # CuPy
        return x.get()
    if hasattr(x, "detach"):  # torch
        return x.detach().cpu().numpy()
    return np.asarray(x)


def check_offsets(name: str, cu, total: int | None = None) -> np.ndarray:
    """One packed-batch offsets array on its own (e.g. ``cu_seqlens_k`` without queries).

    ``cu``: [B+1] integer prefix sums starting at 0, non-decreasing, ending at ``total`` when
    given. Returns an int64 NumPy host copy.
    """
    check_array(name, cu, ndim=1, dtypes=("int",))
    cu = np.asarray(cu_to_host(cu), dtype=np.int64)
    if cu.shape[0] < 2:
        raise ValueError(f"{name} must have B+1 >= 2 entries, got shape {cu.shape}")
    if cu[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {cu[0]}")
    if np.any(np.diff(cu) < 0):
        raise ValueError(f"{name} must be non-decreasing, got {cu.tolist()}")
    if total is not None and cu[-1] != total:
        raise ValueError(f"{name}[-1] must equal the packed length {total}, got {cu[-1]}")
    return cu
