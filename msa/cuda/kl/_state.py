"""Device functions every KL rung shares: the support of a (query, group), the online state of
a run of keys and its exact merge, and the compensated sums (module docstring of
``msa.cuda.kl`` for the math).

A run of keys keeps ``m`` (running maximum of ``S^idx``), ``l = sum exp(S^idx - m)``,
``C = sum P`` and ``D = sum P (log P - (S^idx - m))``, Kahan-compensated (``accumulate``), and
ends as the state ``(m, l, C, K)``, ``K = D + C log l`` (``finish``); two states merge exactly
(``merge``), the empty state ``(-inf, 0, 0, 0)`` being the identity.

Non-finite values (docs/design.md §3). A caller passes only the keys its query sees; those may
hold NaN or infinite logits, and the state then carries them as the reference does: every test
of ``l``, ``P`` or ``x`` is written so that a NaN fails the "empty" or "zero" side (``not (l <=
0)`` rather than ``l > 0``), so a NaN ``l`` or teacher ``P`` reaches ``K`` and ``LSE^idx``
instead of being dropped as an empty run, and a student logit of ``-inf`` adds nothing to ``l``
(``exp(-inf - m)`` with ``m = -inf`` would be NaN). For finite values every test gives what
``l > 0`` gave: the results are the same bits.
"""

from __future__ import annotations

import math

from numba import cuda, float32

from .._core.mma import bf16_to_f32

NEG_INF = float32(-math.inf)
INF = float32(math.inf)
FULL_MASK = 0xFFFFFFFF
FOLD = 16  # dk_idx: terms summed plainly before a Kahan-compensated fold


def _identity_f32(x):
    return float32(x)


_to_f32_plain = cuda.jit(device=True)(_identity_f32)


def loader(kind: str):
    """Device function turning one input element into float32 (bf16 arrives as uint16 bits)."""
    return bf16_to_f32 if kind == "bfloat16" else _to_f32_plain


@cuda.jit(device=True)
def finite_or_zero(x):
    """An empty support's ``-inf`` LSE becomes 0 (its keys are never read), as in the reference."""
    return x if x > NEG_INF else float32(0.0)


@cuda.jit(device=True)
def sequence_of(offsets, x):
    """The sequence holding packed index ``x``: the largest ``b`` in ``[0, len(offsets) - 2]``
    with ``offsets[b] <= x`` (an empty segment loses to the later one with the same offset).

    The same answer as ``msa.cuda._core.packed.last_le`` for every ``x``, by another loop: the
    KL kernels' machine code is this one's (a swap would change their PTX)."""
    lo = 0
    hi = offsets.shape[0] - 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if offsets[mid] <= x:
            lo = mid
        else:
            hi = mid - 1
    return lo


@cuda.jit(device=True)
def query_row(cu_q, cu_k, t):
    """``(key0, pos, lk)`` of query ``t``: packed index of its sequence's first key, its key
    position (bottom-right: query ``i`` of ``Lq`` sits at ``Lk - Lq + i``) and ``Lk``."""
    b = sequence_of(cu_q, t)
    key0 = int(cu_k[b])
    lk = int(cu_k[b + 1]) - key0
    lq = int(cu_q[b + 1]) - int(cu_q[b])
    return key0, lk - lq + (t - int(cu_q[b])), lk


@cuda.jit(device=True)
def block_range(I, t, r, s, warmup, block_size, pos):
    """``(kk0, kk1)``: key positions of slot ``s`` of (query t, group r) that the query sees;
    ``kk1 <= kk0`` when the slot is empty (-1), invalid or wholly in the future."""
    blk = s if warmup else int(I[t, r, s])
    kk0 = blk * block_size
    if blk < 0 or kk0 > pos:
        return 0, 0
    return kk0, min(kk0 + block_size, pos + 1)


@cuda.jit(device=True)
def kahan_add(s, e, x):
    """``(s, e) + x`` Kahan-compensated: the sum is ``s - e`` (``e`` the lost low-order part)."""
    y = x - e
    t = s + y
    return t, (t - s) - y


@cuda.jit(device=True)
def kahan_add_inf(s, e, x):
    """``kahan_add`` for sums that may reach an infinity (the KL state's ``D`` and ``C``): an
    infinite sum keeps no low-order part (``inf - inf`` would make it NaN)."""
    y = x - e
    t = s + y
    e = (t - s) - y
    if abs(t) == INF:
        e = float32(0.0)
    return t, e


@cuda.jit(device=True)
def times_gap(c, g):
    """``c g`` for a mass ``c >= 0`` and a log gap ``g >= 0``; 0 where ``g = 0`` (an infinite
    teacher mass gives no NaN there; for finite ``c`` the same bits as ``c g``)."""
    return c * g if g != float32(0.0) else float32(0.0)


