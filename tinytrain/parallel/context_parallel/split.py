"""Which sequence positions each rank of the context-parallel group holds: contiguous or zigzag.

Causal attention is triangular: a query at position i reads keys 0..i, so late positions cost
more than early ones. Cut the sequence into *chunks*; a query chunk reads a key chunk only if the
key chunk is not later (a chunk later than the query chunk is *skipped*; the same chunk is the
diagonal, computed with the causal mask).

contiguous: N chunks of T/N, rank r holds chunk r. Rank r computes r + 1 blocks of (T/N)²
products, rank N−1 N times as many as rank 0: the ring waits for the slowest.

zigzag: 2N chunks of T/(2N), two a rank, one early and one late, paired so that every rank
computes the same 2N + 1 blocks of (T/(2N))² products: balanced (which pair: task 7.4, its
handout's worked case).

Every rank keeps its positions sorted (its early chunk, then its late one): ``positions(T, r, N,
split)`` says which tokens of the batch a rank takes (``ids[:, positions]``).
"""

from __future__ import annotations

import numpy

SPLITS = ("zigzag", "contiguous")


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not a context-parallel split; use one of {SPLITS}")


def n_chunks(n: int, split: str) -> int:
    """How many chunks the sequence is cut into: 2N for zigzag, N for contiguous."""
    check_split(split)
    return 2 * n if split == "zigzag" else n


def chunk_size(T: int, n: int, split: str) -> int:
    """T / (number of chunks), or a ValueError that says what to change."""
    chunks = n_chunks(n, split)
    if T % chunks:
        raise ValueError(
            f"sequence length {T} does not cut into {chunks} equal chunks ({split} split over a "
            f"context-parallel group of {n} ranks needs a multiple of {chunks}); choose a sequence "
            f"length (block_size) divisible by {chunks}, or another CP size"
        )
    return T // chunks


def chunk_ids(rank: int, n: int, split: str) -> list[int]:
    """The chunks rank ``rank`` holds, in the order it holds them (ascending)."""
    check_split(split)
    if split == "contiguous":
        return [rank]
    # BEGIN SOLUTION 7.4 "Two chunks per member, chosen so that every member does the same causal attention work." full="Zigzag: one early chunk and its mirror image from the end, [rank, 2n − 1 − rank]."
    return [rank, n_chunks(n, split) - 1 - rank]
    # END SOLUTION


def chunk_positions(i: int, c: int) -> numpy.ndarray:
    """The positions of chunk ``i`` when chunks hold ``c`` positions each."""
    return numpy.arange(i * c, (i + 1) * c)


def positions(T: int, rank: int, n: int, split: str) -> numpy.ndarray:
    """The global sequence positions rank ``rank`` of ``n`` holds (sorted int64 array of T/n)."""
    c = chunk_size(T, n, split)
    if split == "contiguous":
        return chunk_positions(rank, c)
    # BEGIN SOLUTION 7.4 "The sorted sequence positions covered by the chunks this member holds." full="Zigzag: chunk_positions of each of chunk_ids(rank, n, split), concatenated."
    return numpy.concatenate([chunk_positions(i, c) for i in chunk_ids(rank, n, split)])
    # END SOLUTION


def block_pairs(rank: int, src: int, n: int, split: str) -> list[tuple[int, int, bool]]:
    """The blocks rank ``rank``'s queries compute against the keys rank ``src`` holds.

    ``(i, j, diagonal)``: my i-th chunk of queries with the j-th chunk of ``src``'s keys; pairs
    where the key chunk comes after the query chunk are skipped (causal: all masked), and the
    diagonal (the same chunk) takes the causal mask.
    """
    mine, theirs = chunk_ids(rank, n, split), chunk_ids(src, n, split)
    return [(i, j, a == b) for i, a in enumerate(mine) for j, b in enumerate(theirs) if b <= a]


def attention_work(T: int, n: int, split: str) -> list[int]:
    """q·k products each rank computes for one (batch row, head) under the causal skips."""
    c = chunk_size(T, n, split)
    return [sum(c * c for src in range(n) for _ in block_pairs(r, src, n, split)) for r in range(n)]
