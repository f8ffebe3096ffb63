"""One MSA layer across processes (context parallelism, docs/context_parallel.md) on the CPU.

    python examples/context_parallel.py                 # 2 gloo processes
    python examples/context_parallel.py --world-size 4

A packed batch of three sequences (the longest spans ranks, a rank holds several) is sharded by
``msa.distributed.shard_tokens``; each process holds its rows of ``x``, runs
``ContextParallelMSA`` (K, V and K_idx all-gathered, queries local) forward and backward on
``L = <output, g> + lambda L_KL``, and sums the weight gradients over the group. This process
runs the same step on one ``MSAAttention`` and compares: the selection must be equal exactly,
the outputs, LSE, ``L_KL`` and every gradient (weights and ``x``) to float64 rounding.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import msa.reference as R
from msa.distributed import ContextParallelMSA, all_reduce_gradients, shard_tokens
from msa.torch import MSAAttention

CU = [0, 200, 230, 320]  # three sequences, 320 tokens
BLOCK, TOPK, LAM, CHUNK = 16, 4, 0.5, 32
WEIGHTS = ("w_q", "w_k", "w_v", "w_o", "w_q_idx", "w_k_idx")


def setup():
    """The layer (d_model 64, Hq 8, Hkv 2, D = Didx = 16), ``x`` and the output gradient ``g``."""
    layer = MSAAttention.from_params(R.init_params(64, 8, 2, 16, 16, seed=0),
                                     block_size=BLOCK, topk=TOPK)
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.standard_normal((CU[-1], 64)))
    g = torch.from_numpy(rng.standard_normal((CU[-1], 64)))
    return layer, x, g


def worker(rank, world_size, workdir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(workdir, 'store')}",
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    layer, x, g = setup()
    cp = ContextParallelMSA(layer, chunk_size=CHUNK)
    ids = torch.from_numpy(cp.shard(CU).token_ids(rank))
    x_local = x[ids].clone().requires_grad_()  # this rank's rows
    out = cp(x_local, CU)  # this rank's rows of the output; loss_kl: its share of L_KL
    ((out.output * g[ids]).sum() + LAM * out.loss_kl).backward()
    all_reduce_gradients(cp.parameters())  # the one-device weight gradients on every rank
    loss_kl = out.loss_kl.detach().clone()
    dist.all_reduce(loss_kl)
    torch.save(dict(ids=ids, output=out.output.detach(), lse=out.lse, sel=out.block_indices,
                    dx=x_local.grad, loss_kl=loss_kl,
                    **{w: getattr(layer, w).grad for w in WEIGHTS}),
               os.path.join(workdir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def run(world_size=2, verbose=True):
    """Run the step on ``world_size`` processes and on one; returns the largest relative
    difference per result and whether the selections are equal."""
    sh = shard_tokens(CU, world_size, CHUNK)
    if verbose:
        print(f"{CU[-1]} tokens in {len(CU) - 1} sequences, chunks of {CHUNK}, "
              f"{world_size} ranks")
        for r in range(world_size):
            mine = sh.chunks[sh.chunks[:, 3] == r]
            chunks = ", ".join(f"s{b}[{p0}:{p1})" for b, p0, p1, _ in mine)
            print(f"  rank {r}: {sh.counts[r]} tokens, causal work {sh.work[r]}: {chunks}")
    with tempfile.TemporaryDirectory() as workdir:
        mp.spawn(worker, args=(world_size, workdir), nprocs=world_size, join=True)
        parts = [torch.load(os.path.join(workdir, f"rank{r}.pt")) for r in range(world_size)]

    layer, x, g = setup()
    x.requires_grad_()
    ref = layer(x, CU)
    ((ref.output * g).sum() + LAM * ref.loss_kl).backward()
    want = dict(output=ref.output.detach(), lse=ref.lse, dx=x.grad, loss_kl=ref.loss_kl.detach(),
                **{w: getattr(layer, w).grad for w in WEIGHTS})

    def rows(key):
        out = torch.empty_like(want.get(key, ref.block_indices))
        for p in parts:
            out[p["ids"]] = p[key]
        return out

    selection_equal = bool(torch.equal(rows("sel"), ref.block_indices))
    diffs = {}
    for key, w in want.items():
        got = rows(key) if key in ("output", "lse", "dx") else parts[0][key]
        diffs[key] = float((got - w).abs().max() / w.abs().max())
    if verbose:
        print(f"selection equal to one process: {selection_equal}")
        for key, d in diffs.items():
            print(f"  {key:8s} max |difference| / max |one process| = {d:.1e}")
        ok = selection_equal and max(diffs.values()) < 1e-12
        print("results match one process" if ok else "RESULTS DIFFER from one process")
    return diffs, selection_equal


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    run(ap.parse_args().world_size)
