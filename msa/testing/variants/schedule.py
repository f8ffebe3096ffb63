"""Kernel variants of msa.cuda.schedule: its two kernels and the look-back scan it launches.

No shape-dependent specialisation: one signature per kernel, with the argument types
``build_schedule`` passes (row_ptr int32 from build_csr, row_offsets uploaded as int32 [::1],
Python ints typed int64). The order is the one of the listing at 426fbbf (Numba numbers shared
arrays per process, in compile order).
"""

from numba import types


def variants():
    from msa.cuda._core import scan
    from msa.cuda.schedule import v1_counting_sort as v1

    i32, i64 = types.int32, types.int64
    i32_1, i32_2, i32_3 = i32[::1], i32[:, ::1], i32[:, :, ::1]
    yield "rows", v1.rows_kernel, (i32_2, i64, i64, i64, i32_3, i32_1, i32_3)
    yield "scan_v3_lookback", scan._scan_kernel_lookback, (i32_3, i64, i64[::1], i64, i32_2)
    yield "write", v1.write_kernel, (i32_2, i32_1, i64, i32_3, i32_2, i32_1, i32_3, i32_2, i32_2,
                                     i32_1)
