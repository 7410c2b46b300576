"""Figures drawn from metrics and traces with matplotlib (no display needed).

``viz`` reads data (metrics dicts, trace files); it imports nothing from the layers above it.
"""

from __future__ import annotations

# No backend is forced: on a machine without a screen matplotlib falls back to Agg (files only),
# and in a notebook the inline backend shows the figures.
import matplotlib.pyplot as plt
import numpy


def plot_loss_curve(metrics: dict, path, title: str | None = None) -> None:
    """Training loss per step (and validation loss where measured) from a ``metrics.json`` dict."""
    steps = metrics["steps"]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    ax.plot([s["step"] for s in steps], [s["loss"] for s in steps], lw=1, label="train")
    val = [s for s in steps if "val_loss" in s]
    if val:
        ax.plot([s["step"] for s in val], [s["val_loss"] for s in val], "o-", ms=3, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title or "tinytrain loss")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_expert_load(metrics: dict, path, experts_per_rank: int | None = None) -> None:
    """Mixture of experts from ``metrics.json``: the share of assignments each expert took at each
    step (a heatmap: even load is one flat colour), the auxiliary loss and the dropped share; with
    ``experts_per_rank`` (expert parallel), also the tokens each rank's experts received."""
    steps = [s for s in metrics["steps"] if "moe" in s]
    if not steps:
        raise ValueError("metrics has no 'moe' records: train with --experts")
    load = [numpy.asarray(s["moe"]["load"], dtype=float) for s in steps]
    share = numpy.stack([row / max(row.sum(), 1.0) for row in load], axis=1)  # (experts, steps)
    panels = 3 if experts_per_rank else 2
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.4), dpi=120)
    image = axes[0].imshow(
        share,
        aspect="auto",
        cmap="viridis",
        origin="lower",
        extent=(steps[0]["step"] - 0.5, steps[-1]["step"] + 0.5, -0.5, share.shape[0] - 0.5),
    )
    fig.colorbar(image, ax=axes[0], label="share of assignments")
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("expert")
    axes[0].set_yticks(range(share.shape[0]))
    axes[0].set_title("expert load")
    xs = [s["step"] for s in steps]
    axes[1].plot(xs, [s["moe"]["aux"] for s in steps], label="aux loss")
    axes[1].plot(xs, [s["moe"]["dropped"] for s in steps], label="dropped share")
    axes[1].set_xlabel("step")
    axes[1].legend()
    axes[1].set_title("balance")
    if experts_per_rank:
        per_rank = share.reshape(-1, experts_per_rank, share.shape[1]).sum(axis=1)
        for r, row in enumerate(per_rank):
            axes[2].plot(xs, row, label=f"rank {r}")
        axes[2].set_xlabel("step")
        axes[2].set_ylabel("share of tokens received")
        axes[2].legend()
        axes[2].set_title("tokens per expert-parallel rank")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Pipeline schedules: Gantt charts and activation memory
#
# A pipeline event is a tuple (stage, kind, microbatch, chunk, start, end) with kind "F" or "B";
# simulator timelines give them with ``Timeline.rows()``, real runs with ``pipeline_events(spans)``.


def pipeline_events(spans: list) -> list:
    """Pipeline events from trace spans (``cat`` "forward"/"backward"), start times from 0 in ms."""
    rows = [s for s in spans if s["cat"] in ("forward", "backward")]
    if not rows:
        raise ValueError("the trace has no forward/backward spans: was it recorded with tracing on?")
    t0 = min(s["start"] for s in rows)
    return [
        (
            s["rank"],
            "F" if s["cat"] == "forward" else "B",
            s["args"]["microbatch"],
            s["args"].get("chunk", 0),
            (s["start"] - t0) / 1e3,
            (s["end"] - t0) / 1e3,
        )
        for s in rows
    ]


def bubble_share(events: list) -> float:
    """Idle time over total time, from the first start to the last end over all stages."""
    stages = {e[0] for e in events}
    start, end = min(e[4] for e in events), max(e[5] for e in events)
    busy = sum(e[5] - e[4] for e in events)
    return 1.0 - busy / (len(stages) * (end - start))


