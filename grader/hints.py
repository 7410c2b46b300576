"""How much a stub's hint gives away: the share of its solution's identifiers that the hint names.

A hint that names every call and argument of the solution (``reduce_scatter flat with op='avg',
sizes=s.sizes, ...``) can be transcribed without thinking; a brief hint says what the code must
achieve. For each solution region: the identifiers its code uses (names, attributes, keywords of
calls; Python's keywords and one-letter names aside), and the share of them that appear as words
in the hint::

    python -m grader hints                # every region's share at the brief level, and the median
    python -m grader hints --level full   # the same for the full hints

The brief hints are held to a median share of at most ``BRIEF_MEDIAN_LIMIT`` (a test checks it).
"""

from __future__ import annotations

import builtins
import io
import keyword
import re
import statistics
import textwrap
import tokenize
from dataclasses import dataclass

from .config import ROOT
from .stubs import solution_regions

BRIEF_MEDIAN_LIMIT = 0.10
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Names any Python code uses, which name nothing of the solution.
_COMMON = set(dir(builtins)) | {"self", "cls"}


@dataclass(frozen=True)
class Share:
    file: str
    line: int  # 1-based line of the BEGIN marker
    task: str
    hint: str
    used: frozenset[str]  # identifiers of the solution
    named: frozenset[str]  # those the hint names

    @property
    def share(self) -> float:
        return len(self.named) / len(self.used) if self.used else 0.0


def solution_identifiers(code: str) -> set[str]:
    """The identifiers a piece of code uses, less keywords, builtins, ``self`` and one-letter names."""
    names = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type == tokenize.NAME:
                names.add(tok.string)
    except (tokenize.TokenError, IndentationError):  # a region need not be a whole statement list
        names = set(_WORD.findall(code))
    return {n for n in names if len(n) > 1 and not keyword.iskeyword(n) and n not in _COMMON}


def hint_words(hint: str) -> set[str]:
    """Identifier-like words of a hint, and the parts of dotted or underscored ones (``s.sizes``)."""
    words = set(_WORD.findall(hint))
    return words | {part for w in words for part in w.split("_") if part}


def shares(level: str = "brief", root=ROOT) -> list[Share]:
    out = []
    for reference, r, lines in solution_regions(root):
        code = "\n".join(line for line in lines if not line.strip().startswith("#"))
        used = solution_identifiers(textwrap.dedent(code))
        said = r.todo(level).partition(": ")[2]
        words = hint_words(said)
        named = {u for u in used if u in words}
        out.append(Share(reference, r.begin + 1, r.task, said, frozenset(used), frozenset(named)))
    return out


def median_share(level: str = "brief") -> float:
    return statistics.median(s.share for s in shares(level))


def main(level: str) -> int:
    rows = shares(level)
    for s in sorted(rows, key=lambda s: -s.share):
        named = ", ".join(sorted(s.named))
        print(f"{s.share:5.2f}  {s.task:<4} {s.file}:{s.line}  names {len(s.named)}/{len(s.used)}: {named}")
    print(
        f"\n{len(rows)} regions; median share of a solution's identifiers named by its {level} hint: "
        f"{statistics.median(s.share for s in rows):.2f} (brief limit {BRIEF_MEDIAN_LIMIT})"
    )
    return 0
