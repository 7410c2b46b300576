"""Assignment 10 (elastic training), graded. Run: ``python -m grader --tasks 10.1``.

``layout_for(available, train_args)`` is checked against the rules of the handout, never against a
stored answer of the reference: every layout it returns must keep a replica's ``tp·pp·cp·ep``
ranks, use no more ranks than there are, split the global batch evenly over ``dp × ep`` and, with a
pipeline, over its micro-batches, hold no more rows per micro-batch than the launch did, and be a
count of micro-batches its schedule plays; and no layout with more replicas (nor, for as many
replicas, fewer micro-batches) may keep the same rules. The test finds that best layout by trying
every count of replicas and of micro-batches, which is slow and plain and so easy to trust.

The schedule is the test's own: ``schedule_takes`` of your file is replaced, for the test, by one
that plays any count (GPipe, 1F1B, ZB) or a multiple of ``--pp`` (interleaved 1F1B), as
tinytrain's schedules do, or, in one case, by a schedule that plays multiples of 3 only: your code
must ask it, not know the rule. So 10.1 grades alone, whatever is done of assignment 5.

Fixed hard cases besides drawn launches: a remainder rank (7 ranks, ``--tp 2``), a batch that 3
replicas do not split, ``--ep 2``, a pipeline replica that needs more micro-batches after
shrinking, growth (more ranks than the launch had, with and without a pipeline), a micro-batch
bound that the first count above it misses (10 rows, at most 4), interleaved 1F1B needing a
multiple of ``--pp`` (down to one replica when 2 have no such count), exactly one replica, and the
refusals (a world below one replica names the smallest world; a batch that no count splits).

Seeds are drawn at run time; replay with ``TINYTRAIN_GRADER_SEED=<seed>``.
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from grader.seeds import grading_seed
from tinytrain.trainer.args import add_arguments

_PARSER = argparse.ArgumentParser()
add_arguments(_PARSER)


def launch(flags: str):
    """``tinytrain train``'s options, as the agent hands them to ``layout_for``."""
    return _PARSER.parse_args(flags.split())


def tinytrains_schedules(train_args, microbatches: int) -> bool:
    """Which counts tinytrain's schedules play: interleaved 1F1B multiples of --pp, the others any."""
    assert isinstance(microbatches, (int, np.integer)) and not isinstance(microbatches, bool), (
        f"schedule_takes was asked about {microbatches!r}: it takes a whole number of micro-batches"
    )
    if microbatches < 1:
        return False
    return train_args.schedule != "interleaved" or microbatches % train_args.pp == 0


def multiples_of_3(train_args, microbatches: int) -> bool:
    return tinytrains_schedules(train_args, microbatches) and microbatches % 3 == 0


@pytest.fixture
def elastic(impl, monkeypatch):
    """Your file, with the test's schedule in place of ``schedule_takes`` (see the docstring)."""
    monkeypatch.setattr(impl.elastic, "schedule_takes", tinytrains_schedules)
    return impl.elastic


def launched_rows(a) -> int:
    """The rows of one micro-batch of the launch's own layout (rounded down: only the refused cases
    have a batch that the launch's layout does not split)."""
    at_launch = a.microbatches or 2 * a.pp
    return a.batch_size // a.ep // a.dp // at_launch


def keeps_the_rules(available: int, a, dp: int, m: int, plays) -> str | None:
    """Why (dp, m) breaks a rule of the handout for ``available`` ranks, or None if it keeps them all."""
    replica = a.tp * a.pp * a.cp * a.ep
    if dp < 1 or m < 1:
        return f"--dp {dp} with {m} micro-batch(es) is not a layout: both must be at least 1"
    if dp * replica > available:
        return f"it uses {dp} × {replica} = {dp * replica} ranks, more than the {available} available"
    if a.pp == 1 and m != 1:
        return f"without a pipeline a replica takes its rows at once (microbatches 1), not in {m}"
    pieces = dp * a.ep * m
    if a.batch_size % pieces:
        return (
            f"the global batch of {a.batch_size} rows does not split evenly over {dp} replica(s) × {a.ep} expert "
            f"rank(s){f' × {m} micro-batches' if a.pp > 1 else ''}"
        )
    if a.pp > 1 and a.batch_size // pieces > launched_rows(a):
        return (
            f"its micro-batches hold {a.batch_size // pieces} rows each, more than the launch's "
            f"{launched_rows(a)}: a replica given more rows must run more micro-batches, not bigger ones"
        )
    if a.pp > 1 and not plays(a, m):
        return f"the schedule ({a.schedule}, --pp {a.pp}) does not play {m} micro-batches (ask schedule_takes)"
    return None


def best(available: int, a, plays) -> tuple[int, int] | None:
    """The layout of the handout by trying every one: the most replicas, then the fewest micro-batches."""
    found = [
        (dp, m)
        for dp in range(1, available + 1)
        for m in (range(1, a.batch_size + 1) if a.pp > 1 else [1])
        if keeps_the_rules(available, a, dp, m, plays) is None
    ]
    return max(found, key=lambda layout: (layout[0], -layout[1])) if found else None


