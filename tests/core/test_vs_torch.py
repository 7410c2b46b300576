"""End to end against PyTorch (skipped where torch is not installed): the GPT's logits, loss and
every parameter gradient, AdamW/SGD trajectories over several steps, and GELU in both its forms."""

from __future__ import annotations

import importlib.util
import math

import numpy
import pytest

from tinytrain import functional as F
from tinytrain.autograd import Parameter, Tensor
from tinytrain.backend import to_host, xp
from tinytrain.bench.step import torch_gpt
from tinytrain.nn import GPT, GPTConfig
from tinytrain.optim import SGD, AdamW
from tinytrain.testing import assert_close

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
torch = None  # imported by the first test that runs: under mpirun -n 4 the ranks that sit these out never
# import it (at collection each rank took 1-2 s of CPU for it, 5 s of the suite on 2 cores)


@pytest.fixture(autouse=True)
def _import_torch():
    global torch
    torch = pytest.importorskip("torch")


def torch_param_grad(tm, name):
    """PyTorch's gradient of ``name`` in tinytrain's layout (Linear weights transposed)."""
    p = tm.get_parameter(name)
    g = p.grad.numpy()
    owner = tm.get_submodule(name.rsplit(".", 1)[0])
    if isinstance(owner, torch.nn.Linear) and name.endswith("weight"):
        g = g.T
    return g


@pytest.mark.parametrize(
    "cfg",
    [
        dict(vocab_size=13, block_size=9, n_layer=2, n_head=4, n_embd=32),
        dict(vocab_size=7, block_size=16, n_layer=1, n_head=1, n_embd=24),
        # longer than one block of query rows (ops.ATTENTION_BLOCK = 64): causal blocks skip keys
        dict(vocab_size=11, block_size=80, n_layer=1, n_head=2, n_embd=16),
    ],
)
def test_gpt_logits_loss_and_gradients_match_torch(cfg):
    rng = numpy.random.default_rng()
    config = GPTConfig(**cfg)
    model = GPT(config, seed=int(rng.integers(1 << 30)))
    # bigger than the init so LayerNorm gains, biases and attention patterns are not trivial
    for _, p in model.named_parameters():
        p.data[...] = xp.asarray((to_host(p.data) + 0.1 * rng.standard_normal(p.shape)).astype(numpy.float32))
    tm = torch_gpt(model, torch)
    B, T = 3, config.block_size
    ids = rng.integers(0, config.vocab_size, size=(B, T))
    targets = rng.integers(0, config.vocab_size, size=(B, T))
    targets[0, :2] = -100  # ignored positions

    logits = model(ids)
    loss = F.cross_entropy(logits, xp.asarray(targets))
    loss.backward()

    t_logits = tm(torch.from_numpy(ids))
    t_loss = torch.nn.functional.cross_entropy(
        t_logits.flatten(0, 1), torch.from_numpy(targets).flatten(), ignore_index=-100
    )
    t_loss.backward()

    assert_close(logits, t_logits.detach().numpy(), atol=1e-4, rtol=1e-4, what="logits")
    assert loss.item() == pytest.approx(t_loss.item(), rel=1e-5, abs=1e-5)
    names = [n for n, _ in tm.named_parameters()]
    ours = dict(model.named_parameters())
    assert sorted(names) == sorted(ours)  # same parameters, nothing left out on either side
    for name in names:
        g = torch_param_grad(tm, name)
        scale = float(numpy.abs(g).max()) + 1e-12
        assert_close(to_host(ours[name].grad), g, atol=1e-4 * scale + 1e-7, rtol=1e-3, what=f"grad {name}")


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_and_its_gradient_match_torch_in_float64(approximate):
    """F.gelu against torch.nn.functional.gelu, same ``approximate``, at the exact form's hard
    points (0, -0, tiny, its erf's piece boundaries x/√2 = ±0.5, ±4, and ±0.5, ±4 themselves, a far
    tail) and random ones. PyTorch's exact form is 0.5·x·(1 + erf(x/√2)), which cancels to 0 in the
    left tail where ours keeps x·Φ(x) (-30: -1e-195): an absolute tolerance of float64's rounding."""
    r = math.sqrt(2)
    hard = [0.0, -0.0, 1e-300, -1e-300, 0.5, -0.5, 4.0, -4.0, 0.5 * r, -0.5 * r, 4 * r, -4 * r, 30.0, -30.0]
    x = numpy.concatenate([hard, numpy.random.default_rng().standard_normal(500) * 5])
    ours = Tensor(xp.asarray(x), requires_grad=True)
    y = F.gelu(ours, approximate=approximate)
    y.sum().backward()
    theirs = torch.tensor(x, requires_grad=True)
    t_y = torch.nn.functional.gelu(theirs, approximate=approximate)
    t_y.sum().backward()
    assert_close(y, t_y.detach().numpy(), atol=1e-14, rtol=1e-12, what=f"gelu ({approximate})")
    assert_close(to_host(ours.grad), theirs.grad.numpy(), atol=1e-14, rtol=1e-12, what=f"gelu ({approximate}) grad")
    assert numpy.array_equal(numpy.signbit(to_host(y.data)[:4]), numpy.signbit(t_y.detach().numpy()[:4]))


