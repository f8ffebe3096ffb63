"""The figure of a benchmark's results JSON, beside it (runs anywhere, no GPU).

    python -m benchmarks.plot [benchmarks/results/bench_<stage>.json ...]

Default: every ``benchmarks/results/bench_*.json``. Each JSON gets ``bench_<stage>.png`` next to
it: one group of bars per case, one bar per implementation timed on it (in the order the run
timed them), ms on a log scale, the value on each bar, and the run's GPU and commit in the title.
"""

from __future__ import annotations

import glob
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

TITLES = {
    "bench_attention": "Sparse attention forward and MSA prefill",
    "bench_layer": "MSA layer training step (forward + backward)",
    "bench_attention_backward": "Main branch backward (dQ, dK, dV)",
    "bench_csr": "k2q CSR + hot-row schedule",
    "bench_kl": "Sparse KL loss and backward",
    "bench_select": "Index branch + top-k",
}
CONFIG = "Hq=64, Hkv=4, D=Didx=128, Bk=128, k=16, bf16"


def rows_of(payload: dict) -> list[dict]:
    """``(case, impl, ms)`` rows: ``results`` as written, or ``bench_csr``'s per-case fields."""
    if "results" in payload:
        return [r for r in payload["results"] if r.get("ms")]
    rows = []
    for c in payload["cases"]:
        case = f"N={c['n'] // 1024}K {c['pattern']}"
        rows.append(dict(case=case, impl="msa CSR + schedule", ms=c["msa_csr_schedule_ms"]))
        rows.append(dict(case=case, impl="PyTorch CSR + schedule", ms=c["torch_csr_schedule_ms"]))
    return rows


def plot(path: str) -> str:
    if os.path.basename(path).startswith("bench_layer"):  # its own figure: time and ratio vs N
        from benchmarks.bench_layer import figure

        out = figure(path)
        print("wrote", out)
        return out
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    with open(path) as f:
        payload = json.load(f)
    rows = rows_of(payload)
    cases = list(dict.fromkeys(r["case"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(cases) * max(1, len(impls)) ** 0.5 + 3), 4))
    width = 0.8 / max(1, len(impls))
    for j, impl in enumerate(impls):
        xs, ys = [], []
        for i, case in enumerate(cases):
            for r in rows:
                if r["case"] == case and r["impl"] == impl:
                    xs.append(i + (j - (len(impls) - 1) / 2) * width)
                    ys.append(r["ms"])
        bars = ax.bar(xs, ys, width, label=impl)
        ax.bar_label(bars, labels=[f"{y:,.0f}" if y >= 100 else f"{y:.2g}" if y < 1 else f"{y:.1f}"
                                   for y in ys], fontsize=6)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ms = [r["ms"] for r in rows]
    ax.set_ylim(bottom=min(ms) / 4, top=max(ms) * 4)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases, rotation=15, fontsize=8)
    ax.set_ylabel("ms (log scale, lower is better)")
    stem = os.path.splitext(os.path.basename(path))[0]
    head = payload.get("header", {})
    title = TITLES.get(stem, TITLES.get(stem.rsplit("_", 1)[0], stem))  # (bench_x_h100: x's)
    ax.set_title(f"{title} on an {head.get('gpu', '?')}\n{CONFIG}, "
                 f"run at commit {str(head.get('commit', '?'))[:7]}", fontsize=9)
    ax.legend(fontsize=7, ncol=min(len(impls), 4), loc="upper center",
              bbox_to_anchor=(0.5, -0.2), frameon=False)
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print("wrote", out)
    return out


if __name__ == "__main__":
    import sys

    for p in sys.argv[1:] or sorted(glob.glob(os.path.join(RESULTS, "bench_*.json"))):
        plot(p)
