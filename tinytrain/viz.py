"""Figures drawn from metrics and traces with matplotlib (no display needed).

``viz`` reads data (metrics dicts, trace files); it imports nothing from the layers above it.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only: works on a machine with no screen
import matplotlib.pyplot as plt  # noqa: E402


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
