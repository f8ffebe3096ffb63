"""Paper §4.2, K2 on the GPU: exact log-sum-exp combine of the KV-outer partials.

Same function and arguments as ``msa.reference.combine`` (read its docstring for the math):

.. math::  L = a + \\log \\sum_s e^{L_s - a},\\ a = \\max_s L_s, \\qquad O = \\sum_s e^{L_s - L} O_s

The weights are computed as ``e^{L_s - a} / \\sum_t e^{L_t - a}``, as the reference does, not as
``e^{L_s - L}``: ``L`` rounded to float32 is off by up to half an ulp of ``|L|`` (5e-7 at
``L`` = 13), and ``e^{L_s - L}`` turns that absolute error into a relative error of every
weight. The quotient's error does not grow with ``|L|``.

K2 is memory bound: it reads ``K*Tq*Hq*D`` partial values once (4 bytes each, 2 with bf16
partials) and writes ``Tq*Hq*D`` outputs. A (query, head) whose slots are all ``-inf`` gets
``O = 0`` and ``LSE = -inf``, never NaN. Both versions are deterministic (fixed slot order, no
atomics). ``launch_combine`` is the combine for other stages (``msa.cuda.attention``): it
checks nothing.

===  ==================================================  ==========================================
v    idea                                                where it runs; verdict (H200, paper
                                                         configuration, 16K queries, bf16 partials)
===  ==================================================  ==========================================
1    one warp of lanes per (query, head), slot by slot   the simulator's default; the GPU's
     (``v1_warp``)                                       fallback where v2 does not apply: 5.8 ms,
                                                         0.78 TB/s
2    one warp per row, 16-byte loads of a batch of       the GPU default: 1.46-1.50 ms, ~3 TB/s
     slots in flight, the first batch beside the LSE     (70% of the copy bandwidth)
     loads (``v2_vector``)
===  ==================================================  ==========================================
"""

from __future__ import annotations

import numpy as np

from ..._checks import check_array, check_version, unsupported
from .._core.arrays import SIMULATOR, ArrayContext, float_kind
from .v1_warp import launch_v1
from .v2_vector import launch_v2, vector_path_ok

__all__ = ["VERSIONS", "DEFAULT_VERSION", "combine_partials", "launch_combine"]

VERSIONS = (1, 2)
# The simulator runs v1 by default: v2 needs a warp of 32 Python threads a row there (v1: 4),
# about 8x slower; tests/cuda/test_combine.py runs both versions explicitly.
DEFAULT_VERSION = 1 if SIMULATOR else 2


def _out_kind(dtype) -> str:
    """``'float32' | 'float16' | 'bfloat16'`` for the ``out_dtype`` argument (a NumPy/torch dtype
    or a name); TypeError otherwise."""
    name = str(dtype).replace("torch.", "")
    if name in ("bfloat16", "bf16"):
        return "bfloat16"
    try:  # a torch dtype (torch.float16) is no NumPy dtype: go by its name
        dt = np.dtype(name if str(dtype).startswith("torch.") else dtype)
    except TypeError:
        raise TypeError(f"out_dtype must be float32, float16 or bfloat16, got {dtype!r}") from None
    if dt == np.float32:
        return "float32"
    if dt == np.float16:
        return "float16"
    if dt == np.float64:
        raise unsupported("out_dtype", "float64", "msa.cuda", "float32, float16 or bfloat16",
                          exc=TypeError)
    raise TypeError(f"out_dtype must be float32, float16 or bfloat16, got {dt}")


