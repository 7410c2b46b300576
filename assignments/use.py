"""Run tinytrain on your assignment code: what ``tinytrain train --impl assignments`` does.

The CLI trains with tinytrain's own chapters (``tinytrain/parallel/...``). In a student copy their
solution regions are stubs, so a run that needs one stops at its TODO even after you wrote it in
``assignments/``. :func:`use_assignments` swaps your code in: every function and class that an
assignment file defines in place of the reference's replaces the reference's object of the same
name -- in the reference module, in its package, and wherever tinytrain had already imported it
(``from x import y`` copies and module-level tables such as a schedule registry). From then on the
training loop, the schedules and the layers run your code; tasks you have not done stop at their
TODO, with its text.

    from assignments.use import use_assignments
    use_assignments()          # before the run builds its model and schedule

It changes only this process, and only objects, never files.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import sys

from grader.config import ROOT, load_rubric, module_name


def _defined_in(module) -> dict[str, object]:
    """The functions and classes ``module`` defines itself (not what it imports)."""
    return {
        name: obj
        for name, obj in vars(module).items()
        if callable(obj) and getattr(obj, "__module__", None) == module.__name__
    }


def use_assignments(assignments: list[str] | None = None) -> list[str]:
    """Make tinytrain run the assignment code (all assignments, or those ids); returns what was
    swapped, as "module.name" of the reference."""
    swaps = _swaps(assignments)
    _swap_all(swaps)
    return sorted(where for _, _, where in swaps.values())


@contextlib.contextmanager
def tasks_in_use(tasks: list[str]):
    """For the with-block only, tinytrain runs the assignment files that hold these tasks' code
    (the reference's objects come back after it). The grader uses it in a student copy, where a
    task's tests run framework code that calls another assignment's reference (ZeRO-3's layers
    recompute with ``checkpoint``, task 8.1): the reference is a stub there, so they run the
    student's code of the task they require instead."""
    swaps = _swaps(None, set(tasks))
    _swap_all(swaps)
    try:
        yield
    finally:
        _swap_all({id(yours): (yours, it, where) for it, yours, where in swaps.values()})


def _swaps(assignments: list[str] | None, tasks: set[str] | None = None) -> dict[int, tuple[object, object, str]]:
    """id(reference object) -> (it, yours, "module.name"), for the assignments chosen (None: all),
    and with ``tasks``, only in the files that hold one of their solution regions."""
    rubric = load_rubric()
    swaps: dict[int, tuple[object, object, str]] = {}
    for a in rubric.assignments.values():
        if assignments and a.id not in assignments:
            continue
        for reference, own in a.pairs:
            if tasks is not None and not tasks & _tasks_in(ROOT / reference):
                continue
            ref_module = importlib.import_module(module_name(reference))
            own_module = importlib.import_module(module_name(own))
            for name, obj in _defined_in(ref_module).items():
                if name in vars(own_module):
                    swaps[id(obj)] = (obj, vars(own_module)[name], f"{ref_module.__name__}.{name}")
    return swaps


# A task's code in a reference file: its solution region, or in a student copy, its stub.
_TASK_IN = re.compile(r'# BEGIN SOLUTION (\d+\.\d+) |NotImplementedError\("TODO (\d+\.\d+):')


def _tasks_in(path) -> set[str]:
    return {a or b for a, b in _TASK_IN.findall(path.read_text())}


def _swap_all(swaps: dict) -> None:
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("tinytrain"):
            _swap_in(vars(module), swaps)


def _swap_in(namespace: dict, swaps: dict) -> None:
    for name, value in list(namespace.items()):
        hit = swaps.get(id(value))
        if hit is not None and hit[0] is value:
            namespace[name] = hit[1]
        elif isinstance(value, dict) and not name.startswith("__"):
            for key, item in list(value.items()):
                hit = swaps.get(id(item))
                if hit is not None and hit[0] is item:
                    value[key] = hit[1]
