"""Assignment 3 (ZeRO), graded. Run: ``python -m grader --tasks 3.*`` (4 ranks, and 3 for uneven pieces).

Each test trains a tiny GPT with ``impl.zero.Zero`` at one stage and checks three things against
formulas, never against stored numbers: the parameters equal a serial run on the same global
batches (SGD atol 1e-6, AdamW atol 2e-4 at lr 1e-2 with eps 1e-6: Adam turns a gradient near
zero into a step of about lr whatever its rounding, and eps 1e-6 keeps rounding-sized gradients
small), the bytes each rank holds are the ZeRO paper's (fp32 + Adam: stage 1 8Ψ + 8Ψ_r,
stage 2 4Ψ + 12Ψ_r, stage 3 16Ψ_r, Ψ_r = this rank's elements), and the bytes sent are exactly
ring reduce-scatter + all-gather (twice the gathers in stage 3). Seeds are drawn at run time;
replay with ``TINYTRAIN_GRADER_SEED=<seed>``.
"""

from __future__ import annotations

import numpy as np
import pytest

from grader.seeds import grading_seed
from tinytrain import distributed as dist
from tinytrain import functional as F
from tinytrain.backend import to_host, xp
from tinytrain.data import shard_rows
from tinytrain.distributed import work
from tinytrain.nn import GPT, GPTConfig
from tinytrain.optim import SGD, AdamW
from tinytrain.testing import assert_matches_serial

VOCAB, T, ROWS, STEPS = 16, 8, 12, 2
TOL = {"sgd": {"rtol": 1e-5, "atol": 1e-6}, "adamw": {"rtol": 1e-4, "atol": 2e-4}}


class Case:
    def __init__(self, opt_kind="sgd"):
        self.seed = grading_seed()
        self.opt_kind = opt_kind

    def model(self):
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=2, n_embd=32), seed=self.seed % 1000)

    def optimizer(self, model):
        if self.opt_kind == "adamw":
            return AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
        return SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)

    def batch(self, step):
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, VOCAB, size=(ROWS, T)), rng.integers(0, VOCAB, size=(ROWS, T))

    def what(self, text):
        return f"{text} (seed {self.seed}, rank {dist.get_rank()} of {dist.get_world_size()})"


def serial(case):
    model = case.model()
    opt = case.optimizer(model)
    for t in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(model(xp.asarray(case.batch(t)[0])), xp.asarray(case.batch(t)[1])).backward()
        opt.step()
    return {n: to_host(p.data) for n, p in model.named_parameters()}


def serial_gradients(case):
    """The serial run's gradients of the first step."""
    model = case.model()
    F.cross_entropy(model(xp.asarray(case.batch(0)[0])), xp.asarray(case.batch(0)[1])).backward()
    return {n: to_host(p.grad) for n, p in model.named_parameters()}


class Backward:
    """What happens inside ZeRO's backward, seen from hooks the test adds after ZeRO's own: the
    bytes of full gradients held at once (the whole backward's peak, not one sample after it), and
    reduce-scatters waited for before ``finish_gradient_sync`` (no overlap with backward)."""

    def __init__(self, zero, model, monkeypatch):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.peak_grad_bytes, self.early_waits, self.running = 0, 0, False
        self.peak_param_bytes = 0  # full parameters held (ZeRO-3 gathers a layer at a time)
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._after_zeros_hook)
        finish, wait = zero.finish_gradient_sync, work.Work.wait

        def finishing(*args, **kwargs):
            self.running = False
            return finish(*args, **kwargs)

        def waiting(w, *args, **kwargs):
            if self.running and w._call.op == "reduce_scatter":
                self.early_waits += 1
            return wait(w, *args, **kwargs)

        monkeypatch.setattr(zero, "finish_gradient_sync", finishing)
        monkeypatch.setattr(work.Work, "wait", waiting)

    def _after_zeros_hook(self, p) -> None:
        self.running = True
        held = sum(q.grad.nbytes for q in self.params if q.grad is not None)
        self.peak_grad_bytes = max(self.peak_grad_bytes, held)
        self.peak_param_bytes = max(self.peak_param_bytes, sum(q.data.nbytes for q in self.params))


