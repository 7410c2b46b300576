"""Activation recomputation under every layout (``--recompute``, ``nn/recompute.py``).

Under each layout a step with ``selective`` or ``full`` recompute must give the loss and every
local gradient of the same layout without recompute, bit for bit, with dropout on (the recompute
redraws the forward's masks, also where a pipeline runs a micro-batch's backward outside its
``batch_rows``); and the bytes a block keeps, measured by the engine, must be
``costs.tinytrain_activation_bytes`` with this rank's piece of the work: under tensor and sequence
parallel (divided by t where it says), data parallel (its rows), context parallel (its positions,
and the attention algorithm's own arrays), ZeRO-3 (each block's input, whatever the mode).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tinytrain import distributed as dist
from tinytrain import random
from tinytrain.autograd import Tensor, peak_saved_bytes, reset_peak_saved_bytes, saved_bytes
from tinytrain.backend import to_host
from tinytrain.nn import GPT, GPTConfig
from tinytrain.nn.recompute import apply_recompute
from tinytrain.parallel import costs
from tinytrain.parallel.hybrid import parallelize
from tinytrain.parallel.plan import Plan

VOCAB, T, ROWS, C, H = 16, 8, 8, 32, 4


def batch(step: int = 0):
    rng = np.random.default_rng([7, step])
    return rng.integers(0, VOCAB, size=(ROWS, T)), rng.integers(0, VOCAB, size=(ROWS, T))


def one_step(plan: Plan, mode: str, dropout: float = 0.1, experts: int = 0, n_layer: int = 2):
    """(loss, this rank's gradients in order, peak bytes saved for backward) of one step."""
    config = GPTConfig(
        vocab_size=VOCAB, block_size=T, n_layer=n_layer, n_head=H, n_embd=C, dropout=dropout, n_experts=experts
    )
    plan = dataclasses.replace(plan, recompute=mode)
    plan.check(dist.get_world_size(), config, ROWS)
    model = parallelize(GPT(config, seed=0), plan)
    random.manual_seed((0, 1))
    reset_peak_saved_bytes()
    loss = model.forward_backward(*batch())
    peak = peak_saved_bytes()
    grads = [None if g is None else to_host(g).copy() for _, g in model._local_gradients()]
    assert saved_bytes() == 0, "a graph outlived its backward"
    return loss, grads, peak


LAYOUTS = {
    "--dp 2": Plan(dp=2),
    "--dp 2 --zero 1": Plan(dp=2, zero=1),
    "--dp 2 --zero 2": Plan(dp=2, zero=2),
    "--dp 2 --zero 3": Plan(dp=2, zero=3),
    "--tp 2": Plan(tp=2),
    "--tp 2 --sp": Plan(tp=2, sp=True),
    "--pp 2 (1f1b)": Plan(pp=2),
    "--pp 2 --schedule gpipe": Plan(pp=2, schedule="gpipe"),
    "--pp 2 --schedule interleaved --chunks 2": Plan(pp=2, schedule="interleaved", chunks=2, microbatches=4),
    "--pp 2 --schedule zb-h1": Plan(pp=2, schedule="zb-h1"),  # a recomputed block's W comes with its B
    "--pp 2 --schedule zb-v": Plan(pp=2, schedule="zb-v"),
    "--cp 2 (ring)": Plan(cp=2),
    "--cp 2 --cp-algo alltoall": Plan(cp=2, cp_algo="alltoall"),
}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_recompute_gives_the_same_loss_and_gradients_bit_for_bit(layout):
    assert_recompute_changes_no_number(layout, LAYOUTS[layout])


# ZeRO-3 composed: over a module its units recompute already; over a pipeline stage (gathered for the
# step, no units) --recompute full is the blocks' own
COMPOSED_ZERO3 = {
    "--dp 2 --tp 2 --zero 3": Plan(dp=2, tp=2, zero=3),
    "--dp 2 --pp 2 --zero 3": Plan(dp=2, pp=2, zero=3),
    "--dp 2 --cp 2 --zero 3": Plan(dp=2, cp=2, zero=3),
}


@pytest.mark.world_size(4)
@pytest.mark.parametrize("layout", list(COMPOSED_ZERO3))
def test_recompute_under_zero3_composed_gives_the_same_loss_and_gradients_bit_for_bit(layout):
    assert_recompute_changes_no_number(layout, COMPOSED_ZERO3[layout])


def assert_recompute_changes_no_number(layout: str, plan: Plan) -> None:
    n_layer = 4 if plan.chunks > 1 else 2
    loss, grads, peak = one_step(plan, "none", n_layer=n_layer)
    peaks = {"none": peak}
    for mode in ("selective", "full"):
        got_loss, got_grads, peaks[mode] = one_step(plan, mode, n_layer=n_layer)
        assert got_loss == loss, f"{layout} --recompute {mode}: loss {got_loss!r} != {loss!r}"
        for i, (g, want) in enumerate(zip(got_grads, grads)):
            assert (g is None) == (want is None), f"{layout} --recompute {mode}: gradient {i} missing on one side"
            if g is not None:
                assert np.array_equal(g, want), (
                    f"{layout} --recompute {mode}: gradient {i} differs by up to {np.abs(g - want).max():.3g} "
                    f"(rank {dist.get_rank()})"
                )
    if plan.zero == 3 and plan.pp == 1:  # its units recompute every block already: full changes nothing
        assert peaks["none"] == peaks["full"] > peaks["selective"], peaks
    else:
        assert peaks["none"] > peaks["selective"] > peaks["full"], peaks


@pytest.mark.world_size(2)
def test_recompute_under_expert_parallel_gives_the_same_gradients():
    """The MoE's load-balancing loss leaves a fully recomputed block as a second output."""
    plan = Plan(ep=2)
    loss, grads, _ = one_step(plan, "none", dropout=0.0, experts=4)
    for mode in ("selective", "full"):
        got_loss, got_grads, _ = one_step(plan, mode, dropout=0.0, experts=4)
        assert got_loss == loss
        assert all(np.array_equal(g, w) for g, w in zip(got_grads, grads) if w is not None), mode


def kept_at_backward(plan: Plan, mode: str, n_layer: int, monkeypatch, rows: int = 8, seq: int = 16) -> int:
    """Bytes saved for backward when this rank's first backward starts (its whole forward done)."""
    config = GPTConfig(vocab_size=VOCAB, block_size=seq, n_layer=n_layer, n_head=H, n_embd=C, dropout=0.1)
    model = parallelize(GPT(config, seed=0), dataclasses.replace(plan, recompute=mode))
    kept, backward = [], Tensor.backward

    def measured(self, *args, **kwargs):
        kept.append(saved_bytes())
        return backward(self, *args, **kwargs)

    monkeypatch.setattr(Tensor, "backward", measured)
    random.manual_seed((0, 1))
    x, y = (np.random.default_rng(1).integers(0, VOCAB, size=(rows, seq)) for _ in range(2))
    model.forward_backward(x, y)
    monkeypatch.undo()
    return kept[0]


BYTES_LAYOUTS = {
    "--tp 2": Plan(tp=2),
    "--tp 2 --sp": Plan(tp=2, sp=True),
    "--dp 2": Plan(dp=2),
    "--cp 2 (ring)": Plan(cp=2),
    "--cp 2 --cp-algo alltoall": Plan(cp=2, cp_algo="alltoall"),
    "--dp 2 --zero 3": Plan(dp=2, zero=3),
}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layout", list(BYTES_LAYOUTS))
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_bytes_per_block_equal_the_formula(mode, layout, monkeypatch):
    """A block's bytes (two blocks minus one) on this rank: the formula with its piece of the work,
    divided by t under TP where the formula says; ZeRO-3 keeps each block's input whatever the mode."""
    plan = BYTES_LAYOUTS[layout]
    measured = kept_at_backward(plan, mode, 2, monkeypatch) - kept_at_backward(plan, mode, 1, monkeypatch)
    rows = 8 // plan.dp
    mode = "full" if plan.zero == 3 else mode
    want = costs.tinytrain_activation_bytes(16, rows, C, H, plan.tp, plan.sp, mode, cp=plan.cp, cp_algo=plan.cp_algo)
    assert measured == want, (layout, mode, measured, want)


def test_recompute_none_undoes_it():
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=1, n_head=H, n_embd=C))
    apply_recompute(model, "full")
    apply_recompute(model, "selective")
    assert model.blocks[0].recompute_fn is None and model.blocks[0].attn.attention_fn is not None
    apply_recompute(model, "none")
    assert model.blocks[0].recompute_fn is None and model.blocks[0].attn.attention_fn is None
