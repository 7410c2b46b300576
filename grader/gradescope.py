"""``python -m grader gradescope OUT.zip``: an autograder for Gradescope, built on the student copy.

Gradescope unpacks the zip into ``/autograder/source``, runs ``setup.sh`` once as root when it
builds the image, copies ``run_autograder`` to ``/autograder/run_autograder`` and runs it, from
``/autograder``, for every submission (in ``/autograder/submission``); what it shows is
``/autograder/results/results.json``. The zip holds, at its root:

* ``setup.sh`` -- installs Python and, in a virtual environment ``/autograder/venv``, the copy with
  the README's command (``pip install -e ".[dev]"``: NumPy, mpi4py, MPI itself, pytest);
* ``run_autograder`` -- takes the submission's assignment files into the copy and grades them
  (``python -m grader.gradescope``, below), always leaving a ``results.json``;
* ``tinytrain/`` -- a student copy (``python -m grader release``): the grader and the tests the
  students have, no solutions.

Only the submission's assignment files are used: the grader and the tests are the copy's, so a
submission cannot change how it is graded. A submission may be the whole repository (uploaded
from GitHub, in a folder or not), its ``assignments/`` folder, or the files alone: each file of
the rubric is found by its path below ``assignments/`` (``a4_tensor_parallel/layers.py``). A file
the submission lacks stays the copy's stub, and its tasks are TODO.

``AUTOGRADER_ROOT`` moves ``/autograder`` elsewhere (the tests run ``run_autograder`` so).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from .config import ROOT, is_release, load_rubric
from .run import mpi_environment

COPY = "tinytrain"  # the student copy's folder inside the zip (/autograder/source/tinytrain)

SETUP_SH = f"""#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image (Ubuntu): Python, and
# the student copy installed with its README's command into a virtual environment.
set -euo pipefail
ROOT="${{AUTOGRADER_ROOT:-/autograder}}"
apt-get update
apt-get install -y python3 python3-venv python3-pip
cd "$ROOT/source/{COPY}"
python3 -m venv "$ROOT/venv" && . "$ROOT/venv/bin/activate" && pip install -e ".[dev]"
"""

RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this for every submission, from /autograder (AUTOGRADER_ROOT elsewhere): the
# submission's assignment files go into the student copy, which grades them into
# results/results.json. The grader and tests are the copy's own, whatever the submission holds.
set -euo pipefail
ROOT="${{AUTOGRADER_ROOT:-/autograder}}"
if [ -f "$ROOT/venv/bin/activate" ]; then . "$ROOT/venv/bin/activate"; fi
cd "$ROOT/source/{copy}"
export PYTHONPATH="$PWD"  # the copy's packages, whatever else is installed
python -m grader.gradescope --root "$ROOT"{grader_args}
"""


def build(zip_path: Path, tasks: list[str] | None = None, hints: str = "brief", root: Path = ROOT) -> list[str]:
    """Write the autograder zip; ``tasks`` (globs, as ``--tasks``) are what each submission is graded
    on (all when None). Returns the names in the zip."""
    from .release import make_release

    zip_path = Path(zip_path)
    if zip_path.suffix != ".zip":
        raise ValueError(f"{zip_path}: Gradescope takes a .zip; name the file OUT.zip")
    if zip_path.exists():
        raise FileExistsError(f"{zip_path} already exists; choose a new file name")
    chosen = [t.id for t in load_rubric(root / "grader" / "rubric.toml").select(tasks)] if tasks else []
    grader_args = "".join(f" {shlex.quote(a)}" for a in (["--tasks", *chosen] if chosen else []))
    with tempfile.TemporaryDirectory(prefix="tinytrain-gradescope-") as tmp:
        source = Path(tmp)
        make_release(source / COPY, root=root, hints=hints)
        scripts = {
            "setup.sh": SETUP_SH,
            "run_autograder": RUN_AUTOGRADER.format(copy=COPY, grader_args=grader_args),
        }
        names = []
        with zipfile.ZipFile(zip_path, "w", zipfile.ZIP_DEFLATED) as zf:
            for name, text in scripts.items():  # at the root of the zip, executable
                info = zipfile.ZipInfo(name, date_time=time.localtime()[:6])
                info.external_attr = (stat.S_IFREG | 0o755) << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(info, text)
                names.append(name)
            for path in sorted(p for p in (source / COPY).rglob("*") if p.is_file()):
                name = path.relative_to(source).as_posix()
                zf.write(path, name)
                names.append(name)
    return names


