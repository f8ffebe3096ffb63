"""Kernel variants of msa.cuda.decode (rung 3 is the default for bf16/fp16 on every GPU, rung 2
where its index kernel does not apply (Didx not a multiple of 32); rung 1 for float32/float64
and the shapes rung 2 does not take), at the paper configuration (Bk = 128,
D = Didx = 128, Hkv = 4, G = 16, K = 16, bf16) for Lq = 1, 4, 8, and at small shapes (Bk = 16,
D = Didx = 16, G = 1 or 2, K = 4, fp16 and float32), with the argument types the launchers
pass (16-bit arrays as uint32 words or uint16 bits, int32 metadata, int64 and float32 scalars)."""

from numba import types


def variants():
    from msa.cuda.decode import v1_simple as v1
    from msa.cuda.decode import v2_split_attention as att
    from msa.cuda.decode import v2_split_index as idx
    from msa.cuda.decode import v3_register_index as reg

    i32, i64, f32, u16, u32 = types.int32, types.int64, types.float32, types.uint16, types.uint32
    w3, w4 = u32[:, :, ::1], u32[:, :, :, ::1]
    b2, b3, b4 = u16[:, ::1], u16[:, :, ::1], u16[:, :, :, ::1]
    f2, f3, f4 = f32[:, ::1], f32[:, :, ::1], f32[:, :, :, ::1]
    table, lens, i3, i4 = i32[:, ::1], i32[::1], i32[:, :, ::1], i32[:, :, :, ::1]
    index_sig = (w3, w3, table, lens, i64, f32, f4, i4)
    merge_sig = (f4, i4, lens, i64, i64, i3)
    att_sig = (w3, w4, w4, i3, table, lens, f32, f4, f3, b3, f2)
    for lq in (1, 4, 8):
        yield f"index-split-paper-Lq{lq}-bf16", idx.split_kernel(128, 128, lq, 4, 16, True), index_sig
        yield (f"index-register-paper-Lq{lq}-bf16", reg.split_kernel(128, 128, lq, 4, 16, True),
               index_sig)
        for direct in (False, True):  # one CTA column a draft
            yield (f"attention-split-paper-Lq{lq}-bf16" + ("-direct" if direct else ""),
                   att.split_kernel(128, 128, 16, 16, True, direct, lq), att_sig)
    yield "index-merge-paper", idx.merge_kernel(128, 16), merge_sig
    yield "index-merge-K64", idx.merge_kernel(128, 64), merge_sig
    yield "index-merge-K1", idx.merge_kernel(128, 1), merge_sig
    yield "attention-combine", att.combine_kernel, (f4, f3, b3, f2, i64)
    yield "append-bf16", v1.append_kernel, (b3, b3, b2, b4, b4, b3, table, lens, lens, i64, i64,
                                            i64, i64, i64)
    # small shapes (the tests' sizes)
    yield "index-split-small-fp16", idx.split_kernel(16, 16, 2, 2, 4, False), index_sig
    yield "index-register-small-fp16", reg.split_kernel(16, 32, 2, 2, 4, False), index_sig
    yield "attention-split-small-fp16-G1", att.split_kernel(16, 16, 1, 4, False, False, 3), att_sig
    yield "attention-split-small-fp16-G2-direct", att.split_kernel(16, 16, 2, 4, False, True, 2), att_sig
    yield "index-merge-small", idx.merge_kernel(16, 4), merge_sig
    # rung 1 (float32, and bf16 bits)
    for kind, e3, e4 in (("float32", f3, f4), ("bfloat16", b3, b4)):
        yield (f"v1-scores-{kind}", v1.scores_kernel(kind, 16),
               (e3, e3, table, lens, i64, f32, f3))
        yield (f"v1-attention-{kind}", v1.attention_kernel(kind, 16),
               (e3, e4, e4, i3, table, lens, i64, i64, f32, f3, b3 if kind == "bfloat16" else f3, f2))
    yield "v1-topk", v1.topk_kernel(16), (f3, lens, i64, i3)
    # the merge over several warps a row, where a request has more than 32 index splits
    # (idx.wide_warps: 8 warps at 256 splits, 2 at 49, 5 at K = 32)
    for k, w in ((16, 8), (16, 2), (32, 5)):
        yield f"index-merge-wide-K{k}-W{w}", idx.merge_kernel_wide(128, k, w), merge_sig
