"""ZeRO 1/2/3 (tinytrain/parallel/zero.py): equivalence with the serial run, the ZeRO paper's
memory figures measured from the arrays each rank holds, and exact communication volumes; ZeRO-1
over a plain list of parameters (a pipeline stage), and clipping in a composed layout.

Tolerances against the serial run as in test_data_parallel.py (SGD atol 1e-6, AdamW 2e-4 at lr
1e-2). On 2 ranks every sum is a + b, the same bits in any order, so there ZeRO and DDP agree
*bitwise* (stage 3 is checked to 1e-6 only: its recompute-in-backward adds partial gradients
of a layer in a different order).
"""

from __future__ import annotations

import numpy as np
import pytest
from parallel_cases import (
    VOCAB,
    T,
    assert_params_close,
    assert_same_on_all_ranks,
    global_batch,
    make_optimizer,
    serial_params,
    tiny_gpt,
    train,
)

from tinytrain import distributed as dist
from tinytrain import functional as F
from tinytrain import random
from tinytrain.autograd import Tensor
from tinytrain.backend import xp
from tinytrain.data import shard_rows
from tinytrain.nn import GPT, GPTConfig
from tinytrain.optim import AdamW
from tinytrain.parallel.data_parallel import NaiveDDP, trainable
from tinytrain.parallel.hybrid import parallelize
from tinytrain.parallel.plan import Plan
from tinytrain.parallel.zero import (
    ZERO_STAGES,
    Zero,
    ZeroStage1,
    ZeroStage2,
    ZeroStage3,
    gpt_units,
)
from tinytrain.parallel.zero_parts import unsharded_memory

TOL = {"sgd": {"rtol": 1e-5, "atol": 1e-6}, "adamw": {"rtol": 1e-4, "atol": 2e-4}}
STEPS, ROWS = 2, 24  # 24 rows: 2, 3 or 4 ranks each get an even number


def run_zero(stage, opt_kind="adamw", steps=STEPS, accum=1, **model_kw):
    rank, n = dist.get_rank(), dist.get_world_size()
    model = tiny_gpt(**model_kw)
    opt = make_optimizer(opt_kind, model)
    zero = Zero(model, opt, stage=stage)
    train(zero, zero.backward, zero.step, opt, steps, ROWS, rank, n, accum=accum, no_sync=zero.no_sync)
    return zero


