"""Assignment 5 (pipeline parallel), graded. Run: ``python -m grader --tasks 5.*``.

Schedules (5.2-5.4, 5.6) are checked on paper with the simulator in ``tinytrain.parallel.simulator``:
every pass exactly once, no backward before its forward, no deadlock, and the bubble share and
peak activations of the textbook. Sizes are drawn when the test runs, so only a real schedule
passes. Stage messages (5.1) are checked by a two-stage run whose gradients must equal a serial
computation, and the whole pipeline by training a small GPT against a serial run; the split
backward (5.5) by two-stage runs of written-out split schedules, against the serial gradients and
with no weight gradient before a stage's first W.

Besides the drawn sizes each schedule runs fixed edge cases whatever the draw: one stage, one
micro-batch, fewer micro-batches than stages, many more; interleaved with m == p (every chunk's
forward before the first backward) and with 3 chunks.
"""

from __future__ import annotations

import numpy as np
import pytest

from grader.seeds import grading_seed
from tinytrain import distributed as dist
from tinytrain import functional as F
from tinytrain.autograd import Tensor
from tinytrain.nn import GPT, GPTConfig
from tinytrain.optim import SGD
from tinytrain.parallel.simulator import Action, ScheduleError, bubble_formula, simulate
from tinytrain.testing import assert_close


def shared_rng():
    """A generator every rank draws identically, and its seed (named in failure messages)."""
    seed = grading_seed()
    return np.random.default_rng(seed), seed


def sizes(rng, n=4):
    return [(int(rng.integers(2, 6)), int(rng.integers(1, 13))) for _ in range(n)]


def run_on_paper(schedule, stages, chunks, what):
    try:
        return simulate(schedule, forward_cost=1.0, backward_cost=2.0, chunks=chunks)
    except ScheduleError as exc:
        raise AssertionError(f"{what}: {exc}") from None


def order(actions) -> str:
    return " ".join(map(str, actions))


def check_passes(sched, p, m, what, chunks=1, kinds="FB"):
    """Properties every valid order has: p stage lists; on every stage each pass (kind, chunk) runs
    once per micro-batch and in the order the micro-batches entered the pipe (no overtaking)."""
    assert len(sched) == p, f"{what}: {len(sched)} stage lists, expected {p}"
    for s, actions in enumerate(sched):
        extra = [str(a) for a in actions if a.kind not in kinds or not 0 <= a.chunk < chunks]
        assert not extra, (
            f"{what}: stage {s} runs {extra}: this schedule has only {'/'.join(kinds)} on {chunks} chunk(s)"
        )
        for kind in kinds:
            for c in range(chunks):
                mbs = [a.microbatch for a in actions if a.kind == kind and a.chunk == c]
                where = f"{kind}s" + (f" of chunk {c}" if chunks > 1 else "")
                assert mbs == list(range(m)), (
                    f"{what}: stage {s} runs its {where} for micro-batches {mbs}, expected each of 0..{m - 1} once "
                    f"and in that order (a micro-batch never overtakes an earlier one); the stage runs {order(actions)}"
                )


def check_fixed(sched, expected, what):
    """A fixed case against its whole order, written out (kind, micro-batch and chunk per stage)."""
    for s, (actions, want) in enumerate(zip(sched, expected)):
        got = order(actions)
        if got != want:
            mine, theirs = got.split(), want.split()
            i = next((i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y), min(len(mine), len(theirs)))
            yours, wanted = (a[i] if i < len(a) else "none" for a in (mine, theirs))
            first = f"pass {i} is {yours}, expected {wanted}"
            raise AssertionError(  # the cause on the first line: the score table shows only that one
                f"{what}: stage {s}'s order differs from the schedule's from its pass {i} on ({first}; "
                f"a warm-up, pairing or drain off?)\n  got      {got}\n  expected {want}"
            )


# --- 5.2 GPipe -------------------------------------------------------------------------------------


