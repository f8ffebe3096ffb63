"""Plot benchmark JSON from benchmarks/results/ into docs/figures/ (runs anywhere, no GPU).

    python -m benchmarks.plot [bench_attention JSON]

Default: ``benchmarks/results/bench_attention.json``. Every implementation timed on the sparse
cases gets a bar per case, in the order the run timed them.
"""

from __future__ import annotations

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
FIG = os.path.join(HERE, "..", "docs", "figures")


def attention(path=os.path.join(HERE, "results", "bench_attention.json")):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        rows = json.load(f)["results"]
    cases = [c for c in dict.fromkeys(r["case"] for r in rows) if c.startswith("sparse")]
    impls = list(dict.fromkeys(r["impl"] for r in rows
                               if r["case"] in cases and r.get("ms")))
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / max(1, len(impls))
    for j, impl in enumerate(impls):
        xs, ys = [], []
        for i, case in enumerate(cases):
            for r in rows:
                if r["case"] == case and r["impl"] == impl and r.get("ms"):
                    xs.append(i + (j - (len(impls) - 1) / 2) * width)
                    ys.append(r["ms"])
        bars = ax.bar(xs, ys, width, label=impl)
        ax.bar_label(bars, labels=[f"{y:,.0f}" if y >= 100 else f"{y:.1f}" for y in ys], fontsize=7)
    ax.set_yscale("log")
    lows = [r["ms"] for r in rows if r["case"] in cases and r.get("ms")]
    ax.set_ylim(bottom=min(lows) / 4, top=max(lows) * 3)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([c.replace("sparse ", "") for c in cases], rotation=15, fontsize=8)
    ax.set_ylabel("ms (log scale, lower is better)")
    ax.set_title("Sparse attention forward on an H200: Hq=64, Hkv=4, D=128, Bk=128, k=16, bf16")
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(FIG, exist_ok=True)
    out = os.path.join(FIG, "perf_attention.png")
    fig.savefig(out, dpi=110)
    print("wrote", out)


if __name__ == "__main__":
    import sys

    attention(*sys.argv[1:2])
