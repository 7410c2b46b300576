"""Pipeline schedules on paper: bubble share and peak activations against the formulas, and the
simulator catching schedules that cannot run. Single-process (no messages are sent)."""

from __future__ import annotations

import numpy as np
import pytest

from tinytrain.parallel.pipeline import (
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    placement_of,
    split_layers,
    zb_h1,
    zb_v,
)
from tinytrain.parallel.simulator import (
    Action,
    ScheduleError,
    bubble_formula,
    simulate,
    stage_of,
    validate,
    virtual_stage,
)

rng = np.random.default_rng()
# Shapes become test ids, which must be the same on every rank of `mpirun -n 4 pytest` (the
# harness compares what each rank collected), so the extra shapes come from a fixed seed.
_shape_rng = np.random.default_rng(20261130)
SHAPES = [(1, 1), (1, 5), (2, 1), (2, 2), (3, 7), (4, 4), (4, 8)] + [
    (int(_shape_rng.integers(2, 7)), int(_shape_rng.integers(1, 17))) for _ in range(4)
]


@pytest.mark.parametrize("p,m", SHAPES)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_bubble_share_matches_formula(name, p, m):
    # unequal forward/backward costs: the share does not depend on their ratio
    cost_f, cost_b = float(rng.uniform(0.5, 2)), float(rng.uniform(0.5, 3))
    t = simulate(make_schedule(name, p, m), cost_f, cost_b)
    assert t.bubble_share == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)
    assert t.makespan == pytest.approx((m + p - 1) * (cost_f + cost_b))


@pytest.mark.parametrize("p,m", SHAPES)
def test_peak_activations_gpipe_holds_all_1f1b_at_most_p(p, m):
    assert simulate(gpipe(p, m)).peak_activations == [m] * p
    peaks = simulate(one_f_one_b(p, m)).peak_activations
    assert peaks == [min(p - s, m) for s in range(p)]  # stage s holds p - s: never more than p


@pytest.mark.parametrize("p,k,v", [(2, 1, 2), (2, 3, 3), (4, 1, 2), (4, 2, 2), (4, 4, 4), (3, 2, 2)])
def test_interleaving_divides_the_bubble(p, k, v):
    m = p * k
    t = simulate(interleaved_1f1b(p, m, v), chunks=v)
    assert t.bubble_share == pytest.approx(bubble_formula(p, m, v), abs=1e-9)
    assert bubble_formula(p, m, v) == pytest.approx((p - 1) / (v * m + p - 1))
    if p > 1:
        assert t.bubble_share < simulate(one_f_one_b(p, m)).bubble_share


@pytest.mark.parametrize("p,m", [(p, m) for p, m in SHAPES if m >= p] + [(4, 4), (4, 8), (4, 16), (3, 3), (6, 7)])
def test_zb_h1_with_unit_costs_has_the_zero_bubble_formula(p, m):
    # F = B = W = 1: the whole backward costs 2, of which W is 1
    t = simulate(zb_h1(p, m), forward_cost=1.0, backward_cost=2.0, weight_cost=1.0)
    idle_per_stage = (p - 1) * (1 + 1 - 1)  # (p-1)(F + B - W), counted independently of the code
    assert t.makespan == pytest.approx(3 * m + idle_per_stage)
    assert t.bubble_share == pytest.approx(idle_per_stage / (3 * m + idle_per_stage), abs=1e-12)
    assert bubble_formula(p, m, schedule="zb-h1") == pytest.approx(t.bubble_share, abs=1e-12)
    # the same peak as 1F1B's (its stage 0 holds p), now on every stage
    assert t.peak_activations == [p] * p
    if p > 1:  # about a third of 1F1B's
        one_f = simulate(one_f_one_b(p, m), 1.0, 2.0).bubble_share
        assert t.bubble_share < 0.5 * one_f


@pytest.mark.parametrize("p,m", [(2, 1), (4, 2), (5, 3), (1, 4)])
def test_zb_h1_with_fewer_microbatches_than_stages_still_beats_1f1b(p, m):
    t = simulate(zb_h1(p, m), 1.0, 2.0, weight_cost=1.0)
    assert t.peak_activations == [min(p, m)] * p
    assert t.bubble_share <= simulate(one_f_one_b(p, m), 1.0, 2.0).bubble_share + 1e-12


@pytest.mark.parametrize(
    "p,m", [(1, 3), (2, 2), (2, 7), (3, 3), (3, 6), (4, 4), (4, 8), (4, 16), (5, 6), (6, 7), (8, 8), (8, 21), (12, 12)]
)
def test_zb_v_with_unit_costs_has_its_formula_from_p_microbatches(p, m):
    # each chunk's F, B and W cost half of a stage's: 1/2 each; a stage's work is 6m halves
    t = simulate(zb_v(p, m), forward_cost=1.0, backward_cost=2.0, weight_cost=1.0, chunks=2, placement="v")
    idle_per_stage = (p - 1) * 0.5  # the first micro-batch's way down: p-1 chunk forwards, no work yet
    assert t.makespan == pytest.approx(3 * m + idle_per_stage)
    assert t.bubble_share == pytest.approx(idle_per_stage / (3 * m + idle_per_stage), abs=1e-12)
    assert bubble_formula(p, m, schedule="zb-v") == pytest.approx(t.bubble_share, abs=1e-12)
    # 2p chunks' activations: p micro-batches of a whole stage, 1F1B's peak, on every stage
    assert t.peak_activations == [2 * p] * p
    if p > 1:  # half of ZB-H1's idle time
        h1 = simulate(zb_h1(p, m), 1.0, 2.0, weight_cost=1.0)
        assert t.makespan - 3 * m == pytest.approx(0.5 * (h1.makespan - 3 * m))


