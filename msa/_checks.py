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
INT32_MAX = int(np.iinfo(np.int32).max)
INT64_MAX = int(np.iinfo(np.int64).max)


def unsupported(name: str, value, backend: str, accepted: str, *, why: str | None = None,
                exc=ValueError) -> Exception:
    """The error for a value that ``msa.reference`` accepts and ``backend`` does not.

    Returns the exception (``raise unsupported(...)``), so the traceback points at the caller::

        raise unsupported("G = Hq/Hkv", 3, "msa.cuda", "G in (1, 2, 4, 8, 16)",
                          why="a group's heads fill one MMA tile")

    gives ``G = Hq/Hkv = 3 is not supported by msa.cuda, which accepts G in (1, 2, 4, 8, 16) (a
    group's heads fill one MMA tile); msa.reference accepts it``. ``exc`` is ``TypeError`` for
    a dtype.
    """
    because = f" ({why})" if why else ""
    return exc(f"{name} = {value!r} is not supported by {backend}, which accepts {accepted}"
               f"{because}; msa.reference accepts it")


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


def dtype_name(x) -> str:
    """``x``'s dtype as an error names it: ``'bfloat16'`` for a torch bf16 tensor (which
    ``dtype_of`` reads as uint16), else ``dtype_of``'s name."""
    return "bfloat16" if "bfloat16" in str(getattr(x, "dtype", "")) else str(dtype_of(x))


def check_positive_int(name: str, value, *, low: int = 1, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]``; TypeError for non-integers, ValueError out of range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {rng}, got {value}")
    return value


def check_flag(name: str, value) -> bool:
    """``value`` as a bool; anything but ``True``/``False`` (``"no"``, 0, None) is a TypeError,
    since ``bool("no")`` is True."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def check_choice(name: str, value, choices) -> str:
    """One of the strings ``choices``; anything else (another string, a dtype object, None) is a
    ValueError naming ``name`` and the choices."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def check_version(name: str, value, versions) -> int | None:
    """A kernel rung ``value`` among ``versions`` (``None`` passes: the launcher picks). A
    ValueError otherwise, ``True`` and ``1.0`` included (``True == 1``, but it is no version)."""
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
            or int(value) not in versions):
        raise ValueError(f"{name} must be one of {tuple(versions)} or None, got "
                         f"{type(value).__name__} {value!r}")
    return int(value)


TOPK_SLACK = 64  # slots past NB that a selection may carry as -1 padding (msa.cuda's K limit)


def check_block_size(value) -> int:
    """``block_size`` (Bk): an integer in ``[1, 2**31 - 1]`` (block offsets are int32 on a GPU)."""
    return check_positive_int("block_size", value, high=INT32_MAX)


