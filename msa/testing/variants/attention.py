"""Kernel variants of msa.cuda.attention (K1 and the backward), for the offline PTX checks.

K1: v1 (CUDA cores: fp32 inputs, shapes the tensor cores reject, the teaching rung), v2
(``mma.sync`` through shared memory: D or Bk above 128), v3 (registers: other GPUs' default,
the simulator's) and v4 (wgmma: the cc 9.0 default). The backward: version 1 (CUDA cores; its
delta, dK/dV sum and parts kernels, in ``_backward_parts``, serve versions 2 and 3 too), version 2
(tensor cores + dQ sum) and version 3 (wgmma; version 2's dQ sum).

Argument types as the launchers pass them from torch (the benchmarks' and msa.torch's library):
bf16 as int16 (``ArrayContext`` views torch bf16 as int16), the tensor-core inputs as uint32
words, work / CSR / slots int32 [:, ::1], offsets int32 [::1] (``device_constant``), the scale
np.float32, Python ints int64, partials from a flat buffer reshaped (C-contiguous), bf16
partials as int16 (v1), uint32 [K, Tq, Hq, D/2] (v2) or flat uint32 (v3/v4). Tile rows and
groups are what ``_plan.K1Plan`` picks on a GPU: 64 rows for v1/v3/v4 (3 warp groups where a
CTA stays at 12 warps), 128 for v2; one simulator-style variant (16 rows, 1 group) of v3. The
names and the order are those of the listing at 426fbbf, then the paged K1 variants (K and V
read through a block table) at the end.
"""

from numba import types


