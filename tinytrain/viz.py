"""Figures drawn from metrics and traces with matplotlib (no display needed).

``viz`` reads data (metrics dicts, trace files); it imports nothing from the layers above it.
"""

from __future__ import annotations

# No backend is forced: on a machine without a screen matplotlib falls back to Agg (files only),
# and in a notebook the inline backend shows the figures.
import re

import matplotlib.pyplot as plt
import numpy


def _finish(fig, path=None, title: str | None = None):
    """Lay out ``fig`` (with a ``title`` over all panels); write it to ``path`` and close it, or
    return it open (a notebook shows it)."""
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    if path:
        fig.savefig(path)
        plt.close(fig)
    return fig


def plot_loss_curve(metrics: dict, path, title: str | None = None) -> None:
    """Training loss per step (and validation loss where measured) from a ``metrics.json`` dict."""
    steps = metrics["steps"]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    ax.plot([s["step"] for s in steps], [s["loss"] for s in steps], lw=1, label="train")
    val = [s for s in steps if "val_loss" in s]
    if val:
        ax.plot([s["step"] for s in val], [s["val_loss"] for s in val], "o-", ms=3, label="validation")
    for i, restart in enumerate(r for r in metrics.get("restarts", []) if "first_step_after" in r):
        world = next((s["world"] for s in steps if s["step"] == restart["first_step_after"] and "world" in s), "?")
        ax.axvline(restart["first_step_after"] - 0.5, color="gray", ls="--", lw=1,
                   label="restart (tinytrain launch)" if i == 0 else None)  # fmt: skip
        ax.annotate(f"{world} ranks", (restart["first_step_after"], 1), xycoords=("data", "axes fraction"),
                    xytext=(3, -12), textcoords="offset points", fontsize=7, color="gray")  # fmt: skip
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
    axes[1].plot(xs, [max_over_mean(row) for row in load], label="max / mean load", alpha=0.7)
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


def max_over_mean(load) -> float:
    """The busiest expert's load over the mean load: 1 when balanced, E when one expert takes all."""
    load = numpy.asarray(load, dtype=float)
    return float(load.max() / max(load.mean(), 1e-12))


