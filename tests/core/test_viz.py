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


# --- communication figures (issue 13) ----------------------------------------------------------------


def counters_span(rank, peers):
    return {
        "name": "comm counters",
        "cat": "counters",
        "rank": rank,
        "start": 0.0,
        "end": 0.0,
        "args": {"peers": peers},
    }


def test_comm_matrix_from_trace_reads_the_counters_records():
    spans = [
        counters_span(0, [["dp", "all_reduce", 1, 100, 40], ["tp", "send", 2, 7, 0]]),
        counters_span(1, [["dp", "all_reduce", 0, 40, 100]]),
        {"name": "x", "cat": "compute", "rank": 2, "start": 0.0, "end": 1.0, "args": {}},
    ]
    m = viz.comm_matrix_from_trace(spans)
    assert m.shape == (3, 3) and m[0, 1] == 100 and m[0, 2] == 7 and m[1, 0] == 40 and m.sum() == 147
    assert viz.comm_matrix_from_trace(spans, group="tp").sum() == 7
    assert viz.comm_matrix_from_trace(spans, op="all_reduce")[0, 2] == 0
    earlier = dict(counters_span(0, [["dp", "all_reduce", 1, 60, 0]]), start=-1.0)  # counters only grow
    assert viz.comm_matrix_from_trace([earlier, *spans])[0, 1] == 100
    with pytest.raises(ValueError, match="comm counters"):
        viz.comm_matrix_from_trace(spans[2:])


def step_span(rank, start, text, name="all_reduce"):
    return {"name": name, "cat": "comm.step", "rank": rank, "start": start, "end": start + 1, "args": {"step": text}}


def test_exchange_steps_parse_each_algorithms_step_names():
    spans = [
        step_span(0, 0, "ring reduce-scatter step 1/1 (chunk 0 to rank 1, chunk 1 from rank 1)"),
        step_span(0, 2, "ring all-gather step 1/1 (chunk 1 to rank 1, chunk 0 from rank 1)"),
        step_span(1, 0, "tree broadcast: send to ranks [3, 2]", name="broadcast"),
        step_span(1, 1, "recursive doubling round 1/1 with rank 0"),
        step_span(1, 2, "tree broadcast: receive from rank 0", name="broadcast"),
        step_span(0, 9, "signature", name="debug_check"),
    ]
    rows = viz.exchange_steps(spans)
    assert [(r["rank"], r["step"], r["to"], r["chunk"], r["phase"]) for r in rows] == [
        (0, 0, 1, 0, "ring reduce-scatter"),
        (0, 1, 1, 1, "ring all-gather"),
        (1, 0, 3, None, "tree broadcast"),
        (1, 0, 2, None, "tree broadcast"),
        (1, 1, 0, None, "recursive doubling"),
    ]
    assert [r["to"] for r in viz.exchange_steps(spans, op="broadcast")] == [3, 2]
    with pytest.raises(ValueError, match="no messages"):
        viz.exchange_steps(spans[-1:])


def test_communication_figures_are_written(tmp_path):
    viz.plot_comm_matrices({"a": np.eye(4, k=1) * 3000, "b": np.ones((4, 4))}, tmp_path / "m.png", title="t")
    rows = [
        {"step": 0, "rank": 0, "to": 1, "chunk": 0, "phase": "p"},
        {"step": 1, "rank": 1, "to": 0, "chunk": None, "phase": "q"},
    ]
    viz.plot_exchange_steps(rows, 2, tmp_path / "e.png", title="t")
    viz.plot_bytes_vs_formula(["DP", "TP"], [10, 12], [10, 11], tmp_path / "b.png")
    bench = [{"algo": a, "size_bytes": s, "time_us": s / 1e3 + 5} for a in ("ring", "rd") for s in (1024, 65536)]
    viz.plot_latency_model(bench, lambda algo, size: size / 1e9 + 5e-6, {"x": 4096}, tmp_path / "l.png")
    for name in ("m", "e", "b", "l"):
        assert (tmp_path / f"{name}.png").stat().st_size > 1000


def test_alpha_beta_fit_recovers_a_known_link_and_its_crossover():
    from tinytrain.parallel import costs

    alpha, bw, n = 20e-6, 2e9, 4
    points = []
    for algo in ("ring", "recursive_doubling", "halving_doubling"):
        for size in (1 << 12, 1 << 16, 1 << 20):
            steps, sent = (
                costs.collective_steps("all_reduce", n, algo),
                costs.collective_bytes("all_reduce", size, n, algo),
            )
            points.append((steps, sent, steps * alpha + sent / bw))
    got_alpha, got_bw = costs.fit_alpha_beta(points)
    assert got_alpha == pytest.approx(alpha, rel=1e-9) and got_bw == pytest.approx(bw, rel=1e-9)
    # recursive doubling (2 steps, 2N) against halving-doubling (4 steps, 1.5N): equal at N = 2α / (0.5 / bw)
    cross = costs.crossover("all_reduce", "recursive_doubling", "halving_doubling", n, alpha, bw)
    assert cross == pytest.approx(4 * alpha * bw)
    t = lambda algo: costs.collective_time("all_reduce", cross, n, alpha, bw, algo)  # noqa: E731
    assert t("recursive_doubling") == pytest.approx(t("halving_doubling"))
    assert costs.crossover("all_reduce", "ring", "halving_doubling", n, alpha, bw) is None  # same bytes, more steps


def test_expert_balance_comparison_figure(tmp_path):
    def run(loads):
        steps = [{"step": i + 1, "loss": 2.0 - 0.01 * i, "moe": {"load": load}} for i, load in enumerate(loads)]
        return {"steps": steps}

    assert viz.max_over_mean([3, 1, 0, 0]) == 3.0 and viz.max_over_mean([2, 2]) == 1.0
    path = tmp_path / "balance.png"
    viz.compare_expert_balance({"aux": run([[3, 1, 0, 0]] * 30), "bias": run([[1, 1, 1, 1]] * 30)}, path)
    assert path.stat().st_size > 0
    with pytest.raises(ValueError, match="train with --experts"):
        viz.compare_expert_balance({"dense": {"steps": [{"step": 1, "loss": 1.0}]}}, path)