def variants():
    from msa.cuda.attention import (_backward_parts, _paged, _tile, v1_backward_cuda_cores,
                                    v1_cuda_cores, v2_backward_tensor_cores, v2_mma,
                                    v3_backward_wgmma, v3_registers, v4_wgmma)

    i16, i32, i64, u32, f16, f32 = (types.int16, types.int32, types.int64, types.uint32,
                                    types.float16, types.float32)
    elem = {"f32": f32, "f16": f16, "bf16": i16}
    cu = i32[::1]
    index = (i32[:, ::1], i32[:, ::1], i32[:, ::1], cu, cu, f32)
    w3 = u32[:, :, ::1]
    lse3 = f32[:, :, ::1]

    # K1 v1: (dtype, Bk, D, G, P, bf16 partials), 128 threads
    for dt, bk, d, g, p, bfp in (("f32", 128, 128, 16, 4, False), ("bf16", 128, 128, 16, 4, True),
                                 ("f32", 16, 16, 2, 32, False), ("f16", 32, 24, 1, 64, False)):
        e = elem[dt][:, :, ::1]
        o = (i16 if bfp else f32)[:, :, :, ::1]
        yield (f"k1.v1.{dt}.bk{bk}.d{d}.g{g}.p{p}{'.bf16part' if bfp else ''}",
               v1_cuda_cores.k1_kernel_v1(bk, d, g, p, 128, dt == "bf16", bfp),
               (e, e, e, *index, o, lse3))

    # K1 v2: (dtype, Bk, D, G, P, bf16 partials); the default where D or Bk exceeds 128
    for dt, bk, d, g, p, bfp in (("bf16", 64, 256, 16, 8, True), ("f16", 64, 256, 16, 8, False),
                                 ("f16", 32, 160, 2, 64, False), ("f16", 16, 16, 2, 64, False)):
        o = (u32 if bfp else f32)[:, :, :, ::1]
        yield (f"k1.v2.{dt}.bk{bk}.d{d}.g{g}.p{p}{'.bf16part' if bfp else ''}",
               v2_mma.k1_kernel_v2(bk, d, g, p, dt == "bf16", bfp),
               (w3, w3, w3, *index, o, lse3, i32, i32))

    # K1 v3 and v4: (dtype, Bk, D, G, P, bf16 partials, cp.async, groups, 16-byte stores)
    reg = (("bf16", 128, 128, 16, 4, True, True, 3, True),
           ("bf16", 128, 128, 16, 4, True, False, 3, True),
           ("f16", 128, 128, 16, 4, False, True, 3, False),
           ("f16", 128, 64, 8, 8, False, True, 3, False),
           ("f16", 16, 16, 2, 32, False, True, 3, False),
           ("bf16", 32, 32, 1, 64, True, True, 3, True),
           ("f16", 16, 16, 2, 8, False, True, 1, False))
    for wg in (False, True):
        factory = v4_wgmma.k1_kernel_v4 if wg else v3_registers.k1_kernel_v3
        for dt, bk, d, g, p, bfp, aligned, groups, v4 in reg:
            if wg and p * g != 64:
                continue
            o = (u32 if bfp else f32)[::1]
            name = (f"k1.v{4 if wg else 3}.{dt}.bk{bk}.d{d}.g{g}.p{p}"
                    f"{'.bf16part' if bfp else ''}{'' if aligned else '.plain'}.grp{groups}"
                    f"{'.st16' if v4 else ''}")
            yield (name, factory(bk, d, g, p, dt == "bf16", bfp, aligned, _tile.o_parts(d),
                                 groups, v4),
                   (w3, w3, w3, *index, o, lse3))

    # backward v1 (CUDA cores): delta, dQ, dK/dV, the hot rows' sum, the parts count
    f2, f3 = f32[:, ::1], f32[:, :, ::1]
    for dt, bk, d, g, I in (("bf16", 128, 128, 16, i32), ("f32", 128, 128, 16, i32),
                            ("f32", 16, 16, 2, i32), ("f16", 32, 32, 1, i32)):
        e = elem[dt][:, :, ::1]
        bf16 = dt == "bf16"
        tag = f"{dt}.bk{bk}.d{d}.g{g}"
        yield f"bwd.v1.delta.{tag}", _backward_parts.delta_kernel(d, bf16), (e, e, f2)
        yield (f"bwd.v1.dq.{tag}", v1_backward_cuda_cores.dq_kernel(bk, d, g, bf16, 128),
               (e, e, e, e, f2, f2, I[:, :, ::1], cu, cu, f32, f3))
        yield (f"bwd.v1.dkdv.{tag}", v1_backward_cuda_cores.dkdv_kernel(bk, d, g, bf16, 128),
               (e, e, e, e, f2, f2, i32[:, ::1], i32[:, ::1], cu, cu, cu, f32, i32[:, ::1], i64,
                f3, f3, f2, f2))
        yield (f"bwd.v1.dkdv_sum.{tag}", _backward_parts.dkdv_sum_kernel(bk, d, 128),
               (i32[:, ::1], cu, cu, f2, f2, f3, f3))
        yield f"bwd.v1.parts.{tag}", _backward_parts.parts_kernel, (i32[:, ::1], i64, i32[:, ::1])

    # backward v2 (tensor cores): the dK/dV/dQ kernel and the dQ sum
    for dt, bk, d, g, rows, aligned in (("bf16", 128, 128, 16, 64, True),
                                        ("f16", 128, 128, 1, 64, True),
                                        ("bf16", 128, 128, 4, 64, False),
                                        ("f16", 32, 32, 2, 64, True)):
        yield (f"bwd.v2.tc.{dt}.bk{bk}.d{d}.g{g}.r{rows}{'' if aligned else '.plain'}",
               v2_backward_tensor_cores.backward_kernel_v2(bk, d, g, rows, dt == "bf16",
                                                           aligned),
               (w3, w3, w3, w3, f2, f2, i32[:, ::1], i32[:, ::1], i32[:, ::1], cu, cu, cu, f32,
                f32, i32[:, ::1], i64, f3, f3, f2, f2, f32[:, :, :, ::1]))
    for d, g in ((128, 16), (32, 2)):
        yield (f"bwd.v2.dq_sum.d{d}.g{g}", v2_backward_tensor_cores.dq_sum_kernel(d, g),
               (i32[:, :, ::1], f32[:, :, :, ::1], f32, f3))
    # bf16 dQ partials (partial_dtype="bfloat16"): the paper configuration's kernel and sum
    yield ("bwd.v2.tc.bf16.bk128.d128.g16.r64.dq_bf16",
           v2_backward_tensor_cores.backward_kernel_v2(128, 128, 16, 64, True, True, True),
           (w3, w3, w3, w3, f2, f2, i32[:, ::1], i32[:, ::1], i32[:, ::1], cu, cu, cu, f32, f32,
            i32[:, ::1], i64, f3, f3, f2, f2, u32[:, :, :, ::1]))
    yield ("bwd.v2.dq_sum.d128.g16.dq_bf16", v2_backward_tensor_cores.dq_sum_kernel(128, 16, True),
           (i32[:, :, ::1], u32[:, :, :, ::1], f32, f3))

    # backward v3 (wgmma): the dK/dV/dQ kernel (the dQ sum is version 2's)
    for dt, bk, d, g, aligned in (("bf16", 128, 128, 16, True), ("f16", 64, 32, 2, True),
                                  ("bf16", 128, 128, 4, False)):
        yield (f"bwd.v3.wg.{dt}.bk{bk}.d{d}.g{g}{'' if aligned else '.plain'}",
               v3_backward_wgmma.backward_kernel_v3(bk, d, g, dt == "bf16", aligned),
               (w3, w3, w3, w3, f2, f2, i32[:, ::1], i32[:, ::1], i32[:, ::1], cu, cu, cu, f32,
                f32, i32[:, ::1], i64, f3, f3, f2, f2, f32[:, :, :, ::1]))
    yield ("bwd.v3.wg.bf16.bk128.d128.g16.dq_bf16",
           v3_backward_wgmma.backward_kernel_v3(128, 128, 16, True, True, True),
           (w3, w3, w3, w3, f2, f2, i32[:, ::1], i32[:, ::1], i32[:, ::1], cu, cu, cu, f32, f32,
            i32[:, ::1], i64, f3, f3, f2, f2, u32[:, :, :, ::1]))

    # K1 on K/V in pages (``sparse_attention(..., block_table=...)``; the caches viewed as
    # [P*Hkv*Bk, 1, D], arrays of the packed variants' types), and the kernel that writes each
    # work item's page: the paper configuration on v4 and v3, plus v1 and v2
    yield ("k1.v4.paged.bf16.bk128.d128.g16.p4.bf16part.grp3.st16",
           v4_wgmma.k1_kernel_v4(128, 128, 16, 4, True, True, True, _tile.o_parts(128), 3, True,
                                 True), (w3, w3, w3, *index, u32[::1], lse3))
    yield ("k1.v3.paged.bf16.bk128.d128.g16.p4.bf16part.grp3.st16",
           v3_registers.k1_kernel_v3(128, 128, 16, 4, True, True, True, _tile.o_parts(128), 3,
                                     True, True), (w3, w3, w3, *index, u32[::1], lse3))
    e = elem["f32"][:, :, ::1]
    yield ("k1.v1.paged.f32.bk128.d128.g16.p4",
           v1_cuda_cores.k1_kernel_v1(128, 128, 16, 4, 128, False, False, True),
           (e, e, e, *index, f32[:, :, :, ::1], lse3))
    yield ("k1.v2.paged.bf16.bk64.d256.g16.p8.bf16part",
           v2_mma.k1_kernel_v2(64, 256, 16, 8, True, True, True),
           (w3, w3, w3, *index, u32[:, :, :, ::1], lse3, i32, i32))
    yield "k1.paged.pages", _paged.pages_kernel, (i32[:, ::1], i32[:, ::1])
