"""``python -m grader release``: a student copy without solutions, whose own tests pass."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from grader.config import ROOT, is_release, load_rubric
from grader.release import make_release
from grader.selfcheck import copy_environment
from grader.stubs import BEGIN
from tinytrain import launcher

pytestmark = [
    pytest.mark.skipif(is_release(), reason="releases are made from the instructors' repository"),
    pytest.mark.deadline(600),  # runs the grader and a test suite inside a release copy
]
RUBRIC = load_rubric()


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    out = tmp_path_factory.mktemp("release") / "tinytrain"
    make_release(out)
    return out


def test_release_has_no_solution_and_defaults_to_assignments(release):
    assert (release / "grader" / "RELEASE").exists()
    assert not (release / "tests" / "grader").exists(), "the grader's own tests contain solution code"
    for a in RUBRIC.assignments.values():
        ref = "".join((release / r).read_text() for r in a.references)  # every file of a package
        assert not [ln for ln in ref.splitlines() if BEGIN.match(ln)]
        for task in a.tasks:
            assert f'raise NotImplementedError("TODO {task.id}:' in ref
        for file in a.files:
            assert (release / file).read_text() == (ROOT / file).read_text()
        assert (release / "grader" / "rubric.toml").exists()
    for path in release.rglob("*.py"):
        if "grader" not in path.relative_to(release).parts:
            assert not [ln for ln in path.read_text().splitlines() if BEGIN.match(ln)], path


def test_release_refuses_an_existing_folder(release):
    with pytest.raises(FileExistsError, match="already exists"):
        make_release(release)


@pytest.mark.slow  # a copy's suite of three folders: about a minute on 2 cores
def test_release_suite_passes_with_stand_ins_and_todo_stubs(release):
    """In the copy: graded tests are TODO, reference tests skipped, the framework works on stand-ins."""
    env = copy_environment(release)
    cmd = [
        *launcher.mpirun_command(4),
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-rs",
        "tests/graded",
        "tests/distributed",
        "tests/harness",
    ]
    proc = subprocess.run(cmd, cwd=release, env=env, capture_output=True, text=True, timeout=600, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, failures_of(out)
    assert "[reference]" not in out  # --impl defaults to assignments in a release
    assert "TODO 1.1:" in out and "which this student copy does not contain" in out, out[-3000:]

    grade = subprocess.run(
        [sys.executable, "-m", "grader", "--out", "out", "--tasks", "1.*"],
        cwd=release,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    results = json.loads((release / "out" / "results.json").read_text())
    assert grade.returncode == 0 and results["score"] == 0, grade.stdout + grade.stderr
    assert all(t["output"].startswith("TODO") for t in results["tests"]), results


def test_release_with_assignment_1_done_is_green_and_its_handout_commands_work(release, tmp_path):
    """Fill in assignment 1 from the reference solutions: the copy's tests that touch it stay green,
    the grader gives full marks (results in the ignored out/grader), and the handout's bench runs."""
    from grader.stubs import assignment_text

    a1 = RUBRIC.assignments["1"]
    done = tmp_path / "done"
    shutil.copytree(release, done)
    (done / a1.file).write_text(assignment_text(a1, RUBRIC, solved=True))
    env = copy_environment(done)

    def run(*cmd, timeout=600):
        proc = subprocess.run(list(cmd), cwd=done, env=env, capture_output=True, text=True, timeout=timeout)
        return proc.returncode, proc.stdout + proc.stderr

    code, out = run(
        *launcher.mpirun_command(4), sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
        "tests/graded/test_a1_collectives.py", "tests/distributed/test_bench.py",
    )  # fmt: skip
    assert code == 0, out[-6000:]
    assert "student copy: this test expects the TODO stubs" in out or "skipped" in out, out[-3000:]
    code, out = run(sys.executable, "-m", "grader", "--tasks", "1.*")
    results = json.loads((done / "out" / "grader" / "results.json").read_text())
    assert code == 0 and results["score"] == results["max_score"] == 100, out
    code, out = run(sys.executable, "-m", "grader", "--impl", "reference")
    assert code == 2 and "--impl" in out, out  # a student copy has no reference to grade
    code, out = run(
        *launcher.mpirun_command(4), sys.executable, "-m", "tinytrain.cli", "bench", "collectives",
        "--impl", "assignments", "--algo", "ring", "--sizes", "64K", "--rounds", "1",
    )  # fmt: skip
    assert code == 0 and "TODO" not in out, out[-3000:]


def failures_of(out: str) -> str:
    """The failing tests' sections and FAILED lines of a pytest output (its skip list can be long)."""
    start = out.find("= FAILURES =")
    failed = "\n".join(line for line in out.splitlines() if line.startswith(("FAILED", "ERROR")))
    return (out[start : start + 8000] if start >= 0 else out[-4000:]) + "\n" + failed


def test_a_task_requiring_another_assignments_task_runs_the_students_code_of_it(release, tmp_path):
    """In a copy the framework's checkpoint is a stub, and ZeRO-3's layers recompute with it: task
    3.3 (which requires 8.1) runs the student's 8.1 instead. Without it, 3.3 is a TODO of 8.1; with
    it, 3.3 scores in full."""
    from grader.selfcheck import solve

    done = tmp_path / "done"
    shutil.copytree(release, done)
    scores = []
    for solved in (("3.1", "3.2", "3.3"), ("3.1", "3.2", "3.3", "8.1")):
        solve(done, RUBRIC, solved)
        proc = subprocess.run(
            [sys.executable, "-m", "grader", "--tasks", "3.3"],
            cwd=done,
            env=copy_environment(done),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        row = json.loads((done / "out" / "grader" / "results.json").read_text())["tests"][0]
        scores.append((row["score"], row["output"]))
    assert scores[0][0] == 0 and "TODO 8.1" in scores[0][1] and "needed by task 3.3" in scores[0][1], scores[0]
    assert scores[1][0] == 35, scores[1]
