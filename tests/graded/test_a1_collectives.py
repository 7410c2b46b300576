"""Assignment 1 (collectives), graded. Run: ``python -m grader`` or ``mpirun -n 4 python -m pytest tests/graded``.

Every test runs a collective of ``impl.collectives`` (your ``assignments/a1_collectives.py``, or
the reference) and compares each rank's result with MPI's own collective on the same data. The
inputs -- seed, lengths, which ranks form the group -- are drawn when the test runs (all ranks
agree on them), so only a real implementation passes. Every run uses the whole world, a group of
3 ranks (not a power of two) and a random smaller group. To replay a run, set the seed the failure
message names: ``TINYTRAIN_GRADER_SEED=1234 python -m grader``.

MPI's result is computed *before* your code runs, with a deadline (``grader/mpi_reference.py``):
if your code fails on one rank only, that rank's message is the failure, in seconds.

Besides the values, the tests check what defines each algorithm, from the steps your generator
yields (``c.exchange``): a ring step sends one chunk to the right neighbour and receives one from
the left, n-1 steps per phase; a pairwise all-to-all step talks to one peer each way, every peer
once. Data are small integers stored as floats or ints, so sums are exact in any order and results
are compared exactly. A failure says which rank, which chunk and which index, in words. Besides
the drawn uneven splits, the uneven tests run fixed ones with empty pieces (every other rank's
piece empty; an all-to-all where one rank sends nothing and another receives nothing).
"""

from __future__ import annotations

import numpy as np
import pytest

from grader.config import is_release
from grader.mpi_reference import mpi
from grader.seeds import grading_seed
from tinytrain import distributed as dist
from tinytrain.distributed import algorithms as reference_algorithms
from tinytrain.distributed import work
from tinytrain.distributed._mpi import MPI
from tinytrain.distributed.chunks import ring_neighbours, split_counts

DTYPES = [np.float32, np.float64, np.int64]
# Big enough that each message exceeds MPI's eager limit: a rank that sends before it posts its
# receive then waits forever for its peer (which does the same): a deadlock, caught by the deadline.
LARGE = 1 << 19

# Three ranks are enough for everything here (a 3-rank world still has a ring, a tree and a
# non-power-of-two group); with more ranks every test uses all of them.
at_least_3_ranks = pytest.mark.world_size(3, at_least=True)


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
        """The whole world, a group of 3 ranks, a random group of 1 or 2 ranks; as (group or None,
        its world ranks). All groups are built before any of your code runs (building one waits
        for its members, which must not be stuck in a failed test)."""
        n = dist.get_world_size()
        choices = [list(range(n))]
        if n > 3:
            choices.append(sorted(int(x) for x in self.rng.choice(n, size=3, replace=False)))
        small = int(self.rng.integers(1, 3))
        choices.append(sorted(int(x) for x in self.rng.choice(n, size=small, replace=False)))
        built = [(dist.new_group(ranks), ranks) for ranks in choices]
        for g, ranks in built:
            yield (g if dist.get_rank() in ranks else None), ranks

    def data(self, shape, dtype, rank: int):
        """This rank's input: small integers (exact sums), different on every rank."""
        rng = np.random.default_rng([self.seed, rank, int(np.prod(shape))])
        return rng.integers(-50, 50, size=shape).astype(dtype)

    def where(self, ranks, length, dtype) -> str:
        return f"(length {length}, {np.dtype(dtype).name}, group of world ranks {ranks}; seed {self.seed})"


class Steps:
    """Records the peers of every step your algorithm yields: ``[(send peers, recv peers), ...]``
    per call, in group ranks."""

    def __init__(self, monkeypatch):
        self.log: list[tuple[list[int], list[int]]] = []
        original = work.Call.exchange

        def exchange(call, what, sends=(), recvs=()):
            self.log.append(([p for _, p in sends], [p for _, p in recvs]))
            return original(call, what, sends=sends, recvs=recvs)

        monkeypatch.setattr(work.Call, "exchange", exchange)

    def take(self) -> list[tuple[list[int], list[int]]]:
        steps, self.log[:] = list(self.log), []
        return steps


