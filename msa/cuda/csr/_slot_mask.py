"""Which slots of a selection are CSR entries, one bit a slot, for the sums that follow the CSR.

The backward's ``dq`` sum and the KL's slot sums add, per (query, group), the partial each slot's
CSR entry got. A slot is an entry when its id is a block of the query's sequence (``0 <= I[t, g,
s] < nblocks``) that no earlier slot of the row names (``_core.packed.repeats_a_slot``:
``validate=False`` may pass repeats; only the first was written). Deciding that costs ``K - 1``
loads of the row a slot; the sums run a thread per output element (``D / 4`` or ``Didx`` of them
a row and head), so each decided it again: at 128K tokens that was ~10% of the backward. Here one
thread per (query, group) decides it once for all ``K`` slots, and the sums read one bit a slot.
"""

from __future__ import annotations

from numba import cuda, int32, int64, uint32

from .._core.diskcache import kernel_jit
from .._core.launch import THREADS
from .._core.packed import last_le, repeats_a_slot
from .._core.streams import stream


def mask_words(topk: int) -> int:
    """int32 words a row of the mask takes: one bit a slot."""
    return (int(topk) + 31) // 32


@kernel_jit
def slot_mask_kernel(I, cu_q, cu_k, block_size, mask):
    """``mask[t, g, s // 32]`` bit ``s % 32`` = 1 iff slot ``s`` of (t, g) is a CSR entry of
    the batch ``(cu_q, cu_k)`` (module docstring); every word written. One thread per (t, g)."""
    tq = I.shape[0]
    hkv = I.shape[1]
    topk = I.shape[2]
    i = cuda.grid(1)
    if i >= tq * hkv:
        return
    t = i // hkv
    g = i % hkv
    b = last_le(cu_q, t)
    lk = int64(cu_k[b + 1]) - int64(cu_k[b])
    nblocks = (lk + block_size - 1) // block_size
    word = uint32(0)
    for s in range(topk):
        j = int64(I[t, g, s])
        if j >= 0 and j < nblocks and not repeats_a_slot(I, t, g, s, j):
            word |= uint32(1) << uint32(s % 32)
        if s % 32 == 31 or s == topk - 1:
            mask[t, g, s // 32] = int32(word)
            word = uint32(0)


@cuda.jit(device=True, inline=True)
def is_entry(mask, t, g, s):
    """Slot ``s`` of (t, g) is a CSR entry (bit of ``slot_mask_kernel``'s mask)."""
    return (uint32(mask[t, g, s >> 5]) >> uint32(s & 31)) & uint32(1) != uint32(0)


def launch_slot_mask(I, cu_q, cu_k, block_size: int, mask) -> None:
    """Fill ``mask`` int32 [Tq, Hkv, mask_words(K)] for the rows of ``I`` [Tq, Hkv, K] (kernel
    arguments; ``cu_q, cu_k`` the offsets of the batch whose CSR the sums follow). Checks
    nothing."""
    n = int(I.shape[0]) * int(I.shape[1])
    if n:
        slot_mask_kernel[-(-n // THREADS), THREADS, stream()](I, cu_q, cu_k, block_size, mask)
