"""Index-stage kernel variants: ``block_scores`` and the fused index + top-k kernels (the
tensor-core rungs with their top-k epilogue) that the launchers run by default (cc 9.0 and
other GPUs: v3 where it applies, v2 where Bk % 16 != 0 or k_idx is unaligned, v1 for
fp32/fp64 and the other shapes), at the paper's shapes and small ones. GPU tile: 8 warps."""
from numba import types


def variants():
    from msa.cuda.index import v1_cuda_cores as v1, v2_tensor_cores as v2, v3_pipelined as v3

    i32, i64, u32, f32, f64 = types.int32, types.int64, types.uint32, types.float32, types.float64
    f16, i16 = types.float16, types.int16
    cu = i32[::1]

    def v1_sig(dt, out=f32, scale=f32):
        return (dt[:, :, ::1], dt[:, ::1], cu, cu, i64, i64, scale, out[:, :, ::1])

    tc_sig = (u32[:, :, ::1], u32[:, ::1], cu, cu, i32[:, ::1], i64, i64, f32, f32[:, :, ::1],
              i64, i32[:, :, ::1])
    # v1: CUDA cores (fp32/fp64 default; bf16/fp16 where no tensor-core rung applies)
    yield "v1.f32.max", v1.block_scores_kernel(False, False), v1_sig(f32)
    yield "v1.f32.mean", v1.block_scores_kernel(False, True), v1_sig(f32)
    yield "v1.f64.max", v1.block_scores_kernel(True, False), v1_sig(f64, f64, f64)
    yield "v1.f64.mean", v1.block_scores_kernel(True, True), v1_sig(f64, f64, f64)
    yield "v1.f16.max", v1.block_scores_kernel(False, False), v1_sig(f16)
    yield "v1.bf16.max", v1.block_scores_kernel(False, False), v1_sig(i16)
    # v2: Bk % 16 != 0 or unaligned k_idx; with cap > 0 the fused top-k (fused version 2)
    for d, bk, bf16, mean, cap in ((128, 128, True, False, 0), (128, 128, True, True, 0),
                                   (128, 128, True, False, 16), (128, 128, False, False, 16),
                                   (128, 136, True, False, 16), (16, 8, False, False, 0),
                                   (16, 8, False, True, 0), (16, 8, False, False, 4),
                                   (32, 24, True, False, 0), (32, 24, True, False, 64)):
        name = (f"{'fused' if cap else 'v'}2.{'bf16' if bf16 else 'f16'}.d{d}.bk{bk}."
                f"{('k' + str(cap)) if cap else ('mean' if mean else 'max')}")
        yield name, v2.block_scores_kernel(d, bk, 8, bf16, mean, cap), tc_sig
    # v3: the default; with cap > 0 the fused top-k (fused version 3)
    for d, bk, bf16, mean, cap in ((128, 128, True, False, 0), (128, 128, True, True, 0),
                                   (128, 128, False, False, 0), (128, 128, True, False, 16),
                                   (128, 128, True, False, 64), (128, 128, False, False, 16),
                                   (128, 64, True, False, 16), (16, 16, False, False, 0),
                                   (16, 16, False, True, 0), (16, 16, False, False, 4),
                                   (32, 32, True, False, 0), (32, 32, True, False, 4)):
        name = (f"{'fused' if cap else 'v'}3.{'bf16' if bf16 else 'f16'}.d{d}.bk{bk}."
                f"{('k' + str(cap)) if cap else ('mean' if mean else 'max')}")
        yield name, v3.block_scores_kernel(d, bk, 8, bf16, mean, cap), tc_sig
