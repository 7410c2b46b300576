"""tinytrain's settings from the environment (those outside ``tinytrain.distributed``), read checked.

A bad value is a ``ValueError`` that names the variable and the values it takes (the ``tinytrain``
command prints it as one sentence, exit 2), never a value quietly read as something else. A switch
takes ``0`` or ``1`` only: ``TINYTRAIN_DEBUG`` is also read by ``tinytrain.distributed`` (anything
but ``0`` or empty is on there), so a word like ``false`` would mean "on" to it; refusing it keeps
the two readers in agreement. Imports nothing of tinytrain: every layer may use it.
"""

from __future__ import annotations

import os


def switch(name: str, default: bool = False, what: str = "") -> bool:
    """``name`` as an on/off switch: ``1`` on, ``0`` off, unset or empty ``default``."""
    value = os.environ.get(name, "").strip()
    if value == "":
        return default
    if value in ("0", "1"):
        return value == "1"
    raise ValueError(f"{name}={value!r} is not a setting it takes: 1 ({what or 'on'}) or 0 (off), or leave it unset")


def positive_int(name: str, default: int, what: str = "") -> int:
    """``name`` as a whole number of at least 1, ``default`` when unset or empty."""
    value = os.environ.get(name, "").strip()
    if value == "":
        return default
    if not value.isdigit() or int(value) < 1:
        raise ValueError(
            f"{name}={value!r} is not a setting it takes: a whole number of at least 1{f' ({what})' if what else ''}"
            ", or leave it unset"
        )
    return int(value)


def positive_number(name: str, default: float, what: str = "") -> float:
    """``name`` as a positive, finite number, ``default`` when unset or empty; ``what`` follows
    "a positive number" in the error ("(GB/s)", "of seconds such as 2")."""
    value = os.environ.get(name, "").strip()
    if value == "":
        return default
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not 0 < number < float("inf"):
        raise ValueError(
            f"{name}={value!r} is not a setting it takes: a positive number{f' {what}' if what else ''}, "
            "or leave it unset"
        )
    return number


def positive_seconds(name: str, default: float) -> float:
    """``name`` as a positive, finite number of seconds, ``default`` when unset or empty."""
    return positive_number(name, default, f"of seconds such as {default:g}")