def check(elastic, available: int, flags: str, plays=tinytrains_schedules, why: str = "") -> None:
    a = launch(flags)
    what = f"layout_for({available}, `{flags}`){f' ({why})' if why else ''}"
    want = best(available, a, plays)
    if want is None:
        with pytest.raises(ValueError):
            got = elastic.layout_for(available, a)
            raise AssertionError(
                f"{what}: returned --dp {got.dp} with {got.microbatches} micro-batch(es), but no layout keeps the "
                "rules there: it must refuse (ValueError)"
            )
        return
    try:
        got = elastic.layout_for(available, a)
    except ValueError as exc:
        raise AssertionError(
            f"{what}: refused ({exc}), but --dp {want[0]} with {want[1]} micro-batch(es) keeps every rule"
        ) from None
    assert type(got).__name__ == "Layout", f"{what}: returned a {type(got).__name__}; it returns a Layout"
    for field in ("dp", "fixed", "microbatches"):
        value = getattr(got, field)
        assert isinstance(value, (int, np.integer)) and not isinstance(value, bool), (
            f"{what}: Layout.{field} is {value!r}; it is a whole number"
        )
    replica = a.tp * a.pp * a.cp * a.ep
    assert got.fixed == replica, (
        f"{what}: Layout.fixed is {got.fixed}; a replica keeps its --tp × --pp × --cp × --ep = {replica} ranks"
    )
    broken = keeps_the_rules(available, a, got.dp, got.microbatches, plays)
    assert broken is None, f"{what}: returned --dp {got.dp} with {got.microbatches} micro-batch(es): {broken}"
    assert got.dp >= want[0], (
        f"{what}: returned --dp {got.dp}, but {want[0]} replicas fit and keep the rules: fewer replicas than fit "
        f"(with {want[1]} micro-batch(es))"
    )
    assert got.microbatches <= want[1], (
        f"{what}: returned --dp {got.dp} with {got.microbatches} micro-batches, but fewer micro-batches "
        f"({want[1]}) would do: the fewest that keep the rules"
    )


# Each case: ranks available, the launch's options, why it is hard.
CASES = {
    "remainder-rank": (7, "--tp 2 --dp 3 --batch-size 12", "3 replicas of 2 ranks fit 7: one rank stays idle"),
    "3-replicas-do-not-split-the-batch": (3, "--dp 4 --batch-size 8", "8 rows over 3 replicas do not split"),
    "expert-parallel": (8, "--ep 2 --dp 4 --batch-size 16", "a replica's 2 expert ranks take rows of their own"),
    "expert-parallel-remainder": (8, "--ep 2 --dp 2 --batch-size 12", "4 replicas × 2 expert ranks do not split 12"),
    "pipeline-shrinks": (4, "--pp 2 --dp 3 --batch-size 24", "12 rows a replica, at most 2 a micro-batch"),
    "pipeline-shrinks-to-one": (3, "--pp 2 --dp 2 --microbatches 2 --batch-size 8", "8 rows in micro-batches of 2"),
    "growth": (8, "--dp 2 --batch-size 16", "more ranks than the launch: more replicas"),
    "pipeline-growth": (4, "--pp 2 --dp 1 --microbatches 4 --batch-size 8", "4 rows a replica, at most 2 each"),
    "pipeline-growth-to-one-micro-batch": (4, "--pp 2 --dp 1 --microbatches 2 --batch-size 8", "4 rows fit in one"),
    "bound-missed-by-the-first-count": (
        6, "--pp 2 --dp 1 --microbatches 4 --batch-size 12", "4 rows a replica, at most 3 each: 3 does not divide 4"
    ),
    "bound-missed-twice": (
        4, "--pp 2 --dp 1 --microbatches 5 --batch-size 20", "10 rows, at most 4 each: 3 and 4 do not divide 10"
    ),
    "interleaved-needs-a-multiple-of-pp": (
        4, "--pp 2 --dp 3 --microbatches 2 --schedule interleaved --chunks 2 --batch-size 24",
        "12 rows, at most 4 each: 3 micro-batches would do, but interleaved 1F1B plays multiples of 2",
    ),
    "interleaved-drops-a-replica": (
        4, "--pp 2 --dp 3 --microbatches 2 --schedule interleaved --chunks 2 --batch-size 18",
        "2 replicas' 9 rows have no even count of micro-batches: one replica",
    ),
    "exactly-one-replica": (4, "--tp 2 --pp 2 --dp 2 --batch-size 8", "4 ranks are one replica of --tp 2 --pp 2"),
    "one-replica-and-a-spare": (5, "--tp 2 --cp 2 --dp 2 --batch-size 6", "5 ranks hold one replica of 4"),
    "zb-h1": (6, "--pp 2 --dp 4 --schedule zb-h1 --batch-size 32", "3 replicas do not split 32; 2 do"),
}  # fmt: skip


