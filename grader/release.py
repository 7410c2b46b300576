"""``python -m grader release OUT``: a copy of the repository for students, without solutions.

What the copy holds:

* every git-tracked file, except those under ``[release] exclude`` of the rubric (the grader's own
  tests, which plant bugs into the solution and so would show it);
* each reference file of an assignment (every file of a reference package) with its solution
  regions replaced by the same stubs as the assignment file (the framework then uses its
  stand-ins: ``AlgorithmSource`` in ``tinytrain/distributed/choice.py``, ``rooted.py``);
* ``grader/RELEASE``, which makes ``--impl`` default to ``assignments`` and skips the tests of
  the removed reference solutions.

It refuses to write when any ``BEGIN SOLUTION`` marker would survive into the copy.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from .classroom import README_SECTION, write_classroom
from .config import RELEASE_MARKER, ROOT, is_release, load_rubric
from .stubs import BEGIN, HINT_LEVELS, assignment_texts, released_reference_text

RELEASE_NOTE = """This is a student copy of tinytrain, made by `python -m grader release`.

The reference solutions of the assignments are not in it: where the framework needs one of them,
it uses a simpler stand-in. Write your solutions in assignments/ and grade them with

    python -m grader              (score table, results.json)
    mpirun -n 4 python -m pytest  (the whole test suite; your unfinished tasks show as TODO skips)
"""


STUDENT_README = """# tinytrain: the student copy

```bash
python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[dev]" && python -m grader   # set up, grade
pip install -e ".[dev]" && mpirun -n 4 python -m pytest -q                                       # the whole suite
```

This is your copy of tinytrain, a small training framework in which every parallel strategy is
a chapter you write. The reference solutions are not here: each part you write is a
`raise NotImplementedError("TODO <task>: <hint>")` in `assignments/`, and the handout beside it
(`assignments/a1_collectives.md`, ...) explains the algorithm, its invariants and a worked case.

## Setting up

Python 3.10 or newer. The first command above makes a virtual environment in `.venv/` and installs
tinytrain, NumPy, mpi4py, MPI itself (the `mpich` wheel brings `mpirun`), pytest and Jupyter's
kernel into it. In a new terminal, `. .venv/bin/activate` first.

## The assignments

| assignment | files | handout | tasks |
|---|---|---|---|
{rows}

Do them in any order: a task scores in full once it and the tasks named in its handout as
prerequisites (the `requires` column) are correct, whatever else you have done. Where the
framework needs a part you have not written, it uses a simpler stand-in or reports the TODO.

## Grading

```bash
python -m grader                      # every task: the score table
python -m grader --tasks '1.*'        # one assignment (quote the pattern), or --tasks 1.1 1.3
mpirun -n 4 python -m pytest tests/graded -x   # the same tests with pytest's full output
TINYTRAIN_GRADER_SEED=1234 python -m grader --tasks 1.1   # replay the inputs of a failure
```

A task scores its points only if all its tests pass on every rank; an unfinished task shows as
TODO (0 points), never as an error. A failure says what went wrong first, on which rank, and the
seed that replays it. A hang or a crash costs only its own task. Results go to `out/grader/`:
`results.json` (Gradescope's format) and `junit.xml`.

## Your analysis

```bash
python -m grader report               # report.md: each assignment's tables, measured on your code
```

Each assignment ends with an analysis of your own runs: bytes against the formula, memory per
rank against the ZeRO paper, the bubble of your schedules, drops against the capacity factor, ring
against all-to-all attention. The questions under each table are yours to answer in prose (the
grader scores the code, not the prose).

## Running your own code

```bash
tinytrain train --impl assignments                      # train a small GPT on your code (serially)
mpirun -n 4 tinytrain train --impl assignments --dp 4   # ... data parallel on your DDP (assignment 2)
mpirun -n 4 tinytrain bench collectives --impl assignments --algo ring   # your collectives vs MPI's
```

Without `--impl assignments`, `tinytrain train` runs the framework's own chapters, which this copy
cuts out: a layout stops at the TODO of the chapter it needs. Runs write to `runs/latest/`
(`metrics.json`, `loss.png`, the checkpoint); `--trace run.json --plot` adds a Chrome trace and a
timeline. The notebooks in `notebooks/` draw what the handouts describe once their tasks are done.
"""


def student_readme(rubric) -> str:
    rows = []
    for a in rubric.assignments.values():
        files = a.file + ("/" if len(a.files) > 1 else "")
        tasks = ", ".join(t.id + (f" (requires {', '.join(t.requires)})" if t.requires else "") for t in a.tasks)
        rows.append(f"| {a.id} {a.title} | `{files}` | `{a.handout}` | {tasks} |")
    return STUDENT_README.format(rows="\n".join(rows))


def tracked_files(root: Path = ROOT) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p]


def make_release(out: Path, root: Path = ROOT, hints: str = "brief") -> list[str]:
    """Write the student copy into ``out`` (which must not exist), its stubs at hint level ``hints``.
    Returns the files written."""
    rubric = load_rubric(root / "grader" / "rubric.toml")
    if out.exists():
        raise FileExistsError(f"{out} already exists; choose a new folder")
    if hints not in HINT_LEVELS:
        raise ValueError(f"--hints {hints}: choose one of {', '.join(HINT_LEVELS)}")
    stubs = {
        f: t for a in rubric.assignments.values() for f, t in assignment_texts(a, rubric, root, hints=hints).items()
    }
    exclude = tuple(load_release_excludes(root))
    references = {ref: a for a in rubric.assignments.values() for ref in a.references}  # every file of a package
    written = []
    for rel in tracked_files(root):
        if rel.startswith(exclude) or not (root / rel).is_file():
            continue
        dest = out / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if rel in references:
            dest.write_text(released_reference_text(references[rel], root, reference=rel, hints=hints))
        elif rel in stubs:  # the checked-in stubs have brief hints; another level is generated
            dest.write_text(stubs[rel])
        else:
            shutil.copy2(root / rel, dest)
        # (grader/ itself only shows markers as examples)
        if (
            rel.endswith(".py")
            and not rel.startswith("grader/")
            and any(BEGIN.match(line) for line in dest.read_text().splitlines())
        ):
            shutil.rmtree(out)
            raise ValueError(
                f"{rel} has solution regions but is not the reference of any assignment in "
                "grader/rubric.toml; add it there (or remove the markers) before releasing"
            )
        written.append(rel)
    (out / RELEASE_MARKER.relative_to(ROOT)).write_text(RELEASE_NOTE)
    (out / "README.md").write_text(student_readme(rubric) + README_SECTION)  # a student's: no instructor commands
    written += write_classroom(out)  # .github/: the workflow that grades each push, and its script
    return written


def load_release_excludes(root: Path = ROOT) -> list[str]:
    from .config import tomllib

    with open(root / "grader" / "rubric.toml", "rb") as f:
        return list(tomllib.load(f).get("release", {}).get("exclude", []))


def main(out: str, hints: str = "brief") -> int:
    if is_release():
        print("This is already a student copy; make releases from the instructors' repository.")
        return 2
    try:
        files = make_release(Path(out), hints=hints)
    except (FileExistsError, ValueError) as exc:
        print(f"error: {exc}")
        return 2
    except OSError as exc:  # a place no folder can be made in (/proc, a file on the path, a full disk)
        print(f"error: cannot write the student copy in {out} ({exc.strerror}); choose another folder")
        return 2
    print(
        f"wrote a student copy of {len(files)} files to {out}: solution regions stubbed, "
        f"hints {hints}, --impl defaults to assignments there"
    )
    return 0