@pytest.mark.world_size(4)
@pytest.mark.parametrize("opt_kind", ["sgd", "adamw"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_matches_the_serial_run_with_gradient_accumulation(stage, opt_kind):
    zero = run_zero(stage, opt_kind, accum=2)
    params = zero.full_parameters()
    assert_params_close(
        params, serial_params(opt_kind, STEPS, ROWS), **TOL[opt_kind], what=f"ZeRO-{stage}, {opt_kind}, 2 micro-batches"
    )
    assert_same_on_all_ranks(params)


@pytest.mark.world_size(3)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_uneven_pieces_on_3_ranks_with_frozen_and_untied_weights(stage):
    """Width 32 does not divide by 3: every parameter splits into unequal pieces."""
    frozen = ("wpe", "blocks.1.mlp.fc_1")
    for tie in (False,):  # tied weights: every other test
        zero = run_zero(stage, "sgd", freeze=frozen, tie=tie)
        assert any(len(set(s.sizes)) > 1 for s in zero.shards)
        assert_params_close(
            zero.full_parameters(),
            serial_params("sgd", STEPS, ROWS, freeze=frozen, tie=tie),
            **TOL["sgd"],
            what=f"ZeRO-{stage} on 3 ranks, frozen {frozen}, tied={tie}",
        )
        assert all(id(p) not in zero.shard_of for n, p in zero.module.named_parameters() if n.startswith(frozen))


@pytest.mark.world_size(2)
def test_on_two_ranks_zero_and_ddp_agree_bitwise():
    rank, n = dist.get_rank(), dist.get_world_size()
    model = tiny_gpt()
    opt = make_optimizer("adamw", model)
    ddp = NaiveDDP(model)
    train(ddp, ddp.backward, opt.step, opt, STEPS, ROWS, rank, n)
    want = {k: p.data for k, p in model.named_parameters()}
    for stage in (1, 2, 3):
        got = run_zero(stage, "adamw").full_parameters()
        for k, w in want.items():
            if stage < 3:
                assert np.array_equal(got[k], w), f"ZeRO-{stage}: {k} differs from DDP in its bits"
            else:
                np.testing.assert_allclose(got[k], w, rtol=1e-5, atol=1e-6, err_msg=k)


def my_elements(zero) -> int:
    """Ψ_r: elements of this rank's pieces (Ψ/N when N divides every parameter's size)."""
    return sum(s.stop - s.start for s in zero.shards)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("opt_kind", ["adamw", "sgd"])
def test_memory_per_rank_is_the_zero_papers_figure(opt_kind):
    """fp32 + Adam: unsharded 16Ψ; stage 1 8Ψ + 8Ψ_r; stage 2 4Ψ + 12Ψ_r; stage 3 16Ψ_r (SGD with
    momentum keeps 4 bytes of state per element instead of Adam's 8)."""
    n = dist.get_world_size()
    model = tiny_gpt()
    opt = make_optimizer(opt_kind, model)
    train(model, lambda loss: loss.backward(), lambda: None, opt, 1, ROWS)
    opt.step()
    serial = unsharded_memory(model, opt)
    psi = sum(p.size for p in trainable(model))
    k = 8 if opt_kind == "adamw" else 4  # optimizer bytes per element
    assert serial == {"params": 4 * psi, "grads": 4 * psi, "optimizer": k * psi}  # 16Ψ with Adam
    for stage in (1, 2, 3) if opt_kind == "adamw" else (2,):
        rank = dist.get_rank()
        m = tiny_gpt()
        o = make_optimizer(opt_kind, m)
        zero = Zero(m, o, stage=stage)
        train(zero, zero.backward, lambda: None, o, 1, ROWS, rank, n)
        zero.step()
        x, y = global_batch(1, ROWS)
        zero.backward(F.cross_entropy(zero(xp.asarray(shard_rows(x, rank, n))), xp.asarray(shard_rows(y, rank, n))))
        mem, pr = zero.memory(), my_elements(zero)
        assert abs(pr - psi / n) < len(zero.shards), "rounding: at most one element per parameter"
        want = {1: (4 * psi, 4 * psi, k * pr), 2: (4 * psi, 4 * pr, k * pr), 3: (4 * pr, 4 * pr, k * pr)}[stage]
        assert (mem["params"], mem["grads"], mem["optimizer"]) == want, f"ZeRO-{stage} on rank {rank}: {mem}"
        if stage == 3:
            biggest = max(sum(4 * int(np.prod(s.shape)) for s in shards) for _, _, shards in zero.units)
            assert mem["gathered_peak"] == biggest, "stage 3 should hold one layer's parameters at a time"
        else:
            assert mem["gathered_peak"] == 0


def rs_ag_bytes(zero, rank: int, n: int) -> tuple[int, int]:
    """Bytes rank ``rank`` sends: ring reduce-scatter (every piece but its own) and all-gather
    (every piece but piece rank+1), per parameter (collectives.py)."""
    rs = sum(4 * (sum(s.sizes) - s.sizes[rank]) for s in zero.shards)
    ag = sum(4 * (sum(s.sizes) - s.sizes[(rank + 1) % n]) for s in zero.shards)
    return rs, ag


@pytest.mark.world_size(4)
def test_communication_volume_of_ddp_and_the_three_stages():
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(0, ROWS)
    x, y = xp.asarray(shard_rows(x, rank, n)), xp.asarray(shard_rows(y, rank, n))
    sent = {}
    for stage in (0, 1, 2, 3):
        model = tiny_gpt()
        opt = make_optimizer("adamw", model)
        s = NaiveDDP(model) if stage == 0 else Zero(model, opt, stage=stage)
        with dist.comm_stats() as stats:
            s.backward(F.cross_entropy(s(x), y))
            (opt.step if stage == 0 else s.step)()
        ops = ("all_reduce", "reduce_scatter", "all_gather")
        sent[stage] = {op: stats.sent(op) for op in ops}
        if stage in (1, 2):
            rs, ag = rs_ag_bytes(s, rank, n)
            assert sent[stage] == {"all_reduce": 0, "reduce_scatter": rs, "all_gather": ag}
        if stage == 3:
            gathers = sum(4 * (sum(sh.sizes) - sh.sizes[(rank + 1) % n]) for _, _, shards in s.units for sh in shards)
            assert sent[3] == {"all_reduce": 0, "reduce_scatter": rs, "all_gather": 2 * gathers}
    psi = sum(p.size for p in trainable(tiny_gpt()))
    totals = dist.all_reduce(np.array([sum(sent[k].values()) for k in range(4)], dtype=np.int64))
    assert totals[0] == 2 * (n - 1) * 4 * psi, "DDP: N ranks x 2(N-1)/N x 4Ψ"
    assert totals[1] == totals[2] == totals[0], "stages 1 and 2 move exactly what DDP moves"
    wte = 32 * 16  # the tied embedding is gathered by two layers, forward and backward
    assert totals[3] == 3 * (n - 1) * 4 * psi + 2 * (n - 1) * 4 * wte
    assert 1.5 <= totals[3] / totals[0] < 1.6


# ZeRO-3 composed (hybrid.parallelize): it shards over the data group (dp; dp x cp under CP), each
# rank the pieces of its own part: its TP shard (tp), its pipeline stage (pp), the whole model (cp)
COMPOSED = {
    "dp2 x tp2": Plan(dp=2, tp=2, zero=3),
    "dp2 x tp2 sp": Plan(dp=2, tp=2, sp=True, zero=3),
    "dp2 x pp2": Plan(dp=2, pp=2, zero=3),
    "dp2 x cp2": Plan(dp=2, cp=2, zero=3),
}


@pytest.mark.world_size(4)
@pytest.mark.parametrize("layout", list(COMPOSED))
def test_zero3_composed_holds_pieces_of_its_part_and_moves_them_over_the_data_axis(layout):
    """What a rank holds: 4 + 4 bytes per element of its pieces (8 of AdamW state after a step), the
    pieces being 1/N of its part (N: the data group's size) and its part less than the model under TP
    and PP. What it sends over the data group, measured: a module gathers each unit forward and again
    backward and reduce-scatters each gradient once; a pipeline stage gathers once for the step."""
    plan = COMPOSED[layout]
    config = GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
    psi = sum(p.size for p in GPT(config).parameters())
    model = parallelize(GPT(config, seed=0), plan)
    zero, n, rank = model.zero, model.data_group.size, model.zero.rank
    assert zero.stage == 3 and n == plan.dp * plan.cp
    x, y = global_batch(0, 8)
    random.manual_seed((0, 0))
    with dist.comm_stats() as stats:
        model.forward_backward(x, y)
    part = sum(sum(s.sizes) for s in zero.shards)  # elements of this rank's TP shard or stage
    mine = my_elements(zero)
    assert abs(mine - part / n) < len(zero.shards)
    assert (part < psi) == (plan.tp * plan.pp > 1), (layout, part, psi)
    mem = zero.memory()
    assert (mem["params"], mem["grads"]) == (4 * mine, 4 * mine), f"{layout} on rank {dist.get_rank()}: {mem}"
    model.step(AdamW(model.parameters(), lr=1e-2))
    assert zero.memory()["optimizer"] == 8 * mine
    rs = sum(4 * (sum(s.sizes) - s.sizes[rank]) for s in zero.shards)
    gathers = [4 * (sum(s.sizes) - s.sizes[(rank + 1) % n]) for _, _, shards in zero.units for s in shards]
    passes = 1 if plan.pp > 1 else 2  # a stage stays gathered for the step: no second gather in backward
    group = zero.group.name
    assert stats.sent("reduce_scatter", group) == rs, layout
    assert stats.sent("all_gather", group) == passes * sum(gathers), layout


@pytest.mark.world_size(4)
def test_clipping_uses_the_global_norm_of_the_pieces():
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(0, ROWS)
    serial = tiny_gpt()
    F.cross_entropy(serial(xp.asarray(x)), xp.asarray(y)).backward()
    want = float(np.sqrt(sum((p.grad.astype(np.float64) ** 2).sum() for p in serial.parameters())))
    for stage in (1, 2, 3):
        model = tiny_gpt()
        zero = Zero(model, make_optimizer("sgd", model), stage=stage)
        zero.backward(F.cross_entropy(zero(xp.asarray(shard_rows(x, rank, n))), xp.asarray(shard_rows(y, rank, n))))
        assert zero.clip_grad_norm_(1e-3) == pytest.approx(want, rel=1e-5)
        assert zero.clip_grad_norm_(1e9) == pytest.approx(1e-3, rel=1e-4)


@pytest.mark.world_size(2)
def test_impossible_settings_say_what_to_change():
    model = tiny_gpt()
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        Zero(model, make_optimizer("sgd", model), stage=4)
    with pytest.raises(ValueError, match="belong to no unit"):
        Zero(model, make_optimizer("sgd", model), stage=3, units=gpt_units(model)[:-1])


def test_the_stages_build_on_each_other():
    assert issubclass(ZeroStage3, ZeroStage2) and issubclass(ZeroStage2, ZeroStage1)
    assert {k: cls.stage for k, cls in ZERO_STAGES.items()} == {1: 1, 2: 2, 3: 3}
    model = tiny_gpt()
    for k, cls in ZERO_STAGES.items():
        zero = Zero(model if k < 3 else tiny_gpt(), make_optimizer("sgd", model), stage=k)
        assert type(zero) is cls and zero.stage == k
        assert [s.p for s in zero.shards] == trainable(zero.module), "zero.shards: one piece per parameter, in order"


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("n", [pytest.param(k, marks=pytest.mark.world_size(k)) for k in (2, 4)])
def test_zero_over_a_list_of_parameters_like_a_pipeline_stage(n, stage):
    """A pipeline stage is not a Module: ZeRO-1 (or 2) gets its parameters as a list; the caller runs a
    plain backward per micro-batch (gradients accumulate), then finish_gradient_sync() and step()."""
    rank, steps = dist.get_rank(), 3
    model = tiny_gpt()
    opt = make_optimizer("adamw", model)
    zero = Zero(model.parameters(), opt, stage=stage)
    assert zero.module is None and len(zero.shards) == len(model.parameters())

    def finish_and_step():
        zero.finish_gradient_sync()
        zero.clip_grad_norm_(1e9)
        zero.step()

    train(model, lambda loss: loss.backward(), finish_and_step, opt, steps, ROWS, rank, n, accum=2)
    got = {name: p.data for name, p in model.named_parameters()}
    assert_params_close(
        got, serial_params("adamw", steps, ROWS), **TOL["adamw"], what=f"ZeRO-{stage} over a parameter list"
    )
    assert_same_on_all_ranks(got)
    assert all(s.state is not None and s.state["step"] == steps for s in zero.shards)
    assert sorted(zero.full_parameters(), key=int) == [str(i) for i in range(len(zero.shards))]
    with pytest.raises(TypeError, match="list of parameters"):
        zero(xp.zeros((1, T), dtype=xp.int64))


@pytest.mark.world_size(4)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_square_sums_split_by_a_predicate_and_clipping_by_a_given_norm(stage):
    """A hybrid runner asks for (Σ g² of sharded weights, Σ g² of replicated ones) over the ZeRO
    group, adds the first over its other groups, and clips the pieces by the norm it computed."""
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(0, ROWS)
    serial = tiny_gpt()
    F.cross_entropy(serial(xp.asarray(x)), xp.asarray(y)).backward()
    want = {name: p.grad.astype(np.float64) for name, p in serial.named_parameters()}

    def mlp(name):  # the "sharded" weights of this test
        return ".mlp." in name

    model = tiny_gpt()
    zero = Zero(model, make_optimizer("sgd", model), stage=stage)
    zero.backward(F.cross_entropy(zero(xp.asarray(shard_rows(x, rank, n))), xp.asarray(shard_rows(y, rank, n))))
    name_of = {id(p): name for name, p in model.named_parameters()}
    sharded, replicated = zero.grad_square_sums(lambda p: mlp(name_of[id(p)]))
    assert sharded == pytest.approx(sum((g**2).sum() for k, g in want.items() if mlp(k)), rel=1e-5)
    assert replicated == pytest.approx(sum((g**2).sum() for k, g in want.items() if not mlp(k)), rel=1e-5)
    total = 2.0 * np.sqrt(sharded + replicated)  # as if another group had added as much again
    assert zero.clip_grad_norm_(1e-3, total_norm=total) == total
    scale = 1e-3 / (total + 1e-6)
    for s in zero.shards:
        np.testing.assert_allclose(s.grad / scale, s.my_piece(want[name_of[id(s.p)]]), rtol=1e-4, atol=1e-6)


@pytest.mark.world_size(2)
def test_zero3_recompute_draws_the_serial_dropout_masks():
    """Stage 3 recomputes each layer's forward in backward. A mask is a pure function of (seed, dropout
    site) and each rank keeps its rows of the global batch's mask (forward and backward both inside
    batch_rows), so ZeRO-3 with dropout trains like the serial model with dropout."""
    rank, n = dist.get_rank(), dist.get_world_size()

    def run(zero_stage):
        model = GPT(GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=2, n_embd=32, dropout=0.2), seed=0)
        opt = make_optimizer("sgd", model)
        net = Zero(model, opt, stage=zero_stage) if zero_stage else model
        for t in range(STEPS):
            random.manual_seed((0, t))
            opt.zero_grad()
            x, y = global_batch(t, ROWS)
            first, rows = (rank * ROWS // n, ROWS // n) if zero_stage else (0, ROWS)
            with random.batch_rows(first, ROWS):
                loss = F.cross_entropy(net(xp.asarray(x[first : first + rows])), xp.asarray(y[first : first + rows]))
                (net.backward if zero_stage else Tensor.backward)(loss)
            (net.step if zero_stage else opt.step)()
        return net.full_parameters() if zero_stage else {k: p.data for k, p in model.named_parameters()}

    for k in (1, 3):
        assert_params_close(run(k), run(0), **TOL["sgd"], what=f"ZeRO-{k} with dropout 0.2")
