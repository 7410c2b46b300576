"""``python -m grader report``: each assignment's analysis, measured on the student's own code.

Runs ``grader/lab.py`` under ``mpirun -n 4`` (every assignment file's code in place of the
framework's) and writes ``report.md``: per assignment, a table of what the handout predicts next to
what the student's code did -- bytes against the formula, memory per rank, bubble shares, drop
rates, ring against all-to-all -- and the questions to answer in prose below it. The grader scores
the code, not the prose: the report is for the write-up (as CS336's writeups are).

    python -m grader report                 # report.md (every assignment; unfinished ones say TODO)
    python -m grader report --out my.md --assignments 3 5
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from .config import ROOT, load_rubric
from .run import mpi_environment

RANKS = 4
QUESTIONS = {
    "1": [
        "Your ring all-reduce sends 2(n-1)/n of the buffer per rank, like MPI's: why is it still slower at "
        "1K elements, and from which size does the gap close? Use the α-β model with your numbers.",
        "The all-gather sends (n-1)/n of the *gathered* buffer: why is that the same bytes per rank as a "
        "reduce-scatter of the same full buffer? Compare their times: what does the reduce-scatter do "
        "per byte that the all-gather does not?",
        "What would change on 8 ranks, in bytes per rank and in the number of steps?",
    ],
    "2": [
        "The bytes of one data-parallel step equal the formula: which all-reduces make them up, and how "
        "does bucketing change the number of messages but not the bytes?",
        "Where in the step can the gradient all-reduce hide behind backward, and what limits the overlap?",
    ],
    "3": [
        "Read the memory per rank for DP and ZeRO-1/2/3 against the ZeRO paper's 4Ψ + 4Ψ + 8Ψ (fp32 Adam) "
        "and its sharded forms: which term does each stage divide by N?",
        "ZeRO-1 and ZeRO-2 send the same bytes as DP, ZeRO-3 more: how many more, and why?",
        "Activations are not sharded by any stage: at what model size would they dominate?",
    ],
    "4": [
        "TP divides parameters, gradients and optimizer state by t: check it in the table. What does it "
        "cost per step in bytes, and on which path (critical or overlappable) do they travel?",
        "Sequence parallel sends as many bytes as TP (an all-reduce is a reduce-scatter plus an "
        "all-gather) yet saves activations: how much did it save here, and which activations?",
    ],
    "5": [
        "Your schedules' simulated bubble equals (p-1)/(v·m + p-1): explain the formula from the picture "
        "of GPipe, and why 1F1B has the same bubble as GPipe.",
        "What does 1F1B buy instead (see the most micro-batches a stage holds), and what does "
        "interleaving cost in messages?",
        "ZB-H1 and ZB-V sit below 1F1B's formula: which part of a backward fills their bubbles, and what does "
        "ZB-V pay for halving ZB-H1's idle time? Which of your runs holds the most activations, and why there?",
    ],
    "6": [
        "How does the dropped share fall with the capacity factor, for top-1 and top-2? Relate it to the "
        "expert load column: which expert overflows?",
        "Why does top-2 drop less at the same capacity factor here, and what does dropping do to the "
        "equivalence with the serial model?",
    ],
    "7": [
        "Ring attention sends more bytes than all-to-all attention here: by how much, and on what does "
        "each one's volume depend (sequence length, heads, ranks)?",
        "Which of the two can overlap its communication with attention, and why does the zigzag split "
        "matter for the ring but not for all-to-all?",
    ],
    "8": [
        "How many bytes does a block keep under each recompute mode, and which arrays does selective "
        "recompute drop? At what sequence length would they dominate full recompute's saving here?",
        "Mixed precision keeps AdamW's 16 bytes per parameter (2 + 2 + 12 against 4 + 4 + 8): what does "
        "it save, then, and why must the masters be float32?",
    ],
    "9": [
        "Every aggregation moves the formula's bytes per round: why does secure aggregation add none here, "
        "and what would it add in a deployment (the pairs' key agreement, the shares that recover a dropped "
        "client)? Why does DP-FedAvg's sum carry one number fewer?",
        "How many more rounds does the skewed partition need to reach the target loss, and how many bytes is "
        "that? Why does the gap grow with the local steps H (what do the clients' updates point at)?",
        "DP-FedAvg's noise on the average has std σ·S/m for m clients a round: how many clients would a round "
        "need for that noise to stay below a tenth of a typical clipped update's size here?",
    ],
    "10": [
        "Read the --pp 2 launch's rows: on which worlds does a rank stay idle, and on which does a micro-batch hold "
        "fewer rows than the launch's 3? Why does 10 ranks run as 8 do, and 6 ranks in micro-batches of 2 rows?",
        "A step's time is about (m + p - 1) micro-batch times of one replica's rows: from the table, how much longer "
        "is a step on 2 ranks than on 8, and how much of that is the bubble? Would a larger micro-batch have been "
        "faster, and why does the agent not take it?",
        "Which worlds would a DeepSpeed-style elastic batch (a batch size that many world sizes divide) run, and "
        "what does it give up that keeping the global batch keeps?",
    ],
}


def _mib(b: float) -> str:
    return f"{b / 2**20:.3f}"


def _check(got, want) -> str:
    if want is None:
        return "(no formula)"
    return "equal" if got == want else f"**differs by {got - want:+d}**"


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(str(c) for c in r) + " |" for r in rows
    ]


def _strategy_rows(rows) -> list[str]:
    out = []
    for r in rows:
        if "todo" in r:
            out.append([r["strategy"], "", r["todo"], "", "", "", "", ""])
            continue
        top = max(r["per_rank"], key=lambda m: sum(m.values()))
        out.append(
            [
                r["strategy"],
                f"`{r['flags']}`",
                r["sent_total"],
                r["formula_total"] if r["formula_total"] is not None else "",
                _check(r["sent_total"], r["formula_total"]),
                *(_mib(top.get(k, 0)) for k in ("params", "grads", "optimizer", "activations")),
            ]
        )
    header = ["strategy", "flags", "bytes sent (all ranks)", "formula", "check", "params MiB", "grads MiB"]
    return _table(header + ["optimizer MiB", "activations MiB"], out)


def _zero_memory(rows) -> list[str]:
    """Model state per rank against the ZeRO paper's formula for fp32 Adam (4 + 4 + 8 bytes per
    parameter, Figure 1's K = 8 here), Ψ counted from the DP row's parameters."""
    from tinytrain.parallel import costs

    dp = next((r for r in rows if r["strategy"] == "dp" and "per_rank" in r), None)
    if dp is None:
        return []
    psi = dp["per_rank"][0]["params"] / 4
    out = []
    for r in rows:
        if "per_rank" not in r:
            continue
        stage = int(r["strategy"][-1]) if r["strategy"].startswith("zero") else 0
        paper = costs.zero_memory(psi, RANKS, stage, weight=4, grad=4, optimizer=8)
        got = max(sum(m[k] for k in ("params", "grads", "optimizer")) for m in r["per_rank"])
        # a rank's piece of each parameter is Ψ_p/N rounded up at most: 4 + 4 + 8 bytes per parameter
        near = abs(got - paper["total"]) <= 16 * r["tensors"]
        out.append([r["strategy"], _mib(got), _mib(paper["total"]), "equal" if near else "**differs**"])
    return _table(["strategy", "params + grads + optimizer MiB (largest rank)", "ZeRO paper, fp32 Adam", "check"], out)


def measured(figures: dict) -> bool:
    """Does an assignment's section hold a measured table? Not when it stopped at a TODO, raised, or
    every one of its rows is a TODO (assignment 2 with none of its strategies written)."""

    def some_row(rows) -> bool:
        if isinstance(rows, dict):  # assignment 5: its bubbles and its steps
            return any(some_row(r) for r in rows.values())
        return any("todo" not in r for r in rows)

    return "rows" in figures and some_row(figures["rows"])


def section(a: str, figures: dict) -> list[str]:
    """The markdown lines of assignment ``a``'s measured part."""
    if "todo" in figures:
        return [f"Not measured yet: your code stops at `{figures['todo']}`."]
    if "error" in figures:
        return [f"Not measured: your code raised `{figures['error']}` (python -m grader says where)."]
    rows = figures["rows"]
    if a == "1":
        return _table(
            ["collective", "elements", "bytes sent per rank", "formula", "check", "yours µs", "MPI µs", "MPI / yours"],
            [
                [r["op"], r["elements"], r["sent"], r["formula"], _check(r["sent"], r["formula"]),
                 f"{r['ours_us']:.0f}", f"{r['mpi_us']:.0f}", f"{r['mpi_us'] / r['ours_us']:.2f}"]
                for r in rows
            ],
        )  # fmt: skip
    if a == "3":
        return [*_strategy_rows(rows), "", *_zero_memory(rows)]
    if a in ("2", "4"):
        return _strategy_rows(rows)
    if a == "5":
        bubbles = _table(
            ["schedule", "micro-batches m", "bubble (simulated, F=1 B=2)", "formula", "most held per stage"],
            [[r["schedule"], r["microbatches"], r["bubble"], r["formula"], r["peak_held"]] for r in rows["bubbles"]],
        )
        return [*bubbles, "", *_strategy_rows(rows["steps"])]
    if a == "6":
        return _table(
            ["top-k", "capacity factor", "dropped share", "load per expert"],
            [[r["top_k"], r["capacity_factor"] or "none", f"{r['dropped']:.1%}", r["load"]] for r in rows],
        )
    if a == "7":
        return _table(
            ["attention", "bytes sent (all ranks)", "formula", "check", "step ms"],
            [[r["algo"], r["sent_total"], r["formula_total"], _check(r["sent_total"], r["formula_total"]),
              f"{r['ms']:.1f}"] for r in rows],
        )  # fmt: skip
    if a == "9":
        from .lab import FED_ROUNDS, FED_TARGET

        volumes = _table(
            ["aggregation", "flags", "bytes per round (all ranks)", "formula", "check"],
            [[r["what"], f"`{r['flags']}`", *(["", r["todo"], ""] if "todo" in r else
              [r["got"], r["formula"], _check(r["got"], r["formula"])])] for r in rows["bytes"]],
        )  # fmt: skip
        rounds = _table(
            ["partition", "samples per client", f"rounds to a loss of {FED_TARGET}", f"loss after {FED_ROUNDS} rounds"],
            [[r["partition"], *(["", r["todo"], ""] if "todo" in r else
              [r["samples"], r["rounds"] or f"not within {FED_ROUNDS}", f"{r['final']:.3f}"])] for r in rows["rounds"]],
        )  # fmt: skip
        return [*volumes, "", *rounds]
    if a == "10":
        return _table(
            ["launch", "ranks available", "--dp", "ranks used", "micro-batches", "rows per micro-batch"],
            [[f"`{r['flags']}`", r["available"], *(["", r["todo"], "", ""] if "todo" in r else
              ["", f"refused: {r['refused']}", "", ""] if "refused" in r else
              [r["dp"], r["world"], r["microbatches"], f"{r['rows']:g}"])] for r in rows],
        )  # fmt: skip
    if a == "8":
        return _table(
            ["what", "measured", "formula", "check"],
            [[r["what"], r["got"], r["formula"], _check(r["got"], r["formula"])] for r in rows],
        )
    return []


