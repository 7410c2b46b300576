"""How much of a solution a student copy already holds: its expressions found elsewhere in the copy.

``python -m grader hints`` counts the names a stub's hint gives; this counts the *code* the rest
of the copy gives. A handout that gives a per-step index formula ("at step *k* node *i* takes item
*(i + 2k) mod m*"), or a framework stand-in that is the task's algorithm run backwards, can be
transcribed line for line even when the hint is brief. For every solution region this lists its non-trivial
expressions and statements that also occur in the copy a student gets at that hint level::

    python -m grader leaks                  # each region's share, the median and the worst
    python -m grader leaks --show 1.1       # what region(s) of task 1.1 leak, and where from
    python -m grader leaks --level full     # the same for a copy released with --hints full

What is compared (both sides normalized the same way):

* a solution's *units*: every expression and simple statement of its region (a compound
  statement's header: a ``for``'s target and iterable, an ``if``'s test) that does at least
  ``MIN_OPS`` operations (calls, arithmetic, comparisons, subscripts, ...): ``x.y`` or ``f(a)``
  alone is no give-away, ``(i + 2 * k) % m`` is;
* normalized: variable names become placeholders in order of use (``k`` and ``step`` read
  alike), strings become one placeholder, spacing goes, and operands of ``+``/``-``, ``*``,
  ``and``/``or``, ``==`` and the bit operators are put in one order (``a + b`` is ``b + a``;
  ``a > b`` is ``b < a``); the names of attributes, keywords and called functions stay (they are
  the API the code uses, and renaming them changes what it does);
* the copy: every file a student gets (the handouts, docs, notebooks' code cells, the stubs with
  their hints, the framework with its solution regions stubbed, the tests), as ``python -m
  grader release`` writes it. Python files are parsed; in Markdown, every code span and block and
  every formula in prose (``−`` is ``-``, ``mod`` is ``%``, ``·`` and ``×`` are ``*``, ``⌊a/b⌋``
  is ``a // b``) is tried as an expression.

A region's share is the part of its units found in the copy. A test holds the brief copy to a
median share of at most ``MEDIAN_LIMIT`` and every region to at most ``REGION_LIMIT``.
"""

from __future__ import annotations

import ast
import io
import json
import keyword
import re
import statistics
import textwrap
import tokenize
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .config import ROOT, load_rubric
from .stubs import HINT_LEVELS, assignment_texts, released_reference_text, solution_regions

MEDIAN_LIMIT = 0.10
REGION_LIMIT = 0.25
# Operations a unit does before it counts: `a[i]`, `f(x)` or `range(n - 1)` alone gives nothing
# away, `(i + 2 * k) % m` does; a statement (`out = f(x[i])`) counts from one fewer.
MIN_OPS = 3
MIN_STATEMENT_OPS = 2

# Nodes that do something; names, constants, attribute reads and containers are free.
_OPS = (
    ast.BinOp,
    ast.UnaryOp,
    ast.BoolOp,
    ast.Compare,
    ast.Call,
    ast.Subscript,
    ast.IfExp,
    ast.Slice,
    ast.ListComp,
    ast.SetComp,
    ast.DictComp,
    ast.GeneratorExp,
    ast.Lambda,
)
_FLIP = {ast.Gt: "Lt", ast.GtE: "LtE", ast.Lt: "Lt", ast.LtE: "LtE"}
_COMMUTATIVE = (ast.Mult, ast.BitAnd, ast.BitOr, ast.BitXor)


def _walk(node: ast.AST):
    """ast.walk, less what an f-string formats: a message's wording is not the algorithm."""
    todo = [node]
    while todo:
        sub = todo.pop()
        yield sub
        if not isinstance(sub, ast.JoinedStr):
            todo.extend(ast.iter_child_nodes(sub))


def ops(node: ast.AST) -> int:
    """The operations a node does (see _OPS); a negative number literal is no operation."""
    n = 0
    for sub in _walk(node):
        if isinstance(sub, ast.UnaryOp) and isinstance(sub.operand, ast.Constant):
            continue
        n += isinstance(sub, _OPS)
    return n


