"""The seed of a graded test: drawn when the test runs, so hard-coded outputs cannot pass.

Rank 0 draws a *base* seed at a test's first call and every rank of the test's world agrees on it
(with a deadline), so all ranks build the same inputs. Each call of the test gets its own seed,
derived from the base, the test's id (its parameters included) and how many seeds the test drew
before: two parametrized cases, or two draws in one test, never share their inputs.
``TINYTRAIN_GRADER_SEED=<base>`` replays a run: the harness adds that line to every failure of a
test that drew a seed (an assertion, an MPI error, an ``IndexError`` in the student's code alike)
and to the stacks it prints when a test passes its deadline. Under a fixed base every test and
every case still draws its own inputs, so a replayed run is as strong as a graded one, and the
failing test meets again exactly the inputs it failed on.
"""

from __future__ import annotations

import hashlib
import os
import secrets

drawn: list[int] = []  # the seeds the running test was given (the harness empties it before each test)
_base: list[int] = []  # the running test's base seed: the one that replays it


def reset() -> None:
    """Forget the running test's seeds (the harness calls it as each test starts)."""
    drawn.clear()
    _base.clear()


def _fixed_base() -> int | None:
    fixed = os.environ.get("TINYTRAIN_GRADER_SEED", "").strip()
    if fixed and not fixed.isdigit():
        raise ValueError(
            f"TINYTRAIN_GRADER_SEED={fixed!r} is not a setting it takes: a whole number (the seed a failed test "
            "printed, to replay it), or leave it unset"
        )
    return int(fixed) if fixed else None


def test_id() -> str:
    """The running test's id, parameters included (``path::test[case]``); "" outside pytest."""
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]


def derive(base: int, test: str, index: int) -> int:
    """The seed of the ``index``-th draw of ``test`` under ``base``: a hash, so neighbouring bases,
    tests and draws get unrelated seeds."""
    digest = hashlib.sha256(f"{base}:{test}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def grading_seed() -> int:
    """This draw's seed, the same on every rank: derived from the test's base seed (fresh, or
    ``TINYTRAIN_GRADER_SEED``), its id and the number of seeds it drew before."""
    from .mpi_reference import agree_int

    fixed = _fixed_base()
    if not _base:
        _base.append(agree_int(fixed if fixed is not None else secrets.randbits(31)))
    seed = derive(_base[0], test_id(), len(drawn))
    drawn.append(seed)
    return seed


def base_seed() -> int | None:
    """The running test's base seed, or None if it drew none."""
    return _base[0] if _base else None


def replay_hint() -> str:
    """ "replay: TINYTRAIN_GRADER_SEED=<base>" for the running test, or "" if it drew none."""
    return f"replay: TINYTRAIN_GRADER_SEED={_base[0]}" if _base else ""
