"""The exponentials of an mma tile's two rows: ``P = 2**(S c - m c)``, shared by K1's softmax
(``msa.cuda.attention._tile``) and the decode attention's online softmax
(``msa.cuda.decode.v2_split_attention``).

A lane of an ``m16n8`` C fragment holds, per n-tile ``i``, two scores of its top row (``g``:
``s_acc[4 i]``, ``s_acc[4 i + 1]``) and two of its bottom row (``g + 8``: ``+2``, ``+3``). Each
row's ``P`` takes one fused multiply-add a score, ``2**fma(S, c, -m c)``, where the base-2
maximum ``mb = m c`` is moderate. Where ``|m c| >= 2**24`` (``FMA_SAFE``: a huge finite score)
the fused form leaves the maximum a residual of up to half an ulp of ``m c`` (``>= 2**7`` from
``2**31`` on), which would make its ``P`` 0 or +inf; ``2**((S - m) c)`` gives it exactly 1, as
the reference's ``exp(S - m)``. The form is chosen per row, so a row whose own maximum is
moderate keeps the fused form's bits (docs/design.md §3).
"""

from __future__ import annotations

import functools

from numba import cuda, float32

from .mma import exp2

FMA_SAFE = float32(2.0 ** 24)  # |m c| below which the fused form is exact enough


@functools.lru_cache(maxsize=None)
def exp2_rows(n_tiles: int, pack):
    """``p_rows(s_acc, p_frag, m_top, m_bot, mb_top, mb_bot, c, l_top, l_bot) -> (l_top,
    l_bot)`` for ``n_tiles`` n-tiles: ``P`` of both rows packed by ``pack`` into the A
    fragments ``p_frag[2 i]`` (top) and ``p_frag[2 i + 1]`` (bottom), their sums added to
    ``l_top, l_bot`` in n-tile order; ``m`` the rows' maxima (0 for a row with nothing
    visible), ``mb = m c`` their base-2 references."""
    NS = n_tiles

    @cuda.jit(device=True, inline=True)
    def p_rows(s_acc, p_frag, m_top, m_bot, mb_top, mb_bot, c, l_top, l_bot):
        fast_top = abs(mb_top) < FMA_SAFE
        fast_bot = abs(mb_bot) < FMA_SAFE
        if fast_top and fast_bot:
            for i in range(NS):  # one fused multiply-add a score
                p0 = exp2(cuda.fma(s_acc[4 * i], c, -mb_top))
                p1 = exp2(cuda.fma(s_acc[4 * i + 1], c, -mb_top))
                p2 = exp2(cuda.fma(s_acc[4 * i + 2], c, -mb_bot))
                p3 = exp2(cuda.fma(s_acc[4 * i + 3], c, -mb_bot))
                l_top += p0 + p1
                l_bot += p2 + p3
                p_frag[2 * i] = pack(p0, p1)
                p_frag[2 * i + 1] = pack(p2, p3)
        else:
            m_top = m_top if mb_top != float32(0.0) else float32(0.0)
            m_bot = m_bot if mb_bot != float32(0.0) else float32(0.0)
            for i in range(NS):
                p0 = (exp2(cuda.fma(s_acc[4 * i], c, -mb_top)) if fast_top
                      else exp2((s_acc[4 * i] - m_top) * c))
                p1 = (exp2(cuda.fma(s_acc[4 * i + 1], c, -mb_top)) if fast_top
                      else exp2((s_acc[4 * i + 1] - m_top) * c))
                p2 = (exp2(cuda.fma(s_acc[4 * i + 2], c, -mb_bot)) if fast_bot
                      else exp2((s_acc[4 * i + 2] - m_bot) * c))
                p3 = (exp2(cuda.fma(s_acc[4 * i + 3], c, -mb_bot)) if fast_bot
                      else exp2((s_acc[4 * i + 3] - m_bot) * c))
                l_top += p0 + p1
                l_bot += p2 + p3
                p_frag[2 * i] = pack(p0, p1)
                p_frag[2 * i + 1] = pack(p2, p3)
        return l_top, l_bot

    return p_rows