def _union(intervals: list) -> list:
    """Sorted, merged (start, end) intervals."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def overlap_share(spans: list, is_compute, is_comm=lambda s: s["cat"] == "comm.step") -> float:
    """Share of communication time hidden behind compute: per rank, the time that both a span
    with ``is_comm`` and one with ``is_compute`` were open, over the time any ``is_comm`` span was
    open, added up over ranks. 1.0: every message moved while the rank computed; 0.0: none did."""
    hidden = total = 0.0
    for rank in sorted({s["rank"] for s in spans}):
        comm = _union([(s["start"], s["end"]) for s in spans if s["rank"] == rank and is_comm(s)])
        compute = _union([(s["start"], s["end"]) for s in spans if s["rank"] == rank and is_compute(s)])
        total += sum(end - start for start, end in comm)
        for c0, c1 in comm:
            hidden += sum(max(0.0, min(c1, k1) - max(c0, k0)) for k0, k1 in compute)
    if total == 0:
        raise ValueError("the trace has no communication spans to measure overlap on")
    return hidden / total


def plot_pipeline(
    events: list, ax=None, title: str | None = None, formula: float | None = None, path=None, unit_ms: bool = False
):
    """A Gantt chart: one row per stage, forward (solid) and backward (hatched) blocks coloured by
    micro-batch and labelled ``F3`` / ``B3`` (``.c`` for chunk c), white gaps are the bubbles."""
    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(10, 0.6 * (1 + len({e[0] for e in events})) + 0.8), dpi=120)
    n_mb = 1 + max(e[2] for e in events)
    colours = plt.get_cmap("tab20" if n_mb > 10 else "tab10")
    for stage, kind, mb, chunk, start, end in events:
        ax.barh(
            stage,
            end - start,
            left=start,
            height=0.8,
            color=colours(mb % colours.N),
            alpha=1.0 if kind == "F" else 0.55,
            hatch=None if kind == "F" else "//",
            edgecolor="black",
            linewidth=0.4,
        )
        label = f"{kind}{mb}" + (f".{chunk}" if chunk else "")
        if end - start > 0.02 * max(e[5] for e in events):
            ax.text((start + end) / 2, stage, label, ha="center", va="center", fontsize=7)
    ax.set_yticks(sorted({e[0] for e in events}))
    ax.set_yticklabels([f"stage {s}" for s in sorted({e[0] for e in events})])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)" if unit_ms else "time (one forward = 1)")
    share = bubble_share(events)
    note = f"bubble {share:.1%}" + (f" (formula {formula:.1%})" if formula is not None else "")
    ax.set_title(f"{title} — {note}" if title else note, fontsize=10)
    if own:
        fig.tight_layout()
        if path:
            fig.savefig(path)
            plt.close(fig)
    return ax


def compare_pipelines(
    named_events: list, path=None, formulas: list | None = None, sharex: bool = True, units_ms: list | None = None
):
    """Several Gantt charts stacked: e.g. GPipe, 1F1B and interleaved 1F1B on one time axis, or
    (``sharex=False``) a simulated schedule above a measured one, each on its own time axis."""
    heights = [1 + len({e[0] for e in ev}) for _, ev in named_events]
    fig, axes = plt.subplots(
        len(named_events),
        1,
        figsize=(10, 0.55 * sum(heights) + 1),
        dpi=120,
        sharex=sharex,
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    for i, ((name, events), ax) in enumerate(zip(named_events, axes[:, 0])):
        plot_pipeline(
            events, ax=ax, title=name, formula=formulas[i] if formulas else None, unit_ms=bool(units_ms and units_ms[i])
        )
    fig.tight_layout()
    if path:
        fig.savefig(path)
        plt.close(fig)
    return fig


def plot_activation_memory(series: dict, path=None, title: str = "activation memory per stage"):
    """Bytes saved for backward over time, one line per label (e.g. ``{"GPipe stage 0": [(t, b), ...]}``)."""
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=120)
    for label, points in series.items():
        t0 = points[0][0]
        ax.step([(t - t0) / 1e3 for t, _ in points], [b / 2**20 for _, b in points], where="post", label=label)
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("saved for backward (MiB)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    if path:
        fig.savefig(path)
        plt.close(fig)
    return fig


_SPAN_COLORS = {"compute": "#4c72b0", "idle": "#b0b0b0", "comm": "#dd8452", "comm step": "#8c3b0c"}


def _lane(cat: str) -> tuple[str, float, float]:
    """(legend key, y offset in the rank's row, bar height) of a span category."""
    if cat == "comm":  # a whole collective, from its call to its completion
        return "comm", 0.42, 0.38
    if cat.startswith("comm"):  # one step (one exchange) of it, drawn inside the call's bar
        return "comm step", 0.52, 0.18
    if cat == "idle":
        return "idle", 0.0, 0.38
    return "compute", 0.0, 0.38  # compute, forward, backward, ...


def plot_timeline(spans: list[dict], path, title: str | None = None) -> None:
    """Per-rank timeline of trace spans (``tinytrain.trace.merge()``): compute (and idle) on the upper
    half of a rank's row, communication on the lower half, so overlap shows as bars stacked in one
    column. A collective's bar runs from its call to its completion; its steps are the dark marks."""
    spans = [s for s in spans if s["cat"] not in ("memory", "step")]  # instants and whole-step markers
    if not spans:
        raise ValueError("plot_timeline needs at least one span (was tracing enabled?)")
    t0 = min(s["start"] for s in spans)
    ranks = sorted({s["rank"] for s in spans})
    fig, ax = plt.subplots(figsize=(9, 0.8 + 0.7 * len(ranks)), dpi=120)
    for s in sorted(spans, key=lambda s: _lane(s["cat"])[2], reverse=True):  # steps on top of calls
        key, offset, height = _lane(s["cat"])
        ax.broken_barh(
            [((s["start"] - t0) / 1e3, max((s["end"] - s["start"]) / 1e3, 1e-3))],
            (ranks.index(s["rank"]) + offset, height),
            facecolors=_SPAN_COLORS[key],
            edgecolor="white",
            linewidth=0.3,
        )
    ax.set_yticks([i + 0.4 for i in range(len(ranks))])
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=k) for k, c in _SPAN_COLORS.items()]
    ax.legend(handles=handles, loc="upper right", fontsize=7, ncol=3)
    ax.set_title(title or "timeline: compute (top of each row) and communication (bottom)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
