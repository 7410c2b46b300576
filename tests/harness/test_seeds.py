"""Graded tests' seeds: every test, parametrized case and draw gets its own, and a replay under
``TINYTRAIN_GRADER_SEED`` gives the failing test exactly the inputs it failed on."""

from __future__ import annotations

import json

import pytest
from test_harness import needs_mpirun, run_pytest

from grader import seeds


def _draw(monkeypatch, test_id: str, draws: int = 1) -> list[int]:
    monkeypatch.setenv("PYTEST_CURRENT_TEST", f"{test_id} (call)")
    seeds.reset()
    return [seeds.grading_seed() for _ in range(draws)]


def test_a_fixed_seed_still_gives_each_case_and_each_draw_its_own_inputs(monkeypatch):
    monkeypatch.setenv("TINYTRAIN_GRADER_SEED", "1234")
    try:
        cases = [_draw(monkeypatch, f"tests/graded/test_x.py::test_chunks[{c}]")[0] for c in ("1", "7", "64")]
        other_test = _draw(monkeypatch, "tests/graded/test_x.py::test_other")[0]
        two_draws = _draw(monkeypatch, "tests/graded/test_x.py::test_chunks[1]", draws=2)
        again = _draw(monkeypatch, "tests/graded/test_x.py::test_chunks[7]")[0]
        assert len({*cases, other_test}) == 4, (cases, other_test)  # a bug seen for one case is met on replay
        assert two_draws[0] == cases[0] and two_draws[1] != two_draws[0]  # the first draw replays, the second differs
        assert again == cases[1]  # the same base and test: the same inputs
        assert seeds.replay_hint() == "replay: TINYTRAIN_GRADER_SEED=1234"
        monkeypatch.setenv("TINYTRAIN_GRADER_SEED", "1235")
        assert _draw(monkeypatch, "tests/graded/test_x.py::test_chunks[7]")[0] != cases[1]
    finally:
        seeds.reset()


INJECTED = """
import json, os
import pytest
from grader import seeds

@pytest.mark.world_size(2)
@pytest.mark.parametrize("case", ["a", "b", "c"])
def test_case(case):
    seed = seeds.grading_seed()
    with open(os.environ["SEEDS_OUT"], "a") as f:
        f.write(json.dumps({"case": case, "seed": seed, "base": seeds.base_seed()}) + "\\n")
"""


@needs_mpirun
def test_a_replayed_run_meets_the_same_inputs_case_by_case(tmp_path):
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    proc, out, _ = run_pytest(tmp_path, INJECTED, 2, SEEDS_OUT=str(first))
    assert proc.returncode == 0, out
    drawn = [json.loads(line) for line in first.read_text().splitlines()]
    assert len(drawn) == 6, drawn  # 3 cases on 2 ranks
    by_case = {}
    for row in drawn:
        by_case.setdefault(row["case"], set()).add(row["seed"])
    assert all(len(s) == 1 for s in by_case.values()), by_case  # the ranks agree
    b = next(r["base"] for r in drawn if r["case"] == "b")
    proc, out, _ = run_pytest(tmp_path, INJECTED, 2, SEEDS_OUT=str(second), TINYTRAIN_GRADER_SEED=str(b))
    assert proc.returncode == 0, out
    replayed = {json.loads(line)["case"]: json.loads(line)["seed"] for line in second.read_text().splitlines()}
    assert replayed["b"] in by_case["b"], (replayed, by_case)  # case b meets its inputs again
    assert len(set(replayed.values())) == 3, replayed  # and the other cases still draw their own


def test_a_seed_that_is_not_a_number_is_refused(monkeypatch):
    monkeypatch.setenv("TINYTRAIN_GRADER_SEED", "abc")
    with pytest.raises(ValueError, match="a whole number"):
        seeds.grading_seed()
