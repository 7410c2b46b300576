"""``python -m grader collect DIR...``: a class's results.json in one CSV and one printed table, a
column per task; a missing copy, an ungraded one and a broken results.json are rows that say why."""

from __future__ import annotations

import csv
from pathlib import Path

from grader.collect import main
from grader.config import load_rubric
from grader.report import TaskScore, write_results

RUBRIC = load_rubric()


def graded_copy(folder: Path, passed: set[str], tasks: list[str]) -> dict[str, float]:
    """A copy graded on ``tasks`` as the grader leaves it (out/grader/results.json); its scores."""
    scores = [
        TaskScore(RUBRIC.tasks[t], "PASS" if t in passed else "TODO", RUBRIC.tasks[t].points * (t in passed), "", [])
        for t in tasks
    ]
    write_results(scores, folder / "out" / "grader", [])
    return {s.task.id: s.score for s in scores}


def test_collect_writes_a_row_per_copy_and_says_why_a_row_has_no_scores(tmp_path, capsys):
    alice = graded_copy(tmp_path / "alice", {"1.1", "1.2"}, [t.id for t in RUBRIC.select(None)])
    bob = graded_copy(tmp_path / "bob", {"2.1"}, ["2.1", "2.2"])  # graded on one assignment
    broken = tmp_path / "carol" / "results.json"
    broken.parent.mkdir()
    broken.write_text('{"score": 40, "tests": [')  # cut off
    (tmp_path / "dave").mkdir()  # never graded
    dirs = [tmp_path / "alice", tmp_path / "bob" / "out" / "grader" / "results.json", broken.parent, tmp_path / "dave"]
    dirs.append(tmp_path / "erin")  # missing
    out = tmp_path / "scores.csv"

    assert main([str(d) for d in dirs], str(out)) == 0
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == ["copy", "score", "max_score", *(t.id for t in RUBRIC.select(None)), "note"]
    assert [r["copy"] for r in rows] == [str(d) for d in dirs]
    for row, scores in ((rows[0], alice), (rows[1], bob)):
        assert {t: float(row[t]) for t in scores} == scores
        assert float(row["score"]) == sum(scores.values()) and row["note"] == ""
        assert float(row["max_score"]) == sum(RUBRIC.tasks[t].points for t in scores)
    assert rows[1]["3.1"] == ""  # not graded on it: empty, not 0
    carol, dave, erin = rows[2:]
    assert carol["note"].startswith(f"broken: {broken} is not the grader's results.json")
    assert dave["note"].startswith("not graded: no ") and "python -m grader" in dave["note"]
    assert erin["note"] == f"missing: {tmp_path / 'erin'} does not exist"
    assert all(r[t.id] == "" and r["score"] == "" for r in rows[2:] for t in RUBRIC.select(None))

    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split() == list(rows[0])
    assert printed[1].split() == [v for k, v in rows[0].items() if k != "note"]  # alice: every task graded
    for row in rows[2:]:  # the reason stands where the scores would
        assert any(line.split(None, 1) == [row["copy"], row["note"]] for line in printed), row
    assert printed[-1] == f"2 of 5 copies graded; wrote {out}"


def test_a_results_json_of_another_shape_is_a_broken_row(tmp_path, capsys):
    cases = {
        "list.json": ("[]", "not an object with a list of tests"),
        "no_tests.json": ('{"score": 1, "max_score": 2}', "it has no 'tests'"),
        "text_score.json": ('{"score": "full", "max_score": 2, "tests": []}', "score is 'full', not a number"),
    }
    for name, (text, _) in cases.items():
        (tmp_path / name).write_text(text)
    out = tmp_path / "s.csv"
    assert main([str(tmp_path / n) for n in cases], str(out)) == 0
    for row, (_, why) in zip(csv.DictReader(out.open()), cases.values()):
        assert row["note"].startswith("broken:") and why in row["note"], row["note"]


def test_an_out_that_cannot_be_written_is_one_sentence(tmp_path, capsys):
    assert main([str(tmp_path)], str(tmp_path / "no" / "such" / "s.csv")) == 2
    assert capsys.readouterr().err.startswith(f"error: cannot write --out {tmp_path / 'no' / 'such' / 's.csv'}")
