"""Select-stage kernel variants: select_blocks v1 (the simple rung), v2 (the paper's warp heap)
and v3 (the default), with the int32 device offsets the launcher passes. (The fused index +
top-k kernels are the index stage's tensor-core rungs: ``msa.testing.variants.index``.)"""
from numba import types


def variants():
    from msa.cuda.select import v1_sorted as v1, v2_warp_heap as v2, v3_warp_list as v3

    i32, i64, f16, f32, f64 = types.int32, types.int64, types.float16, types.float32, types.float64
    cu = i32[::1]

    def sig(dt):
        return (dt[:, :, ::1], cu, cu, i64, i64, i64, i32[:, :, ::1])

    for cap, dt in ((16, f32), (4, f32), (64, f32), (16, f64), (16, f16), (1, f32)):
        yield f"v1.cap{cap}.{dt}", v1.select_kernel(cap, dt == f64), sig(dt)
    for cap, dt in ((16, f32), (4, f32), (64, f32), (16, f64), (16, f16), (1, f32)):
        yield f"v2.cap{cap}.{dt}", v2.select_kernel(cap, dt == f64), sig(dt)
    for wide_list, dt, vec in ((False, f32, True), (False, f32, False), (True, f32, True),
                               (True, f32, False), (False, f64, False), (True, f64, False),
                               (False, f16, False)):
        name = f"v3.{'wide' if wide_list else 'narrow'}.{dt}.{'vec' if vec else 'scalar'}"
        yield name, v3.select_kernel(wide_list, dt == f64, vec), sig(dt)
