"""Figures and trace measurements from ``tinytrain.viz``, on data made in the test."""

from __future__ import annotations

import numpy as np
import pytest

from tinytrain import viz


def test_overlap_share_counts_communication_time_covered_by_compute():
    def span(rank, cat, start, end):
        return {"rank": rank, "cat": cat, "name": cat, "start": start, "end": end, "args": {}}

    spans = [
        span(0, "comm.step", 0, 10),
        span(0, "compute", 5, 20),  # 5 of 10 hidden
        span(1, "comm.step", 0, 4),
        span(1, "comm.step", 2, 6),
        span(1, "compute", 0, 2),  # union 0-6: 2 hidden
    ]
    assert viz.overlap_share(spans, lambda s: s["cat"] == "compute") == pytest.approx((5 + 2) / (10 + 6))
    with pytest.raises(ValueError, match="no communication spans"):
        viz.overlap_share([span(0, "compute", 0, 1)], lambda s: True)


def test_expert_load_figure_from_metrics(tmp_path):
    rng = np.random.default_rng(0)
    steps = []
    for step in range(1, 6):
        load = rng.integers(0, 50, size=4).tolist()
        steps.append({"step": step, "loss": 1.0, "moe": {"load": load, "aux": 1.0 + 0.1 * step, "dropped": 0.05}})
    path = tmp_path / "expert_load.png"
    viz.plot_expert_load({"steps": steps}, path, experts_per_rank=2)
    assert path.read_bytes().startswith(b"\x89PNG") and path.stat().st_size > 5000
    with pytest.raises(ValueError, match="train with --experts"):
        viz.plot_expert_load({"steps": [{"step": 1, "loss": 1.0}]}, path)