def launch_combine(o_part, lse_part, out, lse_out, *, head_dim, bf16_part, bf16_out,
                   version=DEFAULT_VERSION):
    """K2 on kernel-ready arrays, for other stages: checks nothing.

    Args:
        o_part: [K, Tq, Hq, D] float32, or bf16 bits (int16/uint16) with ``bf16_part``.
        lse_part: float32 [K, Tq, Hq] (``-inf``: unused slot, its ``O_s`` never summed).
        out: [Tq, Hq, D] float32, float16 or bf16 bits (``bf16_out``); lse_out float32
            [Tq, Hq]. Either may be a view of a larger output (a query chunk of it).
        head_dim: D. version: 1, or 2 (16-byte loads where ``vector_path_ok`` allows, version
            1 otherwise: the same results up to the float32 summation order).

    Returns:
        The version that ran (None when there is no row).
    """
    rows = int(lse_part.shape[1]) * int(lse_part.shape[2])
    if rows == 0:
        return None
    if version == 2 and vector_path_ok(o_part, out, head_dim, bf16_part, int(lse_part.shape[0])):
        out_code = ("bf16" if bf16_out else
                    "f16" if np.dtype(out.dtype) == np.float16 else "f32")
        launch_v2(o_part, lse_part, out, lse_out, head_dim=head_dim, bf16_part=bf16_part,
                  out_code=out_code)
        return 2
    launch_v1(o_part, lse_part, out, lse_out, head_dim=head_dim, bf16_part=bf16_part,
              bf16_out=bf16_out)
    return 1


def combine_partials(o_part, lse_part, *, out_dtype=None, version: int | None = None):
    """Paper §4.2 K2: merge the ``K`` partial attentions of every (query, head) with their LSEs.

    .. math::  L = \\log \\sum_s e^{L_s}, \\qquad O = \\sum_s e^{L_s - L} O_s

    Args:
        o_part: [K, Tq, Hq, D] float32 (or bfloat16 partials), ``O_s``, K >= 1; a CuPy array,
            torch CUDA tensor, Numba device array or (copied) NumPy array.
        lse_part: float32 [K, Tq, Hq], ``L_s`` in natural log; ``-inf`` marks an unused slot (its
            ``O_s`` is never read, so it may hold anything). A NaN ``L_s`` gives its (query,
            head) ``o = NaN, lse = NaN``, else a ``+inf`` one ``o = NaN, lse = +inf`` (what eq
            8 gives for such scores), bit for bit as ``msa.reference.combine_partials``.
        out_dtype: dtype of ``o``: float32, float16 or bfloat16 (a NumPy/torch dtype or the
            string ``"bfloat16"``); ``None`` keeps ``o_part``'s dtype.
        version: kernel version 1 or 2 (the package's table); ``None``: 2.

    Returns:
        ``(o [Tq, Hq, D] in out_dtype, lse float32 [Tq, Hq])`` in the caller's array library. A
        (query, head) whose slots are all ``-inf`` gets ``o = 0``, ``lse = -inf``. Bitwise
        deterministic (fixed slot order, no atomics).

    Raises:
        TypeError: ``o_part`` not float32/bfloat16, ``lse_part`` not float32, a bad ``out_dtype``,
        mixed array libraries. ValueError: wrong ranks, ``K < 1``, ``lse_part``'s shape not
        ``o_part.shape[:3]``, non-contiguous arrays, a bad ``version``.
    """
    check_array("o_part", o_part, ndim=4)
    bf16_part = float_kind("o_part", o_part, ("float32", "bfloat16")) == "bfloat16"
    num_slots, tq, hq, d = (int(s) for s in o_part.shape)
    if num_slots < 1:
        raise ValueError(f"o_part must have K >= 1 slots on axis 0, got shape "
                         f"{tuple(o_part.shape)}")
    check_array("lse_part", lse_part, ndim=3, shape=(num_slots, tq, hq))
    float_kind("lse_part", lse_part, ("float32",))
    kind = _out_kind(out_dtype) if out_dtype is not None else ("bfloat16" if bf16_part
                                                               else "float32")
    version = check_version("version", version, VERSIONS) or DEFAULT_VERSION
    ctx = ArrayContext(o_part=o_part, lse_part=lse_part)
    o_arg = ctx.input("o_part", o_part)
    l_arg = ctx.input("lse_part", lse_part)
    out = ctx.empty((tq, hq, d), kind)
    lse = ctx.empty((tq, hq), np.float32)
    launch_combine(o_arg, l_arg, ctx.arg(out), ctx.arg(lse), head_dim=d, bf16_part=bf16_part,
                   bf16_out=kind == "bfloat16", version=version)
    return ctx.output(out), ctx.output(lse)
