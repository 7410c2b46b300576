"""The grader is honest: the reference scores 100, the stubs score 0 (all TODO), planted bugs lose
exactly the right task with a message naming it, and borrowing the reference is refused.

These tests run ``python -m grader`` (which spawns ``mpirun -n 4``) as a subprocess. They are
single-process tests: under ``mpirun -n 4 python -m pytest`` the harness runs them on rank 0 only,
and the grader strips the outer launcher's variables so its own ``mpirun`` starts cleanly. Each
grader run is shared by the tests that read it (module-scoped fixtures), and sizes are small.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from grader import guard
from grader.config import ROOT, is_release, load_rubric
from grader.run import mpi_environment
from grader.stubs import assignment_text, assignment_texts

pytestmark = [
    pytest.mark.skipif(is_release(), reason="grader self-tests need the reference solution (not in a student copy)"),
    pytest.mark.deadline(600),  # each runs python -m grader (the first one grades every assignment)
]

RUBRIC = load_rubric()
A1 = RUBRIC.assignments["1"]
A4 = RUBRIC.by_name("tensor_parallel")  # an assignment of several files: a package
A8 = RUBRIC.by_name("memory")  # a front module (tinytrain/memory.py) and files from two packages


def grade(tmp: Path, *args: str, timeout: float = 240) -> tuple[dict, str]:
    """Run ``python -m grader`` and return (results.json, printed output)."""
    out = tmp / "out"
    cmd = [sys.executable, "-m", "grader", "--out", str(out), "--comm-timeout", "4", "--timeout", "40", *args]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=mpi_environment(), capture_output=True, text=True, timeout=timeout, check=False
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the grader itself failed (status {proc.returncode}):\n{text}"
    return json.loads((out / "results.json").read_text()), text


def by_task(results: dict) -> dict[str, dict]:
    return {t["number"]: t for t in results["tests"]}


def planted(tmp: Path, old: str, new: str) -> Path:
    """A folder holding the solved assignment with one planted bug (``old`` replaced by ``new``)."""
    text = assignment_text(A1, RUBRIC, solved=True)
    assert text.count(old) == 1, f"the bug cannot be planted: {old!r} occurs {text.count(old)} times"
    folder = tmp / "planted"
    folder.mkdir()
    (folder / Path(A1.file).name).write_text(text.replace(old, new))
    return folder


def insert_after_docstring(text: str, function: str, line: str) -> str:
    """``text`` with ``line`` as the first statement after ``function``'s docstring."""
    start = text.index(f"def {function}(")
    doc_end = text.index('"""', text.index('"""', start) + 3) + 3
    return text[:doc_end] + "\n    " + line + text[doc_end:]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    return grade(tmp_path_factory.mktemp("reference"), "--impl", "reference")


@pytest.fixture(scope="module")
def stubs_run(tmp_path_factory):
    return grade(tmp_path_factory.mktemp("stubs"))


def test_reference_scores_full_marks_on_every_task(reference_run):
    results, text = reference_run
    assert results["score"] == results["max_score"] == 100 * len(RUBRIC.assignments), text
    assert {t["number"] for t in results["tests"]} == set(RUBRIC.tasks)
    assert all(t["status"] == "passed" and t["score"] == t["max_score"] for t in results["tests"]), text


def test_stubs_score_zero_with_every_task_todo(stubs_run, tmp_path):
    results, text = stubs_run
    assert results["score"] == 0 and results["max_score"] == 100 * len(RUBRIC.assignments), text
    for task in results["tests"]:
        assert task["output"].startswith("TODO: TODO "), task["output"]
    for task in A1.tasks:
        assert by_task(results)[task.id]["output"].startswith(f"TODO: TODO {task.id}:")
    assert text.count(" TODO\n") == len(RUBRIC.tasks), text  # the table's result column


def test_junit_and_gradescope_files_agree(reference_run):
    results, _ = reference_run
    assert set(results) >= {"score", "max_score", "tests"}
    for t in results["tests"]:
        assert set(t) >= {"name", "score", "max_score", "status", "output"}


# Planted bugs: see mutants.py (the mutation suite) and test_mutants.py.


def test_solved_assignment_scores_full_marks(tmp_path):
    """The assignment machinery itself (loading from a folder, the copy's own helpers) works."""
    folder = tmp_path / "solved"
    folder.mkdir()
    (folder / Path(A1.file).name).write_text(assignment_text(A1, RUBRIC, solved=True))
    results, text = grade(tmp_path, "--assignments", str(folder), "--tasks", "1.3", "1.5")
    assert results["score"] == results["max_score"] == 30, text