class _Canon:
    """One unit's normal form: a string in which names are placeholders numbered in order of use."""

    def __init__(self, erase: bool):
        self.erase = erase  # the first pass erases names, to order commutative operands by shape
        self.names: dict[str, str] = {}

    def name(self, ident: str) -> str:
        if self.erase:
            return "_"
        return self.names.setdefault(ident, f"v{len(self.names)}")

    def terms(self, node, sign="+"):
        """A chain of + and - as signed terms: a - (b - c) + d -> +a -b +c +d."""
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            right = sign if isinstance(node.op, ast.Add) else ("-" if sign == "+" else "+")
            return self.terms(node.left, sign) + self.terms(node.right, right)
        return [(sign, node)]

    def chain(self, node, op):
        if isinstance(node, ast.BinOp) and isinstance(node.op, op):
            return self.chain(node.left, op) + self.chain(node.right, op)
        return [node]

    def ordered(self, nodes):
        """Operands in one order: by their shape with names erased (ties keep the written order)."""
        return sorted(nodes, key=lambda n: _Canon(erase=True).form(n))

    def form(self, node) -> str:  # noqa: C901 - one case per kind of node reads best as one table
        f = self.form
        if isinstance(node, ast.Name):
            return self.name(node.id)
        if isinstance(node, ast.arg):
            return self.name(node.arg)
        if isinstance(node, ast.Constant):
            return "S" if isinstance(node.value, (str, bytes)) else repr(node.value)
        if isinstance(node, ast.Attribute):
            return f"{f(node.value)}.{node.attr}"
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            terms = self.terms(node)
            shapes = sorted(terms, key=lambda t: (t[0], _Canon(erase=True).form(t[1])))
            return "(" + " ".join(sign + f(t) for sign, t in shapes) + ")"
        if isinstance(node, ast.BinOp) and isinstance(node.op, _COMMUTATIVE):
            parts = self.ordered(self.chain(node, type(node.op)))
            return "(" + f" {type(node.op).__name__} ".join(f(p) for p in parts) + ")"
        if isinstance(node, ast.BinOp):
            return f"({f(node.left)} {type(node.op).__name__} {f(node.right)})"
        if isinstance(node, ast.UnaryOp):
            return f"({type(node.op).__name__} {f(node.operand)})"
        if isinstance(node, ast.BoolOp):
            parts = self.ordered(node.values)
            return "(" + f" {type(node.op).__name__} ".join(f(p) for p in parts) + ")"
        if isinstance(node, ast.Compare):
            if len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.NotEq, ast.Is, ast.IsNot)):
                a, b = self.ordered([node.left, node.comparators[0]])
                return f"({f(a)} {type(node.ops[0]).__name__} {f(b)})"
            if len(node.ops) == 1 and isinstance(node.ops[0], (ast.Gt, ast.GtE)):
                return f"({f(node.comparators[0])} {_FLIP[type(node.ops[0])]} {f(node.left)})"
            left = f(node.left)  # before the comparators: placeholders are numbered in reading order
            rest = " ".join(f"{type(o).__name__} {f(c)}" for o, c in zip(node.ops, node.comparators))
            return f"({left} {rest})"
        if isinstance(node, ast.Call):
            func = node.func.id if isinstance(node.func, ast.Name) else f(node.func)
            args = [f(a) for a in node.args] + [f"{k.arg}={f(k.value)}" for k in node.keywords]
            return f"{func}({', '.join(args)})"
        if isinstance(node, ast.Subscript):
            return f"{f(node.value)}[{f(node.slice)}]"
        if isinstance(node, ast.Slice):
            return ":".join("" if p is None else f(p) for p in (node.lower, node.upper, node.step))
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return type(node).__name__ + "(" + ", ".join(f(e) for e in node.elts) + ")"
        if isinstance(node, ast.Starred):
            return "*" + f(node.value)
        if isinstance(node, ast.Dict):
            return "{" + ", ".join(f"{f(k) if k else '**'}: {f(v)}" for k, v in zip(node.keys, node.values)) + "}"
        if isinstance(node, ast.IfExp):
            return f"({f(node.body)} if {f(node.test)} else {f(node.orelse)})"
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
            gens = " ".join(self.comprehension(g) for g in node.generators)
            return f"{type(node).__name__}({f(node.elt)} {gens})"
        if isinstance(node, ast.DictComp):
            gens = " ".join(self.comprehension(g) for g in node.generators)
            return f"DictComp({f(node.key)}: {f(node.value)} {gens})"
        if isinstance(node, ast.Lambda):
            params = ", ".join(f(a) for a in node.args.args)
            return f"lambda {params}: {f(node.body)}"
        if isinstance(node, ast.Assign):
            return " = ".join(f(t) for t in node.targets) + " = " + f(node.value)
        if isinstance(node, ast.AugAssign):
            return f"{f(node.target)} {type(node.op).__name__}= {f(node.value)}"
        if isinstance(node, ast.AnnAssign) and node.value is not None:
            return f"{f(node.target)} = {f(node.value)}"
        if isinstance(node, ast.Return):
            return "return " + (f(node.value) if node.value else "")
        if isinstance(node, ast.Expr):
            return f(node.value)
        if isinstance(node, ast.NamedExpr):
            return f"{f(node.target)} := {f(node.value)}"
        if isinstance(node, ast.JoinedStr):
            return "S"
        if isinstance(node, (ast.Yield, ast.YieldFrom, ast.Await)):
            return f"{type(node).__name__} " + (f(node.value) if node.value is not None else "")
        return type(node).__name__  # anything else: its kind only

    def comprehension(self, g) -> str:
        conds = "".join(f" if {self.form(c)}" for c in g.ifs)
        return f"for {self.form(g.target)} in {self.form(g.iter)}{conds}"


