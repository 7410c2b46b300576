"""The mutation suite's CI subset: planted bugs must each fail their own task, naming the cause,
with a replay seed (see mutants.py; ``python -m grader mutants`` runs all of them)."""

import pytest

from grader.config import is_release

pytestmark = [
    pytest.mark.skipif(is_release(), reason="the mutation suite needs the reference solutions"),
    pytest.mark.deadline(600),  # one grader run of 14 tasks
]


def test_every_ci_mutant_fails_its_own_task_naming_the_cause_with_a_seed(tmp_path):
    from mutants import CI_MUTANTS, MUTANTS, grade, rounds, verdict

    chosen = [m for m in MUTANTS if m.ci]
    assert sorted(m.name for m in chosen) == sorted(CI_MUTANTS)
    assert len(rounds(chosen)) == 1, "the CI subset is one mutant per task, graded in one run"
    results = grade(chosen, tmp_path)
    missed = {m.name: why for m in chosen for caught, why in [verdict(m, results)] if not caught}
    assert not missed, missed
    assert results["score"] == 0, "each mutated task fails (no other task was graded)"


def test_every_mutant_can_be_planted(tmp_path):
    """Each mutant's text occurs exactly once in its solved assignment (a reference edit that moves
    it must move the mutant too)."""
    from mutants import MUTANTS, plant

    for m in MUTANTS:
        plant([m], tmp_path / m.name)
