"""The main branch's backward under several part sizes and dQ-partial budgets, in one process (GPU).

    source .gpu/env.sh && python3 -m benchmarks.dev.backward_parts --sizes 32768,131072 \
        --configs "default;part_size=4096;part_size=1024;part_size=256;max_partial_bytes=8589934592"

``bench_attention_backward``'s problem (paper configuration, bf16, uniform selection). A config
is keyword arguments of ``msa.cuda.sparse_attention_backward`` (``part_size``,
``max_partial_bytes``, ``partial_dtype``) joined by ``,``; ``default`` passes none. Each
config's ``dq, dk, dv`` must agree with the first config's (``gate``) and be bitwise the same on
a rerun (determinism), and its dq's error is reported per element (``dq_p99_rel``: the 99th
percentile of |diff| / |ref| where |ref| is above a thousandth of its max; for scale, the
first config's row also has that of its dq rounded once to bf16);
then the call is timed (median of ``--reps``, CUDA events) with its peak memory. Prints a table
and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("NUMBA_CUDA_ARRAY_INTERFACE_SYNC", "0")


def parse_config(text):
    """The keyword arguments of one config (``default``: none)."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        if item == "default":
            continue
        name, value = item.split("=")
        if name == "partial_dtype":
            out[name] = value
            continue
        if name not in ("part_size", "max_partial_bytes"):
            raise ValueError(f"unknown knob {name!r}: part_size, max_partial_bytes or "
                             f"partial_dtype")
        out[name] = int(value)
    return out


def gate(kw):
    """The largest max |diff| / max |ref| against the first config that a config may have:
    1e-3 (a part size changes the order of the dK/dV sums, hence the last bits), 1e-2 with
    bf16 dQ partials (one bf16 rounding of each slot's share of dq)."""
    return 1e-2 if kw.get("partial_dtype") == "bfloat16" else 1e-3


def main(argv=None):
    import torch

    from benchmarks.bench_attention import BK, _qkv, make_selection
    from benchmarks.common import cuda_time_ms, peak_memory_gib, print_table, write_json
    from msa.cuda.attention import sparse_attention, sparse_attention_backward

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="32768,131072")
    ap.add_argument("--configs", default="default;part_size=4096")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"),
                                                  "backward_parts.json"))
    args = ap.parse_args(argv)
    configs = [(c, parse_config(c)) for c in args.configs.split(";")]
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        q, k, v = _qkv(n, seed=3)
        I = make_selection("uniform", n, seed=4)
        cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        o, lse = sparse_attention(q, k, v, I, cu, cu, BK, validate=False)
        do = torch.randn_like(q)
        first = None
        for name, kw in configs:
            def call(kw=kw):
                return sparse_attention_backward(q, k, v, o, lse, do, I, cu, cu, BK,
                                                 validate=False, **kw)

            got = call()
            again = call()
            row = dict(case=f"N={n}", config=name,
                       deterministic=all(torch.equal(a, b) for a, b in zip(got, again)))
            if first is None:
                first = got
            row["rel_err_vs_first"] = max(
                float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                for a, b in zip(got, first))
            big = first[0].abs() > 1e-3 * first[0].abs().max()

            def p99_rel(x):
                return float(torch.quantile(
                    ((x - first[0]).abs()[big] / first[0].abs()[big])[:1 << 24], 0.99))

            row["dq_p99_rel"] = p99_rel(got[0])
            if got is first:  # for scale: the first config's dq rounded once to bf16
                row["dq_p99_rel_bf16_output"] = p99_rel(first[0].bfloat16().float())
            again = None
            if not row["deterministic"] or row["rel_err_vs_first"] > gate(kw):
                row["error"] = "gate"
            else:
                row["ms"] = cuda_time_ms(call, warmup=0, reps=args.reps)
                row["peak_gib"] = peak_memory_gib(call)
            print(row, flush=True)
            rows.append(row)
            got = None
        first = None
        torch.cuda.empty_cache()
    print_table(rows, ["case", "config", "ms", "peak_gib", "rel_err_vs_first", "dq_p99_rel",
                       "deterministic", "error"])
    write_json(args.out, rows, config=dict(configs=args.configs, reps=args.reps))


if __name__ == "__main__":
    main()