@pytest.mark.task("5.2")
def test_gpipe_schedule(impl):
    rng, seed = shared_rng()
    for p, m in sizes(rng) + [(1, 1), (1, 3), (4, 1), (2, 7)]:  # drawn, then fixed edge cases
        what = f"gpipe({p}, {m}) (seed {seed})"
        sched = impl.pipeline.gpipe(p, m)
        check_passes(sched, p, m, what)
        for s, actions in enumerate(sched):
            kinds = "".join(a.kind for a in actions)
            assert kinds == "F" * m + "B" * m, f"{what}: stage {s} runs {kinds}; GPipe runs all F, then all B"
        t = run_on_paper(sched, p, 1, what)
        assert t.peak_activations == [m] * p, f"{what}: peak activations {t.peak_activations}, expected {m} everywhere"
        assert abs(t.bubble_share - bubble_formula(p, m)) < 1e-9, f"{what}: bubble {t.bubble_share:.4f}"


# --- 5.3 1F1B --------------------------------------------------------------------------------------

ONE_F_ONE_B_ORDERS = {  # written out (the 1F1B picture in schedules.py, and one with m > p)
    (4, 4): [
        "F0 F1 F2 F3 B0 B1 B2 B3",
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ],
    (3, 5): ["F0 F1 F2 B0 F3 B1 F4 B2 B3 B4", "F0 F1 B0 F2 B1 F3 B2 F4 B3 B4", "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4"],
    (4, 2): ["F0 F1 B0 B1", "F0 F1 B0 B1", "F0 F1 B0 B1", "F0 B0 F1 B1"],
}


@pytest.mark.task("5.3")
def test_1f1b_schedule(impl):
    rng, seed = shared_rng()
    for p, m in sizes(rng) + [(4, 2), (1, 3), (3, 1), (4, 4), (2, 8), (3, 5)]:  # drawn, then fixed: m < p, m = 1, p = 1
        what = f"one_f_one_b({p}, {m}) (seed {seed})"
        sched = impl.pipeline.one_f_one_b(p, m)
        check_passes(sched, p, m, what)
        if (p, m) in ONE_F_ONE_B_ORDERS:
            check_fixed(sched, ONE_F_ONE_B_ORDERS[(p, m)], what)
        t = run_on_paper(sched, p, 1, what)
        expected = [min(p - s, m) for s in range(p)]
        assert t.peak_activations == expected, (
            f"{what}: stages hold at most {t.peak_activations} micro-batches at once; 1F1B holds {expected} "
            "(stage s holds at most p - s)"
        )
        assert abs(t.bubble_share - bubble_formula(p, m)) < 1e-9, (
            f"{what}: bubble {t.bubble_share:.4f}, textbook {bubble_formula(p, m):.4f}"
        )


# --- 5.4 interleaved 1F1B --------------------------------------------------------------------------

INTERLEAVED_ORDERS = {  # written out: the handout's worked case, and p = 3 (F3.1: micro-batch 3, chunk 1)
    (2, 4, 2): [
        "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3",
        "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3",
    ],
    (3, 6, 2): [
        "F0 F1 F2 F0.1 F1.1 F2.1 F3 F4 B0.1 F5 B1.1 F3.1 B2.1 F4.1 B0 F5.1 B1 B2 B3.1 B4.1 B5.1 B3 B4 B5",
        "F0 F1 F2 F0.1 F1.1 F2.1 B0.1 F3 B1.1 F4 B2.1 F5 B0 F3.1 B1 F4.1 B2 F5.1 B3.1 B4.1 B5.1 B3 B4 B5",
        "F0 F1 F2 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3 B0 F4 B1 F5 B2 F3.1 B3.1 F4.1 B4.1 F5.1 B5.1 B3 B4 B5",
    ],
    (2, 2, 2): ["F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1", "F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1"],  # m == p
}
INTERLEAVED_PEAKS = {  # chunk activations each stage holds at most, for the fixed cases
    (2, 2, 2): [4, 4],
    (4, 4, 3): [12, 12, 12, 12],
    (3, 9, 2): [8, 6, 4],
    (4, 8, 2): [11, 9, 7, 5],
    (2, 4, 2): [5, 3],
    (3, 6, 3): [11, 9, 7],
    (3, 6, 2): [8, 6, 4],
}


