"""``python -m grader leaks``: the share of each solution's expressions that the student copy holds.

The tool's normal form is checked on its own (names, order, spacing), then the copy itself: every
region at most ``REGION_LIMIT``, the median at most ``MEDIAN_LIMIT`` (issue 38)."""

from __future__ import annotations

import ast
import statistics

import pytest

from grader import leaks
from grader.config import is_release

pytestmark = pytest.mark.skipif(is_release(), reason="needs the reference solution (not in a student copy)")


def form(code: str) -> str:
    return leaks.normal_form(ast.parse(code, mode="eval").body)


def test_names_spacing_and_commutative_order_are_normalized():
    assert form("(r + 1 + shift - s) % n") == form("(shift+r -  s + 1) % n")
    assert form("(r + 1 + shift - s) % n") == form("(rank + 1 + offset - step) % size")  # renamed alike
    assert form("(r + 1 - s) % n") != form("(r - 1 - s) % n")  # a sign is not an order
    assert form("a * b * c") == form("c * (b * a)")
    assert form("a > b + 1") == form("b + 1 < a")
    assert form("x == f(y)") == form("f(y) == x")
    assert form("x[i:j] - y") != form("y - x[i:j]")  # subtraction does not commute
    assert form("comm.isend(buf, dest=right)") != form("comm.irecv(buf, dest=right)")  # the API's names stay


def test_a_handouts_prose_formula_is_found_as_code_is():
    text = "In step *s* rank *r* sends chunk *(r + 1 + shift − s) mod n* to the right; `x = a[⌊i/2⌋] · 3`."
    found = leaks.markdown_units(text)
    assert form("(r + 1 + shift - s) % n") in found, found
    solution = leaks.solution_units("send_i = (rank + 1 + offset - step) % size")
    assert set(solution) & set(found)
    assert leaks.normal_form(ast.parse("a[i // 2] * 3", mode="eval").body) in found


def test_trivial_units_and_one_call_regions_count_for_nothing():
    assert leaks.solution_units("y = f(x)\nreturn g(y, dest=peer)") == {}  # the API's own spelling
    assert leaks.solution_units("out = (a[i] + b[j]) * c") != {}
    row = leaks.Leak("f.py", 1, "1.1", {})
    assert row.share is None and leaks.measured([row]) == []


def test_a_stub_hint_and_a_docstring_are_read_as_prose():
    text = (
        'def f():\n    """Send chunk (r + 1 - s) % n each step."""\n'
        '    raise NotImplementedError("TODO 1.1: pick (r - s) % n * 2")\n'
    )
    found = leaks.python_units(text)
    assert form("(r + 1 - s) % n") in found and form("(r - s) % n * 2") in found


def test_the_student_copy_gives_no_solution_away():
    rows = leaks.measured(leaks.leaks("brief"))
    over = [f"{r.task} {r.file}:{r.line} {r.share:.2f}" for r in rows if r.share > leaks.REGION_LIMIT]
    assert not over, f"regions whose expressions the copy holds (python -m grader leaks --show TASK): {over}"
    median = statistics.median(r.share for r in rows)
    assert median <= leaks.MEDIAN_LIMIT, f"median share {median:.2f} > {leaks.MEDIAN_LIMIT}"
