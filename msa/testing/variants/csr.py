"""Kernel variants of msa.cuda.csr (and the scans of ``_core.scan`` it launches).

The CSR kernels have no shape-dependent specialisation (no factories; shared-array sizes are
module constants), so each kernel has one signature per block_indices dtype the launchers pass:
int32 (what select_blocks returns, the pipeline's) and int64 (accepted by build_csr). Offsets
(cu_q, row_offsets) are uploaded as int32 [::1]; Python ints are typed int64. The order is the
one of the listing at 426fbbf (Numba numbers shared arrays per process, in compile order).
"""

from numba import types


def variants():
    from msa.cuda._core import scan
    from msa.cuda.csr import v1_rowwise as v1
    from msa.cuda.csr import v2_tiled as v2
    from msa.cuda.csr import v3_multisplit as v3

    i32, i64 = types.int32, types.int64
    i32_1, i32_2, i32_3 = i32[::1], i32[:, ::1], i32[:, :, ::1]
    i64_1, i64_2, i64_3 = i64[::1], i64[:, ::1], i64[:, :, ::1]
    for tag, I in (("", i32_3), ("[I=int64]", i64_3)):
        # count v1 (csr_histogram; build_csr's fallback above 22528 rows) and v2 (default)
        yield f"count_v1_atomic{tag}", v1.count_kernel, (I, i32_1, i32_1, i64, i32_3)
        yield f"count_v2_shared{tag}", v2.count_kernel, (I, i32_1, i32_1, i64, i32_3)
        # scatter v1 (explicit version=1), v2 (default below 192 MiB), v3 (above)
        yield f"scatter_v1_rowwise{tag}", v1.scatter_kernel, (I, i32_1, i32_1, i32_2, i32_2,
                                                              i32_2)
        yield (f"scatter_v2_tiled{tag}", v2.scatter_kernel,
               (I, i32_1, i32_1, i32_2, i32_3, i64, i64, i64, i32_2, i32_2))
        yield (f"scatter_v3_split_groups{tag}", v3.split_groups_kernel,
               (I, i32_1, i32_1, i32_2, i32_3, i64, i64_2))
    yield "scatter_v1_fill_tail", v1.fill_tail_kernel, (i32_2, i32_2, i32_2)
    yield "scatter_v3_split_rows", v3.split_rows_kernel, (i32_2, i32_3, i64_2, i64_2)
    yield "scatter_v3_unpack", v3.unpack_kernel, (i32_2, i64_2, i32_2, i32_2)
    # scan v1 serial (exclusive_prefix_sum(version=1)), v2 (its default), v3 (build_csr's)
    yield "scan_v1_serial", scan._scan_kernel_serial, (i32_2, i32_2, i32_1)
    yield "scan_v2_reduce", scan._scan_kernel_reduce, (i32_2, i64_2, i32_1)
    yield "scan_v2_block_sums", scan._scan_kernel_block_sums, (i64_2, i64_2, i32_2, i32_1)
    yield "scan_v2_add_back", scan._scan_kernel_add_back, (i32_2, i64_2, i32_2)
    yield "scan_v3_lookback", scan._scan_kernel_lookback, (i32_3, i64, i64_1, i64, i32_2)
    # the slot mask of the sums that follow the CSR (the backward's dq, the KL's)
    from msa.cuda.csr import _slot_mask
    for tag, I in (("", i32_3), ("[I=int64]", i64_3)):
        yield f"slot_mask{tag}", _slot_mask.slot_mask_kernel, (I, i32_1, i32_1, i64, i32_3)