def normal_form(node: ast.AST) -> str:
    """The unit's form with names as placeholders and commutative operands in one order."""
    return _Canon(erase=False).form(node)


def _for_header(node: ast.For) -> ast.AST:
    """A for loop's header as one unit: ``for target in iter`` (its body is units of its own)."""
    return ast.Tuple(elts=[node.target, node.iter], ctx=ast.Load())


def units(tree: ast.AST, least: tuple[int, int] = (MIN_OPS, MIN_STATEMENT_OPS)) -> dict[str, str]:
    """Normal form -> source text of every unit of ``tree`` doing at least ``least`` operations
    (an expression's, a statement's)."""
    out = {}
    for node in _walk(tree):
        if isinstance(node, (ast.For, ast.AsyncFor)):
            candidate = _for_header(node)
        elif isinstance(node, (ast.expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return, ast.Expr)):
            candidate = node
        else:
            continue  # compound statements: their headers' expressions and their bodies are met on their own
        is_statement = isinstance(candidate, ast.stmt) or candidate is not node
        if isinstance(candidate, ast.expr_context) or ops(candidate) < least[is_statement]:
            continue
        text = ast.unparse(candidate if candidate is not node else node).splitlines()[0]
        out.setdefault(normal_form(candidate), text)
    return out


def solution_units(code: str) -> dict[str, str]:
    """A region's units. A region of a call or two has none: nothing in it is more than the API's
    own spelling (``dist.recv(buf, src)``), so no expression can give it away; such a region is
    listed as unmeasured and left out of the median (a fresh reader judges it)."""
    tree = _parse(code)
    return units(tree) if tree is not None else {}


# --- the copy's text: Python parsed, Markdown's code and formulas tried as expressions ---------------

_MATH = [
    ("−", "-"),
    ("–", "-"),
    ("·", "*"),
    ("×", "*"),
    ("≤", "<="),
    ("≥", ">="),
    ("≠", "!="),
    ("÷", "/"),
]
_FLOOR = re.compile(r"⌊([^⌋]+)⌋")
_CEIL = re.compile(r"⌈([^⌉]+)⌉")
_MOD = re.compile(r"\bmod\b")
_CODE_SPAN = re.compile(r"`([^`]+)`")
_FENCE = re.compile(r"^```.*?$(.*?)^```", re.S | re.M)
_WORD_EDGE = re.compile(r"[\w)\]]+|[(\[]")
_TWO_NAMES = re.compile(r"\b([A-Za-z_]\w*)\s+([A-Za-z_]\w*)\b")


