"""Kernel variants of msa.cuda.kl (the stage folder msa/cuda/kl/), for the PTX checks.

Named by rung (v1 thread rows, v2 CTA rows, v3 register tensor cores; before the stage layout
v3 was v4, and the old v3 is deleted); the names are those of the listing of 426fbbf. The
launchers pass: inputs as their element type (bf16 as uint16 bits; the tensor-core kernels take
uint32 words of two 16-bit values), offsets and CSR/schedule arrays as int32, block_indices
int32 (select_blocks' and msa.torch's), Python ints as int64, np.float32 scalars, C-contiguous
float32 buffers. Tile sizes are what msa.cuda.kl._plan picks on a GPU (grad tile R = P G = 64
rows, 32 at G = 1 with the paper's sizes; student tile 4 warps; v2 row CTAs of 128 threads;
the mean CTA of 512).
"""

from numba import types


def variants():
    from msa.cuda.kl import _common
    from msa.cuda.kl import v1_thread_rows as v1
    from msa.cuda.kl import v2_cta_rows as v2
    from msa.cuda.kl import v3_dk_idx as v3dk
    from msa.cuda.kl import v3_student as v3s
    from msa.cuda.kl import v3_tensor_cores as v3

    i32, i64, u16, u32, f16, f32 = (types.int32, types.int64, types.uint16, types.uint32,
                                    types.float16, types.float32)
    b1 = types.boolean
    cu, i2, I3 = i32[::1], i32[:, ::1], i32[:, :, ::1]
    f1, f2, f3, f4 = f32[::1], f32[:, ::1], f32[:, :, ::1], f32[:, :, :, ::1]
    w3, w2 = u32[:, :, ::1], u32[:, ::1]
    elem = {"f32": f32, "f16": f16, "bf16": u16}
    kinds = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}

    def inputs(dt):
        return (dt[:, :, ::1], dt[:, :, ::1], dt[:, :, ::1], dt[:, ::1])

    def rows_sig(dt):
        return (*inputs(dt), I3, f2, cu, cu, i64, b1, f32, f32, f2)

    def rows_grad_sig(dt):
        return (*inputs(dt), I3, f2, cu, cu, i64, b1, f32, f32, f32, i64, i64, b1, f2, f3, f4)

    def keys_sig(dt):
        return (*inputs(dt), f2, f2, i2, i2, i2, f4, cu, cu, cu, i64, f32, f32, f32, f2)

    # every rung: the teacher's own LSE (lse=None) and the mean of eq 10
    for dt, g, d in (("f32", 2, 16), ("bf16", 16, 128)):
        yield (f"teacher_lse.{dt}.g{g}.d{d}", _common.kl_kernel_teacher_lse(kinds[dt], g, d),
               (elem[dt][:, :, ::1], elem[dt][:, :, ::1], I3, cu, cu, i64, b1, f32, f2))
    yield "mean.t512", _common.kl_kernel_mean(512), (f1, f1)

    # v1, thread rows / thread keys (teaching)
    for dt, g, d, di in (("f32", 2, 16, 16), ("f16", 1, 32, 32), ("bf16", 16, 128, 128)):
        tag = f"{dt}.g{g}.d{d}.di{di}"
        yield f"v1.rows.{tag}", v1.kl_kernel_thread_rows(kinds[dt], g, d, di), rows_sig(elem[dt])
        yield (f"v1.rows_grad.{tag}", v1.kl_kernel_thread_rows_grad(kinds[dt], g, d, di),
               rows_grad_sig(elem[dt]))
        for warm in (False, True):
            yield (f"v1.keys{'_warmup' if warm else ''}.{tag}",
                   v1.kl_kernel_thread_keys(kinds[dt], g, d, di, warm), keys_sig(elem[dt]))

    # v2, CTA rows / CTA keys: float32, the warmup, shapes the tensor cores reject; its dk_idx
    # kernel also serves v3 for fp16 (and Bk > 128)
    for dt, g, d, di, bk, rows, keys in (
            ("f32", 2, 16, 16, 16, True, ((16, False), (16, True))),
            ("f32", 16, 128, 128, 128, True, ((16, False), (4, True))),
            ("f16", 2, 8, 16, 16, True, ((16, True),)),
            ("bf16", 16, 128, 128, 128, True, ((4, True),)),
            ("f16", 16, 128, 128, 128, False, ((16, False),)),
            ("f16", 2, 16, 16, 16, False, ((16, False),))):
        tag = f"{dt}.g{g}.d{d}.di{di}"
        if rows:
            yield (f"v2.rows.{tag}", v2.kl_kernel_cta_rows(kinds[dt], g, d, di, 128),
                   rows_sig(elem[dt]))
            yield (f"v2.rows_grad.{tag}", v2.kl_kernel_cta_rows_grad(kinds[dt], g, d, di, 128),
                   rows_grad_sig(elem[dt]))
        for entries, warm in keys:
            yield (f"v2.keys{'_warmup' if warm else ''}.{tag}.bk{bk}.e{entries}",
                   v2.kl_kernel_cta_keys(kinds[dt], g, d, di, bk, entries, warm),
                   keys_sig(elem[dt]))

    # v3 (old v4), register tensor cores: fp16/bf16 with a selection
    student_sig = (w3, w2, i2, i2, i2, cu, cu, f32, f4)
    for bf16, bk, di, aligned in ((True, 128, 128, True), (False, 128, 128, True),
                                  (False, 16, 16, True), (True, 32, 32, False)):
        name = (f"v3.student.{'bf16' if bf16 else 'f16'}.bk{bk}.di{di}"
                f"{'' if aligned else '.plain'}")
        yield name, v3s.kl_kernel_student(bf16, bk, di, 4, aligned), student_sig
    grad_sig = (w3, w3, w3, w2, f2, f2, i2, i2, i2, cu, cu, f32, f32, f32, f4, f4, f4)
    for bf16, bk, d, di, g, p, aligned, modes in (
            (True, 128, 128, 128, 16, 4, True, (True, False)),
            (False, 128, 128, 128, 16, 4, True, (True, False)),
            (True, 128, 128, 128, 16, 8, True, (True,)),
            (True, 128, 128, 128, 8, 8, True, (True,)),
            (True, 128, 128, 128, 4, 16, True, (True,)),
            (True, 128, 128, 128, 2, 32, True, (True,)),
            (True, 128, 128, 128, 1, 32, True, (True,)),
            (False, 128, 128, 128, 1, 32, False, (True,)),
            (False, 16, 16, 16, 2, 32, True, (True, False)),
            (True, 32, 32, 32, 1, 64, True, (True,))):
        for grads in modes:
            name = (f"v3.{'grad' if grads else 'kl'}.{'bf16' if bf16 else 'f16'}.g{g}.p{p}"
                    f".bk{bk}.d{d}.di{di}{'' if aligned else '.plain'}")
            yield name, v3.kl_kernel_grad(bf16, bk, d, di, g, p, aligned, grads), grad_sig
    # the teacher's S on wgmma (TEACHER_WGMMA; tiles of whole warpgroups)
    for bf16, bk, g, p, modes in ((True, 128, 16, 8, (True, False)), (False, 128, 16, 8, (True,)),
                                  (True, 128, 4, 16, (True,)), (True, 64, 16, 4, (True,))):
        for grads in modes:
            name = (f"v3.{'grad' if grads else 'kl'}.{'bf16' if bf16 else 'f16'}.g{g}.p{p}"
                    f".bk{bk}.d128.di128.wgmma")
            yield name, v3.kl_kernel_grad(bf16, bk, 128, 128, g, p, True, grads, True), grad_sig
    keys_tc_sig = (w3, f4, i2, i2, i2, cu, cu, i2, i64, f32, f2, f2)
    for bk, di, aligned in ((128, 128, True), (128, 128, False), (32, 32, True), (16, 16, True)):
        yield (f"v3.keys.bf16.bk{bk}.di{di}{'' if aligned else '.plain'}",
               v3dk.kl_kernel_keys(bk, di, aligned), keys_tc_sig)
    yield "v3.keys_parts", v3dk.keys_parts_kernel, (i2, i64, i2)
    yield "v3.keys_sum.bk128.di128", v3dk.keys_sum_kernel(128, 128)[0], (i2, cu, cu, f2, f2)
    yield "v3.combine_states", _common.kl_kernel_combine_states, (f4, I3, i64, b1, f2)
    yield "v3.combine_kl", _common.kl_kernel_combine_kl, (f4, I3, i64, f2)
    yield "v3.combine_dq", _common.kl_kernel_combine_dq, (f4, I3, i64, f3)
    yield "v3.full_selection", _common.kl_kernel_full_selection, (cu, cu, i64, I3)
