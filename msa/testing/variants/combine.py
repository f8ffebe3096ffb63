"""Kernel variants of msa.cuda.combine (K2), for the offline PTX checks.

K2 v1 (one warp of lanes per (query, head): the simulator's default and the GPU's fallback) and
v2 (16-byte loads, the first batch beside the LSE loads, 4 warps a CTA under launch bounds: the
GPU default), with the arguments ``launch_combine`` passes from torch: bf16 as int16 (v1) or
uint32 words (v2), float32 partials as they are, outputs of 16 bits as uint32 pairs (v2). The
names and the order are those of the listing at 426fbbf.
"""

from numba import types


def variants():
    from msa.cuda.combine import v1_warp, v2_vector

    i16, u32, f16, f32 = types.int16, types.uint32, types.float16, types.float32
    lse3, lse2 = f32[:, :, ::1], f32[:, ::1]
    # v2: (D, bf16 partials, output, K > 32)
    for d, bfp, out, two in ((128, True, "bf16", False), (128, True, "bf16", True),
                             (128, False, "f16", False), (128, False, "f32", False),
                             (32, True, "bf16", False), (16, False, "f32", False),
                             (24, False, "f16", False)):
        o = (u32 if bfp else f32)[:, :, :, ::1]
        res = (f32 if out == "f32" else u32)[:, :, ::1]
        yield (f"k2.v2.d{d}.{'bf16' if bfp else 'f32'}part.{out}out{'.k64' if two else ''}",
               v2_vector.combine_kernel_v2(d, bfp, out, two, v2_vector.WARPS,
                                           v2_vector.slots_per_batch(d, bfp)),
               (o, lse3, res, lse2))
    # v1: (D, bf16 partials, output dtype); 32 lanes and 4 rows a CTA on a GPU
    for d, bfp, out in ((128, True, "bf16"), (128, False, "f32"), (16, False, "f32"),
                        (24, False, "f16"), (6, True, "bf16")):
        o = (i16 if bfp else f32)[:, :, :, ::1]
        res = {"bf16": i16, "f16": f16, "f32": f32}[out][:, :, ::1]
        yield (f"k2.v1.d{d}.{'bf16' if bfp else 'f32'}part.{out}out",
               v1_warp.combine_kernel_v1(d, 32, 4, bfp, out == "bf16"), (o, lse3, res, lse2))