def _cannot_parse(piece: str) -> bool:
    """A one-line piece that Python's grammar rejects in any mode, told without the parser: two names
    side by side with no operator between them (``item next``), neither a keyword (``x if y``, ``a
    and b``). Only where no string or comment could hold them. Most spans of a prose line are such
    pieces, and parsing each twice (expression, then statement) took most of a copy's scan."""
    if any(c in piece for c in "'\"#\\"):
        return False
    return any(
        not keyword.iskeyword(a) and not keyword.iskeyword(b) and not keyword.issoftkeyword(a)
        for a, b in _TWO_NAMES.findall(piece)
    )


def _math_to_python(text: str) -> str:
    for a, b in _MATH:
        text = text.replace(a, b)
    text = _FLOOR.sub(lambda m: "(" + m.group(1).replace("/", "//") + ")", text)
    text = _CEIL.sub(lambda m: "-(-" + m.group(1).replace("/", "//-") + ")", text)
    text = _MOD.sub("%", text)
    return text.replace("\\*", "*").replace("\\_", "_")


def _parse(text: str):
    try:
        return ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError):
        pass
    try:
        return ast.parse(textwrap.dedent(text).strip(), mode="exec")
    except (SyntaxError, ValueError):
        return None


def _prose_candidates(line: str) -> list[str]:
    """Spans of a prose line that may be formulas: each run between two word edges that holds an operator.

    Markdown's emphasis (``*k*``) is dropped first; what is left is tried from every word to every
    later word, so "takes item (i + 2k) % m next" yields ``(i + 2k) % m``... and ``(i + 2 * k) % m``
    where the product is written out.
    """
    plain = re.sub(r"(?<![\w*])\*(?!\s)|(?<!\s)\*(?![\w*])", " ", _math_to_python(line))
    if not re.search(r"[-+*/%<>=&|^]|//", plain):
        return []
    edges = [(m.start(), m.end()) for m in _WORD_EDGE.finditer(plain)]
    spans = []
    for i, (start, _) in enumerate(edges):
        for _, end in edges[i + 2 : i + 40]:  # a formula is at most a few dozen words
            piece = plain[start:end]
            if re.search(r"[-+*/%<>=&|^\[(]", piece):
                spans.append(piece)
    return spans


def markdown_units(text: str) -> dict[str, str]:
    """Units of a Markdown text: code blocks, code spans and the formulas of its prose."""
    found = {}
    blocks = _FENCE.findall(text)
    for block in blocks:
        tree = _parse(block)
        if tree is not None:
            found.update(units(tree))
        else:
            for line in block.splitlines():
                tree = _parse(_math_to_python(line))
                if tree is not None:
                    found.update(units(tree))
    prose = _FENCE.sub("", text)
    for span in _CODE_SPAN.findall(prose):
        tree = _parse(_math_to_python(span))
        if tree is not None:
            found.update(units(tree))
    for line in _CODE_SPAN.sub(lambda m: " " + m.group(1) + " ", prose).splitlines():
        for piece in _prose_candidates(line):
            tree = None if _cannot_parse(piece) else _parse(piece)
            if tree is not None:
                found.update(units(tree))
    return found