def random_problem(rng, shapes):
    values = [rng.standard_normal(s).astype(numpy.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(numpy.float32) for s in shapes] for _ in range(5)]
    ours = [Parameter(xp.asarray(v.copy())) for v in values]
    theirs = [torch.tensor(v.copy(), requires_grad=True) for v in values]
    return grads, ours, theirs


def run_both(opt, topt, grads, ours, theirs):
    for step_grads in grads:
        for p, tp, g in zip(ours, theirs, step_grads):
            p.grad = xp.asarray(g)
            tp.grad = torch.from_numpy(g.copy())
        opt.step()
        topt.step()
        for p, tp in zip(ours, theirs):
            assert_close(p, tp.detach().numpy(), atol=1e-6, rtol=1e-5, what="parameter")


def test_adamw_trajectory_matches_torch():
    rng = numpy.random.default_rng()
    grads, ours, theirs = random_problem(rng, [(4, 3), (5,)])
    kw = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    run_both(AdamW(ours, **kw), torch.optim.AdamW(theirs, **kw), grads, ours, theirs)


@pytest.mark.parametrize("momentum,wd", [(0.0, 0.0), (0.9, 0.0), (0.9, 0.05)])
def test_sgd_trajectory_matches_torch(momentum, wd):
    rng = numpy.random.default_rng()
    grads, ours, theirs = random_problem(rng, [(3, 2), (6,)])
    opt = SGD(ours, lr=0.1, momentum=momentum, weight_decay=wd)
    topt = torch.optim.SGD(theirs, lr=0.1, momentum=momentum, weight_decay=wd)
    run_both(opt, topt, grads, ours, theirs)


def test_profiles_name_the_same_ops_in_both_frameworks():
    """``bench step --profile``: tinytrain's per-Function timer and PyTorch's profiler events map
    to the same rows, and the ops they name take most of the step (the table is not all "other")."""
    from tinytrain.bench import step as bench

    ours = bench.tinytrain_profile(bench.tinytrain_step("default", 1), 1)
    theirs = bench.torch_profile(bench.torch_step("default", 1), 1)
    for row in ("linear forward", "linear backward", "attention forward", "attention backward", "gelu forward"):
        assert ours[row] > 0 and theirs[row] > 0, (row, ours, theirs)
    for row in ("layer_norm backward", "cross_entropy forward", "AdamW step"):
        assert ours[row] > 0 and theirs[row] > 0, (row, ours, theirs)
    for ops in (ours, theirs):
        named = sum(v for k, v in ops.items() if k != "step" and not k.startswith("other"))
        assert named > 0.5 * ops["step"], ops