def expect_ring(steps, g, phases: int, what: str, context: str) -> None:
    """Each step: one chunk to the right neighbour, one from the left; n-1 steps per phase."""
    n, r = g.size, g.rank
    right, left = ring_neighbours(r, n)  # tests/distributed/test_standins.py checks it on fixed cases
    want = phases * (n - 1)
    rank = dist.get_rank()
    if want and not steps:
        raise AssertionError(
            f"rank {rank}: {what} yielded no c.exchange(...) step: write each ring step as one "
            f"`yield c.exchange(what, sends=[...], recvs=[...])` (messages sent any other way are neither "
            f"posted together nor counted) {context}"
        )
    if len(steps) != want:
        raise AssertionError(
            f"rank {rank}: {what} took {len(steps)} steps; a ring takes n-1 = {n - 1} steps per phase "
            f"({want} in all) {context}"
        )
    for k, (sends, recvs) in enumerate(steps, 1):
        if sends != [right] or recvs != [left]:
            raise AssertionError(
                f"rank {rank} (group rank {r}): step {k} of {what} sends to group ranks {sends} and receives "
                f"from {recvs}; in a ring every step sends one chunk to the right neighbour {right} and "
                f"receives one from the left neighbour {left} {context}"
            )


def with_empty_pieces(n: int) -> list[int]:
    """A fixed uneven split that every run checks besides the drawn one: every other rank's piece is
    empty (rank 0's among them), the others of different sizes."""
    return [0 if p % 2 == 0 else 3 + p for p in range(n)] if n > 1 else [0]