def test_grader_refuses_an_assignment_that_imports_the_reference(tmp_path):
    folder = tmp_path / "cheat"
    folder.mkdir()
    cheat = assignment_text(A1, RUBRIC) + "\nfrom tinytrain.distributed.algorithms import _ring_reduce_scatter\n"
    (folder / Path(A1.file).name).write_text(cheat)
    results, text = grade(tmp_path, "--assignments", str(folder), "--tasks", "1.*")
    assert results["score"] == 0, text
    assert "refusing to grade" in text and "imports from tinytrain.distributed.algorithms" in text, text
    assert all("refusing" in t["output"] for t in results["tests"]), results


def test_a_refused_call_costs_only_the_task_whose_code_makes_it(tmp_path):
    """MPI's own Bcast inside the broadcast (1.5): only 1.5 is refused, the other tasks are graded."""
    text = assignment_text(A1, RUBRIC, solved=True)
    anchor = "    if kids:\n        # All children at once"
    assert text.count(anchor) == 1
    text = text.replace(anchor, "    c.group.comm.Bcast(flat)\n" + anchor)
    folder = tmp_path / "borrows"
    folder.mkdir()
    (folder / Path(A1.file).name).write_text(text)
    assert sorted(guard.refused_tasks(A1, path=folder / Path(A1.file).name)) == ["1.5"]
    results, out = grade(tmp_path, "--assignments", str(folder), "--tasks", "1.*")
    rows = by_task(results)
    assert results["score"] == 85 and rows["1.5"]["score"] == 0, out
    assert "calls MPI's own collective .Bcast()" in rows["1.5"]["output"], rows["1.5"]["output"]
    assert "grading 4 task(s)" in out, out


@pytest.mark.parametrize(
    "line, words",
    [
        ("from tinytrain.distributed import all_reduce", "imports all_reduce from tinytrain.distributed"),
        ("import tinytrain.distributed.algorithms as ref", "imports tinytrain.distributed.algorithms"),
        ("from tinytrain.distributed import algorithms", "imports tinytrain.distributed.algorithms"),
        ("import importlib; importlib.import_module('tinytrain.distributed.algorithms')", "names the reference module"),
        ('import sys\nref = sys.modules["tinytrain.distributed.algorithms"]', "tinytrain.distributed.algorithms"),
        ("from tinytrain import distributed as d\nx = d.reduce_scatter", "uses d.reduce_scatter"),
        ("def f(g, x, y): g.comm.Allreduce(x, y)", "calls MPI's own collective .Allreduce()"),
    ],
)
def test_guard_names_each_way_of_borrowing_the_solution(tmp_path, line, words):
    path = tmp_path / "a1_collectives.py"
    path.write_text(assignment_text(A1, RUBRIC) + "\n" + line + "\n")
    found = guard.problems(A1, path=path)
    assert any(words in p for p in found), found
    path.write_text(assignment_text(A1, RUBRIC))
    assert guard.problems(A1, path=path) == []


def test_crash_and_hang_cost_only_their_own_tasks(tmp_path):
    """MPI_Abort(1) in 1.4 (mpirun then exits with pytest's own "tests failed" status) and an endless
    loop in 1.5: tasks 1.1-1.3 keep their points; the abort is a crash, the loop a hang that ends at
    the harness's deadline with every rank's Python stack and the replay seed."""
    text = assignment_text(A1, RUBRIC, solved=True)
    text = insert_after_docstring(text, "_all_to_all_pairwise", "from mpi4py import MPI; MPI.COMM_WORLD.Abort(1)")
    text = insert_after_docstring(text, "_broadcast_tree", "while True: pass")
    folder = tmp_path / "crashy"
    folder.mkdir()
    (folder / Path(A1.file).name).write_text(text)
    results, out = grade(tmp_path, "--assignments", str(folder), "--timeout", "6", "--tasks", "1.*")
    rows = by_task(results)
    assert [rows[t]["status"] for t in ("1.1", "1.2", "1.3")] == ["passed"] * 3, out
    assert results["score"] == 60, out
    assert "crashed" in rows["1.4"]["output"] and "NOT RUN" in rows["1.4"]["output"], rows["1.4"]["output"]
    hang = rows["1.5"]["output"]
    assert "hung: the test ran past its deadline of 4.2 s" in hang, hang
    assert "in _broadcast_tree" in hang and "TINYTRAIN_GRADER_SEED=" in hang, hang  # the stack, the seed
    assert all(f"tinytrain harness, rank {r}:" in hang for r in range(4)), hang  # every rank's stacks


