from numba import types
def variants():
    from msa.cuda import schedule as S
    i32, i64 = types.int32, types.int64
    i32_1, i32_2, i32_3 = i32[::1], i32[:, ::1], i32[:, :, ::1]
    yield "rows", S._schedule_kernel_rows, (i32_2, i64, i64, i64, i32_3, i32_1, i32_3)
