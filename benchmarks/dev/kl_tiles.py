"""The KL's grad pass under several tile heights (rows = positions x G) and teachers
(``mma.sync`` or ``wgmma``), in one process (GPU).

    source .gpu/env.sh && python3 -m benchmarks.dev.kl_tiles --sizes 32768,131072 --rows 64,128 \
        --min-positions 1

``bench_kl``'s problem (paper configuration, bf16, the local block and 15 earlier blocks drawn
uniformly; ``--pattern`` takes ``bench_attention``'s others). For each height
``msa.cuda.kl.v3_tensor_cores.TILE_ROWS`` is set before the plan is made (a dev knob, not an
API: ``tensor_core_tiles`` reads it per call), and for each ``--teacher``
``v3.TEACHER_WGMMA`` (``mma``: False, ``wgmma``: True, ``auto``: None); the tile
also keeps at least ``MIN_POSITIONS`` positions (8 by default: 128 rows at G = 16 whatever
``--rows`` says), which ``--min-positions`` sets, 1 to compare 4 positions with 8. A tile's rows
are independent in every ``mma`` and every sum runs in the same order whatever the height, so
each config's ``kl, loss, dq_idx, dk_idx`` must equal the first config's **bitwise**; then
``kl_loss_and_backward`` is timed (median of ``--reps``, CUDA events) and, with ``--table``,
torch.profiler's kernel table is printed. ``--save DIR`` writes the first config's outputs per N
(``torch.save``) and ``--against DIR`` compares with such files bitwise (two versions of the
kernel, run one after the other). Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("NUMBA_CUDA_ARRAY_INTERFACE_SYNC", "0")


def main(argv=None):
    import torch

    from benchmarks.bench_attention import make_selection
    from benchmarks.bench_kl import BK, make_inputs, uniform_selection
    from benchmarks.common import cuda_time_ms, kernel_table, print_table, write_json
    from msa.cuda.attention import sparse_attention
    from msa.cuda.kl import kl_loss_and_backward
    from msa.cuda.kl import v3_tensor_cores as v3

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="32768,131072")
    ap.add_argument("--rows", default="64,128", help="tile heights, the first the reference")
    ap.add_argument("--teacher", default="auto",
                    help="comma-separated teacher products per height: mma, wgmma, auto")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pattern", default="uniform",
                    help="the selection: uniform (bench_kl's), sink+local+random or skewed "
                         "(bench_attention's)")
    ap.add_argument("--min-positions", type=int, default=None,
                    help="positions a tile at least (default: the module's)")
    ap.add_argument("--table", action="store_true", help="print the kernel table per config")
    ap.add_argument("--save", help="folder for the first config's outputs")
    ap.add_argument("--against", help="folder of --save files to compare with, bitwise")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"),
                                                  "kl_tiles.json"))
    args = ap.parse_args(argv)
    heights = [int(r) for r in args.rows.split(",")]
    teachers = args.teacher.split(",")
    knob = {"mma": False, "wgmma": True, "auto": None}
    if args.min_positions is not None:
        v3.MIN_POSITIONS = args.min_positions
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        x = make_inputs(n)
        I = uniform_selection(n) if args.pattern == "uniform" else make_selection(args.pattern, n)
        _, lse = sparse_attention(x["q"], x["k"], x["v"], I, x["cu"], x["cu"], BK,
                                  validate=False)
        lse = lse.float().contiguous()

        def call():
            return kl_loss_and_backward(x["q"], x["k"], x["q_idx"], x["k_idx"], I, lse,
                                        x["cu"], x["cu"], BK, validate=False)

        first = None
        for height, teacher in ((r, t) for r in heights for t in teachers):
            v3.TILE_ROWS = height
            v3.TEACHER_WGMMA = knob[teacher]
            row = dict(case=f"N={n}", pattern=args.pattern, tile_rows=height, teacher=teacher)
            try:
                got = list(call())  # kl, loss, dq_idx, dk_idx: torch tensors
            except Exception as e:  # a height that does not compile or launch: say so
                row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
                print(row, flush=True)
                rows.append(row)
                continue
            if first is None:
                first = got
                if args.save:
                    os.makedirs(args.save, exist_ok=True)
                    torch.save([t.cpu() for t in got],
                               os.path.join(args.save, f"{n}-{args.pattern}.pt"))
            if args.against:
                other = torch.load(os.path.join(args.against, f"{n}-{args.pattern}.pt"))
                row["bitwise_vs_against"] = all(torch.equal(a.cpu(), b)
                                                for a, b in zip(got, other))
                # largest difference relative to each output's largest magnitude
                row["rel_vs_against"] = max(
                    float((a.cpu().float() - b.float()).abs().max()
                          / b.float().abs().max().clamp_min(1e-30))
                    for a, b in zip(got, other))
            row["bitwise_vs_first"] = all(torch.equal(a, b) for a, b in zip(got, first))
            row["ms"] = cuda_time_ms(call, warmup=1, reps=args.reps)
            if args.table:
                kernel_table(call, f"N={n} tile rows {height}, teacher {teacher}", rows=6)
            print(row, flush=True)
            rows.append(row)
            got = None
        first = None
        torch.cuda.empty_cache()
    print_table(rows, ["case", "tile_rows", "teacher", "ms", "bitwise_vs_first",
                       "bitwise_vs_against", "rel_vs_against", "error"])
    write_json(args.out, rows, config=dict(rows=args.rows, teacher=args.teacher,
                                           reps=args.reps, min_positions=v3.MIN_POSITIONS))


if __name__ == "__main__":
    main()
