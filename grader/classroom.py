"""The student copy on GitHub (GitHub Classroom, or any repository): a workflow that grades each push.

``python -m grader release`` writes three files into the copy:

* ``.github/grade.sh`` -- the steps: install with the README's command (a ``.venv`` in the copy),
  grade with ``python -m grader``, and append the score table to the job's summary page
  (``$GITHUB_STEP_SUMMARY``; outside GitHub ``out/grader/summary.md``). Its arguments go to the
  grader: ``bash .github/grade.sh --tasks '1.*'`` grades one assignment the way the workflow would;
* ``.github/workflows/grade.yml`` -- on every push (and by hand from the Actions tab): check out,
  set up Python, run ``.github/grade.sh``, keep ``results.json`` and ``junit.xml`` as the run's
  artifact, even when grading failed;
* ``.github/zizmor.yml`` -- zizmor's policy for the workflow: GitHub's own actions by tag (the
  tests lint the workflow with zizmor and GitHub's workflow schema).

The workflow holds no grading step of its own, so what runs on GitHub is the script the tests run
on a released copy (``tests/grader/test_classroom.py``).
"""

from __future__ import annotations

import stat
from pathlib import Path

SCRIPT = ".github/grade.sh"
WORKFLOW = ".github/workflows/grade.yml"
ZIZMOR_CONFIG = ".github/zizmor.yml"
# The artifact's files: the grader's default --out (grader/__main__.py's DEFAULT_OUT)
RESULTS = ("out/grader/results.json", "out/grader/junit.xml")

GRADE_SH = """#!/usr/bin/env bash
# Grade this copy as its GitHub workflow does (.github/workflows/grade.yml runs this script):
# install with the README's command, grade every task, and put the score table on the job's
# summary page ($GITHUB_STEP_SUMMARY; run by hand, out/grader/summary.md). Arguments go to the
# grader: `bash .github/grade.sh --tasks '1.*'` grades assignment 1 only.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[dev]"
python -m grader --out out/grader --summary "${GITHUB_STEP_SUMMARY:-out/grader/summary.md}" "$@"
"""

GRADE_YML = f"""# Grades this copy on every push: the steps are {SCRIPT}, which runs the same way on your own
# machine. The score table is on the run's summary page; results.json (Gradescope's format) and
# junit.xml are kept as the run's artifact "grader-results". Grading exits 0 whenever it ran: a low
# score is not a red run, a broken install is.
name: grade

on:
  push:
  workflow_dispatch:

permissions:
  contents: read

jobs:
  grade:
    runs-on: ubuntu-latest
    timeout-minutes: 60
    steps:
      - uses: actions/checkout@v4
        with:
          persist-credentials: false
      - uses: actions/setup-python@v5
        with:
          python-version: "3.12"
      - name: Install and grade
        run: bash {SCRIPT}
      - name: Keep results.json and junit.xml
        if: always()
        uses: actions/upload-artifact@v4
        with:
          name: grader-results
          path: |
            {RESULTS[0]}
            {RESULTS[1]}
          if-no-files-found: error
"""

ZIZMOR_YML = """# zizmor (a static analyser for GitHub Actions) checks .github/workflows/: GitHub's own actions
# (actions/*) may be pinned by tag; any other action must be pinned by commit hash.
rules:
  unpinned-uses:
    config:
      policies:
        "actions/*": ref-pin
        "*": hash-pin
"""

README_SECTION = f"""
## On GitHub

The copy grades itself on every push: `{WORKFLOW}` runs `{SCRIPT}`
(install, `python -m grader`) and shows the score table on the run's summary page (the Actions
tab, the run, "Summary"), with `results.json` and `junit.xml` as the run's artifact
`grader-results`. The same script runs here:

```bash
bash {SCRIPT} --tasks '1.*'            # install into .venv, grade, the table in out/grader/summary.md
```
"""


def write_classroom(out: Path) -> list[str]:
    """Write the workflow, its script and zizmor's policy into the copy at ``out``; returns their paths."""
    files = {SCRIPT: GRADE_SH, WORKFLOW: GRADE_YML, ZIZMOR_CONFIG: ZIZMOR_YML}
    for rel, text in files.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    script = out / SCRIPT
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return list(files)