def find_submitted(submission: Path, rubric) -> dict[str, Path]:
    """Each assignment file of the rubric (``assignments/a1_collectives.py``) -> where the submission
    has it: at its path below ``assignments/``, in any folder, the one nearest the top (a path
    that also ends in ``assignments/`` first)."""
    files = [p for p in submission.rglob("*.py") if not any(x.startswith(".") for x in p.relative_to(submission).parts)]
    found = {}
    for a in rubric.assignments.values():
        for rel in a.files:
            tail = Path(rel).relative_to("assignments").parts
            mine = [p for p in files if p.parts[-len(tail) :] == tail]
            if mine:
                full = Path(rel).parts
                found[rel] = min(mine, key=lambda p: (p.parts[-len(full) :] != full, len(p.parts), str(p)))
    return found


def take_submission(submission: Path, copy: Path, rubric, tasks: list[str] | None) -> tuple[list[str], list[str]]:
    """Copy the submission's assignment files over the copy's stubs; returns (taken, and missing
    among the files of the assignments graded)."""
    found = find_submitted(submission, rubric)
    for rel, path in found.items():
        shutil.copyfile(path, copy / rel)
    graded = {t.assignment for t in rubric.select(tasks)}
    in_order = [rel for a in rubric.assignments.values() for rel in a.files]  # a2 before a10, as the course runs
    wanted = [rel for a in rubric.assignments.values() if a.id in graded for rel in a.files]
    taken = sorted(found, key=lambda rel: (in_order.index(rel) if rel in in_order else len(in_order), rel))
    return taken, [rel for rel in wanted if rel not in found]


def run(root: Path, tasks: list[str] | None = None) -> int:
    """Grade ``root/submission`` in this copy into ``root/results/results.json``, which it always
    writes: Gradescope shows nothing without one, so a failure is a score of 0 in words."""
    start = time.monotonic()
    path = root / "results" / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        results = grade_submission(root / "submission", path.parent, tasks)
    except Exception as exc:  # whatever it was, the student sees a result that says it
        results = {"score": 0.0, "output": f"The autograder failed: {type(exc).__name__}: {exc}", "tests": []}
    results["execution_time"] = round(time.monotonic() - start)
    path.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def grade_submission(submission: Path, results_dir: Path, tasks: list[str] | None) -> dict:
    """The submission's files into this copy, graded; Gradescope's results, the files named in its output."""
    taken, missing = take_submission(submission, ROOT, load_rubric(), tasks)
    note = f"Graded from your submission: {', '.join(taken) or 'no assignment file'}."
    if missing:
        note += f"\nNot in your submission (graded as the TODO stubs): {', '.join(missing)}."
    cmd = [sys.executable, "-m", "grader", "--out", str(results_dir), *(["--tasks", *tasks] if tasks else [])]
    proc = subprocess.run(cmd, cwd=ROOT, env=mpi_environment(), capture_output=True, text=True, check=False)
    print(proc.stdout + proc.stderr)  # Gradescope keeps it in results/stdout, for the instructor
    try:
        results = json.loads((results_dir / "results.json").read_text()) if proc.returncode == 0 else None
    except (OSError, ValueError):
        results = None
    if results is None:
        tail = (proc.stdout + proc.stderr)[-3000:]
        results = {"score": 0.0, "output": f"The grader failed (exit {proc.returncode}):\n{tail}", "tests": []}
    results["output"] = "\n\n".join(x for x in (note, results.get("output", "")) if x)
    return results


def main(out: str, tasks: list[str] | None, hints: str) -> int:
    """``python -m grader gradescope OUT.zip``."""
    try:
        names = build(Path(out), tasks, hints)
    except (FileExistsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: cannot write {out} ({exc.strerror}); choose another place", file=sys.stderr)
        return 2
    which = f"tasks {' '.join(tasks)}" if tasks else "every task"
    print(
        f"wrote {out}: setup.sh, run_autograder and a student copy ({len(names) - 2} files); each submission "
        f"is graded on {which}. Upload it as a Gradescope programming assignment's autograder."
    )
    return 0


if __name__ == "__main__":  # run_autograder's step, inside the student copy
    import argparse

    p = argparse.ArgumentParser(prog="python -m grader.gradescope", description="grade a Gradescope submission")
    p.add_argument("--root", default=os.environ.get("AUTOGRADER_ROOT", "/autograder"), help="Gradescope's folder")
    p.add_argument("--tasks", nargs="+", metavar="PATTERN", help="the tasks to grade (default: all)")
    args = p.parse_args()
    if not is_release():
        print("error: run_autograder grades inside the student copy of the autograder zip", file=sys.stderr)
        sys.exit(2)
    sys.exit(run(Path(args.root), args.tasks))
