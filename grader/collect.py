"""``python -m grader collect DIR... [--out scores.csv]``: a class's scores in one table.

Each DIR is a student's copy (its ``out/grader/results.json``, where ``python -m grader`` writes), a
folder holding a ``results.json`` (the ``grader-results`` artifact of the copy's GitHub workflow,
unpacked), or a ``results.json`` itself. Every DIR is a row: its total, then a column per task
(the rubric's tasks in order, and any other task a results.json has); a task a copy was not graded
on is empty. A DIR that is missing, or whose results.json cannot be read, is a row that says why
in its ``note``, with no scores. The table is printed and, with ``--out``, written as CSV.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .config import load_rubric

# Where a results.json may be below a DIR: the folder itself, then the grader's default --out
PLACES = (Path("results.json"), Path("out") / "grader" / "results.json")


@dataclass
class Row:
    name: str  # the DIR as given
    score: float | None = None
    max_score: float | None = None
    tasks: dict[str, float] = field(default_factory=dict)  # task id -> score
    note: str = ""  # why there are no scores, or "" when there are


def find_results(arg: str) -> tuple[Path | None, str]:
    """The results.json of a DIR argument, or (None, why there is none)."""
    path = Path(arg)
    if not path.exists():
        return None, f"missing: {arg} does not exist"
    if path.is_file():
        return path, ""
    for place in PLACES:
        if (path / place).is_file():
            return path / place, ""
    where = " or ".join(str(path / p) for p in PLACES)
    return None, f"not graded: no {where} (run python -m grader in the copy)"


def read_row(arg: str) -> Row:
    path, why = find_results(arg)
    if path is None:
        return Row(arg, note=why)
    try:
        data = json.loads(path.read_text())
        tasks = {str(t["number"]): _number(t["score"], f"task {t['number']}'s score") for t in data["tests"]}
        score, most = _number(data["score"], "score"), _number(data["max_score"], "max_score")
    except (OSError, UnicodeDecodeError) as exc:
        return Row(arg, note=f"broken: cannot read {path} ({exc})")
    except ValueError as exc:  # json's errors are ValueErrors too
        return Row(arg, note=f"broken: {path} is not the grader's results.json ({exc})")
    except KeyError as exc:
        return Row(arg, note=f"broken: {path} is not the grader's results.json (it has no {exc})")
    except TypeError:
        return Row(arg, note=f"broken: {path} is not the grader's results.json (not an object with a list of tests)")
    return Row(arg, score, most, tasks)


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} is {value!r}, not a number")
    return float(value)


def task_columns(rows: list[Row]) -> list[str]:
    """The rubric's tasks in order, then any other task id found (an older or newer rubric)."""
    ids = [t.id for t in load_rubric().select(None)]
    others = {t for r in rows for t in r.tasks if t not in ids}
    return ids + sorted(others, key=lambda t: [int(x) if x.isdigit() else x for x in t.split(".")])


def records(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    """(header, a list of cells per row) of the table and the CSV."""
    columns = task_columns(rows)
    header = ["copy", "score", "max_score", *columns, "note"]

    def fmt(x: float | None) -> str:
        return "" if x is None else f"{x:g}"

    body = [[r.name, fmt(r.score), fmt(r.max_score), *(fmt(r.tasks.get(c)) for c in columns), r.note] for r in rows]
    return header, body


def table(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header) - 1)]
    lines = []
    for row in [header, *body]:
        if row[-1] and not any(row[1:-1]):  # no scores: the reason, where the scores would be
            lines.append(f"{row[0].ljust(widths[0])}  {row[-1]}")
            continue
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells + [row[-1]]).rstrip())
    return "\n".join(lines)


def main(dirs: list[str], out: str | None) -> int:
    rows = [read_row(d) for d in dirs]
    header, body = records(rows)
    if out:
        try:
            with open(out, "w", newline="") as f:
                csv.writer(f).writerows([header, *body])
        except OSError as exc:
            print(f"error: cannot write --out {out} ({exc.strerror}); choose another file", file=sys.stderr)
            return 2
    print(table(header, body))
    graded = [r for r in rows if r.note == ""]
    print(f"\n{len(graded)} of {len(rows)} copies graded" + (f"; wrote {out}" if out else ""))
    return 0
