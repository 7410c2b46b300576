"""The student copy's GitHub workflow (``.github/workflows/grade.yml``, written by ``python -m grader
release``): two workflow linters accept it and refuse broken ones, and the script it runs
(``.github/grade.sh``) installs a released copy with the README's command, grades it and writes the
score table to the job's summary."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grader.classroom import RESULTS, SCRIPT, WORKFLOW, ZIZMOR_CONFIG
from grader.config import ROOT, is_release, load_rubric
from grader.release import make_release
from grader.run import mpi_environment
from grader.selfcheck import solve

pytestmark = [
    pytest.mark.skipif(is_release(), reason="releases are made from the instructors' repository"),
    pytest.mark.deadline(600),  # the script's run installs a copy and grades it
]
RUBRIC = load_rubric()


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    out = tmp_path_factory.mktemp("classroom") / "tinytrain"
    make_release(out)
    return out


def tool(name: str) -> str:
    """A linter of the dev extra: beside this Python (its virtual environment), else on PATH."""
    found = Path(sys.executable).with_name(name)
    path = str(found) if found.exists() else shutil.which(name)
    assert path, f'{name} is not installed: pip install -e ".[test]" (or [dev]) brings it'
    return path


def lint(copy: Path) -> dict[str, tuple[int, str]]:
    """Each linter's (exit status, output) on the copy's workflow, offline."""
    workflow = copy / WORKFLOW
    commands = {
        "check-jsonschema": [tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(workflow)],
        "zizmor": [tool("zizmor"), "--offline", "--no-progress", "--config", str(copy / ZIZMOR_CONFIG), str(workflow)],
    }
    out = {}
    for name, cmd in commands.items():
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        out[name] = (proc.returncode, proc.stdout + proc.stderr)
    return out


def test_the_released_workflow_passes_both_linters_and_only_runs_the_script(release):
    for name, (code, out) in lint(release).items():
        assert code == 0, f"{name} refuses the released workflow:\n{out}"
    text = (release / WORKFLOW).read_text()
    assert "on:\n  push:" in text
    runs = [line.strip() for line in text.splitlines() if line.strip().startswith("run:")]
    assert runs == [f"run: bash {SCRIPT}"], runs  # every step that grades is the script's
    for path in RESULTS:  # the artifact holds what the grader writes
        assert f"\n            {path}\n" in text, path
    assert os.access(release / SCRIPT, os.X_OK)
    readme = (release / "README.md").read_text()
    install = next(line for line in (release / SCRIPT).read_text().splitlines() if "pip install" in line)
    first = next(line for line in readme.splitlines() if "pip install" in line)
    assert install in first, "the script installs with the README's first command"
    assert WORKFLOW in readme and SCRIPT in readme


@pytest.mark.parametrize(
    "linter, old, new, says",
    [
        ("check-jsonschema", "    runs-on: ubuntu-latest\n", "", "'runs-on' is a required property"),
        ("check-jsonschema", "  push:\n", "  pushed:\n", "pushed"),
        (
            "zizmor",
            f"run: bash {SCRIPT}",
            f'run: echo "${{{{ github.event.head_commit.message }}}}" && bash {SCRIPT}',
            "template-injection",
        ),
        ("zizmor", "actions/upload-artifact@v4", "someone/upload-artifact@v4", "unpinned-uses"),
    ],
    ids=["no-runs-on", "unknown-event", "injection", "unpinned-third-party"],
)
def test_a_broken_workflow_fails_the_linter(release, tmp_path, linter, old, new, says):
    broken = tmp_path / "copy"
    (broken / WORKFLOW).parent.mkdir(parents=True)
    shutil.copy(release / ZIZMOR_CONFIG, broken / ZIZMOR_CONFIG)
    text = (release / WORKFLOW).read_text()
    assert text.count(old) == 1, old
    (broken / WORKFLOW).write_text(text.replace(old, new))
    code, out = lint(broken)[linter]
    assert code != 0 and says in out, out


def test_the_summary_is_the_score_table_in_markdown(tmp_path):
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")  # GitHub's summary file is appended to
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "grader",
            "--tasks",
            "1.1",
            "1.2",
            "--out",
            str(tmp_path / "out"),
            "--summary",
            str(summary),
        ],
        cwd=ROOT,
        env=mpi_environment(),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    lines = summary.read_text().splitlines()
    assert lines[0] == "earlier step" and "## tinytrain grader" in lines
    for t in results["tests"]:  # a row per task, as results.json has it
        status = "PASS" if t["status"] == "passed" else t["output"].split(":")[0]
        row = f"| {t['number']} | {RUBRIC.tasks[t['number']].title} | {t['score']:g}/{t['max_score']:g} | {status}"
        assert any(line.startswith(row) for line in lines), (row, lines)
    assert f"| | **total** | **{results['score']:g}/{results['max_score']:g}** | |" in lines


def test_a_summary_that_cannot_be_written_is_refused_before_grading(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "grader", "--tasks", "1.1", "--summary", str(tmp_path / "no" / "such" / "s.md")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and "error: --summary" in proc.stderr and "grading" not in proc.stderr, proc.stderr


@pytest.mark.slow  # a fresh virtual environment and pip install of the copy: about a minute
def test_the_workflows_script_installs_grades_and_writes_the_summary(release, tmp_path):
    """What the workflow runs, on a released copy with task 1.1 done: a fresh .venv from the
    README's command, the grader's results where the artifact step takes them, the table in
    $GITHUB_STEP_SUMMARY."""
    copy = tmp_path / "student"
    shutil.copytree(release, copy)
    solve(copy, RUBRIC, ("1.1",))
    summary = tmp_path / "summary.md"
    env = {k: v for k, v in mpi_environment().items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["GITHUB_STEP_SUMMARY"] = str(summary)
    proc = subprocess.run(
        ["bash", SCRIPT, "--tasks", "1.*"], cwd=copy, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert (copy / ".venv" / "bin" / "mpirun").exists(), "the README's install brings MPI into the copy's .venv"
    for path in RESULTS:
        assert (copy / path).is_file(), path
    results = json.loads((copy / RESULTS[0]).read_text())
    status = {t["number"]: t["status"] for t in results["tests"]}
    assert status["1.1"] == "passed" and results["score"] == RUBRIC.tasks["1.1"].points, out[-3000:]
    table = summary.read_text()
    assert f"| 1.1 | {RUBRIC.tasks['1.1'].title} | {RUBRIC.tasks['1.1'].points:g}/" in table
    assert "| TODO: TODO 1.2:" in table, table