def run(impl, case, stage, monkeypatch=None):
    """Train STEPS steps with ZeRO; returns (zero, memory just before the last step, bytes sent
    per op, what its backward did). Checks each rank's gradient pieces after the first backward."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model = case.model()
    opt = case.optimizer(model)
    zero = impl.zero.Zero(model, opt, stage=stage)
    backward = Backward(zero, model, monkeypatch) if monkeypatch is not None else None
    names = {id(p): name for name, p in model.named_parameters()}
    sent = {"reduce_scatter": 0, "all_gather": 0, "all_reduce": 0}
    for t in range(STEPS):
        opt.zero_grad()
        x, y = (shard_rows(a, rank, n) for a in case.batch(t))
        with dist.comm_stats() as stats:
            zero.backward(F.cross_entropy(zero(xp.asarray(x)), xp.asarray(y)))
            if t == 0:
                check_gradient_pieces(case, zero, stage, names)
            memory = zero.memory()
            zero.step()
        for op in sent:
            sent[op] += stats.sent(op)
    return zero, memory, sent, backward


def check_gradient_pieces(case, zero, stage, names):
    want = serial_gradients(case)
    for s in zero.shards:
        name = names[id(s.p)]
        got = xp.zeros(s.stop - s.start, dtype=np.float32) if s.grad is None else s.grad
        assert_matches_serial(
            got,
            want[name].reshape(-1)[s.start : s.stop],
            dist.get_world_size(),
            case.what(f"ZeRO-{stage}: this rank's piece [{s.start}:{s.stop}] of the averaged gradient of {name}"),
        )


def check_params(case, zero, stage):
    want = serial(case)
    for name, got in zero.full_parameters().items():
        assert_matches_serial(
            got,
            want[name],
            dist.get_world_size(),
            case.what(f"ZeRO-{stage} ({case.opt_kind}): {name}"),
            **TOL[case.opt_kind],
        )


def check_memory(case, zero, memory, stage):
    psi = sum(s.p.size if stage < 3 else int(np.prod(s.shape)) for s in zero.shards)
    mine = sum(s.stop - s.start for s in zero.shards)
    per = 8 if case.opt_kind == "adamw" else 4
    want = {1: (4 * psi, 4 * psi, per * mine), 2: (4 * psi, 4 * mine, per * mine), 3: (4 * mine, 4 * mine, per * mine)}[
        stage
    ]
    got = (memory["params"], memory["grads"], memory["optimizer"])
    assert got == want, case.what(
        f"ZeRO-{stage} holds (params, grads, optimizer) = {got} bytes, expected {want} "
        f"(Ψ={psi}, this rank's pieces Ψ_r={mine})"
    )


def piece_bytes(op, shards, group):
    """Bytes this rank sends in one ``op`` of each shard's pieces, by the algorithm that runs: the
    ring (every piece but one), or the direct stand-in of a student copy whose assignment 1 is unfinished."""
    return sum(dist.bytes_sent(op, s.sizes, 4, group=group) for s in shards)


def check_volume(case, zero, sent, stage):
    rs = STEPS * piece_bytes("reduce_scatter", zero.shards, zero.group)
    if stage < 3:
        ag = STEPS * piece_bytes("all_gather", zero.shards, zero.group)
    else:
        ag = STEPS * 2 * sum(piece_bytes("all_gather", shards, zero.group) for _, _, shards in zero.units)
    want = {"reduce_scatter": rs, "all_gather": ag, "all_reduce": 0}
    assert sent == want, case.what(
        f"ZeRO-{stage} sent {sent} bytes, expected {want}: one ring reduce-scatter "
        "of each gradient, one all-gather of each parameter per "
        + ("step" if stage < 3 else "use in forward and in backward")
    )


@pytest.mark.task("3.1")
@pytest.mark.world_size(4)
@pytest.mark.parametrize("opt_kind", ["sgd", "adamw"])
def test_zero1(impl, opt_kind):
    case = Case(opt_kind)
    zero, memory, sent, _ = run(impl, case, 1)
    check_params(case, zero, 1)
    check_memory(case, zero, memory, 1)
    check_volume(case, zero, sent, 1)


@pytest.mark.task("3.2")
@pytest.mark.world_size(4)
@pytest.mark.parametrize("opt_kind", ["sgd", "adamw"])
def test_zero2(impl, opt_kind, monkeypatch):
    case = Case(opt_kind)
    zero, memory, sent, backward = run(impl, case, 2, monkeypatch)
    largest = max(4 * s.p.size for s in zero.shards)
    assert backward.peak_grad_bytes <= largest, case.what(
        f"ZeRO-2 held {backward.peak_grad_bytes} bytes of full gradients at once during backward (the largest "
        f"parameter is {largest} bytes): drop each full gradient (p.grad = None) as soon as its reduce-scatter "
        "is launched"
    )
    assert backward.early_waits == 0, case.what(
        f"ZeRO-2 waited for a reduce-scatter {backward.early_waits} times during backward: launch each one "
        "async in the hook and wait in finish_gradient_sync, so communication overlaps the rest of backward"
    )
    check_params(case, zero, 2)
    check_memory(case, zero, memory, 2)
    check_volume(case, zero, sent, 2)
    assert all(s.p.grad is None for s in zero.shards), case.what("ZeRO-2 must drop each full gradient")


@pytest.mark.task("3.3")
@pytest.mark.world_size(4)
@pytest.mark.parametrize("opt_kind", ["sgd", "adamw"])
def test_zero3(impl, opt_kind, monkeypatch):
    case = Case(opt_kind)
    zero, memory, sent, backward = run(impl, case, 3, monkeypatch)
    check_params(case, zero, 3)
    check_memory(case, zero, memory, 3)
    check_volume(case, zero, sent, 3)
    biggest = max(sum(4 * int(np.prod(s.shape)) for s in shards) for _, _, shards in zero.units)
    assert memory["gathered_peak"] == biggest, case.what("ZeRO-3 should hold one layer's full parameters at a time")
    # Measured by the test itself (not by your counter): full parameters held during backward.
    assert backward.peak_param_bytes <= biggest, case.what(
        f"ZeRO-3 held {backward.peak_param_bytes} bytes of full parameters at once during backward; one layer "
        f"at a time is at most {biggest}: free each layer's gathered parameters when its backward is done"
    )
    assert all(s.p.data.size == 0 for s in zero.shards), case.what("ZeRO-3 must free gathered parameters")


@pytest.mark.world_size(3)
@pytest.mark.parametrize("stage", [pytest.param(k, marks=pytest.mark.task(f"3.{k}")) for k in (1, 2, 3)])
def test_uneven_pieces_on_3_ranks(impl, stage):
    case = Case("sgd")
    zero, memory, _, _ = run(impl, case, stage)
    check_params(case, zero, stage)
    check_memory(case, zero, memory, stage)


USES_AUX = (True, True, True, False)  # rank 3's loss never touches `aux`: its gradient stays None there


def with_aux(case, model):
    """``model`` plus a parameter ``aux`` whose loss term ranks 0-2 add and rank 3 does not."""
    from tinytrain.autograd import Parameter

    model.aux = Parameter(xp.asarray(np.random.default_rng(case.seed).normal(size=10).astype(np.float32)))
    return model


@pytest.mark.world_size(4)
@pytest.mark.parametrize("stage", [pytest.param(k, marks=pytest.mark.task(f"3.{k}")) for k in (1, 2)])
def test_a_parameter_without_gradient_on_one_rank_still_takes_part(impl, stage):
    """Rank 3's backward never meets ``aux``: its gradient stays None there and (stage 2) its hook
    never fires. Rank 3 must still join aux's reduce-scatter, with zeros, and in the same turn as
    the others, and the result must be the serial run's (whose loss adds the aux term with weight
    3/4)."""
    case = Case("sgd")
    rank = dist.get_rank()
    serial_model = with_aux(case, case.model())
    opt = case.optimizer(serial_model)
    for t in range(STEPS):
        opt.zero_grad()
        x, y = case.batch(t)
        loss = F.cross_entropy(serial_model(xp.asarray(x)), xp.asarray(y))
        (loss + (serial_model.aux * serial_model.aux).sum() * 0.75).backward()
        opt.step()
    model = with_aux(case, case.model())
    zero = impl.zero.Zero(model, case.optimizer(model), stage=stage)
    for t in range(STEPS):
        for p in model.parameters():
            p.grad = None
        x, y = (shard_rows(a, rank, 4) for a in case.batch(t))
        # aux's term is computed first, so on ranks 0-2 its gradient is complete first (the engine
        # completes the parameters in an order of its own), and not at all on rank 3
        aux_term = (model.aux * model.aux).sum() if USES_AUX[rank] else None
        loss = F.cross_entropy(zero(xp.asarray(x)), xp.asarray(y))
        zero.backward(loss + aux_term if aux_term is not None else loss)
        zero.step()
    for name, p in serial_model.named_parameters():
        assert_matches_serial(
            to_host(dict(model.named_parameters())[name].data),
            to_host(p.data),
            4,
            case.what(f"ZeRO-{stage} with a parameter that has no gradient on rank 3: {name}"),
        )


@pytest.mark.task("3.2")
@pytest.mark.world_size(4)
def test_zero2_over_a_pipeline_stages_parameters_with_two_micro_batches(impl):
    """A pipeline stage hands ZeRO-2 its parameters as a list and runs one plain backward per
    micro-batch, then syncs once: each gradient completes twice before the sync (the second
    backward must start the turns again), and the parameters after the steps equal the serial run's."""
    case = Case("sgd")
    rank = dist.get_rank()
    want = serial(case)
    model = case.model()
    zero = impl.zero.Zero(model.parameters(), case.optimizer(model), stage=2)
    for t in range(STEPS):
        for p in model.parameters():
            p.grad = None
        x, y = (shard_rows(a, rank, 4) for a in case.batch(t))
        half = x.shape[0] // 2
        for rows in (slice(0, half), slice(half, None)):  # two micro-batches of this rank's rows, uneven
            share = len(x[rows]) / len(x)  # a micro-batch's mean weighs by its rows
            (F.cross_entropy(model(xp.asarray(x[rows])), xp.asarray(y[rows])) * share).backward()
        zero.finish_gradient_sync()
        zero.step()
    for name, p in model.named_parameters():
        assert_matches_serial(
            to_host(p.data), want[name], 4, case.what(f"ZeRO-2 over a parameter list, 2 micro-batches: {name}")
        )