def test_an_exception_on_one_rank_while_another_hangs_leads_the_hung_tasks_message(tmp_path):
    """Rank 1 raises in the student's code while the other ranks loop forever: the task fails at the
    harness's deadline, and its message (table, results.json) leads with rank 1's exception, its
    type and the line of the student's file, not with "hung" alone."""
    line = (
        "if __import__('tinytrain').distributed.get_rank() == 1: raise ValueError('tree bounds off by one')"
        "\n    while True: pass"
    )
    text = insert_after_docstring(assignment_text(A1, RUBRIC, solved=True), "_broadcast_tree", line)
    folder = tmp_path / "raises_and_hangs"
    folder.mkdir()
    (folder / Path(A1.file).name).write_text(text)
    results, out = grade(tmp_path, "--assignments", str(folder), "--timeout", "6", "--tasks", "1.5")
    row = by_task(results)["1.5"]
    first = row["output"].splitlines()[0]
    assert row["status"] == "failed", out
    cause = r"rank 1 raised ValueError: tree bounds off by one \(\S*a1_collectives.py:\d+, in _broadcast_tree\)"
    assert re.search(cause, first), first
    assert "hung" in first, first  # and what became of the run after it
    assert "rank 1 raised ValueError" in out, out  # the table shows it too


def test_score_table_and_seed_for_an_exception_in_the_students_code(tmp_path):
    """An IndexError raised in the student's code names the replay seed too."""
    text = insert_after_docstring(assignment_text(A1, RUBRIC, solved=True), "_broadcast_tree", "[][0]")
    folder = tmp_path / "raises"
    folder.mkdir()
    (folder / Path(A1.file).name).write_text(text)
    results, out = grade(tmp_path, "--assignments", str(folder), "--tasks", "1.5")
    row = by_task(results)["1.5"]
    assert row["status"] == "failed" and "IndexError" in row["output"], out
    assert "TINYTRAIN_GRADER_SEED=" in row["output"].splitlines()[0], row["output"]


def test_syntax_error_in_the_assignment_fails_its_tasks_with_the_line(tmp_path):
    folder = tmp_path / "typo"
    folder.mkdir()
    text = insert_after_docstring(assignment_text(A1, RUBRIC, solved=True), "_broadcast_tree", "x = (")
    (folder / Path(A1.file).name).write_text(text)
    results, out = grade(tmp_path, "--assignments", str(folder), "--tasks", "1.5")
    row = by_task(results)["1.5"]
    assert row["status"] == "failed" and "SyntaxError" in row["output"] and "a1_collectives.py" in row["output"], out
    assert "SyntaxError" in out and "line " in out  # the table's one line names it too


