"""Comparing kernel results: floats against a float64 oracle, integers exactly (docs/design.md §5).

The float rule is flash-attention's: a result is as accurate as it should be when its error
against a float64 computation of the same function (the *oracle*) is at most ``factor`` times the
error of a plain computation in the working precision (the *baseline*, e.g. the NumPy reference
run on the float32 inputs the kernel got)::

    max|actual - oracle| <= factor * max|baseline - oracle| + floor
    floor = floor_ulps * eps * scale,   scale = max|oracle| unless the caller gives it

Both maxima run over the positions where the oracle is finite; ``eps`` is the machine epsilon of
the coarser of ``actual``'s and ``baseline``'s float dtypes (float32: 2**-23; float16: 2**-10),
unless ``dtype`` names another. The floor only matters when the baseline happens to be exact
(a copy, a sum of a few exactly representable terms): a kernel that rounds in another order may
still be a few ulps off there. No magic ``atol``. ``scale`` is for results that are small sums
of large terms, which round at the scale of the terms: a float32 LSE ``a + log(total)`` with
``a = max_s L_s`` carries the rounding of ``a`` and of ``log(total)`` (and of ``total``, a sum
of terms in ``[0, 1]``), however close to 0 their sum is.

Special values must match exactly: ``actual`` is ``-inf`` exactly where the oracle is ``-inf``
(empty rows, invisible blocks) and ``+inf`` where it is ``+inf``; NaN is never accepted in
``actual`` or ``baseline`` (kernel outputs start as NaN, see ``backends.poison``), and a NaN in
the oracle is an error in the test.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .backends import to_numpy

__all__ = ["ToleranceReport", "assert_close_to_oracle", "assert_exact", "oracle_and_baseline"]


@dataclass(frozen=True)
class ToleranceReport:
    """What ``assert_close_to_oracle`` measured (useful to print or to compare kernel versions)."""

    name: str
    error: float  # max |actual - oracle| over finite oracle positions
    baseline_error: float  # max |baseline - oracle|
    floor: float
    bound: float  # factor * baseline_error + floor
    worst_index: tuple | None  # where |actual - oracle| is largest

    @property
    def ratio(self) -> float:
        """``error / baseline_error`` (inf if the baseline is exact and the result is not)."""
        if self.baseline_error > 0:
            return self.error / self.baseline_error
        return 0.0 if self.error == 0 else float("inf")


def _float_dtype(x) -> np.dtype | None:
    dt = getattr(x, "dtype", None)
    if dt is None:
        return None
    if "bfloat16" in str(dt):
        return None  # torch bf16: eps 2**-7, handled by _eps_of
    try:
        dt = np.dtype(dt)
    except TypeError:
        return None
    return dt if dt.kind == "f" else None


def _eps_of(x) -> float | None:
    if "bfloat16" in str(getattr(x, "dtype", "")):
        return 2.0 ** -7
    dt = _float_dtype(x)
    return float(np.finfo(dt).eps) if dt is not None else None


def _idx(flat_index: int, shape) -> tuple:
    return tuple(int(i) for i in np.unravel_index(flat_index, shape)) if shape else ()


def _first(mask: np.ndarray):
    return _idx(int(np.flatnonzero(mask)[0]), mask.shape)


def _values(idx, **arrays) -> str:
    return ", ".join(f"{k}={v[idx].item()!r}" for k, v in arrays.items())


def assert_close_to_oracle(actual, oracle, baseline, *, factor: float = 2.0, name: str = "output",
                           floor_ulps: float = 4.0, dtype=None,
                           scale: float | None = None) -> ToleranceReport:
    """Assert ``actual`` is within ``factor`` x the baseline's error of the float64 ``oracle``.

    Args:
        actual: the result under test (any shape; NumPy, CuPy, torch or Numba array).
        oracle: the same function computed in float64 from the same inputs, same shape.
        baseline: the same function computed in the working precision (e.g. the reference on
            the float32 inputs), same shape; it sets the scale of an acceptable error.
        factor: how many times the baseline's error ``actual`` may have (2 as flash-attention).
        name: what is compared, for the message (``"o"``, ``"lse"``).
        floor_ulps: the floor in units of ``eps * max|oracle|`` (see the module docstring).
        dtype: float dtype whose eps sets the floor; default the coarser of actual's/baseline's.
        scale: the magnitude the floor is relative to, >= 0; default ``max|oracle|`` (module
            docstring: for a small sum of large terms, the size of the terms).

    Returns:
        A ``ToleranceReport`` with the measured errors.

    Raises:
        AssertionError naming ``name``, the worst index and the three values there, if
        shapes differ, a special value (-inf, +inf) does not match the oracle, ``actual`` or
        ``baseline`` has a NaN, or the error exceeds the bound.
    """
    if not factor >= 1:
        raise ValueError(f"factor must be >= 1, got {factor}")
    if dtype is not None:
        eps = float(np.finfo(np.dtype(dtype)).eps)
    else:
        eps = max([e for e in (_eps_of(actual), _eps_of(baseline)) if e is not None],
                  default=float(np.finfo(np.float32).eps))
    a = np.asarray(to_numpy(actual), dtype=np.float64)
    o = np.asarray(to_numpy(oracle), dtype=np.float64)
    b = np.asarray(to_numpy(baseline), dtype=np.float64)
    if not (a.shape == o.shape == b.shape):
        raise AssertionError(
            f"{name}: shapes differ: actual {a.shape}, oracle {o.shape}, baseline {b.shape}")
    if np.isnan(o).any():
        raise AssertionError(f"{name}: the float64 oracle has NaN at index {_first(np.isnan(o))}; "
                             f"the test's oracle is wrong, not the result")
    finite = np.isfinite(o)
    for label, x in (("actual", a), ("baseline", b)):
        nan = np.isnan(x)
        if nan.any():
            i = _first(nan)
            raise AssertionError(
                f"{name}: {label} has NaN at {int(nan.sum())} of {x.size} positions, first at "
                f"index {i} ({_values(i, actual=a, oracle=o, baseline=b)})"
                + ("; a NaN left where a kernel did not write (outputs are poisoned with NaN)?"
                   if label == "actual" else ""))
        wrong = (finite & ~np.isfinite(x)) | (~finite & (x != o))
        if wrong.any():
            i = _first(wrong)
            raise AssertionError(
                f"{name}: {label} differs from the oracle in special values (inf must match "
                f"exactly) at {int(wrong.sum())} positions, first at index {i} "
                f"({_values(i, actual=a, oracle=o, baseline=b)})")
    with np.errstate(invalid="ignore"):  # inf - inf where the oracle is infinite, masked out
        err = np.where(finite, np.abs(a - o), 0.0)
        err_base = np.where(finite, np.abs(b - o), 0.0)
    if scale is None:
        scale = float(np.abs(o[finite]).max()) if finite.any() else 0.0
    elif not scale >= 0:
        raise ValueError(f"scale must be >= 0, got {scale}")
    floor = floor_ulps * eps * scale
    baseline_error = float(err_base.max()) if err_base.size else 0.0
    bound = factor * baseline_error + floor
    error = float(err.max()) if err.size else 0.0
    worst = _idx(int(np.argmax(err)), err.shape) if err.size else None
    report = ToleranceReport(name, error, baseline_error, floor, bound, worst)
    if error > bound:
        over = int((err > bound).sum())
        raise AssertionError(
            f"{name}: max |actual - oracle| = {error:.3e} at index {worst} exceeds the bound "
            f"{bound:.3e} = {factor:g} x baseline error {baseline_error:.3e} + floor {floor:.3e} "
            f"({floor_ulps:g} x eps {eps:.2e} x scale {scale:.3e}); at that index "
            f"{_values(worst, actual=a, oracle=o, baseline=b)}; {over} of {err.size} elements "
            f"exceed the bound (error ratio {report.ratio:.3g} x baseline)")
    return report


def assert_exact(actual, expected, *, name: str = "output"):
    """Assert two integer (or bool) arrays are equal element for element.

    The message gives the number of mismatches, the first index, both values, and both rows
    along the last axis there (a whole top-k row or CSR segment reads better than one slot).
    """
    a = np.asarray(to_numpy(actual))
    e = np.asarray(to_numpy(expected))
    if a.shape != e.shape:
        raise AssertionError(f"{name}: shapes differ: actual {a.shape}, expected {e.shape}")
    for label, x in (("actual", a), ("expected", e)):
        if x.dtype.kind not in "iub":
            raise AssertionError(
                f"{name}: assert_exact compares integers; {label} has dtype {x.dtype}")
    diff = a != e
    if diff.any():
        i = _first(diff)
        row = i[:-1] if len(i) > 1 else ()
        rows = (f"; row {row}: actual {a[row].tolist()}, expected {e[row].tolist()}"
                if len(i) > 1 else "")
        raise AssertionError(
            f"{name}: {int(diff.sum())} of {a.size} elements differ, first at index {i}: "
            f"actual {a[i].item()!r}, expected {e[i].item()!r}{rows}")


def _upcast(x):
    if isinstance(x, np.ndarray) and x.dtype.kind == "f":
        return x.astype(np.float64)
    return x


def oracle_and_baseline(fn, *args, **kwargs):
    """``(oracle, baseline)``: ``fn`` on float64 copies of the float array arguments, and as given.

    Pass the arguments exactly as the kernel gets them (e.g. float32 arrays), so that the oracle
    sees the same rounded inputs and measures only the error of the computation::

        q32, k32, v32 = (x.astype(np.float32) for x in (p.q, p.k, p.v))
        oracle, baseline = oracle_and_baseline(reference.attention.dense_attention, q32, k32, v32,
                                               p.cu_seqlens_q, p.cu_seqlens_k)
        o, lse = backend.attention.dense_attention(q32, k32, v32, p.cu_seqlens_q, p.cu_seqlens_k)
        assert_close_to_oracle(o, oracle[0], baseline[0], name="o")

    Only NumPy float arrays are cast; integer arrays and scalars go through unchanged.
    """
    oracle = fn(*(_upcast(x) for x in args), **{k: _upcast(v) for k, v in kwargs.items()})
    baseline = fn(*args, **kwargs)
    return oracle, baseline
