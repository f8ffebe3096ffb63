"""K1 through a block table: each work item's page, for the paged forward.

``sparse_attention(..., block_table=...)`` reads K and V from the pages of a KV cache (``[P,
Hkv, Bk, D]``, one page one block, docs/design.md §8) instead of packed sequences, so that a
chunk of new tokens attends to its requests' caches without a copy. The schedule is the packed
one (it depends only on the selection and the lengths); after it, ``pages_kernel`` writes into
each item's ``row`` column, which K1 does not otherwise read, the page that holds block ``j`` of
sequence ``b``: ``block_table[b, j]``. The K1 rungs built with ``paged=True`` read it there
(``msa.cuda._core.packed.item_reader``).
"""

from __future__ import annotations

from numba import cuda

from .._core.diskcache import kernel_jit
from .._core.streams import stream
from .._core.launch import THREADS, grid_size

ROW = 1  # the work item's column that carries the page (``WORK_COLUMNS[1]``, "row")


@kernel_jit
def pages_kernel(work, block_table):
    """``work[w, 1] = block_table[b, j]`` for every item ``w = [h, row, q_begin, q_count, b,
    j]``; -1 for a padding item (``q_count <= 0``) or ``(b, j)`` outside the table (K1 then
    skips the item). One thread per item."""
    w = cuda.grid(1)
    if w >= work.shape[0]:
        return
    b = work[w, 4]
    j = work[w, 5]
    page = -1
    if work[w, 3] > 0 and 0 <= b < block_table.shape[0] and 0 <= j < block_table.shape[1]:
        page = block_table[b, j]
    work[w, ROW] = page


def launch_pages(work, block_table) -> None:
    """Run ``pages_kernel`` on a chunk's schedule ``work [W, 6]`` and the block-table rows of
    the chunk's sequences (kernel arrays, on the device)."""
    n = int(work.shape[0])
    if n:
        pages_kernel[grid_size(n), THREADS, stream()](work, block_table)
