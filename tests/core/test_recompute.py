"""``--recompute none|selective|full`` on one process: the bytes each block keeps are the formula
(``costs.tinytrain_activation_bytes``), the loss and every gradient are the run without recompute
bit for bit, and ``tinytrain train`` takes the flag (and a resumed run may change it)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tinytrain import random
from tinytrain.autograd import saved_bytes
from tinytrain.cli import main
from tinytrain.nn import GPT, GPTConfig
from tinytrain.nn.recompute import apply_recompute
from tinytrain.parallel import costs
from tinytrain.parallel.plan import Plan

MODES = ("none", "selective", "full")


def gpt(mode, n_layer=2, seq=16, width=32, heads=4, dropout=0.1, **kw):
    config = GPTConfig(
        vocab_size=16, block_size=seq, n_layer=n_layer, n_head=heads, n_embd=width, dropout=dropout, **kw
    )
    model = GPT(config, seed=0)
    apply_recompute(model, mode)
    return model


def step(model, rows=4):
    """(loss, gradients by name, bytes saved for backward after the forward) of one step."""
    seq = model.config.block_size
    x, y = (np.random.default_rng(i).integers(0, 16, size=(rows, seq)) for i in range(2))
    random.manual_seed((0, 1))
    before = saved_bytes()
    loss = model.loss(x, y)
    kept = saved_bytes() - before
    loss.backward()
    assert saved_bytes() == before
    return loss.item(), {n: p.grad.copy() for n, p in model.named_parameters() if p.grad is not None}, kept


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "shape",
    [dict(), dict(dropout=0.0), dict(seq=100, width=24, heads=3), dict(seq=130, width=16, heads=2, dropout=0.0)],
    ids=["default", "no-dropout", "seq-100", "seq-130"],
)
def test_bytes_per_block_equal_the_formula(mode, shape):
    """One block's bytes: the model with two blocks minus the model with one (the same embedding,
    head and loss); beyond 64 positions attention keeps its causal blocks of 64 query rows only."""
    measured = step(gpt(mode, 2, **shape))[2] - step(gpt(mode, 1, **shape))[2]
    seq, width, heads = shape.get("seq", 16), shape.get("width", 32), shape.get("heads", 4)
    dropout = shape.get("dropout", 0.1) > 0
    assert measured == costs.tinytrain_activation_bytes(seq, 4, width, heads, recompute=mode, dropout=dropout)


@pytest.mark.parametrize("kw", [dict(), dict(n_experts=4), dict(n_experts=4, moe_top_k=1, moe_z_loss=0.1)])
def test_loss_and_every_gradient_equal_the_run_without_recompute(kw):
    loss, grads, _ = step(gpt("none", **kw))
    for mode in ("selective", "full"):
        got_loss, got_grads, _ = step(gpt(mode, **kw))
        assert got_loss == loss, mode
        assert got_grads.keys() == grads.keys()
        for name, g in got_grads.items():
            assert np.array_equal(g, grads[name]), f"--recompute {mode}: {name}"


def test_a_mixture_of_experts_keeps_only_its_input_under_full_recompute():
    measured = step(gpt("full", 2, n_experts=4))[2] - step(gpt("full", 1, n_experts=4))[2]
    assert measured == costs.tinytrain_activation_bytes(16, 4, 32, 4, recompute="full")


def test_the_formula_against_korthikanti_in_fp32():
    """Where the planner's formula (the paper's layer, 16-bit terms scaled to fp32) and ours part:
    exactly the terms tinytrain_activation_bytes' docstring lists."""
    for s, b, h, a in [(16, 4, 32, 4), (100, 2, 24, 3), (2048, 1, 12288, 96)]:
        sbh, P = s * b * h, costs.attention_scores_kept(s)
        ours = costs.tinytrain_activation_bytes(s, b, h, a)
        theirs = costs.activation_bytes_per_layer(s, b, h, a, itemsize=4)
        assert ours - theirs == pytest.approx(14 * sbh + 8 * s * b + 4 * a * b * P - 10 * a * b * s * s)
        selective = costs.activation_bytes_per_layer(s, b, h, a, recompute="selective", itemsize=4)
        assert costs.tinytrain_activation_bytes(s, b, h, a, recompute="selective") - selective == 14 * sbh + 8 * s * b
        assert costs.tinytrain_activation_bytes(s, b, h, a, recompute="full") == costs.activation_bytes_per_layer(
            s, b, h, a, recompute="full", itemsize=4
        )
    t = 8  # and under TP and SP, the paper's Table 2
    sbh = 2048 * 12288
    assert costs.activation_bytes_per_layer(2048, 1, 12288, 96, t, recompute="selective") == sbh * (10 + 24 / t)
    assert costs.activation_bytes_per_layer(2048, 1, 12288, 96, t, True, "selective") == pytest.approx(34 * sbh / t)


def test_sampling_keeps_its_cache_and_its_tokens():
    from tinytrain.sample import generate

    prompt = np.array([[1, 2, 3]])
    plain = gpt("none", dropout=0.0)
    plain.eval()
    want = generate(plain, prompt, 5)
    for mode in ("selective", "full"):
        model = gpt(mode, dropout=0.0)
        model.eval()
        assert model.kv_cache(1) is not None
        assert np.array_equal(generate(model, prompt, 5), want)


def test_a_bad_mode_is_refused_in_one_sentence():
    with pytest.raises(ValueError, match="--recompute takes none, selective or full"):
        Plan(recompute="some").check(1, GPTConfig(), 8)


TINY = (  # a constant learning rate: a resumed run may extend it
    "--layers 2 --width 32 --heads 2 --batch-size 8 --eval-every 2 --eval-batches 1 --warmup 0 --lr 3e-3 "
    "--min-lr 3e-3 --quiet --no-plot"
)


def test_train_takes_the_flag_and_a_resumed_run_may_change_it(tmp_path):
    """Recomputing changes no number: the loss curve is the plain run's, bit for bit, and a run
    resumed with another --recompute stays on it."""

    def train(out, *extra):
        assert main(["train", *TINY.split(), "--dropout", "0.1", "--out", str(tmp_path / out), *extra]) == 0
        return [s["loss"] for s in json.loads((tmp_path / out / "metrics.json").read_text())["steps"]]

    plain = train("plain", "--steps", "4")
    assert train("full", "--steps", "4", "--recompute", "full") == plain
    train("switch", "--steps", "2", "--recompute", "selective")
    assert train("switch", "--steps", "4", "--recompute", "full", "--resume") == plain
