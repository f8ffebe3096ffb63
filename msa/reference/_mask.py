"""Masking by selection: the products of attention that never read a key a row cannot see.

A softmax row's probabilities are exactly 0 on the keys it cannot see, but ``P @ V`` still
multiplies them by those keys' values, and ``0 * NaN`` is NaN (as is ``0 * inf``): one NaN in a
future key's value would reach every earlier query of a tile. DESIGN.md §3 therefore asks for
masking by selection. ``attend`` is that product for the reference's tiles, in which several
query rows share one list of keys and each row sees a subset of them.
"""

from __future__ import annotations

import numpy as np

# Elements of one per-row copy of the values (see ``attend``): 32 MiB of float64.
_TILE_ELEMENTS = 1 << 22


def attend(p: np.ndarray, visible: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``p @ v`` in which row ``c`` reads only the value rows that ``visible[c]`` selects.

    Args:
        p: float [..., C, G, N], 0 wherever ``visible`` is False (the G rows of a query share
            its mask: the G heads of a GQA group).
        visible: bool [C, N], shared by the leading axes.
        v: float [..., N, D], leading axes as ``p``'s.

    Returns:
        float [..., C, G, D]. The keys every row sees go through one matmul; each of the others
        is gathered per row with ``np.where`` (0 where the row cannot see it), so a row's result
        is the same arithmetic whatever the keys it cannot see hold, NaN and inf included.
    """
    *lead, c, g, n = p.shape
    d = v.shape[-1]
    shared = visible.all(axis=0) if c else np.ones(n, dtype=bool)  # [N]
    if shared.all():
        return (p.reshape(*lead, c * g, n) @ v).reshape(*lead, c, g, d)
    o = (p[..., shared].reshape(*lead, c * g, -1) @ v[..., shared, :]).reshape(*lead, c, g, d)
    rest = np.flatnonzero(~shared)  # [R] keys some row cannot see
    p_r = p[..., rest]  # [..., C, G, R]
    v_r = v[..., None, rest, :]  # [..., 1, R, D]
    seen = visible[:, rest, None]  # [C, R, 1]
    step = max(1, _TILE_ELEMENTS // max(1, int(np.prod(lead, dtype=np.int64)) * rest.size * d))
    for c0 in range(0, c, step):
        c1 = min(c0 + step, c)
        v_c = np.where(seen[c0:c1], v_r, 0)  # [..., c, R, D], 0 where row c cannot see the key
        o[..., c0:c1, :, :] += p_r[..., c0:c1, :, :] @ v_c
    return o
