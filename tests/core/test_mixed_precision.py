"""Mixed precision (``--precision``, issue 27 item 2): float32 master weights and optimizer state for
16-bit parameters (``optim.Optimizer``), dynamic loss scaling (``optim.LossScaler``), and why each
is there: a bf16 parameter alone cannot take a small update, and fp16 gradients underflow without
a scale, which a scaled run then trains through."""

from __future__ import annotations

import numpy as np
import pytest

from tinytrain import random
from tinytrain.autograd import Parameter, loss_scaling
from tinytrain.backend import device, precision_dtype, to_host, xp
from tinytrain.nn import GPT, GPTConfig
from tinytrain.optim import SGD, AdamW, LossScaler, grads_finite

LOW = ["fp16"] + (["bf16"] if device == "cpu" else [])  # CuPy has no bfloat16


@pytest.mark.parametrize("precision", LOW)
def test_a_16_bit_parameter_gets_a_float32_master_and_float32_moments(precision):
    dtype = precision_dtype(precision)
    p = Parameter(xp.asarray(np.linspace(-1, 1, 6), dtype=dtype))
    opt = AdamW([p], lr=0.1, weight_decay=0.0)
    p.grad = xp.ones(6, dtype=dtype)
    opt.step()
    state = opt.state[p]
    assert p.data.dtype == dtype
    assert {k: str(v.dtype) for k, v in state.items() if hasattr(v, "dtype")} == {
        "exp_avg": "float32",
        "exp_avg_sq": "float32",
        "master": "float32",
    }
    assert np.array_equal(to_host(p.data), to_host(state["master"].astype(dtype))), "the master, rounded"
    assert opt.state_bytes() == 12 * p.size  # master, m, v: the 12 of 2 + 2 + 12 bytes per parameter
    assert not np.array_equal(to_host(state["master"]), to_host(p.data).astype(np.float32))  # rounding was needed


@pytest.mark.parametrize("precision", LOW)
def test_small_updates_add_up_in_the_master_where_the_16_bit_parameter_alone_stalls(precision):
    """1000 SGD steps of 1e-4 on a weight of 1.0: 0.1 in all. bf16's spacing at 1 is 2^-7 (fp16's
    2^-10), so each step alone rounds back to 1.0; the float32 master keeps every step."""
    dtype = precision_dtype(precision)
    alone = xp.ones(4, dtype=dtype)
    p = Parameter(xp.ones(4, dtype=dtype))
    opt = SGD([p], lr=1e-4)
    for _ in range(1000):
        p.grad = xp.ones(4, dtype=dtype)
        opt.step()
        alone -= dtype.type(1e-4)  # the same update, in the parameter's own dtype
    assert float(to_host(alone)[0]) == 1.0, "without a master, every small step is rounded away"
    assert abs(float(to_host(opt.state[p]["master"])[0]) - 0.9) < 1e-4  # (float32 rounding of 1000 steps)
    assert abs(float(to_host(p.data)[0]) - 0.9) < 2**-7  # and the parameter is the master, rounded


def test_update_divides_the_scaled_gradient_in_float32():
    """A gradient of 1e-9 is 0 in float16 (below 2^-24); times a scale of 2^16 it is 6.6e-5, and the
    optimizer divides it back in float32, not in float16, where it would flush to zero again."""
    assert float(np.float16(1e-9)) == 0.0
    p = Parameter(xp.zeros(3, dtype=np.float16))
    opt = SGD([p], lr=1.0)
    p.grad = xp.asarray(np.full(3, 1e-9 * 2**16), dtype=np.float16)
    opt.loss_scale = 2.0**16
    opt.step()
    assert abs(float(to_host(opt.state[p]["master"])[0]) + 1e-9) < 1e-12


def test_the_scaler_skips_and_halves_on_inf_and_grows_after_clean_steps():
    scaler = LossScaler(scale=1024.0, growth_interval=3)
    grads = [xp.ones(4, dtype=np.float16), xp.asarray([1.0, np.inf, 0.0], dtype=np.float16)]
    assert not grads_finite(grads) and grads_finite(grads[:1]) and not grads_finite([xp.asarray([np.nan])])
    assert scaler.update(found_inf=not grads_finite(grads)) is False  # skip the step ...
    assert scaler.skipped and scaler.scale == 512.0  # ... and halve
    assert [scaler.update(found_inf=False) for _ in range(2)] == [True, True] and scaler.scale == 512.0
    assert scaler.update(found_inf=False) and scaler.scale == 1024.0  # the 3rd clean step in a row doubles it
    scaler.update(found_inf=False)
    scaler.update(found_inf=True)  # an overflow restarts the count
    assert scaler.scale == 512.0 and scaler.clean_steps == 0
    again = LossScaler()
    again.load_state_dict(scaler.state_dict())
    assert again.state_dict() == {"scale": 512.0, "clean_steps": 0}


def tiny_weighted_training(precision: str, scaler: LossScaler | None, steps: int = 15, weight: float = 1e-6):
    """(losses of the unweighted model, share of gradient entries exactly zero at step 1) of AdamW
    on ``weight`` x a GPT's loss: a mean over a big batch, say, whose gradients are ~1e-8."""
    config = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16)
    model = GPT(config, seed=0).to(precision_dtype(precision))
    opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 16, size=(8, 8))
    y = (x + 1) % 16  # learnable: the next token is the token plus one
    losses, zeros = [], None
    for step in range(steps):
        random.manual_seed((0, step))
        opt.zero_grad()
        scale = scaler.scale if scaler is not None else 1.0
        with loss_scaling(scale), np.errstate(over="ignore", invalid="ignore"):
            loss = model.loss(x, y)
            (loss * weight).backward()
        losses.append(loss.item())
        grads = [p.grad for p in model.parameters()]
        if zeros is None:
            zeros = sum(int((to_host(g) == 0).sum()) for g in grads) / sum(g.size for g in grads)
        if scaler is not None and not scaler.update(found_inf=not grads_finite(grads)):
            continue
        opt.loss_scale = scale
        opt.step()
    return losses, zeros


def test_fp16_gradients_underflow_without_loss_scaling_and_train_with_it():
    fp32, fp32_zeros = tiny_weighted_training("fp32", None)
    unscaled, unscaled_zeros = tiny_weighted_training("fp16", None)
    scaled, scaled_zeros = tiny_weighted_training("fp16", LossScaler())
    assert fp32_zeros < 0.2 and scaled_zeros < 0.2  # (a few gradients are zero in exact arithmetic)
    assert unscaled_zeros > 0.9, f"fp16 without a scale: only {unscaled_zeros:.0%} of the gradients underflowed"
    assert fp32[-1] < fp32[0] - 0.4, fp32  # it does learn
    assert max(abs(a - b) for a, b in zip(unscaled, unscaled[1:])) < 0.05, "underflowed: no step changes the loss"
    assert max(abs(a - b) for a, b in zip(scaled, fp32)) < 0.01, (scaled, fp32)  # measured: 8e-5