def check_topk(value, nb: int, block_size: int | None = None) -> int:
    """``topk`` (K) before anything of size K is allocated: an integer in ``[1, max(NB, 64)]``.

    A selection row holds at most ``NB = ceil(max Lk / Bk)`` distinct blocks, so the slots past
    NB can only be ``-1`` padding; up to 64 slots (msa.cuda's limit on K) are always allowed,
    so a short batch may keep a model's K. The bound turns a ``topk`` of ``10**9`` into an error
    instead of a ``[Tq, Hkv, 10**9]`` allocation, and catches many ``block_size``/``topk``
    swaps (the order is ``block_size, topk`` everywhere).
    """
    limit = max(int(nb), TOPK_SLACK)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"topk must be an integer, got {type(value).__name__} {value!r}")
    if not 1 <= int(value) <= limit:
        bs = "" if block_size is None else f" with block_size={block_size}"
        raise ValueError(
            f"topk must be in [1, max(NB, {TOPK_SLACK})] = [1, {limit}] (NB = ceil(max Lk / "
            f"block_size) = {nb}{bs}: a row holds at most NB blocks; is the order block_size, "
            f"topk?), got {value}")
    return int(value)


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
    ``dtypes`` is a tuple of NumPy dtypes or the strings ``"float"`` (float16/32/64) / ``"int"``
    (any integer dtype; a torch bfloat16 tensor is not one). Returns the array unchanged.
    """
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if ndim is not None and len(x.shape) != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if dtypes is not None:
        dt = dtype_of(x)
        bf16 = dtype_name(x) == "bfloat16"  # dtype_of reads a torch bf16 tensor as uint16
        ok = False
        for want in dtypes:
            if want == "float":
                ok |= dt in FLOAT_DTYPES
            elif want == "int":
                ok |= dt.kind in "iu" and not bf16
            else:
                ok |= dt == np.dtype(want)
        if not ok:
            raise TypeError(f"{name} must have dtype in {list(map(str, dtypes))}, got "
                            f"{dtype_name(x)}")
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


def check_gqa(num_q_heads: int, num_kv_heads: int, *, allowed=None,
              backend: str = "msa.cuda", what: str = "GQA group size G = Hq/Hkv") -> int:
    """Group size ``G = Hq / Hkv`` (paper eq 3). ``allowed`` restricts G (kernels use 1..16);
    the error then names ``backend``, says that the reference accepts any G and calls G
    ``what`` (a launcher names its arrays: ``"q's heads over k's, G = Hq/Hkv"``)."""
    for name, value in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    num_q_heads, num_kv_heads = int(num_q_heads), int(num_kv_heads)
    if num_kv_heads < 1 or num_q_heads < 1:
        raise ValueError(f"head counts num_q_heads (Hq) and num_kv_heads (Hkv) must be >= 1, got "
                         f"Hq={num_q_heads}, Hkv={num_kv_heads}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q heads (Hq = num_q_heads = {num_q_heads}) must be a multiple of kv "
                         f"heads (Hkv = num_kv_heads = {num_kv_heads})")
    g = num_q_heads // num_kv_heads
    if allowed is not None and g not in allowed:
        raise unsupported(what, g, backend, f"G in {tuple(allowed)}")
    return g


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int):
    """Validate packed-batch offsets; return them as int64 NumPy arrays.

    ``cu_seqlens_q``/``cu_seqlens_k``: [B+1] integer prefix sums starting at 0, non-decreasing,
    ending at ``total_q``/``total_k``, with every sequence having ``Lq <= Lk`` (a sequence's
    queries are the last ``Lq`` positions of its ``Lk`` keys).
    """
    return check_offset_pair(check_offsets("cu_seqlens_q", cu_seqlens_q, total_q),
                             check_offsets("cu_seqlens_k", cu_seqlens_k, total_k))


def check_offset_pair(cq: np.ndarray, ck: np.ndarray):
    """``check_cu_seqlens``' checks of the two offsets together, on arrays ``check_offsets``
    returned (each already checked on its own); returns them."""
    if cq.shape != ck.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length B+1, got {cq.shape[0]} and {ck.shape[0]}")
    lq, lk = np.diff(cq), np.diff(ck)
    bad = np.nonzero(lq > lk)[0]
    if bad.size:
        b = int(bad[0])
        raise ValueError(
            f"cu_seqlens_q, cu_seqlens_k: sequence {b} has more queries than keys (Lq={lq[b]} > "
            f"Lk={lk[b]}); queries are the last Lq of Lk keys")
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
    given. Any integer array-like is accepted, the same in every backend: a NumPy, CuPy, torch
    or Numba device array (copied to the host), or a list or tuple of Python ints. Floats,
    bools and values int64 cannot hold are rejected, not converted. Returns an int64 NumPy host
    copy.
    """
    if hasattr(cu, "shape") and hasattr(cu, "dtype"):
        check_array(name, cu, ndim=1, dtypes=("int",))
        host = np.asarray(cu_to_host(cu))
    elif isinstance(cu, (list, tuple)):
        if any(isinstance(x, bool) or not isinstance(x, numbers.Integral) for x in cu):
            bad = next(x for x in cu if isinstance(x, bool) or not isinstance(x, numbers.Integral))
            raise TypeError(f"{name} must hold integers, got {type(bad).__name__} {bad!r}")
        if any(not -INT64_MAX - 1 <= int(x) <= INT64_MAX for x in cu):
            raise ValueError(f"{name} must hold values that fit int64, got {list(cu)}")
        host = np.array([int(x) for x in cu], dtype=np.int64)
    else:
        raise TypeError(f"{name} must be an integer array or a list of ints [B+1], "
                        f"got {type(cu).__name__}")
    if host.dtype.kind == "u" and host.size and int(host.max()) > INT64_MAX:
        raise ValueError(f"{name} must hold values that fit int64, got max {int(host.max())}")
    cu = host.astype(np.int64, copy=True)
    if cu.shape[0] < 2:
        raise ValueError(f"{name} must have B+1 >= 2 entries, got shape {cu.shape}")
    if cu[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {cu[0]}")
    if np.any(np.diff(cu) < 0):
        raise ValueError(f"{name} must be non-decreasing, got {cu.tolist()}")
    if total is not None and cu[-1] != total:
        raise ValueError(f"{name}[-1] must equal the packed length {total}, got {cu[-1]}")
    return cu


def check_lse(lse, nonempty, *, name: str = "lse") -> None:
    """A forward's log-sum-exp handed to a backward or to the KL loss (a host NumPy array).

    The rule, the same in every backend: ``lse[t, h]`` is finite where query ``t``'s support is
    non-empty, ``-inf`` only where it is empty, and never NaN or ``+inf``. (``exp(S - lse)``
    is the probability the backward rebuilds: a NaN or infinite ``lse`` there would silently
    give zero or NaN gradients.)

    Args:
        lse: float [Tq, Hq] on the host.
        nonempty: bool [Tq, Hq], or [Tq, Hkv] with ``Hkv`` dividing ``Hq`` (repeated over the
            G heads of each group): the query's support holds at least one key.

    Raises:
        ValueError naming ``name``, the first offending ``[t, h]`` (row-major), its value and the
        rule.
    """
    lse = np.asarray(lse)
    nonempty = np.asarray(nonempty, dtype=bool)
    if nonempty.shape != lse.shape:
        nonempty = np.repeat(nonempty, lse.shape[1] // max(nonempty.shape[1], 1), axis=1)
    bad = np.isnan(lse) | np.isposinf(lse) | (nonempty & np.isneginf(lse))
    if bad.any():
        t, h = (int(i) for i in np.argwhere(bad)[0])
        where = "non-empty" if nonempty[t, h] else "empty"
        raise ValueError(
            f"{name}[{t}, {h}] = {float(lse[t, h])} (query {t}'s support is {where}): {name} must "
            "be the forward's log-sum-exp, finite where the support is non-empty and -inf only "
            "where it is empty, never NaN or +inf (the forward gives NaN or +inf where the "
            "query sees a non-finite q, k or v, and its gradients are not defined there)")
