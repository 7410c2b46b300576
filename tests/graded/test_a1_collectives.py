"""Assignment 1 (collectives), graded. Run: ``python -m grader`` or ``mpirun -n 4 python -m pytest tests/graded``.

Every test runs a collective of ``impl.collectives`` (your ``assignments/a1_collectives.py``, or
the reference) and compares each rank's result with MPI's own collective on the same data. The
inputs -- seed, lengths, which ranks form the group -- are drawn when the test runs (all ranks
agree on them), so only a real implementation passes. To replay a run, set the seed the failure
message names: ``TINYTRAIN_GRADER_SEED=1234 python -m grader``.

Data are small integers stored as floats or ints, so sums are exact in any order and results are
compared exactly. A failure says which rank, which chunk and which index, in words.
"""

from __future__ import annotations

import numpy as np
import pytest

from grader.seeds import grading_seed
from tinytrain import distributed as dist
from tinytrain.distributed._mpi import MPI

DTYPES = [np.float32, np.float64, np.int64]
# Big enough that each message exceeds MPI's eager limit: a rank that sends before it posts its
# receive then waits forever for its peer (which does the same): a deadlock, caught by the deadline.
LARGE = 1 << 19


def shared_seed() -> int:
    return grading_seed()


class Case:
    """The shared random choices of one test: a generator every rank draws identically, the seed."""

    def __init__(self):
        self.seed = shared_seed()
        self.rng = np.random.default_rng(self.seed)  # same draws on every rank

    def lengths(self, k: int, low: int = 1, high: int = 3000) -> list[int]:
        return [int(x) for x in self.rng.integers(low, high, size=k)]

    def groups(self):
        """The whole world, then one random subset of ranks; yields (group or None, its world ranks)."""
        n = dist.get_world_size()
        size = int(self.rng.integers(1, n + 1))
        subset = sorted(int(x) for x in self.rng.choice(n, size=size, replace=False))
        for ranks in (list(range(n)), subset):
            g = dist.new_group(ranks)
            yield (g if dist.get_rank() in ranks else None), ranks

    def data(self, shape, dtype, rank: int):
        """This rank's input: small integers (exact sums), different on every rank."""
        rng = np.random.default_rng([self.seed, rank, int(np.prod(shape))])
        return rng.integers(-50, 50, size=shape).astype(dtype)

    def where(self, ranks, length, dtype) -> str:
        return f"(length {length}, {np.dtype(dtype).name}, group of world ranks {ranks}; seed {self.seed})"


def first_difference(got, expected) -> int | None:
    bad = np.flatnonzero(np.asarray(got).reshape(-1) != np.asarray(expected).reshape(-1))
    return int(bad[0]) if bad.size else None


def chunk_of(index: int, counts: list[int]) -> tuple[int, int]:
    """(chunk number, index inside that chunk) of flat ``index`` for chunks of ``counts`` elements."""
    start = 0
    for c, n in enumerate(counts):
        if index < start + n:
            return c, index - start
        start += n
    return len(counts), index - start


def expect_equal(
    got,
    expected,
    what: str,
    context: str,
    counts: list[int] | None = None,
    chunk_word="chunk",
    chunk: int | None = None,
):
    """Assert equality; otherwise say which rank, chunk and index differ, and the values."""
    rank = dist.get_rank()
    if got is None or np.shape(got) != np.shape(expected):
        raise AssertionError(
            f"rank {rank}: {what} returned shape {np.shape(got)}, expected {np.shape(expected)} {context}"
        )
    i = first_difference(got, expected)
    if i is None:
        return
    g, e = np.asarray(got).reshape(-1)[i].item(), np.asarray(expected).reshape(-1)[i].item()
    where = f"differs at index {i}"
    if chunk is not None:  # the whole result is one chunk of a bigger buffer
        where = f"{chunk_word} {chunk} of the {what} {where}"
    elif counts is not None:
        c, j = chunk_of(i, counts)
        where = f"{chunk_word} {c} of the {what} differs at index {j}"
    else:
        where = f"the {what} {where}"
    raise AssertionError(f"rank {rank}: {where}: got {g!r}, expected {e!r} {context}")


def expect_volume(stats, op: str, expected_bytes: int, formula: str, context: str):
    sent = stats.sent(op)
    if sent != expected_bytes:
        raise AssertionError(
            f"rank {dist.get_rank()}: {op} sent {sent} bytes, but the algorithm sends {formula} = "
            f"{expected_bytes} bytes {context}. Send each chunk once per step, nothing more."
        )