def compare_expert_balance(runs: dict, path, window: int = 20) -> None:
    """Several runs' ``metrics.json`` (name -> metrics, e.g. ``--balance aux``, ``bias``, ``none``
    on one seed): max / mean expert load per step (a ``window``-step running mean) and the loss."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), dpi=120)
    for name, metrics in runs.items():
        steps = [s for s in metrics["steps"] if "moe" in s]
        if not steps:
            raise ValueError(f"{name}: metrics has no 'moe' records: train with --experts")
        xs = [s["step"] for s in steps]
        ratio = numpy.array([max_over_mean(s["moe"]["load"]) for s in steps])
        smooth = numpy.convolve(ratio, numpy.ones(window) / window, mode="valid") if len(ratio) >= window else ratio
        axes[0].plot(xs[len(xs) - len(smooth) :], smooth, label=name)
        axes[1].plot(xs, [s["loss"] for s in steps], label=name, alpha=0.8)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel(f"max / mean load ({window}-step mean)")
    axes[0].set_title("expert imbalance")
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("training loss (aux included where trained on)")
    axes[1].set_title("loss")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Pipeline schedules: Gantt charts and activation memory
#
# A pipeline event is a tuple (stage, kind, microbatch, chunk, start, end) with kind "F", "B" or
# "W" (a zero-bubble schedule's weight-gradient pass);
# simulator timelines give them with ``Timeline.rows()``, real runs with ``pipeline_events(spans)``.


def pipeline_events(spans: list) -> list:
    """Pipeline events from trace spans (``cat`` "forward"/"backward"), start times from 0 in ms."""
    kinds = {"forward": "F", "backward": "B", "weights": "W"}
    rows = [s for s in spans if s["cat"] in kinds]
    if not rows:
        raise ValueError("the trace has no forward/backward spans: was it recorded with tracing on?")
    t0 = min(s["start"] for s in rows)
    return [
        (
            s["rank"],
            kinds[s["cat"]],
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


def exposed_time(spans: list, windows: list, is_comm, is_compute) -> float:
    """Time (the spans' unit) inside ``windows`` ((start, end) pairs that do not overlap) during
    which a span with ``is_comm`` was open and none with ``is_compute``: communication that no
    compute hid. Give it one rank's spans."""
    exposed = 0.0
    for w0, w1 in windows:
        clipped = [(s, max(s["start"], w0), min(s["end"], w1)) for s in spans if s["end"] > w0 and s["start"] < w1]
        compute = _union([(a, b) for s, a, b in clipped if is_compute(s)])
        for c0, c1 in _union([(a, b) for s, a, b in clipped if is_comm(s)]):
            exposed += (c1 - c0) - sum(max(0.0, min(c1, k1) - max(c0, k0)) for k0, k1 in compute)
    return exposed


def plot_pipeline(
    events: list, ax=None, title: str | None = None, formula: float | None = None, path=None, unit_ms: bool = False
):
    """A Gantt chart: one row per stage, forward (solid), backward (hatched) and weight-gradient
    (dotted) blocks coloured by micro-batch and labelled ``F3`` / ``B3`` / ``W3`` (``.c`` for chunk
    c), white gaps are the bubbles."""
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
            alpha={"F": 1.0, "B": 0.55, "W": 0.3}[kind],
            hatch={"F": None, "B": "//", "W": ".."}[kind],
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
    return _finish(fig, path)


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
    return _finish(fig, path)


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
    spans = [s for s in spans if s["cat"] not in ("memory", "step", "counters")]  # instants, step markers
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


# --------------------------------------------------------------------------------------------
# Communication: who sends how many bytes to whom, and how an algorithm's messages go
#
# A communication matrix is an (n, n) array: row i, column j = bytes rank i sent to rank j. It
# comes from ``tinytrain.distributed.trace_merge.comm_matrix`` (a live run) or from a merged trace's
# "comm counters" records (``comm_matrix_from_trace``).


def comm_matrix_from_trace(spans: list, op: str | None = None, group: str | None = None) -> numpy.ndarray:
    """The (sender, receiver) bytes matrix from the "comm counters" records a merged trace ends with
    (each rank's per-peer counters at the merge: the whole run). The counters only grow, so where a
    rank has several records the last one counts."""
    last = {}
    for s in sorted((s for s in spans if s["cat"] == "counters"), key=lambda s: s["start"]):
        last[s["rank"]] = s
    records = list(last.values())
    if not records:
        raise ValueError("the trace has no 'comm counters' records: was it merged by tinytrain.trace.merge()?")
    n = 1 + max(max(s["rank"] for s in records), *(p[2] for s in records for p in s["args"]["peers"]))
    matrix = numpy.zeros((n, n), dtype=numpy.int64)
    for s in records:
        for g, o, peer, sent, _ in s["args"]["peers"]:
            if (op is None or o == op) and (group is None or g == group):
                matrix[s["rank"], peer] += sent
    return matrix


def _bytes_label(n: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}" if n < 100 * scale else f"{n / scale:.0f} {unit}"
    return f"{n:.0f} B"


def plot_comm_matrices(named: dict, path=None, title: str | None = None):
    """Communication matrices side by side, four to a row (bytes rank i → rank j, one colour scale
    per panel, each cell labelled), e.g. ``{"DP": m1, "ZeRO-3": m2, "TP": m3}``."""
    cols = min(4, len(named))
    rows = -(-len(named) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.9 * cols, 3.4 * rows), dpi=120, squeeze=False)
    for ax in axes.flat[len(named) :]:
        ax.axis("off")
    for ax, (name, matrix) in zip(axes.flat, named.items()):
        matrix = numpy.asarray(matrix)
        ax.imshow(matrix, cmap="Blues", vmin=0, vmax=max(1, matrix.max()))
        for (i, j), value in numpy.ndenumerate(matrix):
            if value:
                dark = value > 0.6 * matrix.max()
                ax.text(j, i, _bytes_label(value), ha="center", va="center", fontsize=6, color="white" if dark else "k")
        n = matrix.shape[0]
        ax.set_xticks(range(n))
        ax.set_yticks(range(n))
        ax.set_xlabel("to rank")
        ax.set_ylabel("from rank")
        ax.set_title(f"{name}\n{_bytes_label(matrix.sum())} in all", fontsize=9)
    return _finish(fig, path, title)


# The messages of one traced collective: each comm.step span names its step ("ring reduce-scatter
# step 1/3 (chunk 0 to rank 1, chunk 3 from rank 3)", "recursive doubling round 1/2 with rank 1",
# "tree broadcast: send to ranks [2, 1]"); the peers named are ranks of the collective's group.
_TO = re.compile(r"chunk (\d+) to rank (\d+)|to ranks? \[?([\d, ]+)\]?|with rank (\d+)|into rank (\d+)")


