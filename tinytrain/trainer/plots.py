"""What ``tinytrain train`` shows from the run's trace: the pipeline (``--pp ... --plot``), and how
much of context parallel's ring traffic hid behind attention (``--cp ... --trace``)."""

from __future__ import annotations

import sys
from pathlib import Path

from tinytrain.checkpoint import atomic_write


def plot_last_pipeline_step(spans, plan, args, out: Path) -> None:
    """The measured last step next to the simulated schedule, and activation memory per stage."""
    from tinytrain.parallel.pipeline import simulate_schedule
    from tinytrain.parallel.simulator import bubble_formula
    from tinytrain.viz import bubble_share, compare_pipelines, pipeline_events, plot_activation_memory

    # One rank draws each stage: replica 0's TP rank 0 (the mesh {dp, pp, cp, tp} has TP innermost,
    # so stage s of replica 0 starts at world rank s·cp·tp); its spans are relabelled with s.
    stage_of = {s * plan.cp * plan.tp: s for s in range(plan.pp)}
    last = {s["rank"]: s for s in spans if s["cat"] == "step" and s["args"]["step"] == args.steps}
    in_last = [
        dict(s, rank=stage_of[s["rank"]])
        for s in spans
        if s["rank"] in stage_of
        and s["rank"] in last
        and last[s["rank"]]["start"] <= s["start"] <= last[s["rank"]]["end"]
    ]
    measured = pipeline_events(in_last)

    p, m, v = plan.pp, plan.n_microbatches, plan.chunks
    timeline = simulate_schedule(plan.schedule, p, m, v)
    simulated = timeline.rows()
    formula = bubble_formula(p, m, v, schedule=plan.schedule)
    panels = [(f"simulated {args.schedule}", simulated), (f"measured {args.schedule}, step {args.steps}", measured)]
    atomic_write(
        out / "pipeline.png",
        lambda f: compare_pipelines(panels, f, formulas=[formula, formula], sharex=False, units_ms=[False, True]),
    )
    memory = {}
    for s in in_last:
        if s["cat"] == "memory":
            memory.setdefault(f"stage {s['rank']}", []).append((s["start"], s["args"]["bytes"]))
    title = f"bytes saved for backward during step {args.steps} ({args.schedule})"
    atomic_write(
        out / "activation_memory.png", lambda f: plot_activation_memory(dict(sorted(memory.items())), f, title=title)
    )
    exact_from = p if plan.schedule in ("zb-h1", "zb-v") else 1  # fewer micro-batches: a floor
    floor = f" (a floor below m = {exact_from})" if m < exact_from else ""
    print(
        f"pipeline ({plan.schedule}): measured bubble share {bubble_share(measured):.1%}, simulated "
        f"{timeline.bubble_share:.1%}, formula {formula:.1%}{floor}; peak activation bytes per stage "
        f"{[max(b for _, b in memory[k]) for k in sorted(memory)]}; wrote {out}/pipeline.png and activation_memory.png",
        file=sys.stderr,
    )


def print_context_parallel_overlap(spans, plan) -> float:
    """Share of the CP group's message time spent while the same rank computed attention blocks."""
    from tinytrain.viz import overlap_share

    def on_cp(s):
        return s["cat"] in ("comm", "comm.step") and s["args"].get("group") == "cp"

    share = overlap_share(spans, is_compute=lambda s: s["name"] == "ring attention", is_comm=on_cp)
    print(
        f"context parallel ({plan.cp_algo}, {plan.cp_split}): {share:.0%} of the CP group's message time "
        "overlapped attention compute (from the trace)",
        file=sys.stderr,
    )
    return share