# --- 1.1 ring reduce-scatter -----------------------------------------------------------------------


@pytest.mark.task("1.1")
@pytest.mark.world_size(4)
def test_reduce_scatter_matches_mpi(impl):
    case = Case()
    for g, ranks in case.groups():
        lengths = case.lengths(2) + [LARGE // len(ranks)]
        for length, dtype in zip(lengths, DTYPES):
            if g is None:
                continue
            n = g.size
            counts = [length] * n  # equal pieces: piece p goes to rank p
            x = case.data(length * n, dtype, dist.get_rank())
            before = x.copy()
            with dist.comm_stats() as stats:
                got = impl.collectives.reduce_scatter(x, group=g)
            expected = np.empty(length, dtype=dtype)
            g.comm.Reduce_scatter(x, expected, counts, op=MPI.SUM)
            context = case.where(ranks, length * n, dtype)
            expect_equal(got, expected, "reduce-scatter", context, chunk=g.rank)
            expect_equal(x, before, "reduce-scatter's input (it must stay unchanged)", context)
            expect_volume(stats, "reduce_scatter", (n - 1) * length * x.itemsize, "(n-1)/n of the buffer", context)


@pytest.mark.task("1.1")
@pytest.mark.world_size(4)
def test_reduce_scatter_uneven_pieces_and_max(impl):
    case = Case()
    for g, ranks in case.groups():
        if g is None:
            continue
        n = g.size
        counts = case.lengths(n, low=0, high=40)
        x = case.data(sum(counts), np.float64, dist.get_rank())
        got = impl.collectives.reduce_scatter(x, op="max", group=g, sizes=counts)
        expected = np.empty(counts[g.rank], dtype=np.float64)
        g.comm.Reduce_scatter(x, expected, counts, op=MPI.MAX)
        expect_equal(
            got,
            expected,
            f"reduce-scatter (op=max, pieces of sizes {counts})",
            case.where(ranks, sum(counts), np.float64),
            chunk=g.rank,
        )


# --- 1.2 ring all-gather ---------------------------------------------------------------------------


@pytest.mark.task("1.2")
@pytest.mark.world_size(4)
def test_all_gather_matches_mpi(impl):
    case = Case()
    for g, ranks in case.groups():
        lengths = case.lengths(2) + [LARGE // len(ranks)]
        for length, dtype in zip(lengths, DTYPES):
            if g is None:
                continue
            n = g.size
            x = case.data(length, dtype, dist.get_rank())
            with dist.comm_stats() as stats:
                got = impl.collectives.all_gather(x, group=g)
            expected = np.empty(length * n, dtype=dtype)
            g.comm.Allgather(x, expected)
            context = case.where(ranks, length, dtype)
            expect_equal(
                got, expected, "all-gather", context, counts=[length] * n, chunk_word="the piece of group rank"
            )
            expect_volume(stats, "all_gather", (n - 1) * length * x.itemsize, "(n-1)/n of the gathered buffer", context)


@pytest.mark.task("1.2")
@pytest.mark.world_size(4)
def test_all_gather_uneven_pieces(impl):
    case = Case()
    for g, ranks in case.groups():
        if g is None:
            continue
        counts = case.lengths(g.size, low=0, high=40)
        x = case.data((counts[g.rank], 3), np.int64, dist.get_rank())
        got = impl.collectives.all_gather(x, group=g, sizes=counts)
        expected = np.empty((sum(counts), 3), dtype=np.int64)
        g.comm.Allgatherv(x, [expected, [3 * c for c in counts]])
        expect_equal(
            got,
            expected,
            f"all-gather (pieces of {counts} rows)",
            case.where(ranks, sum(counts), np.int64),
            counts=[3 * c for c in counts],
            chunk_word="the piece of group rank",
        )


# --- 1.3 all-reduce composed of the two ------------------------------------------------------------


@pytest.mark.task("1.3")
@pytest.mark.world_size(4)
def test_ring_all_reduce_matches_mpi_and_is_composed(impl, monkeypatch):
    mod = impl.collectives
    calls = {"_ring_reduce_scatter": 0, "_ring_all_gather": 0}
    for name in calls:
        original = getattr(mod, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(mod, name, counted)
    case = Case()
    for g, ranks in case.groups():
        for length, dtype in zip(case.lengths(2) + [LARGE], DTYPES):
            if g is None:
                continue
            n = g.size
            length -= length % n  # divisible, so the textbook volume holds exactly
            x = case.data(length, dtype, dist.get_rank())
            expected = np.empty_like(x)
            g.comm.Allreduce(x, expected, op=MPI.SUM)
            before = dict(calls)
            with dist.comm_stats() as stats:
                got = mod.all_reduce(x, group=g, algo="ring")
            context = case.where(ranks, length, dtype)
            expect_equal(got, expected, "all-reduce", context, counts=list(mod.split_counts(length, n)))
            if n > 1 and (
                calls["_ring_reduce_scatter"] == before["_ring_reduce_scatter"]
                or calls["_ring_all_gather"] == before["_ring_all_gather"]
            ):
                raise AssertionError(
                    f"rank {dist.get_rank()}: the ring all-reduce must call _ring_reduce_scatter "
                    f"and then _ring_all_gather (calls: {calls}) {context}"
                )
            expect_volume(
                stats, "all_reduce", 2 * (n - 1) * (length // n) * x.itemsize, "2(n-1)/n of the buffer", context
            )


# --- 1.4 all-to-all --------------------------------------------------------------------------------


@pytest.mark.task("1.4")
@pytest.mark.world_size(4)
def test_all_to_all_matches_mpi(impl):
    case = Case()
    for g, ranks in case.groups():
        for length, dtype in zip(case.lengths(2) + [LARGE // len(ranks)], DTYPES):
            if g is None:
                continue
            n = g.size
            x = case.data(length * n, dtype, dist.get_rank())
            with dist.comm_stats() as stats:
                got = impl.collectives.all_to_all(x, group=g)
            expected = np.empty_like(x)
            g.comm.Alltoall(x, expected)
            context = case.where(ranks, length * n, dtype)
            expect_equal(
                got,
                expected,
                "all-to-all",
                context,
                counts=[length] * n,
                chunk_word="the block received from group rank",
            )
            expect_volume(stats, "all_to_all", (n - 1) * length * x.itemsize, "every block but your own", context)


@pytest.mark.task("1.4")
@pytest.mark.world_size(4)
def test_all_to_all_uneven_splits(impl):
    case = Case()
    for g, ranks in case.groups():
        if g is None:
            continue
        n = g.size
        # Every rank draws the whole n x n matrix of row counts, so it knows what it receives too.
        table = np.random.default_rng([case.seed, n]).integers(0, 20, size=(n, n))
        send, recv = [int(c) for c in table[g.rank]], [int(c) for c in table[:, g.rank]]
        x = case.data((sum(send), 2), np.float32, dist.get_rank())
        got = impl.collectives.all_to_all(x, send_sizes=send, group=g)
        expected = np.empty((sum(recv), 2), dtype=np.float32)
        sdispl, rdispl = np.cumsum([0] + send[:-1]) * 2, np.cumsum([0] + recv[:-1]) * 2
        g.comm.Alltoallv([x, ([2 * c for c in send], sdispl)], [expected, ([2 * c for c in recv], rdispl)])
        expect_equal(
            got,
            expected,
            f"all-to-all (send_sizes {send})",
            case.where(ranks, sum(send), np.float32),
            counts=[2 * c for c in recv],
            chunk_word="the block received from group rank",
        )


# --- 1.5 broadcast ---------------------------------------------------------------------------------


@pytest.mark.task("1.5")
@pytest.mark.world_size(4)
def test_tree_broadcast_matches_mpi_from_every_root(impl):
    case = Case()
    for g, ranks in case.groups():
        for length, dtype in zip(case.lengths(2) + [LARGE], DTYPES):
            if g is None:
                continue
            for root in range(g.size):
                x = case.data(length, dtype, dist.get_rank())
                expected = x.copy()
                g.comm.Bcast(expected, root=root)
                with dist.comm_stats() as stats:
                    got = impl.collectives.broadcast(x, src=root, group=g, algo="tree")
                context = case.where(ranks, length, dtype) + f", root {root}"
                expect_equal(got, expected, "broadcast copy", context)
                expect_equal(x, expected, "broadcast (in place: x itself must hold the result)", context)
                messages, want_messages = stats.messages("broadcast"), (g.size - 1).bit_length()
                if g.rank == root and messages != want_messages:
                    raise AssertionError(
                        f"rank {dist.get_rank()}: the root of a binomial-tree broadcast sends "
                        f"ceil(log2 n) = {want_messages} messages, this one sent {messages} {context}"
                    )
                received = stats.recv("broadcast")
                want = 0 if g.rank == root else x.nbytes
                if received != want:
                    raise AssertionError(
                        f"rank {dist.get_rank()}: broadcast received {received} bytes; in a tree "
                        f"every rank but the root receives the buffer exactly once ({want} bytes) {context}"
                    )