@pytest.mark.task("5.4")
def test_interleaved_schedule(impl):
    rng, seed = shared_rng()
    drawn = []
    for _ in range(4):
        p, v = int(rng.integers(2, 5)), int(rng.integers(2, 4))
        drawn.append((p, p * int(rng.integers(1, 4)), v))
    for p, m, v in drawn + list(INTERLEAVED_PEAKS):  # drawn, then fixed: m == p, 3 chunks
        what = f"interleaved_1f1b({p}, {m}, {v}) (seed {seed})"
        sched = impl.pipeline.interleaved_1f1b(p, m, v)
        check_passes(sched, p, m, what, chunks=v)
        if (p, m, v) in INTERLEAVED_ORDERS:
            check_fixed(sched, INTERLEAVED_ORDERS[(p, m, v)], what)
        # Every stage visits the (micro-batch, chunk) passes in the same order, forwards and
        # backwards alike; only where its backwards start differs. Its list is warm-up forwards,
        # then forward-backward pairs, then the backwards left.
        passes = [[(a.microbatch, a.chunk) for a in actions if a.kind == k] for actions in sched for k in "FB"]
        for s in range(1, p):
            for k, kind in enumerate("FB"):
                mine, first = (order(a for a in sched[r] if a.kind == kind) for r in (s, 0))
                assert passes[2 * s + k] == passes[k], (
                    f"{what}: stage {s} runs its {kind}s in another (micro-batch, chunk) order than stage 0: "
                    f"{mine} against {first}"
                )
        for s, actions in enumerate(sched):
            kinds = "".join(a.kind for a in actions)
            warm = len(kinds) - len(kinds.lstrip("F")) - (1 if len(kinds.lstrip("F")) else 0)
            shape = "F" * warm + "FB" * (m * v - warm) + "B" * warm
            assert kinds == shape, (
                f"{what}: stage {s} runs {kinds}: after its warm-up a stage alternates F and B, then drains"
            )
        t = run_on_paper(sched, p, v, what)
        assert abs(t.bubble_share - bubble_formula(p, m, v)) < 1e-9, (
            f"{what}: bubble {t.bubble_share:.4f}, textbook (p-1)/(v·m+p-1) = {bubble_formula(p, m, v):.4f}"
        )
        peaks = t.peak_activations
        assert all(a >= b for a, b in zip(peaks, peaks[1:])) and max(peaks) <= m * v, (
            f"{what}: stages hold at most {peaks} chunk activations: a later stage never needs to hold more"
        )
        if (p, m, v) in INTERLEAVED_PEAKS:
            assert peaks == INTERLEAVED_PEAKS[(p, m, v)], (
                f"{what}: stages hold at most {peaks} chunk activations at once (the warm-up forwards, plus one); "
                f"interleaved 1F1B holds {INTERLEAVED_PEAKS[(p, m, v)]}"
            )
    with pytest.raises(ValueError):
        impl.pipeline.interleaved_1f1b(4, 6, 2)  # 6 micro-batches do not go in groups of 4


# --- 5.1 stage messages with autograd ---------------------------------------------------------------


