"""Masking by selection: the products of attention that never read a key a row cannot see.

A softmax row's probabilities are exactly 0 on the keys it cannot see, but ``P @ V`` still
multiplies them by those keys' values, and ``0 * NaN`` is NaN (as is ``0 * inf``): one NaN in a
future key's value would reach every earlier query of a tile. docs/design.md §3 therefore asks for
masking by selection. ``attend`` is that product for the reference's tiles, in which several
query rows share one list of keys and each row sees a subset of them.
"""

from __future__ import annotations

import numpy as np


def attend(p: np.ndarray, visible: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``p @ v`` in which row ``c`` never reads a non-finite value it cannot see.

    Args:
        p: float [..., C, G, N], exactly 0 wherever ``visible`` is False (the G rows of a query
            share its mask: the G heads of a GQA group).
        visible: bool [C, N], shared by the leading axes.
        v: float [..., N, D], leading axes as ``p``'s.

    Returns:
        float [..., C, G, D]. The product is one matmul over ``v`` with its non-finite rows
        replaced by 0 (``np.where``: the NaN is selected out, never multiplied), the same
        arithmetic as a plain ``p @ v`` when every value is finite. A row that cannot see key
        ``j`` adds ``0 * v_j``, an exact zero, whatever finite value ``v_j`` holds, and ``0 * 0``
        once ``v_j`` is NaN or inf: the same sums in the same order, so the same bits (an exact
        zero result could at most change sign). The rows that see a non-finite ``v_j`` then add
        ``p_j v_j`` themselves, so that their NaN or inf is theirs, as IEEE arithmetic says.
    """
    *lead, c, g, n = p.shape
    d = v.shape[-1]
    finite = np.isfinite(v).all(axis=-1)  # [..., N]
    if finite.all():
        return (p.reshape(*lead, c * g, n) @ v).reshape(*lead, c, g, d)
    v_finite = np.where(finite[..., None], v, 0)  # [..., N, D]
    o = (p.reshape(*lead, c * g, n) @ v_finite).reshape(*lead, c, g, d)
    p3, v3 = p.reshape(-1, c, g, n), v.reshape(-1, n, d)
    o3 = o.reshape(-1, c, g, d)  # a view of o
    for l, j in np.argwhere(~finite.reshape(-1, n)):
        rows = visible[:, j]  # [C]: only the queries that see key j
        o3[l, rows] += p3[l, rows, :, j, None] * v3[l, j]
    return o
