"""The seed of a graded test: drawn when the test runs, so hard-coded outputs cannot pass.

Rank 0 draws it and every rank of the test's world agrees on it (with a deadline), so all ranks
build the same inputs. ``TINYTRAIN_GRADER_SEED=<seed>`` replays a run: the harness adds that line
to every failure of a test that drew a seed (an assertion, an MPI error, an ``IndexError`` in the
student's code alike) and to the stacks it prints when a test passes its deadline.
"""

from __future__ import annotations

import os
import secrets

drawn: list[int] = []  # the seeds the running test drew (the harness empties it before each test)


def grading_seed() -> int:
    """A fresh seed (or ``TINYTRAIN_GRADER_SEED``), the same on every rank."""
    from .mpi_reference import agree_int

    fixed = os.environ.get("TINYTRAIN_GRADER_SEED", "").strip()
    if fixed and not fixed.isdigit():
        raise ValueError(
            f"TINYTRAIN_GRADER_SEED={fixed!r} is not a setting it takes: a whole number (the seed a failed test "
            "printed, to replay it), or leave it unset"
        )
    seed = agree_int(int(fixed) if fixed else secrets.randbits(31))
    drawn.append(seed)
    return seed


def replay_hint() -> str:
    """ "replay: TINYTRAIN_GRADER_SEED=<seed>" for the running test, or "" if it drew none."""
    return f"replay: TINYTRAIN_GRADER_SEED={drawn[0]}" if drawn else ""
