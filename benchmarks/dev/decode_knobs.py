"""The decode step under alternative settings of the planners' constants, in one process (GPU).

    source .gpu/env.sh && python3 -m benchmarks.dev.decode_knobs \
        --cases 32:65536:1,8:131072:1,128:8192:1,32:65536:8 \
        --configs "base;v2_split_attention.STAGES=2;_plan.CTAS_PER_SM=3"

A config is ``module.NAME=value`` settings (modules of ``msa.cuda.decode``) and optionally
``version=N`` (the rung ``plan`` takes) joined by ``,``; ``base`` is the code as it is. For
each case and config: ``plan`` + one ``run`` (the outputs must equal the first config's bit for
bit where the constants change only the schedule; another attention split count or key range
a warp combines a row's parts in another order, so there only the selection must, and
``o_rel_diff`` is O's largest difference over max |O|), then the step in a
CUDA graph and each of its kernels alone (as ``bench_decode``), median of ``--reps``. The
settings are restored after each config. The latest run is ``benchmarks/results/
decode_knobs.json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os

os.environ.setdefault("NUMBA_CUDA_ARRAY_INTERFACE_SYNC", "0")


def parse_config(text):
    """``([(module, name, value)], version)`` of one config (``base``: none, None)."""
    out, version = [], None
    for item in filter(None, (t.strip() for t in text.split(","))):
        if item == "base":
            continue
        target, value = item.split("=")
        if target == "version":
            version = int(value)
            continue
        mod, name = target.rsplit(".", 1)
        out.append((importlib.import_module(f"msa.cuda.decode.{mod}"), name, int(value)))
    return out, version


def forget_kernels():
    """Drop the kernels the decode modules' factories memoised (``functools.lru_cache``): they
    read module constants when they build, which a config changes."""
    import sys

    for name, mod in list(sys.modules.items()):
        if name.startswith("msa.cuda.decode"):
            for obj in vars(mod).values():
                if callable(getattr(obj, "cache_clear", None)):
                    obj.cache_clear()


def main(argv=None):
    import torch

    from benchmarks.bench_decode import BK, TOPK, graph_of, kernel_times, make_case, timed
    from benchmarks.common import write_json
    from msa.cuda import decode as gpu

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="32:65536:1,8:131072:1,128:8192:1,32:65536:8")
    ap.add_argument("--configs", default="base;v2_split_attention.STAGES=2")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"),
                                                  "decode_knobs.json"))
    args = ap.parse_args(argv)
    rows = []
    for case in args.cases.split(","):
        b, n, lq = (int(x) for x in case.split(":"))
        torch.cuda.empty_cache()
        _, step = make_case(b, n, lq)
        base_out = None
        for config in args.configs.split(";"):
            settings, version = parse_config(config)
            saved = [(m, k, getattr(m, k)) for m, k, _ in settings]
            try:
                for m, k, v in settings:
                    setattr(m, k, v)
                forget_kernels()
                plan = gpu.plan(*step, BK, TOPK, version=version)
                gpu.run(plan, *step)
                torch.cuda.synchronize()
                out = (plan.o.clone(), plan.lse.clone(), plan.block_indices.clone())
                if base_out is None:
                    base_out = out
                same = all(torch.equal(x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
                                       y.view(torch.int16) if y.dtype == torch.bfloat16 else y)
                           for x, y in zip(out, base_out))
                same_selection = torch.equal(out[2], base_out[2])
                err = ((out[0].float() - base_out[0].float()).abs().max()
                       / base_out[0].float().abs().max()).item()
                graph = graph_of(lambda plan=plan: gpu.run(plan, *step))
                row = dict(case=case, config=config, version=plan.version,
                           index_splits=plan.index_splits,
                           attention_splits=plan.attention_splits, equal_to_first=same,
                           selection_equal=same_selection, o_rel_diff=err,
                           step_ms=timed(graph.replay, args.reps),
                           kernels_ms=kernel_times(plan, step, args.reps))
                del graph, plan
            except Exception as e:  # a config that cannot build or run is reported, not fatal
                row = dict(case=case, config=config, error=f"{type(e).__name__}: {e}"[:400])
            finally:
                for m, k, v in saved:
                    setattr(m, k, v)
                forget_kernels()
            print(json.dumps(row), flush=True)
            rows.append(row)
    write_json(args.out, rows, cases=args.cases, configs=args.configs.split(";"))


if __name__ == "__main__":
    main()