@cuda.jit(device=True)
def accumulate(m, l, le, d, de, c, ce, p, s_idx):
    """Add one key (teacher ``P_j = p``, student logit ``S^idx_j = s_idx``) to a run's
    Kahan-compensated sums ``(m, l - le, D - de, C - ce)``, ``D = sum P (log P - (S^idx - m))``."""
    # m' = max(m, S_idx): l scales by exp(m - m'), D grows by C (m' - m)
    if s_idx > m:
        if m > NEG_INF:
            f = math.exp(m - s_idx)
            l *= f
            le *= f
            d, de = kahan_add_inf(d, de, times_gap(c, s_idx - m))
        m = s_idx
    rel = NEG_INF  # S^idx - m; a visible -inf logit has no student mass (m may be -inf)
    if s_idx != NEG_INF:
        rel = s_idx - m
        l, le = kahan_add(l, le, math.exp(rel))
    if not (p <= float32(0.0)):  # 0 log 0 = 0: an underflowed teacher adds nothing; NaN stays
        d, de = kahan_add_inf(d, de, p * (math.log(p) - rel))
        c, ce = kahan_add_inf(c, ce, p)
    return m, l, le, d, de, c, ce


@cuda.jit(device=True)
def finish(m, l, le, d, de, c, ce):
    """A run's sums as a state ``(m, l, C, K)``, ``K = D + C log l`` = the run's KL against
    its own student normaliser (module docstring); an empty run is ``(-inf, 0, 0, 0)``, a NaN
    ``l`` stays."""
    l -= le
    c -= ce
    d -= de
    if not (l <= float32(0.0)):
        return m, l, c, d + times_gap(c, math.log(l))
    if d != float32(0.0):  # teacher mass on -inf student logits only: K = +inf (or NaN) stays
        return NEG_INF, float32(0.0), c, d
    return NEG_INF, float32(0.0), float32(0.0), float32(0.0)


@cuda.jit(device=True)
def _gap(m, m_self, x_self, l_self, x_other):
    """``LSE - LSE_self = log(1 + x_other / x_self) >= 0`` of a merge (``x = l e^{m_self - m}``);
    written out when ``x_self`` underflows (the maximum's side has ``x >= 1``; a NaN takes
    the first form, which has no ``log`` of a possible 0)."""
    if not (x_self <= float32(1e-30)):
        return math.log1p(x_other / x_self)
    return (m - m_self) + (math.log(x_other) - math.log(l_self))


@cuda.jit(device=True)
def merge(m1, l1, c1, k1, m2, l2, c2, k2):
    """Merge two states ``(m, l, C, K)``: ``K = K1 + K2 + C1 (LSE - LSE1) + C2 (LSE - LSE2)``
    (module docstring); an empty state (``l = 0``) is the identity, and one with ``l = 0``
    but ``K != 0`` (``finish``: no student mass, ``K = +inf`` or NaN) adds its ``C`` and ``K``."""
    if l2 <= float32(0.0):
        if k2 == float32(0.0):
            return m1, l1, c1, k1
        return m1, l1, c1 + c2, k1 + k2
    if l1 <= float32(0.0):
        if k1 == float32(0.0):
            return m2, l2, c2, k2
        return m2, l2, c1 + c2, k1 + k2
    m = max(m1, m2)
    x1 = l1 * math.exp(m1 - m)
    x2 = l2 * math.exp(m2 - m)
    k = (k1 + k2) + (times_gap(c1, _gap(m, m1, x1, l1, x2))
                     + times_gap(c2, _gap(m, m2, x2, l2, x1)))
    return m, x1 + x2, c1 + c2, k


@cuda.jit(device=True)
def student_lse(m, l):
    """``LSE^idx = m + log l``; 0 for an empty support (then no key uses it); NaN for a NaN
    ``l`` (a NaN or ``+inf`` logit on the support, whose every ``P^idx`` is then NaN)."""
    if not (l <= float32(0.0)):
        return m + math.log(l)
    return float32(0.0)


@cuda.jit(device=True)
def fold_every(acc, comp, part, n):
    """After the ``n``-th term of a run, every ``FOLD`` terms: ``acc - comp += part`` (Kahan,
    elementwise) and ``part = 0``; returns the count within the run. Long sums (``dk_idx``: up
    to ``Tq Hkv`` terms) so grow their rounding error like ``sqrt(n / FOLD)`` ulps at most
    ``FOLD`` deep, instead of ``sqrt(n)``."""
    if n < FOLD:
        return n
    for i in range(acc.shape[0]):
        acc[i], comp[i] = kahan_add(acc[i], comp[i], part[i])
        part[i] = float32(0.0)
    return 0
