"""Paper §3.3 eq 12 and §4.2 eq 13-16: FLOP and HBM-traffic models of GQA and MSA attention.

Closed-form cost models, not measurements. All sizes are positive integers; FLOP and byte
counts come back as exact Python ``int`` and ratios as ``float``. Symbols follow the paper:
``N`` sequence length, ``Hq``/``Hkv`` query/KV heads, ``d_h`` head dim, ``d_idx`` index dim,
``k`` (``topk``) selected blocks per query and group, ``Bk`` (``block_size``) block size.

Conventions the paper uses and these functions keep:

* One multiply-add counts as 2 FLOPs. ``F_GQA = 2 Hq d_h N^2`` is ``4 Hq d_h N^2`` (QK^T and PV)
  halved by the causal mask; the index term ``Hkv d_idx N^2`` is ``2 Hkv d_idx N^2`` (QK^T only)
  halved the same way. The main sparse term ``4 Hq d_h N k Bk`` is not halved: every query reads
  up to ``k Bk`` keys.
* IO counts HBM bytes with ``bytes_per_element`` bytes per element (paper: 2, bf16) and assumes
  perfect on-chip reuse inside one work item; it is the model of §4.2, not a cache simulation.

Arguments follow the rest of msa: sizes, then ``block_size``, then ``topk``; the knobs
(``loop_order``, ``bytes_per_element``) are keyword-only.
"""

from __future__ import annotations

from typing import NamedTuple

from .._checks import check_gqa, check_positive_int


class MSAFlops(NamedTuple):
    """Eq 12 split of ``F_MSA(N)``: ``index`` (``Hkv d_idx N^2``) + ``main`` (``4 Hq d_h N k Bk``)."""

    index: int
    main: int
    total: int


class QOuterIO(NamedTuple):
    """Eq 14 terms in bytes: ``q_o`` = read(Q) + write(O), ``kv`` = read(K+V) once per query."""

    q_o: int
    kv: int
    total: int


class KVOuterIO(NamedTuple):
    """Eq 16 terms in bytes: ``kv`` = read(K+V) once, ``q_obuf`` = read(Q) + write(O_buf) per
    selected block, ``combine`` = read(O_buf) + write(O) in the K2 combine."""

    kv: int
    q_obuf: int
    combine: int
    total: int


def _sizes(**sizes) -> dict:
    """Validated positive ints by name; ``Hq`` must be a multiple of ``Hkv`` when both are given."""
    out = {name: check_positive_int(name, value) for name, value in sizes.items()}
    if "Hq" in out and "Hkv" in out:
        check_gqa(out["Hq"], out["Hkv"])
    return out


def gqa_flops(N: int, Hq: int, d_h: int) -> int:
    """Eq 12: ``F_GQA(N) = 2 Hq d_h N^2``, causal dense attention FLOPs of one layer."""
    s = _sizes(N=N, Hq=Hq, d_h=d_h)
    return 2 * s["Hq"] * s["d_h"] * s["N"] ** 2


def attention_flops(N: int, Hq: int, d_h: int, block_size: int, topk: int) -> int:
    """Eq 13: ``FLOPs = 4 Hq N d_h k Bk``, the sparse main branch (identical for Q- and KV-outer).

    An upper bound: a query's local block is only partly visible and early queries have fewer
    than ``k`` visible blocks, both of which the paper ignores.
    """
    s = _sizes(N=N, Hq=Hq, d_h=d_h, topk=topk, block_size=block_size)
    return 4 * s["Hq"] * s["N"] * s["d_h"] * s["topk"] * s["block_size"]


def msa_flops(N: int, Hq: int, Hkv: int, d_h: int, d_idx: int, block_size: int,
              topk: int) -> MSAFlops:
    """Eq 12: ``F_MSA(N) = Hkv d_idx N^2 + 4 Hq d_h N k Bk`` as ``MSAFlops(index, main, total)``.

    The index branch scores every causal (query, key) pair once per group (one shared index key
    head), so it stays quadratic; the main branch is linear in ``N`` for fixed ``k Bk``.
    """
    s = _sizes(N=N, Hq=Hq, Hkv=Hkv, d_idx=d_idx)
    index = s["Hkv"] * s["d_idx"] * s["N"] ** 2
    main = attention_flops(N, Hq, d_h, block_size, topk)
    return MSAFlops(index=index, main=main, total=index + main)