@pytest.mark.task("10.1")
@pytest.mark.parametrize("case", list(CASES))
def test_the_layout_of_the_ranks_left_in_the_hard_cases(elastic, case):
    available, flags, why = CASES[case]
    check(elastic, available, flags, why=why)


@pytest.mark.task("10.1")
def test_a_pipeline_replica_asks_its_schedule_which_counts_it_plays(impl, monkeypatch):
    """A schedule of the test's own, which plays multiples of 3 only: 12 rows a replica in at most
    6 a micro-batch would be 2 micro-batches, and this schedule makes it 3."""
    rng = np.random.default_rng(grading_seed())
    monkeypatch.setattr(impl.elastic, "schedule_takes", multiples_of_3)
    check(impl.elastic, 4, "--pp 2 --dp 2 --microbatches 2 --batch-size 24", plays=multiples_of_3,
          why="a schedule that plays multiples of 3 only")  # fmt: skip
    check(impl.elastic, 8, "--pp 2 --dp 2 --microbatches 3 --batch-size 24", plays=multiples_of_3,
          why="a schedule that plays multiples of 3 only, 4 replicas of 6 rows")  # fmt: skip
    for _ in range(30):
        available, flags = drawn_launch(rng, pipeline=True)
        check(impl.elastic, available, flags, plays=multiples_of_3, why="a drawn launch, a schedule of multiples of 3")


@pytest.mark.task("10.1")
@pytest.mark.parametrize(
    "available, flags, why",
    [
        (4, "--ep 2 --dp 2 --batch-size 7", "7 rows split over no count of replicas × 2 expert ranks"),
        (6, "--pp 2 --dp 3 --microbatches 2 --schedule interleaved --chunks 2 --batch-size 9",
         "9 rows have no even count of micro-batches, and interleaved 1F1B plays multiples of 2"),
    ],
    ids=["odd-batch-over-expert-ranks", "odd-batch-interleaved"],
)  # fmt: skip
def test_a_batch_that_no_layout_splits_is_refused(elastic, available, flags, why):
    rng = np.random.default_rng(grading_seed())
    check(elastic, available, flags, why=why)
    # and drawn ones: an odd batch over 2 expert ranks
    batch, tp = 2 * int(rng.integers(0, 20)) + 1, int(rng.choice([1, 2]))
    drawn = f"--tp {tp} --ep 2 --dp {int(rng.integers(1, 5))} --batch-size {batch}"
    check(elastic, int(rng.integers(2 * tp, 16 * tp)), drawn, why="a drawn odd batch over 2 expert ranks")


@pytest.mark.task("10.1")
def test_a_world_below_one_replica_is_refused_naming_the_smallest_world(elastic):
    check(elastic, 4, "--tp 2 --pp 2 --dp 2 --batch-size 8", why="first, a world that holds one replica")
    for available, flags, smallest in ((3, "--tp 2 --pp 2 --dp 1 --batch-size 8", 4),
                                       (7, "--tp 2 --cp 2 --ep 2 --dp 1 --batch-size 8", 8)):  # fmt: skip
        with pytest.raises(ValueError, match=f"smallest world that would do is {smallest}"):
            elastic.layout_for(available, launch(flags))


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def drawn_launch(rng, pipeline: bool = False) -> tuple[int, str]:
    """(ranks available, a launch's options) whose own layout keeps the rules (``pipeline``: pp > 1)."""
    tp, cp, ep = (int(rng.choice([1, 1, 2])) for _ in range(3))
    pp = int(rng.choice([2, 3] if pipeline else [1, 1, 2, 3]))
    schedule = str(rng.choice(SCHEDULES)) if pp > 1 else "1f1b"
    dp = int(rng.integers(1, 6))
    flags = f"--tp {tp} --pp {pp} --cp {cp} --ep {ep} --dp {dp}"
    m0 = 1
    if pp > 1:
        m0 = pp * int(rng.integers(1, 4)) if schedule == "interleaved" else int(rng.integers(1, 7))
        flags += f" --schedule {schedule} --microbatches {m0}" + (" --chunks 2" if schedule == "interleaved" else "")
    rows = int(rng.integers(1, 5))  # of one micro-batch at the launch
    batch = dp * ep * m0 * rows
    replica = tp * pp * cp * ep
    available = int(rng.integers(replica, replica * (dp + 3) + 1))
    return available, flags + f" --batch-size {batch}"


@pytest.mark.task("10.1")
def test_drawn_launches_get_the_layout_the_rules_choose(elastic):
    rng = np.random.default_rng(grading_seed())
    for _ in range(150):
        available, flags = drawn_launch(rng)
        check(elastic, available, flags, why="a drawn launch")
