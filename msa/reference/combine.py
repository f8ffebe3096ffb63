r"""Paper §4.2, K2: exact log-sum-exp combine of the KV-outer partial attentions.

K1 (``msa.reference.attention.attention_partials``) leaves, for every query ``t`` and head
``h``, up to ``K`` partials, one per selected block ``s`` (token set ``J_s``), each normalised
over its own block only:

.. math::  L_s = \log \sum_{j \in J_s} e^{S_j}, \qquad O_s = \sum_{j \in J_s} e^{S_j - L_s} V_j

No CTA of K1 sees all of a query's blocks, so none can finish the softmax. K2 does, exactly:

.. math::  L = \log \sum_s \exp L_s, \qquad O = \sum_s \exp(L_s - L)\, O_s
           = \sum_s \sum_{j \in J_s} \exp(S_j - L) V_j

which is one softmax over the union of the blocks, i.e. eq 8. The split changes the order of
the work, not the result.
"""

from __future__ import annotations

import numpy as np

from .._checks import FLOAT_DTYPES, check_array, cu_to_host, dtype_of


def combine_partials(o_part, lse_part, *, out_dtype=None):
    r"""Paper §4.2 K2: merge the ``K`` partial attentions of every (query, head) with their LSEs.

    .. math::  L = \log \sum_s e^{L_s}, \qquad O = \sum_s e^{L_s - L} O_s

    Args:
        o_part: float [K, Tq, Hq, D], ``O_s`` (locally normalised partial outputs), K >= 1.
        lse_part: float [K, Tq, Hq], ``L_s`` in natural log; ``-inf`` marks an unused slot or
            a block with no key visible to the query.
        out_dtype: keyword-only NumPy float dtype of ``o``; ``None`` keeps ``o_part``'s dtype.

    Returns:
        ``(o, lse)``: ``o`` [Tq, Hq, D] in ``out_dtype``; ``lse`` [Tq, Hq] (natural log) in the
        compute dtype, float64 when ``o_part`` or ``lse_part`` is float64 and float32 otherwise
        (float16 is promoted).

    Edge cases: a slot with ``L_s = -inf`` contributes nothing, whatever its ``O_s`` holds (the
    weight is masked, not multiplied, so a NaN in an unused slot cannot leak). A (query, head)
    whose slots are all ``-inf`` gets ``o = 0`` and ``lse = -inf``, with no NaN and no floating
    point warning. A slot with ``L_s`` NaN or ``+inf`` is not skipped: its (query, head) gets
    ``o = NaN`` (every element) and ``lse = NaN`` if any of its slots is NaN, else ``lse = +inf``,
    what ``log sum_s exp L_s`` is in IEEE arithmetic and what eq 8 (``sparse_attention``) gives a
    query that sees a NaN or ``+inf`` score. K1 writes such an ``L_s`` only then, so K1 + K2
    equals eq 8 on non-finite inputs too (a skip would silently drop the block). A NaN in
    ``O_s`` with a finite ``L_s`` propagates to that row's ``o`` as usual. The result does not depend on the order of the slots (up to rounding).

    Raises:
        TypeError: non-float arrays or a non-float ``out_dtype``. ValueError: wrong ranks,
        ``K < 1``, or ``lse_part``'s shape not ``o_part.shape[:3]``.
    """
    check_array("o_part", o_part, ndim=4, dtypes=("float",))
    num_slots, tq, hq, _ = (int(s) for s in o_part.shape)
    if num_slots < 1:
        raise ValueError(f"o_part must have K >= 1 slots (axis 0), got shape {tuple(o_part.shape)}")
    check_array("lse_part", lse_part, ndim=3, dtypes=("float",), shape=(num_slots, tq, hq))
    if out_dtype is None:
        out_dtype = dtype_of(o_part)
    else:
        want = ("out_dtype must be a NumPy float dtype (float16, float32, float64) or None; "
                "NumPy has no bfloat16 (msa.cuda.combine_partials returns bf16)")
        try:
            out_dtype = np.dtype(out_dtype)
        except TypeError:
            raise TypeError(f"{want}, got {out_dtype!r}") from None
        if out_dtype not in FLOAT_DTYPES:
            raise TypeError(f"{want}, got {out_dtype}")
    f64 = np.dtype(np.float64)
    compute = f64 if f64 in (dtype_of(o_part), dtype_of(lse_part)) else np.dtype(np.float32)
    L_s = np.asarray(cu_to_host(lse_part), dtype=compute)  # [K, Tq, Hq]
    nan_slot = np.isnan(L_s).any(axis=0)  # [Tq, Hq]: o = NaN, lse = NaN
    inf_slot = np.isposinf(L_s).any(axis=0) & ~nan_slot  # [Tq, Hq]: o = NaN, lse = +inf
    used = np.isfinite(L_s)  # [K, Tq, Hq]
    L_s = np.where(used, L_s, -np.inf)  # [K, Tq, Hq], the poisoned rows are overwritten below

    # a = max_s L_s; rows with every slot -inf take a = 0 so that L_s - a stays -inf, not NaN.
    a = L_s.max(axis=0)  # [Tq, Hq]
    a = np.where(np.isfinite(a), a, 0)  # [Tq, Hq]
    w = np.exp(L_s - a)  # [K, Tq, Hq] in [0, 1], 0 for unused slots
    total = w.sum(axis=0)  # [Tq, Hq], >= 1 where any slot is used, 0 otherwise
    some = total > 0  # [Tq, Hq]
    lse = np.full((tq, hq), -np.inf, dtype=compute)  # [Tq, Hq]
    np.log(total, out=lse, where=some)
    lse[some] += a[some]
    # w_s = exp(L_s - L) = exp(L_s - a) / sum_s exp(L_s - a)
    np.divide(w, total, out=w, where=some)

    o = np.zeros((tq, hq, o_part.shape[3]), dtype=compute)  # [Tq, Hq, D]
    for s in range(num_slots):
        # One slot at a time keeps the temporaries at [Tq, Hq, D] instead of [K, Tq, Hq, D].
        o_s = np.asarray(cu_to_host(o_part[s]), dtype=compute)  # [Tq, Hq, D]
        o += w[s][..., None] * np.where(used[s][..., None], o_s, 0)
    o[nan_slot | inf_slot] = np.nan
    lse[nan_slot] = np.nan
    lse[inf_slot] = np.inf
    return o.astype(out_dtype, copy=False), lse
