"""Context parallelism, the host side: which rank holds which queries, and what each rank runs.

``shard_tokens(cu_seqlens, world_size, chunk_size)`` is a pure function of the global packed
batch (NumPy only, no torch, no process group): every rank computes the same :class:`Sharding`.

**Chunks.** Each sequence is cut into chunks of ``chunk_size`` tokens (its last chunk may be
shorter; a chunk never spans two sequences). A chunk's *causal work* is the number of
(query, visible key) pairs of its queries, ``sum_{p=p0}^{p1-1} (p + 1)``: what the index branch
(block scores over every visible key, eq 6) and a dense causal attention cost. The sparse main
branch costs the same for every query past ``K Bk`` keys, which equal token counts balance.

**Assignment (longest processing time first, a min-heap).** Chunks in order of decreasing work
(ties: the earlier chunk first) each go to the rank with the least work so far (ties: fewer
tokens, then the lower rank) that holds fewer than ``ceil(C / W)`` chunks. Every rank gets early
and late chunks; on one sequence cut into ``2W`` equal chunks this is exactly the zigzag
(rank ``r`` gets chunks ``r`` and ``2W - 1 - r``). Token counts can differ where chunks do
(the short last chunk of each sequence); the gather pads every rank to the largest.

**Spans and rounds.** Consecutive chunks of one sequence on one rank merge into a *span*. A
span ``[p0, p1)`` of sequence ``b`` is the query block of a pseudo-sequence whose keys are
``b``'s positions ``[0, p1)``: its queries are the last ``p1 - p0`` of its ``p1`` keys, the
bottom-right alignment every msa function takes, so positions and block ids are the global
ones. A rank's ``j``-th span of each sequence goes to its round ``j``: a round holds at most one
span per sequence, so its key ranges do not overlap and one call of each msa function (with the
round's ``cu_seqlens_q``, ``cu_seqlens_k``) runs it.

**Local order.** A rank's rows are its rounds one after the other; inside a round, its spans by
sequence; inside a span, by position. On one sequence, or whole sequences per rank, this is the
global order. ``Sharding.token_ids(rank)`` lists the global packed ids of a rank's rows.

**The gathered layout.** Each rank pads its rows to ``n_pad`` (a multiple of ``pieces``) and
cuts them into ``pieces`` equal row ranges; piece ``s`` of every rank is gathered in one
collective, so the gathered buffer is ``[pieces, W, n_pad / pieces]`` rows (rank-major when
``pieces = 1``). ``piece_layout`` maps each piece's rows to global tokens, and
``pieces_needed`` says how many leading pieces each round reads: on a GPU a round starts once
those have arrived, while the later ones are still in flight.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

import numpy as np

from .._checks import check_offsets, check_positive_int

__all__ = ["Round", "Sharding", "shard_tokens", "causal_work"]


def causal_work(p0, p1):
    """Causal work of the queries at positions ``[p0, p1)`` of one sequence: the number of
    (query, visible key) pairs, ``sum_{p=p0}^{p1-1} (p + 1)`` (int64, elementwise)."""
    p0, p1 = np.asarray(p0, dtype=np.int64), np.asarray(p1, dtype=np.int64)
    return (p1 * (p1 + 1) - p0 * (p0 + 1)) // 2


@dataclass(frozen=True)
class Round:
    """One call of the msa functions on a rank: local query rows ``[row0, row1)``.

    ``cu_seqlens_q``, ``cu_seqlens_k`` int64 [S+1] describe its ``S`` spans as pseudo-sequences
    (the queries of span ``i`` are the last ``Lq_i`` of its ``Lk_i`` keys); ``key_starts`` int64
    [S] is the global packed id of the first key of each (its sequence's first token): the keys
    of span ``i`` are the global tokens ``key_starts[i] + [0, Lk_i)``.
    """

    row0: int
    row1: int
    cu_seqlens_q: np.ndarray
    cu_seqlens_k: np.ndarray
    key_starts: np.ndarray

    def key_ids(self) -> np.ndarray:
        """int64 [cu_seqlens_k[-1]]: the global packed ids of the round's keys, in order."""
        lk = np.diff(self.cu_seqlens_k)
        return np.repeat(self.key_starts - self.cu_seqlens_k[:-1], lk) + np.arange(
            int(self.cu_seqlens_k[-1]), dtype=np.int64)


@dataclass(frozen=True, eq=False)
class Sharding:
    """The queries of a packed batch spread over ``world_size`` ranks (see the module docstring).

    Attributes:
        cu_seqlens: int64 [B+1], the global batch (self-attention: queries = keys).
        world_size: W. chunk_size: tokens per chunk.
        chunks: int64 [C, 4] in global order, one row ``(sequence, p0, p1, rank)`` per chunk.
        owner: int64 [T], the rank of each global token. local_index: int64 [T], its row there.
        counts: int64 [W], the rows of each rank. work: int64 [W], their causal work.
    """

    cu_seqlens: np.ndarray
    world_size: int
    chunk_size: int
    chunks: np.ndarray
    owner: np.ndarray
    local_index: np.ndarray
    counts: np.ndarray
    work: np.ndarray
    _rounds: tuple  # per rank, a tuple of Round

    @property
    def total(self) -> int:
        return int(self.cu_seqlens[-1])

    def token_ids(self, rank: int) -> np.ndarray:
        """int64 [counts[rank]]: the global packed ids of ``rank``'s rows, in local order
        (``x_local = x[sharding.token_ids(rank)]``)."""
        rank = self._rank(rank)
        ids = np.empty(int(self.counts[rank]), dtype=np.int64)
        mine = np.flatnonzero(self.owner == rank)
        ids[self.local_index[mine]] = mine
        return ids

    def rounds(self, rank: int) -> tuple:
        """The :class:`Round` s that ``rank`` runs, in local row order."""
        return self._rounds[self._rank(rank)]

    def padded_rows(self, pieces: int = 1) -> int:
        """``n_pad``: every rank's rows padded to a common multiple of ``pieces``."""
        pieces = check_positive_int("pieces", pieces)
        return -(-int(self.counts.max()) // pieces) * pieces

    def piece_layout(self, pieces: int = 1) -> tuple:
        """Per piece ``s``, ``(tokens, rows)`` int64: the global tokens whose rows lie in piece
        ``s`` of their rank's buffer, and their rows in the gathered piece ``[W, n_pad /
        pieces]`` (flattened): ``r n_pad / pieces + l - s n_pad / pieces`` for row ``l`` of rank
        ``r``. Every token is in exactly one piece."""
        per = self.padded_rows(pieces) // pieces
        piece, within = np.divmod(self.local_index, per)  # [T]
        rows = self.owner * per + within  # [T]
        layout = []
        for s in range(pieces):
            tokens = np.flatnonzero(piece == s)
            layout.append((tokens, rows[tokens]))
        return tuple(layout)

    def rank_major_rows(self, pieces: int = 1) -> np.ndarray:
        """int64 [T]: each token's row in the rank-major ``[W, n_pad]`` buffer (flattened) that
        the backward reduce-scatters, ``r n_pad + l``."""
        return self.owner * self.padded_rows(pieces) + self.local_index

    def pieces_needed(self, rank: int, pieces: int = 1) -> np.ndarray:
        """int64 [rounds]: how many leading pieces of the gathered buffer each round of ``rank``
        reads (1 + the highest piece holding one of its keys)."""
        per = self.padded_rows(pieces) // pieces
        piece = self.local_index // per  # [T]
        return np.array([int(piece[r.key_ids()].max()) + 1 for r in self.rounds(rank)],
                        dtype=np.int64)

    def _rank(self, rank) -> int:
        return check_positive_int("rank", rank, low=0, high=self.world_size - 1)


def shard_tokens(cu_seqlens, world_size: int, chunk_size: int | None = None) -> Sharding:
    """Spread the queries of a packed batch over ``world_size`` ranks, balanced by causal work.

    Args:
        cu_seqlens: int [B+1] prefix sums of the global batch (a list, NumPy or torch array).
        world_size: W >= 1 ranks.
        chunk_size: tokens per chunk (a sequence's last chunk may be shorter); default
            ``ceil(T / (2 W))``, two chunks per rank: the zigzag on one sequence.

    Returns:
        The :class:`Sharding`; pure and deterministic (every rank computes the same one; the
        results are cached per arguments).

    Raises ValueError when a rank would get no token (fewer chunks than ranks: a smaller
    ``chunk_size`` or fewer ranks), since every rank must take part in each collective.
    """
    cu = check_offsets("cu_seqlens", cu_seqlens)
    world_size = check_positive_int("world_size", world_size)
    total = int(cu[-1])
    if chunk_size is None:
        chunk_size = max(1, -(-total // (2 * world_size)))
    chunk_size = check_positive_int("chunk_size", chunk_size)
    return _shard(tuple(int(c) for c in cu), world_size, chunk_size)


@functools.lru_cache(maxsize=64)
def _shard(cu_key: tuple, world_size: int, chunk_size: int) -> Sharding:
    cu = np.array(cu_key, dtype=np.int64)
    lengths = np.diff(cu)  # [B]
    seq = np.repeat(np.arange(lengths.size), -(-lengths // chunk_size))  # [C]
    first = np.concatenate([[0], np.cumsum(-(-lengths // chunk_size))])[seq]  # [C]
    p0 = (np.arange(seq.size) - first) * chunk_size  # [C]
    p1 = np.minimum(p0 + chunk_size, lengths[seq])  # [C]
    n_chunks = int(seq.size)
    if n_chunks < world_size:
        raise ValueError(
            f"shard_tokens needs at least world_size={world_size} chunks so that every rank "
            f"holds a token, got {n_chunks} (T={int(cu[-1])}, chunk_size={chunk_size}); use a "
            "smaller chunk_size or fewer ranks")
    cost = causal_work(p0, p1)  # [C]
    rank = _assign(cost, p1 - p0, world_size)  # [C]
    chunks = np.stack([seq, p0, p1, rank], axis=1)  # [C, 4]
    chunks.setflags(write=False)

    owner = np.repeat(rank, p1 - p0)  # [T]: chunks are in global order
    local_index = np.empty_like(owner)
    counts = np.zeros(world_size, dtype=np.int64)
    work = np.bincount(rank, weights=cost, minlength=world_size).astype(np.int64)
    rounds = []
    for r in range(world_size):
        spans = _spans(chunks[rank == r])  # [S, 4] (sequence, p0, p1, ordinal)
        order = np.lexsort((spans[:, 0], spans[:, 3]))  # by ordinal, then sequence
        spans = spans[order]
        row = 0
        mine = []
        for j in np.unique(spans[:, 3]):
            sp = spans[spans[:, 3] == j]  # [S_j, 4]
            lq, lk = sp[:, 2] - sp[:, 1], sp[:, 2]
            row1 = row + int(lq.sum())
            local_index[cu[sp[:, 0]].repeat(lq) + _ranges(sp[:, 1], sp[:, 2])] = np.arange(row, row1)
            mine.append(Round(row, row1, _frozen(np.concatenate([[0], np.cumsum(lq)])),
                              _frozen(np.concatenate([[0], np.cumsum(lk)])),
                              _frozen(cu[sp[:, 0]].copy())))
            row = row1
        counts[r] = row
        rounds.append(tuple(mine))
    for a in (owner, local_index, counts, work):
        a.setflags(write=False)
    return Sharding(_frozen(cu), world_size, chunk_size, chunks, owner, local_index, counts,
                    work, tuple(rounds))


def _assign(cost: np.ndarray, tokens: np.ndarray, world_size: int) -> np.ndarray:
    """The rank of each chunk: longest processing time first over a min-heap of
    ``(work, tokens, rank)``, at most ``ceil(C / W)`` chunks a rank."""
    cap = -(-cost.size // world_size)
    heap = [(0, 0, r) for r in range(world_size)]  # already a heap
    held = np.zeros(world_size, dtype=np.int64)
    rank = np.empty(cost.size, dtype=np.int64)
    for c in sorted(range(cost.size), key=lambda c: (-int(cost[c]), c)):
        w, n, r = heapq.heappop(heap)
        rank[c] = r
        held[r] += 1
        if held[r] < cap:  # a full rank leaves the heap
            heapq.heappush(heap, (w + int(cost[c]), n + int(tokens[c]), r))
    return rank


def _spans(chunks: np.ndarray) -> np.ndarray:
    """``(sequence, p0, p1, ordinal)`` [S, 4]: runs of consecutive chunks of one sequence merged
    (``chunks`` of one rank, in global order); ordinal = the span's index within its sequence."""
    seq, p0, p1 = chunks[:, 0], chunks[:, 1], chunks[:, 2]
    new = np.ones(seq.size, dtype=bool)
    new[1:] = (seq[1:] != seq[:-1]) | (p0[1:] != p1[:-1])
    start = np.flatnonzero(new)
    end = np.concatenate([start[1:], [seq.size]]) - 1
    s_seq = seq[start]
    first_of_seq = np.ones(start.size, dtype=bool)
    first_of_seq[1:] = s_seq[1:] != s_seq[:-1]
    group_start = np.maximum.accumulate(np.where(first_of_seq, np.arange(start.size), 0))
    ordinal = np.arange(start.size) - group_start
    return np.stack([s_seq, p0[start], p1[end], ordinal], axis=1)


def _ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``concat_i(arange(lo_i, hi_i))`` int64, without a Python loop."""
    n = hi - lo
    return np.repeat(lo - np.concatenate([[0], np.cumsum(n)[:-1]]), n) + np.arange(int(n.sum()))


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.int64)
    a.setflags(write=False)
    return a
