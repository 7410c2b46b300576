"""The student copy as a product (issue 24): hints at three levels that leave the thinking to the
student, a task's prerequisites named in its handout, a failure blamed on the task that holds it,
and ``python -m grader selfcheck``, which solves tasks one at a time in fresh copies."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from grader import hints, report
from grader.config import ROOT, Task, is_release, load_rubric
from grader.impl_plugin import todo_in_output
from grader.release import make_release
from grader.selfcheck import rotation
from grader.stubs import HINT_LEVELS, assignment_texts, find_regions

pytestmark = pytest.mark.skipif(is_release(), reason="needs the reference solution (not in a student copy)")
RUBRIC = load_rubric()


def regions():
    for a in RUBRIC.assignments.values():
        for ref in a.references:
            yield from ((ref, r) for r in find_regions((ROOT / ref).read_text(), ref))


def test_every_region_has_a_brief_hint_and_a_full_one():
    for ref, r in regions():
        assert r.full and r.hint != r.full, f'{ref}:{r.begin + 1}: give the marker a brief hint and full="..."'
        assert len(r.hint) <= 300, f"{ref}:{r.begin + 1}: a brief hint is a sentence ({len(r.hint)} characters)"


def test_brief_hints_name_few_of_the_solutions_identifiers():
    """Measured as ``python -m grader hints`` prints it: the median share of a solution's identifiers
    that its brief hint names is at most 0.10; the full hints name far more (they spell the steps)."""
    assert hints.median_share("brief") <= hints.BRIEF_MEDIAN_LIMIT
    assert hints.median_share("full") > 2 * hints.BRIEF_MEDIAN_LIMIT
    worst = max(hints.shares("brief"), key=lambda s: s.share)
    assert worst.share <= 0.25, f"{worst.file}:{worst.line}: the brief hint names {sorted(worst.named)}"


def test_the_measure_counts_names_of_the_solution_that_the_hint_repeats():
    used = hints.solution_identifiers("out = dist.reduce_scatter(flat, op='avg', sizes=s.sizes)\nfor i in x: pass")
    assert used == {"out", "dist", "reduce_scatter", "flat", "op", "sizes"}  # no keywords, builtins, one letter
    assert hints.hint_words("reduce_scatter flat with sizes=s.sizes") >= {"reduce_scatter", "reduce", "flat", "sizes"}


@pytest.mark.parametrize("level", HINT_LEVELS)
def test_each_hint_level_writes_its_text_into_the_stubs(level):
    a = RUBRIC.assignments["3"]
    text = "".join(assignment_texts(a, RUBRIC, hints=level).values())
    ref, r = next((ref, r) for ref, r in regions() if r.task == "3.1")
    want = {"brief": r.hint, "full": r.full, "none": "see the handout"}[level]
    assert f'raise NotImplementedError("TODO 3.1: {want}")' in text


def test_a_release_with_full_hints_and_a_students_readme(tmp_path):
    out = tmp_path / "copy"
    make_release(out, hints="full")
    ref, r = next((ref, r) for ref, r in regions() if r.task == "1.2")
    assert f"TODO 1.2: {r.full}" in (out / "assignments" / "a1_collectives.py").read_text()
    assert f"TODO 1.2: {r.full}" in (out / ref).read_text()  # the framework's stub says the same
    readme = (out / "README.md").read_text()
    assert readme.startswith("# tinytrain: the student copy")
    for words in (
        "python3 -m venv .venv",
        "python -m grader",
        "--impl assignments",
        "out/grader/",
        "requires 1.1, 1.2",
    ):
        assert words in readme, words
    for instructor in ("grader release", "grader mutants", "grader stubs", "--impl reference", "selfcheck"):
        assert instructor not in readme, instructor
    with pytest.raises(ValueError, match="choose one of brief, full, none"):
        make_release(tmp_path / "other", hints="some")


def test_every_prerequisite_is_named_in_its_handout():
    for t in RUBRIC.tasks.values():
        if t.requires:
            handout = (ROOT / RUBRIC.assignments[t.assignment].handout).read_text()
            line = f"Task {t.id} requires {', '.join(t.requires)}"
            assert line in handout, f"{RUBRIC.assignments[t.assignment].handout} must say '{line}' (and why)"


def test_requires_is_transitive_and_refuses_unknown_tasks(tmp_path):
    assert RUBRIC.closure(["4.3"]) == ("4.1", "4.2", "4.3")
    assert RUBRIC.closure(["1.4"]) == ("1.4",)
    bad = tmp_path / "rubric.toml"
    bad.write_text((ROOT / "grader" / "rubric.toml").read_text().replace('requires = ["3.1"]', 'requires = ["3.9"]'))
    with pytest.raises(ValueError, match=r'task."3.2"\] requires 3.9, which is not another task'):
        load_rubric(bad)


def test_a_failure_is_blamed_on_the_task_it_builds_on():
    t1, t2, t3 = Task("4.1", "a", 20), Task("4.2", "b", 20, ("4.1",)), Task("4.3", "c", 20, ("4.2",))
    scores = [
        report.TaskScore(t1, "FAIL", 0, "test_regions: wrong sum", []),
        report.TaskScore(t2, "FAIL", 0, "test_linear: wrong output", []),
        report.TaskScore(t3, "FAIL", 0, "test_mlp: wrong output", []),
    ]
    report.blame_what_it_builds_on(scores)
    assert scores[0].reason == "test_regions: wrong sum"
    assert scores[2].reason.startswith("builds on task 4.1 (FAIL): fix that first") and "test_mlp" in scores[2].reason


def test_a_todo_raised_by_a_program_is_found_in_its_output():
    class Rep:
        longrepr = "AssertionError: rank 0: error: \x1b[31mNotImplementedError\x1b[39m: TODO 2.2: hint"
        sections = []

    assert todo_in_output(Rep()) == f"TODO 2.2 ({RUBRIC.tasks['2.2'].title})"
    Rep.longrepr = "AssertionError: 3 != 4"
    assert todo_in_output(Rep()) is None


def test_rotation_covers_every_task_over_the_days():
    tasks = [t.id for t in RUBRIC.select(None)]
    seen = {t for day in range(len(tasks)) for t in rotation(tasks, 1, day)}
    assert seen == set(tasks)
    assert len(rotation(tasks, 3, 7)) == 3


@pytest.mark.deadline(300)
def test_selfcheck_solves_a_task_and_its_prerequisites_in_a_fresh_copy(tmp_path):
    """1.3 with 1.1 and 1.2 solved scores 15/15; a bad pattern is one sentence with exit 2."""
    proc = subprocess.run(
        [sys.executable, "-m", "grader", "selfcheck", "--tasks", "1.3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"1\.3\s+1\.1,1\.2,1\.3\s+15/15", proc.stdout), proc.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "grader", "selfcheck", "--tasks", "11.*"], cwd=ROOT, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "matches no task" in bad.stderr, bad.stdout + bad.stderr


@pytest.mark.deadline(300)
def test_report_in_a_copy_measures_the_students_code_and_asks_the_questions(tmp_path):
    """In a copy with every task solved: every table's bytes equal their formula, ZeRO's memory the
    paper's, bubbles the textbook's; with the stubs instead, every assignment says TODO."""
    from grader.analysis import QUESTIONS
    from grader.selfcheck import copy_environment, solve

    copy = tmp_path / "copy"
    make_release(copy)
    for solved in (False, True):
        if solved:
            solve(copy, RUBRIC, tuple(RUBRIC.tasks))
        proc = subprocess.run(
            [sys.executable, "-m", "grader", "report", "--out", "out/report.md"],
            cwd=copy,
            env=copy_environment(copy),
            capture_output=True,
            text=True,
            timeout=280,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        text = (copy / "out" / "report.md").read_text()
        assert text.count("*Your answer:*") == sum(len(q) for q in QUESTIONS.values())
        if not solved:
            sections = text.split("## Assignment ")[1:]
            assert len(sections) == len(RUBRIC.assignments) and all("TODO" in x for x in sections), text
            assert "| equal |" not in text, text
            assert "0 of 10 assignments measured; still TODO: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10" in proc.stdout, proc.stdout
            continue
        assert "10 of 10 assignments measured" in proc.stdout, proc.stdout
        assert "Not measured" not in text and "differs" not in text, text
        # A1 9 rows, DP 1, ZeRO 4 + 4 (bytes, memory), TP 2, PP 2 (interleaved has no formula), CP 2,
        # memory 3 + 2 (activation bytes per recompute mode, AdamW state in fp32 and bf16), federated 4
        # (bytes per round: plain and secure, FedAvg and DP-FedAvg)
        assert text.count("| equal |") == 9 + 1 + 8 + 2 + 2 + 2 + 5 + 4, text
        assert re.search(r"\| 1f1b \| 8 \| 0\.2727 \| 0\.2727 \| \[4, 3, 2, 1\] \|", text), text
        # elastic: 6 ranks of a --pp 2 --dp 4 launch run 3 replicas of 8 micro-batches (16 rows, at most 3 each)
        assert "| `--pp 2 --dp 4 --batch-size 48` | 6 | 3 | 6 | 8 | 2 |" in text, text


def test_grading_without_mpirun_is_one_sentence(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PATH"}
    proc = subprocess.run(
        [sys.executable, "-m", "grader", "--tasks", "1.1"],
        cwd=ROOT,
        env=dict(env, PATH="/nonexistent"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: mpirun not found: activate the virtual environment"), proc.stderr


@pytest.mark.deadline(400)
@pytest.mark.parametrize(
    "notebook, says",
    [
        ("communication", r"not drawn until tasks (\d\.\d, )*\d\.\d are done: ring all-reduce, .*DP"),
        ("context_parallel", r"zigzag: not drawn until TODO 7\.\d is done"),
        ("pipeline_bubbles", r"schedules not drawn until tasks 5\.2, (\d\.\d, )*\d\.\d are done: gpipe, 1f1b"),
    ],
)
def test_a_notebook_in_an_unfinished_copy_says_which_tasks_it_needs_and_draws_the_rest(
    tmp_path, monkeypatch, notebook, says
):
    """A notebook in a fresh copy (every task a TODO): no traceback, a line naming the task its
    missing figures need, and the figures that need none (the planner's, the splits') drawn."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    from grader.selfcheck import copy_environment

    copy = tmp_path / "copy"
    make_release(copy)
    env = copy_environment(copy)
    for name in set(os.environ) - set(env):
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    nb = nbformat.read(copy / "notebooks" / f"{notebook}.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(copy / "notebooks")}}
    )
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, errors
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    said = [line for line in text.splitlines() if "not drawn until" in line]
    assert said and re.match(says, said[0]), text
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 1, "nothing was drawn"