def nothing_from_rank_1_to_the_last(n: int) -> list[list[int]]:
    """A fixed all-to-all table (rows: senders) besides the drawn one: group rank 1 sends nothing,
    the last rank receives nothing, rank 0 sends to itself."""
    return [[0 if p == 1 or q == n - 1 else 2 + p + q for q in range(n)] for p in range(n)]


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
@at_least_3_ranks
def test_reduce_scatter_matches_mpi(impl, monkeypatch):
    case, steps = Case(), Steps(monkeypatch)
    for g, ranks in case.groups():
        lengths = case.lengths(2) + [LARGE // len(ranks)]
        for length, dtype in zip(lengths, DTYPES):
            if g is None:
                continue
            n = g.size
            counts = [length] * n  # equal pieces: piece p goes to rank p
            x = case.data(length * n, dtype, dist.get_rank())
            before = x.copy()
            expected = np.empty(length, dtype=dtype)
            mpi(g, "Reduce_scatter", x, expected, counts, op=MPI.SUM)
            steps.take()
            with dist.comm_stats() as stats:
                got = impl.collectives.reduce_scatter(x, group=g)
            context = case.where(ranks, length * n, dtype)
            expect_equal(got, expected, "reduce-scatter", context, chunk=g.rank)
            expect_equal(x, before, "reduce-scatter's input (it must stay unchanged)", context)
            expect_ring(steps.take(), g, 1, "reduce-scatter", context)
            expect_volume(stats, "reduce_scatter", (n - 1) * length * x.itemsize, "(n-1)/n of the buffer", context)


@pytest.mark.task("1.1")
@at_least_3_ranks
def test_reduce_scatter_uneven_pieces_and_max(impl, monkeypatch):
    case, steps = Case(), Steps(monkeypatch)
    for g, ranks in case.groups():
        drawn = case.lengths(len(ranks), low=0, high=40)  # drawn on every rank: the draws stay in step
        if g is None:
            continue
        for counts in (drawn, with_empty_pieces(len(ranks))):
            x = case.data(sum(counts), np.float64, dist.get_rank())
            expected = np.empty(counts[g.rank], dtype=np.float64)
            mpi(g, "Reduce_scatter", x, expected, counts, op=MPI.MAX)
            steps.take()
            got = impl.collectives.reduce_scatter(x, op="max", group=g, sizes=counts)
            context = case.where(ranks, sum(counts), np.float64)
            what = f"reduce-scatter (op=max, pieces of sizes {counts})"
            expect_equal(got, expected, what, context, chunk=g.rank)
            expect_ring(steps.take(), g, 1, what, context)


# --- 1.2 ring all-gather ---------------------------------------------------------------------------


@pytest.mark.task("1.2")
@at_least_3_ranks
def test_all_gather_matches_mpi(impl, monkeypatch):
    case, steps = Case(), Steps(monkeypatch)
    for g, ranks in case.groups():
        lengths = case.lengths(2) + [LARGE // len(ranks)]
        for length, dtype in zip(lengths, DTYPES):
            if g is None:
                continue
            n = g.size
            x = case.data(length, dtype, dist.get_rank())
            expected = np.empty(length * n, dtype=dtype)
            mpi(g, "Allgather", x, expected)
            steps.take()
            with dist.comm_stats() as stats:
                got = impl.collectives.all_gather(x, group=g)
            context = case.where(ranks, length, dtype)
            expect_equal(
                got, expected, "all-gather", context, counts=[length] * n, chunk_word="the piece of group rank"
            )
            expect_ring(steps.take(), g, 1, "all-gather", context)
            expect_volume(stats, "all_gather", (n - 1) * length * x.itemsize, "(n-1)/n of the gathered buffer", context)


@pytest.mark.task("1.2")
@at_least_3_ranks
def test_all_gather_uneven_pieces(impl, monkeypatch):
    case, steps = Case(), Steps(monkeypatch)
    for g, ranks in case.groups():
        drawn = case.lengths(len(ranks), low=0, high=40)  # drawn on every rank: the draws stay in step
        if g is None:
            continue
        for counts in (drawn, with_empty_pieces(len(ranks))):
            x = case.data((counts[g.rank], 3), np.int64, dist.get_rank())
            expected = np.empty((sum(counts), 3), dtype=np.int64)
            mpi(g, "Allgatherv", x, [expected, [3 * c for c in counts]])
            steps.take()
            got = impl.collectives.all_gather(x, group=g, sizes=counts)
            context = case.where(ranks, sum(counts), np.int64)
            what = f"all-gather (pieces of {counts} rows)"
            expect_equal(
                got, expected, what, context, counts=[3 * c for c in counts], chunk_word="the piece of group rank"
            )
            expect_ring(steps.take(), g, 1, what, context)


# --- 1.3 all-reduce composed of the two ------------------------------------------------------------


@pytest.mark.task("1.3")
@at_least_3_ranks
def test_ring_all_reduce_matches_mpi_and_is_composed(impl, monkeypatch):
    """Grades the composition: the two phases it calls are the reference's where the reference is
    there (so a bug in 1.1 or 1.2 costs those tasks, not this one); a student copy has only yours."""
    mod = impl.collectives
    phases = mod if is_release() else reference_algorithms
    calls = {"_ring_reduce_scatter": 0, "_ring_all_gather": 0}
    for name in calls:
        original = getattr(phases, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(mod, name, counted)
    case, steps = Case(), Steps(monkeypatch)
    for g, ranks in case.groups():
        # Lengths not divisible by the group size (one that may be, too): chunks of split_counts sizes.
        lengths = case.lengths(2) + [LARGE + int(case.rng.integers(0, 3))]
        if len(ranks) > 1 and lengths[0] % len(ranks) == 0:
            lengths[0] += 1  # at least one length leaves a remainder (random ones all divided: CI once)
        for length, dtype in zip(lengths, DTYPES):
            if g is None:
                continue
            n = g.size
            x = case.data(length, dtype, dist.get_rank())
            expected = np.empty_like(x)
            mpi(g, "Allreduce", x, expected, op=MPI.SUM)
            before = dict(calls)
            steps.take()
            with dist.comm_stats() as stats:
                got = mod.all_reduce(x, group=g, algo="ring")
            counts = split_counts(length, n)
            context = case.where(ranks, length, dtype) + f", chunks of {sorted(set(counts))} elements"
            expect_equal(got, expected, "all-reduce", context, counts=counts)
            if n > 1 and (
                calls["_ring_reduce_scatter"] == before["_ring_reduce_scatter"]
                or calls["_ring_all_gather"] == before["_ring_all_gather"]
            ):
                raise AssertionError(
                    f"rank {dist.get_rank()}: the ring all-reduce must call _ring_reduce_scatter "
                    f"and then _ring_all_gather (calls: {calls}) {context}"
                )
            expect_ring(steps.take(), g, 2, "ring all-reduce (reduce-scatter, then all-gather)", context)
            # Every chunk but one in each phase, whichever two chunks this rank skips.
            skipped = {counts[a] + counts[b] for a in range(n) for b in range(n) if a != b} or {0}
            volumes = {(2 * length - k) * x.itemsize for k in skipped} if n > 1 else {0}
            if stats.sent("all_reduce") not in volumes:
                expect_volume(
                    stats,
                    "all_reduce",
                    (2 * length - 2 * max(counts)) * x.itemsize,
                    "every chunk but one in each of the two phases (about 2(n-1)/n of the buffer)",
                    context,
                )


# --- 1.4 all-to-all --------------------------------------------------------------------------------


def expect_pairwise(steps, g, what: str, context: str, rounds=(1,)) -> None:
    """n-1 steps per round; in each one message to one peer and one from one peer; every other
    rank once each way per round. (An all-to-all of unknown sizes may first exchange the sizes in
    a round of its own: ``rounds=(1, 2)``.)"""
    n, rank = g.size, dist.get_rank()
    shown = [(s, r) for s, r in steps]
    if n == 1 and not steps:
        return
    if len(steps) not in [k * (n - 1) for k in rounds] or any(len(s) != 1 or len(r) != 1 for s, r in steps):
        raise AssertionError(
            f"rank {rank}: {what} took the steps (send to, receive from) {shown}; a pairwise exchange "
            f"takes n-1 = {n - 1} steps, each sending to one peer and receiving from one {context}"
        )
    others = sorted(set(range(n)) - {g.rank})
    for k in range(0, len(steps), n - 1):
        round_ = steps[k : k + n - 1]
        if sorted(s[0] for s, _ in round_) != others or sorted(r[0] for _, r in round_) != others:
            raise AssertionError(
                f"rank {rank}: {what} took the steps (send to, receive from) {shown}; over n-1 steps each "
                f"other group rank {others} must be sent to once and received from once {context}"
            )


@pytest.mark.task("1.4")
@at_least_3_ranks
def test_all_to_all_matches_mpi(impl, monkeypatch):
    case, steps = Case(), Steps(monkeypatch)
    for g, ranks in case.groups():
        for length, dtype in zip(case.lengths(2) + [LARGE // len(ranks)], DTYPES):
            if g is None:
                continue
            n = g.size
            x = case.data(length * n, dtype, dist.get_rank())
            expected = np.empty_like(x)
            mpi(g, "Alltoall", x, expected)
            steps.take()
            with dist.comm_stats() as stats:
                got = impl.collectives.all_to_all(x, group=g)
            context = case.where(ranks, length * n, dtype)
            expect_equal(
                got,
                expected,
                "all-to-all",
                context,
                counts=[length] * n,
                chunk_word="the block received from group rank",
            )
            expect_pairwise(steps.take(), g, "all-to-all", context)
            expect_volume(stats, "all_to_all", (n - 1) * length * x.itemsize, "every block but your own", context)


@pytest.mark.task("1.4")
@at_least_3_ranks
def test_all_to_all_uneven_splits(impl, monkeypatch):
    case, steps = Case(), Steps(monkeypatch)
    for g, ranks in case.groups():
        if g is None:
            continue
        n = g.size
        # Every rank draws the whole n x n matrix of row counts, so it knows what it receives too.
        drawn = np.random.default_rng([case.seed, n]).integers(0, 20, size=(n, n))
        for table in (drawn, np.array(nothing_from_rank_1_to_the_last(n))):
            send, recv = [int(c) for c in table[g.rank]], [int(c) for c in table[:, g.rank]]
            x = case.data((sum(send), 2), np.float32, dist.get_rank())
            expected = np.empty((sum(recv), 2), dtype=np.float32)
            sdispl, rdispl = np.cumsum([0] + send[:-1]) * 2, np.cumsum([0] + recv[:-1]) * 2
            mpi(g, "Alltoallv", [x, ([2 * c for c in send], sdispl)], [expected, ([2 * c for c in recv], rdispl)])
            steps.take()
            got = impl.collectives.all_to_all(x, send_sizes=send, group=g)
            context = case.where(ranks, sum(send), np.float32)
            what = f"all-to-all (send_sizes {send}, rows sizes[src][dst] {table.tolist()})"
            expect_equal(
                got,
                expected,
                what,
                context,
                counts=[2 * c for c in recv],
                chunk_word="the block received from group rank",
            )
            expect_pairwise(steps.take(), g, what, context, rounds=(1, 2))


# --- 1.5 broadcast ---------------------------------------------------------------------------------


@pytest.mark.task("1.5")
@at_least_3_ranks
def test_tree_broadcast_matches_mpi_from_every_root(impl):
    case = Case()
    for g, ranks in case.groups():
        for length, dtype in zip(case.lengths(2) + [LARGE], DTYPES):
            if g is None:
                continue
            for root in range(g.size):
                x = case.data(length, dtype, dist.get_rank())
                expected = x.copy()
                mpi(g, "Bcast", expected, root=root)
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


class _AloneCall:
    """A stand-in for ``c`` with no MPI behind it: records the steps a generator yields for one
    rank of a group of any size (a 13-rank tree on a 4-rank machine)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size, self.steps = rank, size, []

    def exchange(self, what, sends=(), recvs=()):
        self.steps.append(([(buf, p) for buf, p in sends], [(buf, p) for buf, p in recvs]))
        return self.steps[-1]

    def scratch(self, count, like):
        return np.empty(count, dtype=like.dtype)


def rounds_needed(children: dict[int, list[int]], v: int) -> int:
    """Rounds until v's subtree holds the data when a rank sends one message per round, its
    children in the best order (the largest-finishing subtree first): the telephone model."""
    below = sorted((rounds_needed(children, k) for k in children.get(v, [])), reverse=True)
    return max((i + 1 + t for i, t in enumerate(below)), default=0)


@pytest.mark.task("1.5")
def test_tree_broadcast_shape_on_groups_up_to_16_ranks(impl):
    """Each rank's steps, driven without MPI: every rank but the root receives once, from one
    peer, before it sends; the messages form one tree over the group; the root sends ceil(log2 n)
    times and the tree reaches every rank in ceil(log2 n) rounds (the least any broadcast can)."""
    case = Case()
    for n in (2, 3, 5, 6, 7, 8, 11, 13, int(case.rng.integers(9, 17))):
        rounds = (n - 1).bit_length()
        for root in sorted({0, 1, n - 1, n // 2, int(case.rng.integers(0, n))}):
            context = f"(driving _broadcast_tree alone: group of {n} ranks, root {root}; seed {case.seed})"
            parent, children = {}, {}
            for r in range(n):
                c, flat = _AloneCall(r, n), np.zeros(5)
                for _ in impl.collectives._broadcast_tree(c, flat, root):
                    pass
                sent = [p for sends, _ in c.steps for buf, p in sends]
                got = [(i, p) for i, (_, recvs) in enumerate(c.steps) for buf, p in recvs]
                if any(buf is not flat for s, rv in c.steps for buf, _ in (*s, *rv)):
                    raise AssertionError(f"rank {r}: every message must be flat itself, in place {context}")
                if r == root:
                    if got:
                        raise AssertionError(f"rank {r}: the root received from {[p for _, p in got]} {context}")
                elif len(got) != 1:
                    raise AssertionError(
                        f"rank {r}: received {len(got)} messages (from {[p for _, p in got]}); every rank "
                        f"but the root receives the buffer exactly once {context}"
                    )
                else:
                    first_send = min((i for i, (s, _) in enumerate(c.steps) if s), default=len(c.steps))
                    if got[0][0] > first_send:
                        raise AssertionError(f"rank {r} sends before it has received the data {context}")
                    parent[r] = got[0][1]
                children[r] = sent
            for r, kids in children.items():
                for k in kids:
                    if parent.get(k) != r:
                        raise AssertionError(
                            f"rank {r} sends to rank {k}, which receives from {parent.get(k, 'nobody')} {context}"
                        )
            if len(children[root]) != rounds:
                raise AssertionError(
                    f"the root of a binomial-tree broadcast sends ceil(log2 n) = {rounds} messages, this "
                    f"one sent {len(children[root])} (to {children[root]}) {context}"
                )
            reached, todo = {root}, [root]
            while todo:
                for k in children[todo.pop()]:
                    if k not in reached:
                        reached.add(k)
                        todo.append(k)
            if reached != set(range(n)):
                raise AssertionError(f"the messages never reach ranks {sorted(set(range(n)) - reached)} {context}")
            if rounds_needed(children, root) > rounds:
                raise AssertionError(
                    f"the tree (parents {dict(sorted(parent.items()))}) needs {rounds_needed(children, root)} "
                    f"rounds of one message per rank; a binomial tree needs ceil(log2 n) = {rounds} {context}"
                )