@pytest.mark.parametrize("p,m", [(2, 1), (3, 2), (4, 1), (4, 3), (6, 5), (8, 7)])
def test_zb_v_with_fewer_microbatches_than_stages_runs_and_beats_zb_h1(p, m):
    t = simulate(zb_v(p, m), 1.0, 2.0, weight_cost=1.0, chunks=2, placement="v")
    assert t.bubble_share >= bubble_formula(p, m, schedule="zb-v") - 1e-12  # the formula is a floor
    assert t.bubble_share <= simulate(zb_h1(p, m), 1.0, 2.0, weight_cost=1.0).bubble_share + 1e-12
    assert max(t.peak_activations) <= 2 * p


@pytest.mark.parametrize("p,m", [(3, 6), (4, 5)])
def test_zb_v_cannot_run_on_the_loop_placement(p, m):
    # on interleaved's placement chunk 1 of stage s is part p + s: ZB-V's order waits for passes
    # that come after it (a deadlock), which is how the simulator tells a schedule from its placement
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(zb_v(p, m), chunks=2, placement="loop")


def test_placements_name_every_part_once():
    for p in range(1, 7):
        for placement, chunks in (("loop", 1), ("loop", 3), ("v", 2)):
            parts = [virtual_stage(s, c, p, placement) for s in range(p) for c in range(chunks)]
            assert sorted(parts) == list(range(p * chunks))
            assert all(
                stage_of(virtual_stage(s, c, p, placement), p, placement) == s for s in range(p) for c in range(chunks)
            )
    assert [virtual_stage(s, 1, 4, "v") for s in range(4)] == [7, 6, 5, 4]  # back up the stages
    assert placement_of("zb-v") == "v" and placement_of("interleaved") == "loop"
    with pytest.raises(ValueError, match="'v' \\(2 chunks\\)"):
        simulate(zb_v(2, 4), chunks=3, placement="v")


def test_split_schedules_are_checked():
    with pytest.raises(ScheduleError, match="stage 0 runs W0 before B0"):
        validate([[Action("F", 0), Action("W", 0), Action("B", 0)]])
    with pytest.raises(ScheduleError, match="splits some backwards into B and W but not all"):
        validate([[Action("F", 0), Action("F", 1), Action("B", 0), Action("W", 0), Action("B", 1)]])
    with pytest.raises(ScheduleError, match="an action is F, B or W"):
        validate([[Action("F", 0), Action("X", 0)]])


def test_every_pass_runs_once_and_in_order():
    for sched, chunks, passes in [
        (gpipe(3, 4), 1, 2),
        (one_f_one_b(3, 4), 1, 2),
        (interleaved_1f1b(3, 6, 2), 2, 2),
        (zb_h1(3, 4), 1, 3),
        (zb_v(3, 6), 2, 3),
    ]:
        validate(sched, chunks)
        for actions in sched:
            assert len(actions) == len(set(actions)) == passes * (len(actions) // passes)


def test_backward_before_forward_is_refused():
    with pytest.raises(ScheduleError, match="stage 1 runs B0 before F0"):
        simulate([[Action("F", 0), Action("B", 0)], [Action("B", 0), Action("F", 0)]])


def test_deadlock_is_found_and_explained():
    # stage 1 wants F1 first, but stage 0 sends F1 only after B0, which needs stage 1's B0: a cycle
    bad = [
        [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
        [Action("F", 1), Action("F", 0), Action("B", 0), Action("B", 1)],
    ]
    with pytest.raises(ScheduleError, match="deadlocks: stage 0 at B0 waits for B0 of virtual stage 1"):
        simulate(bad)


def test_bad_schedule_requests_are_clear_errors():
    with pytest.raises(ValueError, match="not a multiple of 4"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match="needs --schedule interleaved"):
        make_schedule("1f1b", 2, 4, chunks=2)
    with pytest.raises(ValueError, match="unknown schedule"):
        make_schedule("zigzag", 2, 4)
    with pytest.raises(ValueError, match="zb-v runs two chunks per stage in a V; drop --chunks 3"):
        make_schedule("zb-v", 2, 4, chunks=3)
    assert make_schedule("zb-v", 2, 4, chunks=2) == make_schedule("zb-v", 2, 4) == zb_v(2, 4)
    with pytest.raises(ValueError, match="one would be empty"):
        split_layers(3, 2, 2)


def test_split_layers_is_even_and_complete():
    for n, p, v in [(8, 4, 2), (7, 3, 1), (5, 2, 2), (4, 4, 1)]:
        parts = split_layers(n, p, v)
        assert [i for r in parts for i in r] == list(range(n))
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