@pytest.mark.task("5.1")
@pytest.mark.world_size(2)
@pytest.mark.parametrize("case", ["drawn", "one-row"])
def test_activation_and_gradient_cross_stages(impl, case):
    rng, seed = shared_rng()
    n, d = int(rng.integers(2, 9)), int(rng.integers(2, 9))
    n = 1 if case == "one-row" else n
    x = rng.normal(size=(n, d)).astype(np.float32)
    w = rng.normal(size=(d, d)).astype(np.float32)
    pl = impl.pipeline
    what = f"{case}: activation ({n}, {d}) (seed {seed})"
    if dist.get_rank() == 0:  # stage 0: h = x @ w, sent on; later its gradient comes back
        weight = Tensor(w, requires_grad=True)
        h = Tensor(x) @ weight
        pl.send_activation(h, 1, tag=7).wait()
        h.backward(pl.recv_gradient(h, 1, tag=8))
        # serial: loss = sum((x w)^2)  ->  d loss / d w = x^T · 2 (x w)
        assert_close(
            weight.grad,
            x.T @ (2 * (x @ w)),
            atol=1e-4,
            rtol=1e-4,
            what=f"rank 0: gradient of stage 0's weight, {what}",
        )
    else:  # stage 1: loss = sum(h^2) of the received activation
        h = pl.recv_activation((n, d), np.float32, 0, tag=7)
        assert h.requires_grad and h.is_leaf, (
            f"rank 1: the received activation must be a leaf that requires grad (requires_grad={h.requires_grad}, "
            f"is_leaf={h.is_leaf}), {what}"
        )
        assert_close(h.data, x @ w, atol=1e-4, rtol=1e-4, what=f"rank 1: the received activation, {what}")
        (h * h).sum().backward()
        pl.send_gradient(h, 0, tag=8).wait()


@pytest.mark.task("5.1")
@pytest.mark.world_size(2)
def test_each_received_activation_has_its_own_buffer(impl):
    """Backward needs every micro-batch's activation until its B: a receive must not reuse the
    buffer of an earlier one."""
    rng, seed = shared_rng()
    shape = (int(rng.integers(2, 9)), int(rng.integers(2, 9)))
    first = rng.normal(size=shape).astype(np.float32)
    pl = impl.pipeline
    if dist.get_rank() == 0:
        for values in (first, first + 1):
            pl.send_activation(Tensor(values), 1, tag=7).wait()
    else:
        a = pl.recv_activation(shape, np.float32, 0, tag=7)
        b = pl.recv_activation(shape, np.float32, 0, tag=7)
        assert_close(b.data, first + 1, what=f"rank 1: the second received activation (seed {seed})")
        assert_close(
            a.data,
            first,
            what=f"rank 1: the first received activation after the second arrived: receive each micro-batch into a "
            f"fresh buffer, backward still needs the earlier one (seed {seed})",
        )


def _actions(text):
    return [Action(a[0], int(a[1])) for a in text.split()]


TWO_STAGE_SCHEDULES = {  # p = 2 stages, m = 4 micro-batches
    "gpipe": [_actions("F0 F1 F2 F3 B0 B1 B2 B3"), _actions("F0 F1 F2 F3 B0 B1 B2 B3")],
    "1f1b": [_actions("F0 F1 B0 F2 B1 F3 B2 B3"), _actions("F0 B0 F1 B1 F2 B2 F3 B3")],
}


@pytest.mark.task("5.1")
@pytest.mark.world_size(2)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stage_training_matches_serial(impl, schedule):
    rng, seed = shared_rng()
    cfg = GPTConfig(vocab_size=9, block_size=5, n_layer=2, n_head=2, n_embd=8)
    ids = rng.integers(0, 9, size=(4, 6))
    x, y = ids[:, :-1], ids[:, 1:]
    serial = GPT(cfg, seed=seed)
    F.cross_entropy(serial(x), y).backward()
    model = GPT(cfg, seed=seed)
    stage = impl.pipeline.PipelineStage(model, 2)
    actions = TWO_STAGE_SCHEDULES[schedule][stage.rank]  # written out: 5.1 must not depend on 5.2/5.3
    impl.pipeline.train_step(stage, actions, x, y, 4)
    ref = dict(serial.named_parameters())
    for name, p in model.named_parameters():
        if any(p is q for q in stage.parameters()):
            assert_close(
                p.grad,
                ref[name].grad,
                atol=1e-5,
                rtol=1e-4,
                what=f"rank {stage.rank}: gradient of {name} after a {schedule} step (seed {seed})",
            )
    SGD(stage.parameters(), lr=0.1).step()  # and the step itself runs