def python_units(text: str) -> dict[str, str]:
    """Units of a Python text, and of the code in its docstrings and comments (doctest-like lines)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return {}
    found = units(tree)
    prose = []  # docstrings and comments are prose with formulas, as a handout is
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                prose.append(doc)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("TODO "):
            prose.append(node.value)  # a stub's hint
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                prose.append(tok.string.lstrip("#"))
    except (tokenize.TokenError, IndentationError):
        pass
    found.update(markdown_units("\n".join(prose)))
    return found


def notebook_units(text: str) -> dict[str, str]:
    try:
        cells = json.loads(text).get("cells", [])
    except json.JSONDecodeError:
        return {}
    found = {}
    for cell in cells:
        source = "".join(cell.get("source", []))
        found.update(python_units(source) if cell.get("cell_type") == "code" else markdown_units(source))
    return found


def copy_texts(level: str = "brief", root: Path = ROOT) -> dict[str, str]:
    """Path -> text of every file a student copy at hint level ``level`` holds (as `release` writes it)."""
    from .release import load_release_excludes, tracked_files

    rubric = load_rubric(root / "grader" / "rubric.toml")
    stubs = {
        f: t for a in rubric.assignments.values() for f, t in assignment_texts(a, rubric, root, hints=level).items()
    }
    references = {ref: a for a in rubric.assignments.values() for ref in a.references}
    exclude = tuple(load_release_excludes(root))
    texts = {}
    for rel in tracked_files(root):
        path = root / rel
        if rel.startswith(exclude) or not path.is_file() or not rel.endswith((".py", ".md", ".ipynb")):
            continue
        if rel in references:
            texts[rel] = released_reference_text(references[rel], root, reference=rel, hints=level)
        elif rel in stubs:
            texts[rel] = stubs[rel]
        else:
            texts[rel] = path.read_text()
    return texts


def copy_index(level: str = "brief", root: Path = ROOT) -> dict[str, dict[str, str]]:
    """Normal form -> {path of the copy: its text there} for every unit the copy holds."""
    index: dict[str, dict[str, str]] = defaultdict(dict)
    reader = {".py": python_units, ".md": markdown_units, ".ipynb": notebook_units}
    for rel, text in copy_texts(level, root).items():
        for form, source in reader[Path(rel).suffix](text).items():
            index[form].setdefault(rel, source)
    return index


@dataclass(frozen=True)
class Leak:
    file: str  # the reference file
    line: int  # 1-based line of the BEGIN marker
    task: str
    units: dict[str, str]  # normal form -> the solution's text
    found: dict[str, dict[str, str]] = field(default_factory=dict)  # leaked form -> {copy path: its text}

    @property
    def share(self) -> float | None:
        """The part of its units the copy holds; None for a region with no unit to find."""
        return len(self.found) / len(self.units) if self.units else None


def leaks(level: str = "brief", root: Path = ROOT) -> list[Leak]:
    """Every solution region's units, and those of them the copy at hint level ``level`` holds."""
    if level not in HINT_LEVELS:
        raise ValueError(f"hint level {level!r}: choose one of {', '.join(HINT_LEVELS)}")
    index = copy_index(level, root)
    out = []
    for reference, r, lines in solution_regions(root):
        mine = solution_units(textwrap.dedent("\n".join(lines)))
        found = {form: index[form] for form in mine if form in index}
        out.append(Leak(reference, r.begin + 1, r.task, mine, found))
    return out


def measured(rows: list[Leak]) -> list[Leak]:
    """The regions that have units to find (the others are a call or two: see solution_units)."""
    return [r for r in rows if r.share is not None]


def main(level: str = "brief", show: list[str] | None = None) -> int:
    rows = leaks(level)
    for row in sorted(rows, key=lambda r: -1.0 if r.share is None else -r.share):
        if row.share is None:
            print(f"   -   {row.task:<4} {row.file}:{row.line}  a call or two: nothing to measure (read it)")
            continue
        counts = f"{len(row.found)}/{len(row.units)} units in the copy"
        print(f"{row.share:5.2f}  {row.task:<4} {row.file}:{row.line}  {counts}")
        if show and any(row.task == s or row.task.startswith(s.rstrip("*")) for s in show):
            for form, where in row.found.items():
                print(f"        {row.units[form]}")
                for path, source in list(where.items())[:3]:
                    print(f"            {path}: {source}")
    rated = measured(rows)
    worst = max(rated, key=lambda r: r.share)
    print(
        f"\n{len(rows)} regions at hint level {level}, {len(rated)} with units to find: median share of a "
        f"solution's units the copy holds {statistics.median(r.share for r in rated):.2f} (limit {MEDIAN_LIMIT}), "
        f"worst {worst.share:.2f} (task {worst.task}, {worst.file}:{worst.line}; limit {REGION_LIMIT})"
    )
    return 0