def exchange_steps(spans: list, op: str | None = None) -> list[dict]:
    """One row per message sent in ONE traced collective call per rank (trace a single call):
    ``{"step", "rank", "to", "chunk", "phase"}``. ``step`` is the index of the exchange among its
    sender's exchanges (ring: reduce-scatter 0..n-2, then all-gather); ``chunk`` is None when the
    whole buffer travels; ``phase`` is the step's name without its numbers. Only the steps of
    ``op`` count when given; the signature checks of debug mode (``"debug_check"``) never do."""
    steps = [s for s in spans if s["cat"] == "comm.step" and s["name"] != "debug_check"]
    steps = [s for s in steps if op is None or s["name"] == op]
    rows = []
    for rank in sorted({s["rank"] for s in steps}):
        mine = sorted((s for s in steps if s["rank"] == rank), key=lambda s: s["start"])
        for step, s in enumerate(mine):
            text = s["args"]["step"]
            phase = re.split(r" step | round |: | with | \(", text)[0]
            for m in _TO.finditer(text):
                chunk, to_one, to_many, partner, into = m.groups()
                peers = [int(x) for x in to_many.split(",")] if to_many else [int(to_one or partner or into)]
                for peer in peers:
                    chunk_id = None if chunk is None else int(chunk)
                    rows.append({"step": step, "rank": rank, "to": peer, "chunk": chunk_id, "phase": phase})
    if not rows:
        raise ValueError("no messages found: trace one collective with tinytrain.trace enabled and merge it")
    return rows


def plot_exchange_steps(rows: list, n: int, path=None, title: str | None = None):
    """An algorithm drawn step by step: one panel per step, the n ranks on a circle, an arrow per
    message coloured by the chunk it carries (grey: the whole buffer), labelled ``c2``; in a ring
    all-reduce the receiver adds the chunk during reduce-scatter and keeps it during all-gather."""
    steps = sorted({r["step"] for r in rows})
    fig, axes = plt.subplots(1, len(steps), figsize=(2.3 * len(steps), 2.7), dpi=120, squeeze=False)
    angle = 2 * numpy.pi * numpy.arange(n) / n
    xy = numpy.stack([numpy.sin(angle), numpy.cos(angle)], axis=1)
    colours = plt.get_cmap("tab10")
    for ax, step in zip(axes[0], steps):
        here = [r for r in rows if r["step"] == step]
        for r in here:
            (x0, y0), (x1, y1) = xy[r["rank"]], xy[r["to"]]
            colour = "0.5" if r["chunk"] is None else colours(r["chunk"] % 10)
            ax.annotate(
                "",
                xy=(x1 * 0.82, y1 * 0.82),
                xytext=(x0 * 0.82, y0 * 0.82),
                arrowprops=dict(arrowstyle="-|>", color=colour, lw=1.6, connectionstyle="arc3,rad=0.15"),
            )
            if r["chunk"] is not None:
                mx, my = (x0 + x1) / 2, (y0 + y1) / 2
                ax.text(mx * 0.7, my * 0.7, f"c{r['chunk']}", color=colour, fontsize=7, ha="center", va="center")
        for rank, (x, y) in enumerate(xy):
            ax.add_patch(plt.Circle((x, y), 0.17, color="#eeeeee", ec="k", lw=0.6))
            ax.text(x, y, str(rank), ha="center", va="center", fontsize=8)
        ax.set_xlim(-1.3, 1.3)
        ax.set_ylim(-1.3, 1.3)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(f"step {step + 1}\n{here[0]['phase']}", fontsize=8)
    return _finish(fig, path, title)