# --- 5.5 the backward split into B and W in the executor --------------------------------------------


def _split_actions(text):
    """``"F0 B0 W0"`` or, with chunks, ``"F0.1 B0.1 W0.1"`` (micro-batch 0 through chunk 1)."""
    out = []
    for a in text.split():
        mb, _, chunk = a[1:].partition(".")
        out.append(Action(a[0], int(mb), int(chunk or 0)))
    return out


# Split schedules, p = 2 stages, written out: 5.5 must not depend on 5.6. Name: (chunks per stage,
# placement, each stage's actions).
SPLIT_SCHEDULES = {
    "zb-h1 m=4": (
        1,
        "loop",
        ["F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3", "F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3"],
    ),
    "all W last m=3": (  # every B first: the W's must still find their micro-batch's work
        1,
        "loop",
        ["F0 F1 F2 B0 B1 B2 W2 W0 W1", "F0 F1 F2 B2 B0 B1 W1 W2 W0"],
    ),
    "one micro-batch": (1, "loop", ["F0 B0 W0", "F0 B0 W0"]),
    # Two chunks per stage: a stage runs the B of one micro-batch on both its chunks before
    # either W, so what a B keeps must be told apart by chunk as well as by micro-batch.
    "interleaved, 2 chunks, W last": (
        2,
        "loop",
        [
            "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0 W1.0 W0.1 W0.0 W1.1",
            "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0 W0.0 W1.1 W1.0 W0.1",
        ],
    ),
    "zb-v m=2": (  # ZB-V's V: stage 0 holds the first and the last part, stage 1 turns round
        2,
        "v",
        [
            "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 B0.0 W0.1 W1.1 W0.0 B1.0 W1.0",
            "F0.0 F0.1 F1.0 F1.1 B0.1 B0.0 W0.1 B1.1 W0.0 B1.0 W1.1 W1.0",
        ],
    ),
}


@pytest.mark.task("5.5")
@pytest.mark.world_size(2)
@pytest.mark.parametrize("case", list(SPLIT_SCHEDULES))
@pytest.mark.parametrize("tied", [True, False])
def test_split_backward_matches_serial_and_leaves_weights_to_w(impl, case, tied):
    rng, seed = shared_rng()
    chunks, placement, texts = SPLIT_SCHEDULES[case]
    cfg = GPTConfig(vocab_size=9, block_size=5, n_layer=3 * chunks, n_head=2, n_embd=8, tie_weights=tied)
    actions_of = [_split_actions(t) for t in texts]
    m = 1 + max(a.microbatch for a in actions_of[0])
    ids = rng.integers(0, 9, size=(2 * m, 6))
    x, y = ids[:, :-1], ids[:, 1:]
    serial = GPT(cfg, seed=seed)
    F.cross_entropy(serial(x), y).backward()
    model = GPT(cfg, seed=seed)
    stage = impl.pipeline.PipelineStage(model, 2, chunks, placement=placement)
    actions = actions_of[stage.rank]
    step = impl.pipeline.PipelineStep(stage, actions, x, y, m)
    before_first_w = []
    weights = step.weights
    what = f"rank {stage.rank}, {case}, tied={tied} (seed {seed})"

    def watch(mb, chunk):  # the parameters with a gradient when this stage's first W starts
        if not before_first_w:
            before_first_w.append([n for n, p in model.named_parameters() if p.grad is not None])
        try:
            weights(mb, chunk)
        except (KeyError, IndexError) as exc:
            raise AssertionError(
                f"{what}: W of micro-batch {mb}, chunk {chunk} found no work kept for it ({type(exc).__name__}: "
                f"{exc}); this stage ran {' '.join(map(str, actions))}: what each B keeps must wait, apart from "
                "every other B's, for its own W"
            ) from None

    step.weights = watch
    step.run()
    early = before_first_w[0]
    assert early == [], (
        f"{what}: weight gradients were computed before this stage's first W: B computes the gradient of the "
        f"stage's input only, and leaves the weight gradients to W ({len(early)} parameters had one: "
        f"{', '.join(early)})"
    )
    ref = dict(serial.named_parameters())
    for name, p in model.named_parameters():
        if any(p is q for q in stage.parameters()):
            assert p.grad is not None, f"{what}: {name} has no gradient after the step: did every W run its work?"
            assert_close(
                p.grad,
                ref[name].grad,
                atol=1e-5,
                rtol=1e-4,
                what=f"{what}: gradient of {name} (does every W run the work its own B kept, once?)",
            )


