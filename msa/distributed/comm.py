"""The key side's collectives: an all-gather whose backward is a reduce-scatter.

Each rank packs its rows of ``K [n, Hkv, D]``, ``V`` and ``K_idx [n, Didx]`` side by side into
one buffer ``[n_pad, F]``, ``F = 2 Hkv D + Didx`` (one collective instead of three), padded to
``n_pad`` rows (``Sharding.padded_rows``). :func:`gather_keys` all-gathers it and returns the
three in global packed order, contiguous; its backward puts their gradients back into the
rank-major layout and reduce-scatters them (a sum over the ranks whose queries read each key,
in float32 for 16-bit keys), so that each rank gets ``dK, dV, dK_idx`` of its own rows.
Queries and their gradients never move.

The gather is cut into ``pieces`` collectives: piece ``s`` is row range ``s`` of every rank's
buffer. On CUDA tensors each is asynchronous, and a side stream waits for it, scatters it into
global order and records an event; :func:`wait_for_pieces` makes the compute stream wait for the
first ``n`` pieces only, so the rounds that read early keys compute while the later pieces are
in flight. No host read happens on that path: the index maps come from the host plan. On CPU
tensors (gloo) the pieces are gathered one after the other, synchronously: the same layout and
index maps, no overlap.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["gather_keys", "wait_for_pieces"]

# torch >= 2.10 names the single-tensor collectives *_single; older torch has *_into_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherKeys(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buf, layout, backward_rows, total, widths, group, events):
        world = dist.get_world_size(group)
        n_pad, f = (int(s) for s in buf.shape)
        pieces = len(layout)
        per = n_pad // pieces
        cols = [sum(widths[:i]) for i in range(len(widths))]
        outs = [buf.new_empty((total, w)) for w in widths]  # every row written by one piece
        gathered = buf.new_empty((pieces, world * per, f))
        if buf.is_cuda:
            _gather_cuda(buf, gathered, layout, outs, cols, widths, group, events)
        else:
            for s, (tokens, rows) in enumerate(layout):
                _all_gather(gathered[s], buf[s * per:(s + 1) * per], group=group)
                for out, c, w in zip(outs, cols, widths):
                    out.index_copy_(0, tokens, gathered[s][:, c:c + w].index_select(0, rows))
        ctx.save_for_backward(backward_rows)
        ctx.meta = (n_pad, f, cols, widths, group)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        (rows,) = ctx.saved_tensors
        n_pad, f, cols, widths, group = ctx.meta
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        ref = next(g for g in grads if g is not None)
        # 16-bit gradients are summed over the ranks in float32 (one rounding, as one device's
        # float32 accumulation has), at twice the bytes
        acc = torch.float32 if ref.dtype in (torch.float16, torch.bfloat16) else ref.dtype
        full = ref.new_zeros((world * n_pad, f), dtype=acc)  # rank-major: rank r at r * n_pad
        for g, c, w in zip(grads, cols, widths):
            if g is not None:
                full[:, c:c + w].index_copy_(0, rows, g.to(acc))  # unique rows: no sum here
        mine = full.new_empty((n_pad, f))
        try:
            _reduce_scatter(mine, full, op=dist.ReduceOp.SUM, group=group)
        except (RuntimeError, NotImplementedError):  # a backend without reduce-scatter
            dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group)
            mine = full[rank * n_pad:(rank + 1) * n_pad]
        return mine.to(ref.dtype), None, None, None, None, None, None


def _gather_cuda(buf, gathered, layout, outs, cols, widths, group, events):
    """The overlapped gather (GPU only; the CPU tests do not run it): one asynchronous
    collective per piece; a side stream waits for each (the host does not), scatters the piece
    into global order and records an event into ``events``."""
    per = int(buf.shape[0]) // len(layout)
    compute = torch.cuda.current_stream(buf.device)
    side = torch.cuda.Stream(device=buf.device)
    side.wait_stream(compute)  # buf, outs and the index maps are ready
    for s, (tokens, rows) in enumerate(layout):
        work = _all_gather(gathered[s], buf[s * per:(s + 1) * per], group=group, async_op=True)
        with torch.cuda.stream(side):
            work.wait()  # the side stream waits for this piece's collective
            for out, c, w in zip(outs, cols, widths):
                out.index_copy_(0, tokens, gathered[s][:, c:c + w].index_select(0, rows))
            event = torch.cuda.Event()
            event.record(side)
            events.append(event)
    # allocated on the compute stream, used on the side one: not freed before it is done
    for t in [gathered, *outs] + [x for pair in layout for x in pair]:
        t.record_stream(side)


def gather_keys(buf, layout, backward_rows, total, widths, group=None, *, events=None):
    """All-gather each rank's key rows into global order; the backward reduce-scatters.

    Args:
        buf: [n_pad, F] this rank's rows (``F = sum(widths)``), padded to ``n_pad`` (a multiple
            of the number of pieces, the same on every rank).
        layout: per piece ``(tokens, rows)``, int64 tensors on ``buf``'s device, from
            ``Sharding.piece_layout(pieces)``: which global tokens the piece holds and their rows
            in the gathered piece ``[W n_pad / pieces, F]``.
        backward_rows: int64 [T] on ``buf``'s device, ``Sharding.rank_major_rows(pieces)``: each
            token's row in the rank-major ``[W n_pad, F]`` buffer the backward reduce-scatters.
        total: T, the global packed length.
        widths: the column widths of the tensors packed in ``buf``, e.g. ``(Hkv D, Hkv D, Didx)``.
        group: the process group (None: the default one).
        events: a list that receives one CUDA event per piece (GPU only), for
            :func:`wait_for_pieces`.

    Returns:
        A tuple of ``[T, widths[i]]`` tensors in global packed order, contiguous, differentiable
        in ``buf`` (the backward is a reduce-scatter: each rank gets the sum over every rank of
        the gradients of its own rows).
    """
    events = [] if events is None else events
    return _GatherKeys.apply(buf, tuple(layout), backward_rows, int(total), tuple(widths),
                             group, events)


def wait_for_pieces(events, n, device):
    """Make the current CUDA stream wait until the first ``n`` gathered pieces are in place
    (no-op on the CPU, where ``events`` is empty). Events are recorded in piece order on one
    stream, so waiting for the ``n``-th waits for all before it."""
    if events and n > 0:
        torch.cuda.current_stream(device).wait_event(events[n - 1])