@pytest.mark.world_size(4)
@pytest.mark.parametrize("stage", [pytest.param(k, marks=pytest.mark.task(f"3.{k}")) for k in (2, 3)])
def test_a_parameter_used_midway_by_three_ranks_of_four(impl, stage):
    """A small model x ─ a ─ (+ Σ aux², ranks 0-2 only) ─ b ─ mean: on ranks 0-2 backward completes
    b, then aux, then a; on rank 3 b, then a, and aux never. Every rank must still start its
    reduce-scatters in the same turns (stage 3: two units, aux in the first). The parameters after
    SGD steps must equal the serial run's, whose loss is the mean of the four ranks' losses."""
    from tinytrain.autograd import Parameter
    from tinytrain.nn import Module

    seed, rank = grading_seed(), dist.get_rank()
    rng = np.random.default_rng(seed)
    start = {"a": rng.normal(size=(6, 5)), "aux": rng.normal(size=7), "b": rng.normal(size=(5, 3))}
    rows = rng.normal(size=(STEPS, 8, 6)).astype(np.float32)  # 2 rows per rank and step

    class Toy(Module):
        def __init__(self):
            super().__init__()
            for name, value in start.items():
                setattr(self, name, Parameter(xp.asarray(value.astype(np.float32))))
            self.uses_aux = True

        def first(self, x):
            h = x @ self.a
            return h + (self.aux * self.aux).sum() if self.uses_aux else h

        def forward(self, x):
            return self.first(x) @ self.b

    serial = Toy()
    opt = SGD(serial.parameters(), lr=0.1)
    for t in range(STEPS):
        opt.zero_grad()
        losses = []
        for r in range(4):
            serial.uses_aux = USES_AUX[r]
            losses.append(serial(xp.asarray(rows[t][2 * r : 2 * r + 2])).mean())
        (sum(losses[1:], losses[0]) * 0.25).backward()
        opt.step()
    toy = Toy()
    toy.uses_aux = USES_AUX[rank]
    units = [("a", toy.first, [toy.a, toy.aux]), ("b", lambda h: h @ toy.b, [toy.b])]
    zero = impl.zero.Zero(toy, SGD(toy.parameters(), lr=0.1), stage=stage, units=units if stage == 3 else None)
    for t in range(STEPS):
        for p in toy.parameters():
            p.grad = None
        zero.backward(zero(xp.asarray(rows[t][2 * rank : 2 * rank + 2])).mean())
        zero.step()
    if stage == 3:
        zero.materialize()
    for name, p in serial.named_parameters():
        assert_matches_serial(
            to_host(dict(toy.named_parameters())[name].data),
            to_host(p.data),
            4,
            f"ZeRO-{stage} with a parameter that has no gradient on rank 3: {name} (seed {seed})",
        )