def crossover_length(Hq: int, Hkv: int, d_h: int, d_idx: int, block_size: int, topk: int) -> float:
    """§3.3: ``N* = 4 Hq d_h k Bk / (Hkv d_idx)``, where the index term equals the main term.

    Below ``N*`` the sparse main branch dominates MSA's FLOPs, above it the quadratic index
    branch does (paper config: ``N* = 131072``).
    """
    s = _sizes(Hq=Hq, Hkv=Hkv, d_h=d_h, d_idx=d_idx, topk=topk, block_size=block_size)
    return 4 * s["Hq"] * s["d_h"] * s["topk"] * s["block_size"] / (s["Hkv"] * s["d_idx"])


def speedup_limit(Hq: int, Hkv: int, d_h: int, d_idx: int) -> float:
    """§3.3: ``lim_{N->inf} F_GQA / F_MSA = 2 Hq d_h / (Hkv d_idx)`` (paper config: 32).

    MSA keeps a quadratic term, so the FLOP ratio saturates instead of growing without bound.
    """
    s = _sizes(Hq=Hq, Hkv=Hkv, d_h=d_h, d_idx=d_idx)
    return 2 * s["Hq"] * s["d_h"] / (s["Hkv"] * s["d_idx"])


def q_outer_io(N: int, Hq: int, Hkv: int, d_h: int, block_size: int, topk: int, *,
               bytes_per_element: int = 2) -> QOuterIO:
    """Eq 14: HBM bytes of Q-outer sparse attention (each query gathers its own K/V blocks).

    ``q_o = 2 Hq N d_h`` elements (read Q, write O) and ``kv = 2 Hkv N k Bk d_h`` elements (K and
    V of every selected block, re-read by every (query, group)), times ``bytes_per_element``.
    """
    s = _sizes(N=N, Hq=Hq, Hkv=Hkv, d_h=d_h, topk=topk, block_size=block_size,
               bytes_per_element=bytes_per_element)
    e = s["bytes_per_element"]
    q_o = e * 2 * s["Hq"] * s["N"] * s["d_h"]
    kv = e * 2 * s["Hkv"] * s["N"] * s["topk"] * s["block_size"] * s["d_h"]
    return QOuterIO(q_o=q_o, kv=kv, total=q_o + kv)


def kv_outer_io(N: int, Hq: int, Hkv: int, d_h: int, topk: int, *,
                bytes_per_element: int = 2) -> KVOuterIO:
    """Eq 16: HBM bytes of KV-outer sparse attention (K1 partials + K2 combine).

    ``kv = 2 Hkv N d_h`` (every K/V block read once), ``q_obuf = 2 Hq N k d_h`` (a query is
    gathered and a partial output written once per selected block), ``combine = Hq N (k+1) d_h``
    (K2 reads ``k`` partials and writes ``O``), all in elements times ``bytes_per_element``.
    Independent of ``Bk``: that is the point of the loop order.
    """
    s = _sizes(N=N, Hq=Hq, Hkv=Hkv, d_h=d_h, topk=topk, bytes_per_element=bytes_per_element)
    e = s["bytes_per_element"]
    kv = e * 2 * s["Hkv"] * s["N"] * s["d_h"]
    q_obuf = e * 2 * s["Hq"] * s["N"] * s["topk"] * s["d_h"]
    combine = e * s["Hq"] * s["N"] * (s["topk"] + 1) * s["d_h"]
    return KVOuterIO(kv=kv, q_obuf=q_obuf, combine=combine, total=kv + q_obuf + combine)


def arithmetic_intensity(N: int, Hq: int, Hkv: int, d_h: int, block_size: int, topk: int, *,
                         loop_order: str = "kv_outer", bytes_per_element: int = 2) -> float:
    """§4.2: FLOPs per HBM byte, eq 13 over eq 14 (``"q_outer"``) or eq 16 (``"kv_outer"``).

    Both numerator and denominator are linear in ``N``, so the result does not depend on ``N``.
    The paper's approximations: Q-outer ``~ G = Hq/Hkv`` (drops the Q/O term), KV-outer
    ``~ 2/3 Bk`` (drops the K/V term and takes ``k+1 ~ k``); with 2-byte elements.
    """
    if loop_order == "q_outer":
        io = q_outer_io(N, Hq, Hkv, d_h, block_size, topk, bytes_per_element=bytes_per_element)
    elif loop_order == "kv_outer":
        check_positive_int("block_size", block_size)
        io = kv_outer_io(N, Hq, Hkv, d_h, topk, bytes_per_element=bytes_per_element)
    else:
        raise ValueError(f"loop_order must be 'q_outer' or 'kv_outer', got {loop_order!r}")
    return attention_flops(N, Hq, d_h, block_size, topk) / io.total
