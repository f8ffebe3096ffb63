"""How fast can a decode step read the cached index keys? Three read patterns, one pool.

The decode index kernel (rung 3, ``msa/cuda/decode/v3_register_index.py``) streams the index keys
``[P, Bk, Didx]`` bf16 from HBM straight into mma registers: lane ``(g, t)`` loads 16 bytes of
rows ``g`` and ``g + 8`` of an m-tile of 16 keys, so one warp load covers 8 rows x 64 bytes (8
half lines). It reads at ~3.6 TB/s on an H200 where dense decode reads at ~4.6. This script times
the bare read, with the same grid (one wave: 3 CTAs of 4 warps an SM, each warp its own pages,
three m-tiles in flight), under three patterns:

- ``fragment``: rung 3's addresses (8 half lines a warp load);
- ``coalesced``: the same bytes a warp load, 512 contiguous bytes (4 whole lines);
- ``bulk``: ``cp.async.bulk`` (the TMA unit, no L1 and no registers in flight) of half pages
  (16 KB) into a ring of ``stages`` shared-memory buffers per warp, one mbarrier each, read back
  with 16-byte shared loads.

Each kernel folds what it reads into one word a thread (XOR), so nothing is optimised away, and
the three folds must agree (the same bytes). Verdict (H100, run O6 of docs/performance.md):
2.9-3.0 TB/s under every pattern and geometry (0.1795-0.1835 ms at 32 x 64K), where rung 3
takes 0.1995 ms: the read pattern is not what holds the index kernel back; another H100 (O26,
``benchmarks/results/decode_read_patterns_h100.json``) 2.80-2.87 TB/s at 32 x 64K.
Usage (GPU, CuPy):
    python3 -m benchmarks.dev.decode_read_patterns [--pages 16384] [--reps 20] [--out F]
"""

from __future__ import annotations

import argparse
import json