# --- 5.6 ZB-H1 ---------------------------------------------------------------------------------------


ZB_H1_ORDERS = {  # written out
    (4, 4): [
        "F0 F1 F2 F3 B0 W0 B1 W1 B2 W2 B3 W3",
        "F0 F1 F2 B0 F3 B1 W0 B2 W1 B3 W2 W3",
        "F0 F1 B0 F2 B1 F3 B2 W0 B3 W1 W2 W3",
        "F0 B0 F1 B1 F2 B2 F3 B3 W0 W1 W2 W3",
    ],
    (3, 5): [
        "F0 F1 F2 B0 W0 F3 B1 W1 F4 B2 W2 B3 W3 B4 W4",
        "F0 F1 B0 F2 B1 W0 F3 B2 W1 F4 B3 W2 B4 W3 W4",
        "F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 F4 B4 W2 W3 W4",
    ],
    (4, 2): ["F0 F1 B0 W0 B1 W1", "F0 F1 B0 B1 W0 W1", "F0 F1 B0 B1 W0 W1", "F0 B0 F1 B1 W0 W1"],
}


@pytest.mark.task("5.6")
def test_zb_h1_schedule(impl):
    rng, seed = shared_rng()
    drawn = []
    for _ in range(4):
        p = int(rng.integers(2, 6))
        drawn.append((p, int(rng.integers(p, 3 * p + 1))))
    # drawn, then fixed: m = p, m < p, p = 1
    for p, m in drawn + [(4, 4), (4, 16), (1, 3), (3, 1), (4, 2), (2, 9), (3, 5)]:
        what = f"zb_h1({p}, {m}) (seed {seed})"
        sched = impl.pipeline.zb_h1(p, m)
        check_passes(sched, p, m, what, kinds="FBW")
        if (p, m) in ZB_H1_ORDERS:
            check_fixed(sched, ZB_H1_ORDERS[(p, m)], what)
        one_f = impl.pipeline.one_f_one_b(p, m)
        for s, actions in enumerate(sched):
            kept = [a for a in actions if a.kind != "W"]
            assert kept == one_f[s], f"{what}: stage {s}'s forwards and backwards are not in 1F1B's order"
        try:  # unit costs F = B = W = 1 (a whole backward is 2, of which W is 1)
            t = simulate(sched, forward_cost=1.0, backward_cost=2.0, weight_cost=1.0)
        except ScheduleError as exc:
            raise AssertionError(f"{what}: {exc}") from None
        assert t.peak_activations == [min(p, m)] * p, (
            f"{what}: stages hold at most {t.peak_activations} micro-batches from F to W; ZB-H1 holds "
            f"{[min(p, m)] * p}, 1F1B's peak (p, or all m when m < p), on every stage"
        )
        if m >= p:
            idle = p - 1  # (p-1)(F + B - W) per stage
            assert abs(t.bubble_share - idle / (3 * m + idle)) < 1e-9, (
                f"{what}: bubble {t.bubble_share:.4f}, zero-bubble formula (p-1)/(3m+p-1) = {idle / (3 * m + idle):.4f}"
            )
        unsplit = simulate(one_f, forward_cost=1.0, backward_cost=2.0).bubble_share
        assert t.bubble_share <= unsplit + 1e-9, f"{what}: bubble {t.bubble_share:.4f} above 1F1B's {unsplit:.4f}"
