"""A backward split in two (engine.backward_inputs): B gives the inputs' gradients and leaves the
weights' untouched; W, run later, adds them; together they equal one full backward bit for bit."""

import numpy as np
import pytest

from tinytrain.autograd import Tensor, backward_inputs, saved_bytes
from tinytrain.nn import GPT, GPTConfig
from tinytrain.nn.recompute import apply_recompute


def gpt_stage_pair(seed, tied, recompute="none"):
    """Two copies of a GPT's blocks 1.. (a pipeline stage's part) and an input activation."""
    cfg = GPTConfig(vocab_size=13, block_size=6, n_layer=3, n_head=2, n_embd=16, tie_weights=tied)
    models = [GPT(cfg, seed=seed) for _ in range(2)]
    for m in models:
        apply_recompute(m, recompute)
    return cfg, models


def run_stage(model, h, y, cfg):
    for block in model.blocks[1:]:
        h = block(h)
    return model.head_loss(h, y, denominator=y.size)


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
@pytest.mark.parametrize("tied", [True, False])
def test_split_gradients_equal_one_full_backward_bit_for_bit(rng, tied, recompute):
    seed = int(rng.integers(1 << 30))
    cfg, (full, split) = gpt_stage_pair(seed, tied, recompute)
    x = rng.normal(size=(3, cfg.block_size, cfg.n_embd)).astype(np.float32)
    y = rng.integers(0, cfg.vocab_size, size=(3, cfg.block_size))
    h_full, h_split = Tensor(x.copy(), requires_grad=True), Tensor(x.copy(), requires_grad=True)

    run_stage(full, h_full, y, cfg).backward()

    held_before = saved_bytes()
    w = backward_inputs(run_stage(split, h_split, y, cfg), inputs=[h_split])
    # B: the input's gradient is complete, no weight has one yet (unless a recomputed block ran whole)
    assert np.array_equal(h_split.grad, h_full.grad)
    params = dict(split.named_parameters())
    if recompute == "none":
        assert all(p.grad is None for p in params.values()), "B must leave the weight gradients to W"
        assert saved_bytes() > 0, "W still needs the saved inputs of the weight ops"
    w()
    assert saved_bytes() <= held_before, "W frees what it used"
    for name, p in full.named_parameters():
        if p.grad is None:
            assert params[name].grad is None, name
            continue
        assert np.array_equal(params[name].grad, p.grad), f"{name}: split gradient differs from the full backward's"


def test_weights_used_through_a_view_and_twice_get_their_gradient_in_w(rng):
    """A weight reached through a non-leaf (w.T) and used twice: the view's backward is W work too."""
    x0 = rng.normal(size=(4, 5))
    w0 = rng.normal(size=(5, 5))
    grads = []
    for split in (False, True):
        x, w = Tensor(x0, requires_grad=True), Tensor(w0, requires_grad=True)
        out = ((x @ w.T) @ w).tanh().sum() + (w * w).sum()
        if split:
            work = backward_inputs(out, inputs=[x])
            assert w.grad is None and x.grad is not None
            work()
        else:
            out.backward()
        grads.append((x.grad, w.grad))
    assert np.array_equal(grads[0][0], grads[1][0]) and np.array_equal(grads[0][1], grads[1][1])


def test_no_inputs_puts_everything_in_w_and_w_runs_once(rng):
    w = Tensor(rng.normal(size=(3,)), requires_grad=True)
    work = backward_inputs((w * w).sum(), inputs=[])
    assert w.grad is None
    work()
    assert np.array_equal(w.grad, 2 * w.data)
    with pytest.raises(RuntimeError, match="W runs once"):
        work()