SOURCE = r"""
#include <cuda_runtime.h>
typedef unsigned int u32;
typedef unsigned long long u64;

// rows of 256 bytes (Didx = 128 bf16), pages of 128 rows (32 KB), m-tiles of 16 rows (4 KB)
#define ROW 256
#define PAGE (128 * ROW)
#define MT 8

__device__ __forceinline__ uint4 ld16(const char* p) {
    uint4 r;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// one m-tile's 8 loads of a lane: FRAG -> rung 3's addresses, else contiguous
template <bool FRAG>
__device__ __forceinline__ void load_tile(uint4* buf, const char* tile, int lane) {
    int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const char* p = FRAG ? tile + (g + 8 * h) * ROW + (t + 4 * u) * 16
                                 : tile + (h * 4 + u) * 512 + lane * 16;
            buf[h * 4 + u] = ld16(p);
        }
}

__device__ __forceinline__ u32 fold(const uint4* buf, u32 acc) {
#pragma unroll
    for (int i = 0; i < 8; ++i) acc ^= buf[i].x ^ buf[i].y ^ buf[i].z ^ buf[i].w;
    return acc;
}

// grid (splits, batch), 4 warps; request b owns pages [b * per_req, (b + 1) * per_req)
template <bool FRAG>
__device__ void reg_kernel(const char* pool, int per_req, u32* out) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int splits = gridDim.x, s = blockIdx.x, b = blockIdx.y;
    int per = (per_req + splits - 1) / splits;
    int j0 = s * per, j1 = min(per_req, j0 + per);
    int n_pages = max(0, j1 - j0 - warp + 3) / 4;
    int n_items = n_pages * MT;
    const char* base = pool + ((u64)b * per_req + j0 + warp) * PAGE;
    uint4 b0[8], b1[8], b2[8];
    u32 acc = 0;
    auto addr = [&](int i) { return base + (u64)(i / MT) * 4 * PAGE + (i % MT) * 16 * ROW; };
    if (0 < n_items) load_tile<FRAG>(b0, addr(0), lane);
    if (1 < n_items) load_tile<FRAG>(b1, addr(1), lane);
    if (2 < n_items) load_tile<FRAG>(b2, addr(2), lane);
    for (int i = 0; i < n_items; i += 3) {
        acc = fold(b0, acc);
        if (i + 3 < n_items) load_tile<FRAG>(b0, addr(i + 3), lane);
        if (i + 1 < n_items) { acc = fold(b1, acc); if (i + 4 < n_items) load_tile<FRAG>(b1, addr(i + 4), lane); }
        if (i + 2 < n_items) { acc = fold(b2, acc); if (i + 5 < n_items) load_tile<FRAG>(b2, addr(i + 5), lane); }
    }
    out[((u64)b * splits + s) * blockDim.x + threadIdx.x] = acc;
}

extern "C" __global__ void __launch_bounds__(128) read_fragment(const char* pool, int per_req, u32* out) {
    reg_kernel<true>(pool, per_req, out);
}
extern "C" __global__ void __launch_bounds__(128) read_coalesced(const char* pool, int per_req, u32* out) {
    reg_kernel<false>(pool, per_req, out);
}

// bulk: each warp a ring of STAGES half pages (16 KB) in dynamic shared memory
#define HALF (PAGE / 2)
__device__ __forceinline__ u32 smem(const void* p) { return (u32)__cvta_generic_to_shared(p); }

extern "C" __global__ void read_bulk(const char* pool, int per_req, int stages, u32* out) {
    extern __shared__ __align__(128) char ring[];
    int warps = blockDim.x >> 5;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    u64* bars = (u64*)(ring + (u64)warps * stages * HALF) + warp * stages;
    char* mine = ring + (u64)warp * stages * HALF;
    int splits = gridDim.x, s = blockIdx.x, b = blockIdx.y;
    int per = (per_req + splits - 1) / splits;
    int j0 = s * per, j1 = min(per_req, j0 + per);
    int n_pages = max(0, j1 - j0 - warp + warps - 1) / warps;
    int n_items = 2 * n_pages;
    const char* base = pool + ((u64)b * per_req + j0 + warp) * PAGE;
    auto src = [&](int i) { return base + (u64)(i / 2) * warps * PAGE + (i % 2) * HALF; };
    if (lane == 0) {
        for (int k = 0; k < stages; ++k)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem(bars + k)));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncwarp();
    auto issue = [&](int i) {
        int k = i % stages;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     :: "r"(smem(bars + k)), "r"(HALF) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(smem(mine + (u64)k * HALF)), "l"(src(i)), "r"(HALF), "r"(smem(bars + k))
                     : "memory");
    };
    if (lane == 0)
        for (int i = 0; i < stages && i < n_items; ++i) issue(i);
    u32 acc = 0;
    for (int i = 0; i < n_items; ++i) {
        int k = i % stages;
        u32 parity = (i / stages) & 1, ok = 0;
        do {
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                         : "=r"(ok) : "r"(smem(bars + k)), "r"(parity) : "memory");
        } while (!ok);
        const uint4* st = (const uint4*)(mine + (u64)k * HALF);
#pragma unroll 8
        for (int e = lane; e < HALF / 16; e += 32) { uint4 w = st[e]; acc ^= w.x ^ w.y ^ w.z ^ w.w; }
        __syncwarp();
        if (lane == 0 && i + stages < n_items) issue(i + stages);
    }
    out[((u64)b * splits + s) * blockDim.x + threadIdx.x] = acc;
}
"""


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="32:65536,8:131072,128:8192",
                    help="batch:context pairs (each request's pages of 128 index keys)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    import cupy as cp
    import numpy as np
    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    k_frag, k_coal, k_bulk = (cp.RawKernel(SOURCE, name, options=("-std=c++17",))
                              for name in ("read_fragment", "read_coalesced", "read_bulk"))
    report = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cases": []}
    start, stop = cp.cuda.Event(), cp.cuda.Event()

    def timed(fn):
        fn()
        cp.cuda.runtime.deviceSynchronize()
        ts = []
        for _ in range(args.reps):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            ts.append(cp.cuda.get_elapsed_time(start, stop))
        ts.sort()
        return ts[len(ts) // 2]

    for case in args.cases.split(","):
        batch, ctx = (int(x) for x in case.split(":"))
        per_req = ctx // 128
        nbytes = batch * per_req * 128 * 256
        pool = cp.random.randint(0, 2**31, size=nbytes // 4, dtype=cp.int64).astype(cp.uint32)
        want = int(np.bitwise_xor.reduce(pool.get()))
        row = {"batch": batch, "context": ctx, "bytes": nbytes}
        # (name, kernel, CTAs an SM, warps a CTA, stages a warp: None for registers)
        for name, kern, ctas, warps, extra in (
            ("fragment", k_frag, 3, 4, None), ("coalesced", k_coal, 3, 4, None),
            ("bulk_c1_w4_s3", k_bulk, 1, 4, 3), ("bulk_c1_w4_s2", k_bulk, 1, 4, 2),
            ("bulk_c2_w4_s1", k_bulk, 2, 4, 1), ("bulk_c1_w8_s1", k_bulk, 1, 8, 1),
            ("bulk_c1_w12_s1", k_bulk, 1, 12, 1), ("bulk_c2_w2_s3", k_bulk, 2, 2, 3),
            ("bulk_c4_w1_s3", k_bulk, 4, 1, 3)):
            splits = max(1, min(ctas * sms // batch, per_req // 4, 256))
            out = cp.zeros(batch * splits * 32 * warps, dtype=cp.uint32)
            if extra is None:
                fn = (lambda kern=kern, splits=splits, out=out, pool=pool:
                      kern((splits, batch), (128,), (pool, cp.int32(per_req), out)))
            else:
                shm = warps * extra * 16384 + warps * extra * 8
                kern.max_dynamic_shared_size_bytes = shm
                fn = (lambda kern=kern, splits=splits, warps=warps, extra=extra, shm=shm, out=out,
                      pool=pool: kern((splits, batch), (32 * warps,),
                           (pool, cp.int32(per_req), cp.int32(extra), out), shared_mem=shm))
            ms = timed(fn)
            got = int(np.bitwise_xor.reduce(out.get()))
            row[name] = {"ms": round(ms, 4), "TB/s": round(nbytes / ms / 1e9, 3),
                         "splits": splits, "fold_ok": got == want}
            print(f"{batch} x {ctx}: {name:>14} {ms:.4f} ms {nbytes / ms / 1e9:.2f} TB/s "
                  f"splits {splits} fold {'ok' if got == want else 'WRONG'}", flush=True)
        report["cases"].append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
