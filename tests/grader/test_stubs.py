"""Stubs are generated from the reference's markers, stay in sync, and keep its interface."""

from __future__ import annotations

import ast
import importlib
import shutil
import subprocess
import sys

import pytest

from grader import guard
from grader.config import ROOT, is_release, load_rubric
from grader.stubs import MarkerError, assignment_text, find_regions, write_stubs

pytestmark = pytest.mark.skipif(is_release(), reason="needs the reference solution (not in a student copy)")
RUBRIC = load_rubric()


def test_checked_in_stubs_are_up_to_date():
    proc = subprocess.run(
        [sys.executable, "-m", "grader", "stubs", "--check"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_check_reports_a_stale_stub_with_a_diff(tmp_path):
    for a in RUBRIC.assignments.values():
        for rel in ("grader/rubric.toml", *a.references, *a.files):
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / rel, tmp_path / rel)
    a1 = RUBRIC.assignments["1"]
    (tmp_path / a1.file).write_text((tmp_path / a1.file).read_text().replace("TODO 1.2:", "TODO 1.2 (edited):"))
    stale, diff = write_stubs(tmp_path, check=True)
    assert stale == [a1.file]
    assert (
        '-    raise NotImplementedError("TODO 1.2 (edited):' in diff
        and '+    raise NotImplementedError("TODO 1.2:' in diff
    )
    write_stubs(tmp_path)  # regenerating fixes it
    assert write_stubs(tmp_path, check=True)[0] == []


def _functions(tree, regions=()) -> dict[str, tuple]:
    """name -> (arguments, docstring) of every function and class, nested ones too, except those
    defined inside a solution region (helpers of the solution, which the stub leaves out)."""
    out = {}
    for node in ast.walk(tree):
        if any(r.begin < node_line(node) - 1 < r.end for r in regions):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = (ast.dump(node.args), ast.get_docstring(node))
        elif isinstance(node, ast.ClassDef):
            out[node.name] = ("class", ast.get_docstring(node))
    return out


def node_line(node) -> int:
    return getattr(node, "lineno", 0)


@pytest.mark.parametrize("a", RUBRIC.assignments.values(), ids=lambda a: a.file)
def test_stub_keeps_every_signature_and_docstring_and_stubs_every_region(a):
    tasks = set()
    for reference, file in a.pairs:
        ref = (ROOT / reference).read_text()
        stub = (ROOT / file).read_text()
        regions = find_regions(ref, reference)
        assert _functions(ast.parse(stub)) == _functions(ast.parse(ref), regions), file
        assert ast.get_docstring(ast.parse(stub)) == ast.get_docstring(ast.parse(ref)), file
        for r in regions:
            assert f'{r.indent}raise NotImplementedError("{r.todo()}")' in stub.splitlines()
        assert "SOLUTION" not in stub
        tasks |= {r.task for r in regions}
    assert tasks == {t.id for t in a.tasks}, "every task of the rubric has a region"


@pytest.mark.parametrize("a", RUBRIC.assignments.values(), ids=lambda a: a.file)
def test_stub_imports_absolutely_and_never_the_reference(a):
    for file in a.files:
        tree = ast.parse((ROOT / file).read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level], file
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {al.name for n in ast.walk(tree) if isinstance(n, ast.Import) for al in n.names}
        assert not imported & set(a.renames), f"{file} imports the reference"
    assert guard.problems(a) == []


def test_a_package_assignment_is_a_package_whose_files_import_each_other():
    a = RUBRIC.by_name("tensor_parallel")
    assert len(a.files) > 1 and a.file == "assignments/a4_tensor_parallel"
    assert (a.reference_module, a.module) == ("tinytrain.parallel.tensor_parallel", "assignments.a4_tensor_parallel")
    model = (ROOT / "assignments/a4_tensor_parallel/model.py").read_text()
    assert "from assignments.a4_tensor_parallel.layers import (" in model
    assert "tinytrain.parallel.tensor_parallel" not in model.replace("# Generated from tinytrain", "")
    ref = importlib.import_module(a.reference_module)
    stub = importlib.import_module(a.module)
    names = [n for n in dir(ref) if not n.startswith("_")]
    assert [n for n in dir(stub) if not n.startswith("_")] == names
    assert all(getattr(stub, n) is not getattr(ref, n) for n in names if n not in ("annotations",))


@pytest.mark.parametrize(
    "reference, file, words",
    [
        ('["p/a.py", "p/__init__.py"]', '["q/a.py", "q/__init__.py"]', "list its __init__.py first"),
        ('["p/__init__.py", "elsewhere/a.py"]', '["q/__init__.py", "q/a.py"]', "outside p/"),
        ('["p/__init__.py", "p/a.py"]', '["q/__init__.py"]', "2 reference files but 1 assignment files"),
        ('"p/a.txt"', '"q/a.py"', "reference must be a .py path"),
    ],
)
def test_rubric_checks_the_files_of_an_assignment(tmp_path, reference, file, words):
    rubric = tmp_path / "rubric.toml"
    rubric.write_text(f'[assignment.9]\ntitle = "t"\nname = "n"\nreference = {reference}\nfile = {file}\n')
    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        load_rubric(rubric)


def test_solved_text_is_the_reference_without_markers():
    a = RUBRIC.assignments["1"]
    solved = assignment_text(a, RUBRIC, solved=True)
    assert "SOLUTION" not in solved
    assert not [ln for ln in solved.splitlines() if ln.strip().startswith('raise NotImplementedError("TODO')]
    body = [ln for ln in (ROOT / a.reference).read_text().splitlines() if "SOLUTION" not in ln and "import" not in ln]
    assert all(line in solved.splitlines() for line in body)


@pytest.mark.parametrize(
    "text, words",
    [
        ('x = 1\n# BEGIN SOLUTION 1.1 "hint"\ny = 2\n', "ref.py:2: BEGIN SOLUTION 1.1 has no # END SOLUTION"),
        (
            '# BEGIN SOLUTION 1.1 "a"\n# BEGIN SOLUTION 1.2 "b"\n# END SOLUTION\n',
            "ref.py:2: BEGIN SOLUTION 1.2 inside the region opened at line 1",
        ),
        ('def f():\n    # BEGIN SOLUTION "no task id"\n    # END SOLUTION\n', "ref.py:2: malformed marker"),
        ("# BEGIN SOLUTION 1.1\n# END SOLUTION\n", "ref.py:1: malformed marker"),
        ("x = 1\n# END SOLUTION\n", "ref.py:2: END SOLUTION without a BEGIN SOLUTION"),
    ],
)
def test_malformed_markers_are_errors_naming_file_and_line(text, words):
    with pytest.raises(MarkerError, match=words.replace("(", r"\(").replace(".", r"\.")):
        find_regions(text, "ref.py")
