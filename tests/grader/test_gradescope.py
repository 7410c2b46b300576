"""``python -m grader gradescope OUT.zip``: the zip is laid out as Gradescope's autograder
specification asks, and its ``run_autograder``, unpacked as Gradescope unpacks it (with
``AUTOGRADER_ROOT`` for ``/autograder``), grades a stub submission 0 with every task TODO and a
solved one in full. The zip grades assignment 1 (``--tasks '1.*'``) to keep this quick."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import zipfile
from pathlib import Path

import pytest

from grader.config import is_release, load_rubric
from grader.gradescope import COPY, build, find_submitted
from grader.run import mpi_environment
from grader.stubs import assignment_text

pytestmark = [
    pytest.mark.skipif(is_release(), reason="the autograder is made from the instructors' repository"),
    pytest.mark.deadline(600),  # two runs of run_autograder, each a grader run of assignment 1
]
RUBRIC = load_rubric()
A1 = RUBRIC.assignments["1"]


@pytest.fixture(scope="module")
def autograder_zip(tmp_path_factory):
    path = tmp_path_factory.mktemp("gradescope") / "autograder.zip"
    build(path, tasks=["1.*"])
    return path


def unpack(zip_path: Path, root: Path) -> Path:
    """What Gradescope does: the zip into root/source (file modes kept, as unzip keeps them),
    run_autograder copied to root/run_autograder, an empty root/submission."""
    source = root / "source"
    with zipfile.ZipFile(zip_path) as zf:
        zf.extractall(source)
        for info in zf.infolist():
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                (source / info.filename).chmod(mode)
    shutil.copy2(source / "run_autograder", root / "run_autograder")
    (root / "submission").mkdir()
    return root


def run_autograder(root: Path) -> tuple[dict, str]:
    env = dict(mpi_environment(), AUTOGRADER_ROOT=str(root))
    env.pop("PYTHONPATH", None)  # run_autograder sets its own: the copy's packages
    proc = subprocess.run(
        [str(root / "run_autograder")], cwd=root, env=env, capture_output=True, text=True, timeout=500, check=False
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    return json.loads((root / "results" / "results.json").read_text()), out


def test_the_zip_has_gradescopes_two_scripts_at_its_root_and_a_student_copy(autograder_zip):
    with zipfile.ZipFile(autograder_zip) as zf:
        infos = {i.filename: i for i in zf.infolist()}
        setup = zf.read("setup.sh").decode()
    for script in ("setup.sh", "run_autograder"):
        assert infos[script].external_attr >> 16 & stat.S_IXUSR, f"{script} is not executable"
    assert f"{COPY}/grader/RELEASE" in infos and f"{COPY}/grader/gradescope.py" in infos
    assert not any(name.startswith(f"{COPY}/tests/grader/") for name in infos), "the grader's tests hold solutions"
    assert 'pip install -e ".[dev]"' in setup  # the README's install
    assert subprocess.run(["bash", "-n", "-c", setup], check=False).returncode == 0


def test_a_stub_submission_scores_zero_with_every_task_todo(autograder_zip, tmp_path):
    root = unpack(autograder_zip, tmp_path / "autograder")
    shutil.copytree(root / "source" / COPY / "assignments", root / "submission" / "assignments")  # untouched
    results, out = run_autograder(root)
    assert results["score"] == 0 and [t["number"] for t in results["tests"]] == [t.id for t in A1.tasks], out
    assert all(t["output"].startswith("TODO") for t in results["tests"]), results
    assert "Graded from your submission: assignments/a1_collectives.py" in results["output"]


def test_a_solved_submission_scores_full_marks(autograder_zip, tmp_path):
    root = unpack(autograder_zip, tmp_path / "autograder")
    (root / "submission" / Path(A1.file).name).write_text(assignment_text(A1, RUBRIC, solved=True))  # loose file
    results, out = run_autograder(root)
    assert results["score"] == sum(t.points for t in A1.tasks) == 100, out[-3000:]
    assert all(t["status"] == "passed" for t in results["tests"]), results


def test_an_autograder_that_fails_still_leaves_a_results_json_that_says_why(autograder_zip, tmp_path):
    """Gradescope shows nothing without results.json: an autograder that stops (here on a task
    that does not exist) is a score of 0 with its words."""
    root = unpack(autograder_zip, tmp_path / "autograder")
    script = root / "run_autograder"
    script.write_text(script.read_text().replace("--tasks 1.1 1.2 1.3 1.4 1.5", "--tasks 9.9"))
    results, out = run_autograder(root)
    assert results["score"] == 0 and results["tests"] == [], results
    assert results["output"].startswith("The autograder failed: ValueError: --tasks 9.9 matches no task"), results


def test_submitted_files_are_found_by_their_path_below_assignments(tmp_path):
    sub = tmp_path / "submission"
    repo = sub / "tinytrain-main"  # a repository uploaded in its folder
    a4 = RUBRIC.by_name("tensor_parallel")
    for rel in (A1.file, *a4.files, "tests/graded/test_a1_collectives.py"):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text("")
    (repo / ".venv" / "lib" / A1.file).parent.mkdir(parents=True)
    (repo / ".venv" / "lib" / A1.file).write_text("")  # hidden folders are not the student's work
    (sub / "old" / "a1_collectives.py").parent.mkdir(parents=True)
    (sub / "old" / "a1_collectives.py").write_text("")  # nearer the top, but not below assignments/
    found = find_submitted(sub, RUBRIC)
    assert found == {rel: repo / rel for rel in (A1.file, *a4.files)}


def test_the_command_refuses_an_existing_file_and_a_name_that_is_not_a_zip(tmp_path, capsys):
    from grader.gradescope import main

    (tmp_path / "a.zip").write_text("")
    assert main(str(tmp_path / "a.zip"), None, "brief") == 2
    assert "a.zip already exists; choose a new file name" in capsys.readouterr().err
    assert main(str(tmp_path / "a.tar"), None, "brief") == 2
    assert "Gradescope takes a .zip" in capsys.readouterr().err
    assert main(str(tmp_path / "b.zip"), ["11.*"], "brief") == 2
    assert "matches no task" in capsys.readouterr().err