def render(figures: dict) -> str:
    rubric = load_rubric()
    lines = [
        "# tinytrain: my analysis",
        "",
        f"Measured on my own code (`python -m grader report`, {RANKS} ranks, the GPT of "
        "`tinytrain bench strategies`). Answer each question below its table, in prose, with the numbers.",
        "",
    ]
    for a, figs in figures.items():
        lines += [f"## Assignment {a}: {rubric.assignments[a].title}", "", *section(a, figs), ""]
        for i, q in enumerate(QUESTIONS[a], 1):
            lines += [f"**Q{a}.{i}.** {q}", "", "*Your answer:*", ""]
    return "\n".join(lines)


def main(out: str, assignments: list[str] | None = None) -> int:
    rubric = load_rubric()
    unknown = [a for a in assignments or [] if a not in rubric.assignments]
    if unknown:
        print(f"error: --assignments {' '.join(unknown)}: there are {', '.join(rubric.assignments)}", file=sys.stderr)
        return 2
    path = Path(out)
    try:  # before the minutes of measuring: the report must have somewhere to go
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
        if path.is_dir():
            raise IsADirectoryError(21, "Is a directory")
    except OSError as exc:
        print(f"error: cannot write {out} ({exc.strerror}); choose another --out", file=sys.stderr)
        return 2
    from tinytrain import launcher

    try:
        launch = launcher.mpirun_command(RANKS)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        figures_path = Path(tmp) / "figures.json"
        cmd = [*launch, sys.executable, "-m", "grader.lab", str(figures_path), *(assignments or [])]
        env = dict(mpi_environment(), TINYTRAIN_TIMEOUT="20")
        print(f"measuring on {RANKS} ranks ...", file=sys.stderr)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200, check=False)
        if proc.returncode or not figures_path.exists():
            print(f"error: the measurements failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
            return 1
        figures = json.loads(figures_path.read_text())
    try:
        path.write_text(render(figures))
    except OSError as exc:
        print(f"error: cannot write {out} ({exc.strerror}); choose another --out", file=sys.stderr)
        return 2
    done = [a for a, f in figures.items() if measured(f)]
    rest = f"; still TODO: {', '.join(a for a in figures if a not in done)}" if len(done) < len(figures) else ""
    print(f"wrote {out}: {len(done)} of {len(figures)} assignments measured{rest}")
    return 0