def plot_bytes_vs_formula(names: list, measured: list, formula: list, path=None, unit: str = "bytes per step"):
    """Measured bytes (all ranks, one step) next to the handout's formula, one pair of bars per strategy."""
    fig, ax = plt.subplots(figsize=(1.3 * len(names) + 2, 3.4), dpi=120)
    x = numpy.arange(len(names))
    ax.bar(x - 0.2, measured, 0.4, label="measured")
    ax.bar(x + 0.2, formula, 0.4, label="formula", hatch="//", alpha=0.7)
    for i, (m, f) in enumerate(zip(measured, formula)):
        ax.text(i, max(m, f), "=" if m == f else f"{m / f:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x)
    ax.set_xticklabels(names, fontsize=8)
    ax.set_ylabel(unit)
    ax.legend(fontsize=8)
    return _finish(fig, path)


def plot_latency_model(rows: list, model, crossovers: dict | None = None, path=None, title: str | None = None):
    """Latency against message size per algorithm (``bench collectives --json`` rows), measured
    points and the α-β model's line ``model(algo, size_bytes) -> seconds``; vertical lines at the
    ``crossovers`` ({label: size in bytes}) where the cheaper algorithm changes."""
    fig, ax = plt.subplots(figsize=(6.5, 4), dpi=120)
    for i, algo in enumerate(sorted({r["algo"] for r in rows})):
        mine = sorted((r for r in rows if r["algo"] == algo), key=lambda r: r["size_bytes"])
        sizes = numpy.array([r["size_bytes"] for r in mine], dtype=float)
        colour = plt.get_cmap("tab10")(i)
        ax.plot(sizes, [r["time_us"] for r in mine], "o", color=colour, label=f"{algo} (measured)")
        grid = numpy.geomspace(sizes.min(), sizes.max(), 50)
        ax.plot(grid, [model(algo, s) * 1e6 for s in grid], "-", color=colour, lw=1, label=f"{algo} (α-β)")
    for label, size in (crossovers or {}).items():
        ax.axvline(size, color="k", ls=":", lw=1)
        ax.text(size, ax.get_ylim()[1], label, rotation=90, va="top", ha="right", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("time per call (µs)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    ax.set_title(title or "latency vs size: measured and the α-β model")
    return _finish(fig, path)


def _smooth(values: list, window: int = 10) -> numpy.ndarray:
    """The running mean over ``window`` steps (the first steps over as many as there are)."""
    cumulative = numpy.cumsum(numpy.asarray(values, dtype=numpy.float64))
    out = cumulative.copy()
    out[window:] = cumulative[window:] - cumulative[:-window]
    return out / numpy.minimum(numpy.arange(1, len(values) + 1), window)


def plot_dp_algos(results: list, names: list, path=None, target: float | None = None):
    """``tinytrain bench dp-algos``: loss (running mean of 10 steps) against steps and against the
    bytes all ranks sent, per data-parallel algorithm, and the asynchronous server's staleness."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), dpi=120)
    for r, name in zip(results, names):
        loss = _smooth(r["loss"])
        axes[0].plot(numpy.arange(1, len(loss) + 1), loss, lw=1, label=name)
        axes[1].plot(numpy.cumsum(r["bytes"]) / 2**20, loss, lw=1, label=name)
    for ax, label in zip(axes[:2], ("step", "MiB sent by all ranks")):
        ax.set_xlabel(label)
        ax.set_ylabel("loss (mean of 10 steps)")
        ax.grid(alpha=0.3)
        if target is not None:
            ax.axhline(target, color="gray", ls=":", lw=1)
    axes[1].set_xscale("symlog", linthresh=1)  # local SGD's first average comes after H steps of nothing
    axes[1].set_xlim(left=0)
    axes[0].legend(fontsize=8)
    stale = [(r, name) for r, name in zip(results, names) if r.get("staleness")]
    for r, name in stale:
        counts = numpy.bincount(r["staleness"])
        axes[2].bar(numpy.arange(len(counts)), counts, label=name)
    axes[2].set_xlabel("staleness (updates behind)")
    axes[2].set_ylabel("gradients")
    axes[2].set_title("asynchronous parameter server" if stale else "no asynchronous run")
    return _finish(fig, path, "data parallel without lock-step: communication against convergence")


def plot_fed(results: list, path=None, target: float | None = None):
    """``tinytrain bench fed``: validation loss against rounds and against the bytes all ranks sent,
    per federated setting, and the skewed clients' share of each label class."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), dpi=120)
    for r in results:
        rounds = numpy.arange(1, len(r["loss"]) + 1)
        axes[0].plot(rounds, r["loss"], lw=1, label=r["name"])
        axes[1].plot(numpy.cumsum(r["bytes"]) / 2**20, r["loss"], lw=1, label=r["name"])
    for ax, label in zip(axes[:2], ("round", "MiB sent by all ranks")):
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
        if target is not None:
            ax.axhline(target, color="gray", ls=":", lw=1)
    axes[0].legend(fontsize=8)
    skewed = next((r for r in results if r["name"].startswith("skew")), None)
    if skewed is not None:
        shares = numpy.asarray(skewed["label_shares"])
        image = axes[2].imshow(shares, aspect="auto", cmap="viridis", vmin=0, vmax=1)
        fig.colorbar(image, ax=axes[2], label="share of the client's samples")
        axes[2].set_xlabel("label class (first answer digit)")
        axes[2].set_ylabel("client")
        axes[2].set_title(skewed["name"].split(",")[0])
    return _finish(fig, path, "federated averaging: what skew, participation, masks and noise cost")
