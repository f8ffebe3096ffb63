"""The packed variable-length batch, validated once at a public entry and shared by every stage.

A public function of msa checks its ``cu_seqlens_q``, ``cu_seqlens_k`` and ``block_size`` once,
building a ``Batch``; every stage below it takes the ``Batch`` and checks nothing again. NumPy
only (the reference uses it too); what a GPU stage derives from it (device copies of the
offsets) it keeps in ``Batch.memo``, so that each is made once per batch.

Layout (``msa.reference.blocks`` has the equations):

* ``cu_q``, ``cu_k`` int64 ``[B+1]`` prefix sums of the query and key lengths;
* a sequence's ``Lq`` queries are the last ``Lq`` of its ``Lk`` key positions (bottom-right
  causal alignment): query ``i`` of sequence ``b`` sits at key position ``Lk - Lq + i``;
* block ``j`` of a sequence holds its key positions ``[j*Bk, min((j+1)*Bk, Lk))``;
  ``nb = ceil(max Lk / Bk)`` is the last axis of the block scores;
* the k2q CSR has one row per (sequence, block): sequence ``b`` owns rows
  ``row_offsets[b] .. row_offsets[b+1]-1``, ``rows = row_offsets[-1]`` in all.
"""

from __future__ import annotations

import numpy as np

from ._checks import check_block_size, check_offset_pair, check_offsets


class Batch:
    """A validated packed batch: offsets, lengths, block size and what follows from them.

    Build it with ``Batch.of(cu_seqlens_q, cu_seqlens_k, block_size, total_q=..., total_k=...)``
    (``cu_seqlens_q=None`` for a batch of keys only); never construct it from unchecked values.
    The arrays are read-only.

    Attributes:
        cu_q, cu_k: int64 [B+1] (``cu_q`` is None for a batch of keys only).
        lq, lk: int64 [B] query and key lengths (``lq`` None without queries).
        tq, tk: packed lengths (``tq`` None without queries). num_seqs: B.
        block_size: Bk. nb: ``ceil(max Lk / Bk)`` (0 for no keys).
        row_offsets: int64 [B+1] CSR rows of each sequence; rows: their total.
        memo: a dict for values derived from the batch (device copies), filled by the stages.
    """

    __slots__ = ("cu_q", "cu_k", "lq", "lk", "tq", "tk", "num_seqs", "block_size", "nb",
                 "row_offsets", "rows", "memo", "_pos", "__weakref__")

    def __init__(self, cu_q, cu_k, block_size: int):
        # Private: the values are trusted here (Batch.of checks them).
        for a in (cu_q, cu_k):
            if a is not None:
                a.setflags(write=False)
        self.cu_q, self.cu_k = cu_q, cu_k
        self.block_size = block_size
        self.lk = np.diff(cu_k)  # [B]
        self.lq = None if cu_q is None else np.diff(cu_q)  # [B]
        self.tk = int(cu_k[-1])
        self.tq = None if cu_q is None else int(cu_q[-1])
        self.num_seqs = int(self.lk.size)
        nb_seq = -(-self.lk // block_size)  # [B] blocks of each sequence
        self.nb = int(nb_seq.max()) if nb_seq.size else 0
        self.row_offsets = np.concatenate([[0], np.cumsum(nb_seq)]).astype(np.int64)  # [B+1]
        self.rows = int(self.row_offsets[-1])
        for a in (self.lk, self.lq, self.row_offsets):
            if a is not None:
                a.setflags(write=False)
        self.memo = {}
        self._pos = None

    @classmethod
    def of(cls, cu_seqlens_q, cu_seqlens_k, block_size, *, total_q: int | None = None,
           total_k: int | None = None) -> Batch:
        """Check the offsets and the block size (errors name the argument); build the batch.

        Args:
            cu_seqlens_q: int [B+1] query offsets (any array library, or a list), or None.
            cu_seqlens_k: int [B+1] key offsets.
            block_size: Bk, an integer in ``[1, 2**31 - 1]`` (``check_block_size``).
            total_q, total_k: the packed lengths the offsets must end at (``q.shape[0]``,
                ``k.shape[0]``), or None to take them from the offsets.
        """
        block_size = check_block_size(block_size)
        if cu_seqlens_q is None:
            return cls(None, check_offsets("cu_seqlens_k", cu_seqlens_k, total_k), block_size)
        # Each offsets array is read (a device-to-host copy for a GPU array) and checked once.
        cu_q, cu_k = check_offset_pair(check_offsets("cu_seqlens_q", cu_seqlens_q, total_q),
                                       check_offsets("cu_seqlens_k", cu_seqlens_k, total_k))
        return cls(cu_q, cu_k, block_size)

    def __repr__(self) -> str:
        return (f"Batch(B={self.num_seqs}, Tq={self.tq}, Tk={self.tk}, "
                f"block_size={self.block_size}, nb={self.nb}, rows={self.rows})")

    @property
    def _positions(self):
        if self._pos is not None:
            return self._pos
        batch = np.repeat(np.arange(self.num_seqs, dtype=np.int64), self.lq)  # [Tq]
        local = np.arange(self.tq, dtype=np.int64) - self.cu_q[batch]  # [Tq]
        pos = (self.lk - self.lq)[batch] + local  # [Tq]
        for a in (batch, pos):
            a.setflags(write=False)
        self._pos = batch, pos
        return self._pos

    @property
    def query_batch(self) -> np.ndarray:
        """int64 [Tq]: the sequence of each packed query."""
        return self._positions[0]

    @property
    def query_pos(self) -> np.ndarray:
        """int64 [Tq]: each query's key position inside its sequence (bottom-right aligned)."""
        return self._positions[1]

    def chunks(self, chunk: int):
        """Cut the queries into chunks of at most ``chunk``, each a ``Batch`` of its own.

        A chunk ``[t0, t1)`` becomes the sequences ``bf .. bl`` it touches, each keeping the keys
        its chunk queries can see: all of them except for ``bl``, whose keys end at its last chunk
        query (queries are the last ``Lq`` of their ``Lk`` keys, so cutting the later keys off
        keeps every position and every block id). Those keys are one contiguous range
        ``[k_lo, k_hi)`` of the packed keys.

        Yields ``(t0, t1, k_lo, k_hi, sub)`` with ``sub`` the chunk's ``Batch``.
        """
        cu_q, cu_k = self.cu_q, self.cu_k
        for t0 in range(0, self.tq, chunk):
            t1 = min(t0 + chunk, self.tq)
            bf = int(np.searchsorted(cu_q, t0, side="right")) - 1
            bl = int(np.searchsorted(cu_q, t1 - 1, side="right")) - 1
            lq_bl = int(cu_q[bl + 1] - cu_q[bl])
            lk_bl = int(cu_k[bl + 1] - cu_k[bl])
            k_lo = int(cu_k[bf])
            k_hi = int(cu_k[bl]) + lk_bl - lq_bl + (t1 - int(cu_q[bl]))
            cu_q_c = np.clip(cu_q[bf:bl + 2], t0, t1) - t0
            cu_k_c = cu_k[bf:bl + 2] - k_lo
            cu_k_c[-1] = k_hi - k_lo
            yield t0, t1, k_lo, k_hi, Batch(cu_q_c, cu_k_c, self.block_size)
