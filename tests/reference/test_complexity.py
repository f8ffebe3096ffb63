"""Paper §3.3 eq 12 and §4.2 eq 13-16: the cost models against the paper's numbers and limits.

Paper configuration throughout: Hq=64, Hkv=4, d_h=128, d_idx=128, k=16, Bk=128 (G=16, k Bk=2048).

How close the paper's rounded statements are to the exact formulas (checked below):

* ``F_GQA / F_MSA = 32 N / (N + N*)`` exactly, with ``N* = 131072``: 28.29 at N = 10^6 (the
  notes' "28.3x", their table uses N = 10^6) and 256/9 = 28.44 at N = 2^20 (the paper's "28.4x").
* Q-outer intensity ``= G / (1 + G / (k Bk)) = 15.876`` for every N, 0.78 % under ``G = 16``.
* KV-outer intensity ``= (2/3) Bk / (1 + (Hq + 2 Hkv) / (3 Hq k)) = 83.38`` for every N, 2.3 %
  under ``(2/3) Bk = 85.33``; their ratio is 5.25 (paper: "about 5.3").
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from msa.reference.complexity import (KVOuterIO, MSAFlops, QOuterIO, arithmetic_intensity,
                                      attention_flops, crossover_length, gqa_flops, kv_outer_io,
                                      msa_flops, q_outer_io, speedup_limit)

PAPER = dict(Hq=64, Hkv=4, d_h=128, d_idx=128, topk=16, block_size=128)
MAIN = dict(Hq=64, d_h=128, topk=16, block_size=128)  # the arguments of eq 13
PAPER_NO_IDX = dict(Hq=64, Hkv=4, d_h=128, topk=16, block_size=128)  # eq 14, intensity
IO = dict(Hq=64, Hkv=4, d_h=128, topk=16)  # the arguments of eq 16


def flop_ratio(N: int, cfg=PAPER) -> float:
    return gqa_flops(N, cfg["Hq"], cfg["d_h"]) / msa_flops(N, **cfg).total


def test_paper_flops_table_at_8192():
    """§3.3 FLOPs table at N = 8192: index 3.44e10, main 54.97e10, GQA 109.9e10 (as printed)."""
    f = msa_flops(8192, **PAPER)
    assert isinstance(f, MSAFlops)
    assert f.index == 4 * 128 * 8192**2 == 34_359_738_368
    assert f.main == 4 * 64 * 128 * 8192 * 16 * 128 == 549_755_813_888
    assert f.total == f.index + f.main
    assert gqa_flops(8192, 64, 128) == 2 * 64 * 128 * 8192**2 == 1_099_511_627_776
    assert round(f.index / 1e10, 2) == 3.44
    # The table truncates: 54.9756e10 is printed 54.97e10 and 109.951e10 is printed 109.9e10.
    assert math.floor(f.main / 1e8) / 100 == 54.97
    assert math.floor(gqa_flops(8192, 64, 128) / 1e9) / 10 == 109.9
    assert attention_flops(8192, **MAIN) == f.main  # eq 13 is eq 12's main term


def test_paper_flop_ratio_at_one_million():
    """§3.3: "28.4x" at 1M tokens; the exact ratio is 32 N / (N + 131072)."""
    assert flop_ratio(2**20) == pytest.approx(256 / 9, rel=1e-15)  # 28.444...
    assert round(flop_ratio(2**20), 1) == 28.4
    assert flop_ratio(10**6) == pytest.approx(32e6 / (10**6 + 131072), rel=1e-15)  # 28.29...
    assert round(flop_ratio(10**6), 2) == 28.29
    # At 1M the index branch is ~88 % of MSA's FLOPs (the notes' corollary one).
    f = msa_flops(2**20, **PAPER)
    assert f.index / f.total == pytest.approx(8 / 9, rel=1e-15)
    # At 8K MSA is only ~1.9x cheaper than GQA: k Bk / N = 25 %.
    assert flop_ratio(8192) == pytest.approx(32 * 8192 / (8192 + 131072), rel=1e-15)


def test_paper_crossover_and_ceiling():
    """N* = 4 Hq d_h k Bk / (Hkv d_idx) = 131072 = 128K; the ratio saturates at 32."""
    n_star = crossover_length(**PAPER)
    assert n_star == 131072.0
    f = msa_flops(131072, **PAPER)
    assert f.index == f.main
    assert flop_ratio(131072) == 16.0  # half the ceiling at the crossover
    assert speedup_limit(64, 4, 128, 128) == 32.0
    assert flop_ratio(2**40) < 32.0
    assert flop_ratio(2**40) == pytest.approx(32.0, rel=2e-7)


def test_paper_arithmetic_intensities():
    """§4.2: Q-outer ~ G = 16, KV-outer ~ 2/3 Bk = 85.3, both N-independent; errors as documented."""
    q_outer = arithmetic_intensity(2**20, **PAPER_NO_IDX, loop_order="q_outer")
    kv_outer = arithmetic_intensity(2**20, **PAPER_NO_IDX, loop_order="kv_outer")
    assert q_outer == pytest.approx(16 / (1 + 16 / 2048), rel=1e-15)
    assert kv_outer == pytest.approx((2 / 3) * 128 / (1 + (64 + 8) / (3 * 64 * 16)), rel=1e-15)
    assert abs(q_outer / 16 - 1) < 0.008  # 0.78 %: the Q/O term the paper drops
    assert abs(kv_outer / (2 / 3 * 128) - 1) < 0.024  # 2.3 %: the K/V term and k+1 ~ k
    assert round(q_outer, 2) == 15.88 and round(kv_outer, 2) == 83.38
    assert round(kv_outer / q_outer, 2) == 5.25  # paper: "about 5.3"


def test_io_terms_match_the_equations():
    """Eq 14 and eq 16 term by term at the paper config, 2 bytes per element (bf16)."""
    N = 8192
    q = q_outer_io(N, **PAPER_NO_IDX)
    assert isinstance(q, QOuterIO)
    assert q.q_o == 2 * 2 * 64 * N * 128
    assert q.kv == 2 * 2 * 4 * N * 16 * 128 * 128
    assert q.total == q.q_o + q.kv
    kv = kv_outer_io(N, **IO)
    assert isinstance(kv, KVOuterIO)
    assert kv.kv == 2 * 2 * 4 * N * 128
    assert kv.q_obuf == 2 * 2 * 64 * N * 16 * 128
    assert kv.combine == 2 * 64 * N * 17 * 128
    assert kv.total == kv.kv + kv.q_obuf + kv.combine
    # KV-outer replaces k Bk d_h of K/V traffic per query with O(k d_h): a Bk-fold saving.
    assert q.kv // kv.kv == 16 * 128
    # fp32 partials would double every term.
    assert kv_outer_io(N, **IO, bytes_per_element=4).total == 2 * kv.total


sizes = st.integers(1, 1 << 20)
heads = st.sampled_from([(1, 1), (4, 1), (8, 2), (16, 4), (64, 4), (6, 3)])


@given(N=sizes, hq_hkv=heads, d_h=st.integers(1, 256), d_idx=st.integers(1, 256),
       topk=st.integers(1, 64), block_size=st.integers(1, 256))
def test_flop_ratio_closed_form(N, hq_hkv, d_h, d_idx, topk, block_size):
    """F_GQA / F_MSA = limit * N / (N + N*) for every configuration, so it rises towards the limit."""
    hq, hkv = hq_hkv
    cfg = dict(Hq=hq, Hkv=hkv, d_h=d_h, d_idx=d_idx, topk=topk, block_size=block_size)
    f = msa_flops(N, **cfg)
    assert all(isinstance(x, int) for x in f)
    assert f.total == f.index + f.main
    limit = speedup_limit(hq, hkv, d_h, d_idx)
    n_star = crossover_length(**cfg)
    assert flop_ratio(N, cfg) == pytest.approx(limit * N / (N + n_star), rel=1e-12)
    assert flop_ratio(N, cfg) < limit
    assert (f.index > f.main) == (N > n_star) or f.index == f.main


@given(N=sizes, hq_hkv=heads, d_h=st.integers(1, 256), topk=st.integers(1, 64),
       block_size=st.integers(1, 256), bytes_per_element=st.sampled_from([1, 2, 4]))
def test_intensity_is_length_independent_and_bounded(N, hq_hkv, d_h, topk, block_size,
                                                     bytes_per_element):
    """Both intensities are N-independent, scale as 1/bytes, and stay under their approximations."""
    hq, hkv = hq_hkv
    cfg = dict(Hq=hq, Hkv=hkv, d_h=d_h, topk=topk, block_size=block_size,
               bytes_per_element=bytes_per_element)
    for order, approx in (("q_outer", hq / hkv), ("kv_outer", 2 / 3 * block_size)):
        a = arithmetic_intensity(N, **cfg, loop_order=order)
        assert a == pytest.approx(arithmetic_intensity(2 * N, **cfg, loop_order=order), rel=1e-12)
        assert a * bytes_per_element / 2 <= approx * (1 + 1e-12)
    assert attention_flops(N, hq, d_h, block_size, topk) == 4 * hq * N * d_h * topk * block_size


@pytest.mark.parametrize("call, error, match", [
    (lambda: gqa_flops(0, 64, 128), ValueError, "N"),
    (lambda: gqa_flops(8192, -1, 128), ValueError, "Hq"),
    (lambda: gqa_flops(8192.0, 64, 128), TypeError, "N"),
    (lambda: gqa_flops(True, 64, 128), TypeError, "N"),
    (lambda: msa_flops(8192, 64, 4, 128, 0, 128, 16), ValueError, "d_idx"),
    (lambda: msa_flops(8192, 64, 5, 128, 128, 128, 16), ValueError, "kv heads"),
    (lambda: attention_flops(8192, 64, 128, 128, 0), ValueError, "topk"),
    (lambda: crossover_length(64, 4, 128, 128, 0, 16), ValueError, "block_size"),
    (lambda: speedup_limit(64, 0, 128, 128), ValueError, "Hkv"),
    (lambda: q_outer_io(8192, 64, 4, 128, 128, 16, bytes_per_element=0), ValueError,
     "bytes_per_element"),
    (lambda: kv_outer_io(8192, 64, 4, "128", 16), TypeError, "d_h"),
    (lambda: arithmetic_intensity(8192, **PAPER_NO_IDX, loop_order="both"), ValueError,
     "loop_order"),
    (lambda: arithmetic_intensity(8192, 64, 4, 128, 0, 16), ValueError, "block_size"),
], ids=["N=0", "Hq<0", "N-float", "N-bool", "d_idx=0", "G-not-int", "topk=0", "Bk=0", "Hkv=0",
        "bytes=0", "d_h-str", "loop-order", "intensity-Bk=0"])
def test_bad_sizes(call, error, match):
    with pytest.raises(error, match=match):
        call()