def package_copy(tmp: Path, solved: bool) -> Path:
    """A folder holding assignment 4's package (``a4_tensor_parallel/``), solved or as stubs."""
    folder = tmp / "package"
    for file, text in assignment_texts(A4, RUBRIC, solved=solved).items():
        path = folder / Path(A4.file).name / Path(file).relative_to(A4.file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return folder


def test_guard_checks_every_file_of_a_package_but_lets_them_import_each_other(tmp_path):
    package = package_copy(tmp_path, solved=False) / Path(A4.file).name
    assert guard.problems(A4, path=package) == []
    layers = package / "layers.py"
    layers.write_text(layers.read_text() + "\nfrom tinytrain.parallel.tensor_parallel.mappings import my_piece\n")
    found = guard.problems(A4, path=package)
    assert len(found) == 1 and found[0].startswith("a4_tensor_parallel/layers.py:"), found
    assert "imports from tinytrain.parallel.tensor_parallel.mappings" in found[0], found


@pytest.mark.parametrize(
    "file, line, words",
    [
        ("checkpoint.py", "from tinytrain.autograd import checkpoint", "imports tinytrain.autograd.checkpoint"),
        ("checkpoint.py", "import tinytrain.autograd.checkpoint as ref", "imports tinytrain.autograd.checkpoint"),
        ("optim.py", "from tinytrain.optim import LossScaler", "imports from tinytrain.optim"),
        ("optim.py", "from tinytrain import optim", "imports tinytrain.optim"),
        ("__init__.py", "from tinytrain.memory import checkpoint", "imports from tinytrain.memory"),
    ],
)
def test_guard_refuses_each_file_a_front_module_gathers(tmp_path, file, line, words):
    """Assignment 8's files come from two packages: borrowing any of them is refused, while the
    framework they import (the engine, tinytrain.random, the backend) stays allowed."""
    folder = tmp_path / Path(A8.file).name
    for name, text in assignment_texts(A8, RUBRIC).items():
        (folder / Path(name).relative_to(A8.file)).parent.mkdir(parents=True, exist_ok=True)
        (folder / Path(name).relative_to(A8.file)).write_text(text)
    assert guard.problems(A8, path=folder) == []
    target = folder / file
    target.write_text(target.read_text() + "\n" + line + "\n")
    found = guard.problems(A8, path=folder)
    assert len(found) == 1 and found[0].startswith(f"a8_memory/{file}:") and words in found[0], found


def test_solved_package_assignment_from_a_folder_scores_full_marks(tmp_path):
    """The folder's package is graded, not the stubs in assignments/ (its files import each other)."""
    results, text = grade(tmp_path, "--assignments", str(package_copy(tmp_path, solved=True)), "--tasks", "4.1,4.2")
    assert results["score"] == results["max_score"] == 40, text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ranks", "0"], "error: --ranks must be positive, got 0"),
        (["selfcheck", "--ranks", "0"], "error: --ranks must be positive, got 0"),
        (["--assignments", "no-such-folder"], "error: --assignments no-such-folder is not a folder"),
        (["collect", "no-such-folder"], "error: collect no-such-folder: no such file or folder"),
        (["--timeout", "-1"], "error: --timeout must be positive, got -1"),
        (["--tasks", "9.9"], "error: --tasks 9.9 matches no task"),
        (["--out", "/proc/no-such-folder", "--tasks", "1.1"], "error: --out /proc/no-such-folder is not a folder"),
        (["--out", "README.md", "--tasks", "1.1"], "error: --out README.md is not a folder this grader can write"),
    ],
)
def test_bad_input_is_one_sentence_with_exit_code_2(args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "grader", *args],
        cwd=ROOT,
        env=mpi_environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_rank_that_dies_without_python_is_named(tmp_path):
    """os._exit on rank 2 inside task 1.4: the task's failure names rank 2 and how it ended."""
    exits = "import os; os._exit(3) if c.rank == 2 else None"
    text = insert_after_docstring(assignment_text(A1, RUBRIC, solved=True), "_all_to_all_pairwise", exits)
    folder = tmp_path / "exits"
    folder.mkdir()
    (folder / Path(A1.file).name).write_text(text)
    results, out = grade(tmp_path, "--assignments", str(folder), "--tasks", "1.4")
    row = by_task(results)["1.4"]
    assert "crashed: rank 2 exited with status 3" in row["output"], row["output"]


def test_dead_ranks_reads_hydras_exit_codes():
    from grader.run import dead_ranks

    assert dead_ranks("[mpiexec@vm] Exit codes: [vm] 9,768,0,0") == (
        "rank 1 exited with status 3 (os._exit, or exit() in C code)"
    )
    assert dead_ranks("[mpiexec@vm] Exit codes: [vm] 0,9,11,9") == "rank 2 was killed by signal 11 (SIGSEGV)"
    assert dead_ranks("Exit codes: [vm] 0,9,0,0") == "rank 1 was killed by signal 9 (SIGKILL)"
    assert dead_ranks("no banner") == ""


def test_dead_ranks_reads_open_mpis_banners():
    """prterun's two banners, as Open MPI 5.0 prints them for os._exit(3) on rank 2 and kill -9 of rank 1."""
    from grader.run import dead_ranks

    exited = (
        "prterun detected that one or more processes exited with non-zero status,\nthus causing the job to be "
        "terminated. The first process to do so was:\n\n   Process name: [prterun-vm-11979@1,2]\n   Exit code:    3\n"
    )
    assert dead_ranks(exited) == "rank 2 exited with status 3 (os._exit, or exit() in C code)"
    signaled = "prterun noticed that process rank 1 with PID 9760 on node vm exited on\nsignal 9 (Killed).\n"
    assert dead_ranks(signaled) == "rank 1 was killed by signal 9 (SIGKILL)"
