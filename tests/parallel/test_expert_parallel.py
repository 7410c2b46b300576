"""Expert parallel against the serial MoE: one layer's outputs and gradients, the whole GPT's loss,
every gradient and the parameters after SGD/AdamW steps (EP 2 and 4, top-1 and top-2, with and
without capacity drops, dropless and padded dispatch, dp 2 × ep 2), the aux loss and load stats,
and the all-to-all bytes per layer against the formula from the token counts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tinytrain import distributed as dist
from tinytrain.autograd import Tensor
from tinytrain.backend import to_host, xp
from tinytrain.data import shard_rows
from tinytrain.nn import GPT, GPTConfig, MoE
from tinytrain.nn.moe import route
from tinytrain.optim import SGD, AdamW
from tinytrain.parallel import expert_parallel as ep_mod

VOCAB, T, B, C, E = 16, 8, 8, 16, 4
RTOL, ATOL = 1e-4, 2e-6


def ep_size(n):
    return pytest.param(n, marks=pytest.mark.world_size(n), id=f"ep{n}")


SIZES = pytest.mark.parametrize("n", [ep_size(2), ep_size(4)])
ROUTING = pytest.mark.parametrize(
    "k,cf", [(1, 0.0), (2, 0.0), (1, 0.75), (2, 0.6)], ids=["top1", "top2", "top1-drop", "top2-drop"]
)


def host(a):
    return to_host(a.data if isinstance(a, Tensor) else a)


def grad(p):
    """The gradient, zeros for an expert no token reached."""
    return np.zeros(p.shape, dtype=np.float32) if p.grad is None else host(p.grad)


def moe_gpt(k, cf, seed=3, dtype=np.float32, balance="aux"):
    """Two blocks of E experts with a sharp gate. AdamW runs in float64: it turns the float32 noise of
    a gradient that is exactly 0 in exact arithmetic (the attention key bias) into full-size steps.
    Under balance "bias" the rate is large (0.2) so that the bias changes choices within 3 steps."""
    cfg = GPTConfig(
        vocab_size=VOCAB, block_size=T, n_layer=2, n_head=2, n_embd=C, n_experts=E, moe_top_k=k, moe_capacity_factor=cf,
        moe_balance=balance, moe_bias_rate=0.2,
    )  # fmt: skip
    model = GPT(cfg, seed=seed)
    rng = np.random.default_rng(seed)
    for m in model.modules():  # a sharper gate than the init: skewed routing, real drops
        if isinstance(m, MoE):
            m.gate.weight.data[...] = xp.asarray(rng.normal(0, 1.0, m.gate.weight.shape).astype(np.float32))
    for p in model.parameters():
        p.data = p.data.astype(dtype)
    return model


def batch(step):
    rng = np.random.default_rng([17, step])
    return rng.integers(0, VOCAB, size=(B, T)), rng.integers(0, VOCAB, size=(B, T))


def average(value, ep):
    total = np.array([value], dtype=np.float64)
    dist.all_reduce(total, op="avg", group=ep.group)
    if ep.dp_group is not None:
        dist.all_reduce(total, op="avg", group=ep.dp_group)
    return total[0]


def ep_step(model, ep, step):
    x, y = batch(step)
    D = ep.data_size
    with ep.active():
        loss = model.loss(shard_rows(x, ep.data_rank, D), shard_rows(y, ep.data_rank, D), denominator=y.size / D)
    loss.backward()
    ep.sync_gradients()
    return average(loss.item(), ep)


def serial_step(model, step):
    loss = model.loss(*batch(step))
    loss.backward()
    return loss.item()


def grad_atol(serial):
    return ATOL + 1e-5 * max(float(np.abs(host(p.grad)).max()) for p in serial.parameters() if p.grad is not None)


def check_against_serial(ep, model, k, cf, opt_kind, steps=3):
    balance = model.config.moe_balance
    serial = moe_gpt(k, cf, dtype=model.wte.weight.data.dtype, balance=balance)
    loads = []
    names = {id(p): n for n, p in model.named_parameters()}
    ref = dict(serial.named_parameters())
    mine = ep.parameters(model)
    assert all(ep.owns(p) for p in mine if ep.is_expert(p))
    n_owned = sum(ep.owns(p) for p in model.parameters())
    assert n_owned * ep.size == sum(ep.is_expert(p) for p in model.parameters())
    make = (lambda ps: SGD(ps, lr=0.5, momentum=0.9)) if opt_kind == "sgd" else (lambda ps: AdamW(ps, lr=1e-2))
    opt_s, opt_p = make(serial.parameters()), make(mine)
    dropped = 0.0
    for step in range(steps):
        opt_s.zero_grad(), opt_p.zero_grad()
        want, got = serial_step(serial, step), ep_step(model, ep, step)
        np.testing.assert_allclose(got, want, rtol=RTOL, err_msg=f"loss at step {step}")
        stats = ep.stats()
        serial_moes = [m for m in serial.modules() if isinstance(m, MoE)]
        np.testing.assert_array_equal(stats["load"], np.stack([m.stats["load"] for m in serial_moes]))
        loads.append(stats["load"])
        np.testing.assert_allclose(stats["dropped"], [m.stats["dropped"] for m in serial_moes], atol=1e-12)
        np.testing.assert_allclose(stats["aux"], [m.stats["aux"] for m in serial_moes], rtol=1e-5)
        dropped += stats["dropped"].sum()
        atol = grad_atol(serial)
        for p in mine:
            s = ref[names[id(p)]]
            np.testing.assert_allclose(grad(p), grad(s), rtol=RTOL, atol=atol, err_msg=f"step {step}: {names[id(p)]}")
        opt_s.step(), opt_p.step()
        ep_mod.balance_experts(serial), ep_mod.balance_experts(model)  # --balance bias: the whole batch's load
        for mine_moe, serial_moe in zip(ep.moes, serial_moes):
            np.testing.assert_array_equal(mine_moe.route_bias, serial_moe.route_bias, err_msg=f"step {step}: bias")
    if balance == "bias":  # the bias moved, and changed where tokens go
        assert any(np.abs(m.route_bias).sum() > 0 for m in ep.moes)
    assert (dropped > 0) == (cf > 0), f"capacity factor {cf}: dropped share {dropped}"
    for p in mine:
        np.testing.assert_allclose(host(p), host(ref[names[id(p)]]), rtol=RTOL, atol=ATOL, err_msg=names[id(p)])
    ep.gather_experts()
    for name, p in model.named_parameters():
        np.testing.assert_allclose(host(p), host(ref[name]), rtol=RTOL, atol=ATOL, err_msg=f"gathered {name}")
    with dist.comm_stats() as quiet:  # outside active(): the serial model, no talk
        np.testing.assert_allclose(model.loss(*batch(9)).item(), serial.loss(*batch(9)).item(), rtol=RTOL)
    assert quiet.sent() == 0


@SIZES
@ROUTING
def test_gpt_loss_gradients_and_steps_match_serial(n, k, cf):
    model = moe_gpt(k, cf)
    ep = ep_mod.apply_expert_parallel(model, dist.world())
    assert ep.group == dist.world() and ep.size == n and ep.data_size == n
    check_against_serial(ep, model, k, cf, "sgd")


@pytest.mark.world_size(2)
@pytest.mark.parametrize("k,cf", [(1, 0.75), (2, 0.0)])
def test_padded_dispatch_with_adamw_matches_serial(k, cf):
    model = moe_gpt(k, cf, dtype=np.float64)
    check_against_serial(ep_mod.apply_expert_parallel(model, dist.world(), variant="padded"), model, k, cf, "adamw")


@pytest.mark.world_size(4)
@pytest.mark.parametrize(
    "k,cf,variant,balance",
    [
        (2, 0.0, "dropless", "aux"),
        (1, 0.75, "dropless", "aux"),
        (2, 0.6, "padded", "aux"),
        (2, 0.6, "dropless", "bias"),
    ],
)
def test_dp2_ep2_mesh_matches_serial(k, cf, variant, balance):
    mesh = dist.DeviceMesh({"dp": 2, "ep": 2})
    model = moe_gpt(k, cf, dtype=np.float64, balance=balance)
    ep = ep_mod.apply_expert_parallel(model, mesh.get_group("ep"), mesh.get_group("dp"), variant=variant)
    assert ep.data_size == 4 and ep.data_rank == dist.get_rank()
    check_against_serial(ep, model, k, cf, "adamw")


# --- one MoE layer: outputs, gradients and bytes on the wire against the formula -------------------------


def layer_case(k, cf, seed=4, rows=12):
    rng = np.random.default_rng(seed)
    moe = MoE(C, 2 * C, E, top_k=k, capacity_factor=cf, rng=rng)
    moe.gate.weight.data[...] = xp.asarray(rng.normal(0, 1, moe.gate.weight.shape).astype(np.float32))
    x, up = rng.normal(size=(rows, C)).astype(np.float32), rng.normal(size=(rows, C)).astype(np.float32)
    return moe, x, up


def expected_wire(moe, x, k, n, variant):
    """(forward, backward) bytes rank r sends, from the serial routing's token counts."""
    r, per, row = dist.get_rank(), E // n, C * 4
    probs = np.exp(x.astype(np.float64) @ host(moe.gate.weight))
    probs /= probs.sum(-1, keepdims=True)
    experts, _, _, kept = route(probs, k, moe.capacity(x.shape[0]))
    kept = kept.reshape(-1, k)
    rows = x.shape[0] // n
    counts = np.zeros((n, n), dtype=int)  # counts[src, dst]: kept rows rank src sends rank dst
    for t in range(x.shape[0]):
        for s in range(k):
            if kept[t, s]:
                counts[t // rows, experts[t, s] // per] += 1
    if variant == "padded":
        cap = moe.capacity(x.shape[0])
        slots = rows if cap is None else min(rows, cap)
        one = row * (n - 1) * per * slots
        return 2 * one, 2 * one, counts
    moved = counts[r].sum() - counts[r, r] + counts[:, r].sum() - counts[r, r]
    return 8 * (n - 1) * per + row * moved, row * moved, counts


@SIZES
@pytest.mark.parametrize("variant", ["dropless", "padded"])
@pytest.mark.parametrize("k,cf", [(1, 0.0), (2, 0.0), (2, 0.5)])
def test_one_layer_outputs_gradients_and_bytes(n, variant, k, cf):
    moe, x, up = layer_case(k, cf)
    serial, _, _ = layer_case(k, cf)
    xs = Tensor(xp.asarray(x), requires_grad=True)
    (serial(xs) * xp.asarray(up)).sum().backward()
    ep = ep_mod.apply_expert_parallel(moe, dist.world(), variant=variant)
    r, rows = dist.get_rank(), x.shape[0] // n
    mine = slice(r * rows, (r + 1) * rows)
    xm = Tensor(xp.asarray(x[mine]), requires_grad=True)
    with dist.comm_stats() as fwd, ep.active():
        y = moe(xm)
    np.testing.assert_allclose(host(y), host(serial(xs))[mine], rtol=1e-5, atol=1e-6)
    with dist.comm_stats() as bwd:
        (y * xp.asarray(up[mine])).sum().backward()
    want_f, want_b, counts = expected_wire(serial, x, k, n, variant)
    assert (fwd.sent("all_to_all"), bwd.sent("all_to_all")) == (want_f, want_b)
    assert ep.last[0]["wire"] == (want_f, want_b)
    assert ep.last[0]["kept_rows"] == counts[r].sum()
    if variant == "padded":  # the padding travels: a rank sends E·slots rows for what it keeps
        assert ep.last[0]["sent_rows"] >= ep.last[0]["kept_rows"]
    np.testing.assert_allclose(host(xm.grad), host(xs.grad)[mine], rtol=1e-4, atol=1e-6)
    ep.sync_gradients(dense=False)
    for p, s in zip(moe.parameters(), serial.parameters()):
        if ep.owns(p):  # the owner has every rank's tokens: Σ over ranks (here D = n, loss not scaled)
            np.testing.assert_allclose(grad(p) * n, grad(s), rtol=1e-4, atol=1e-5)


@pytest.mark.world_size(4)
def test_bad_sizes_say_what_to_change():
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=1, n_head=2, n_embd=8, n_experts=6, moe_top_k=2))
    with pytest.raises(ValueError, match=r"n_experts=6 does not split evenly .* 4 ranks: choose an EP size among"):
        ep_mod.apply_expert_parallel(model, dist.world())
    with pytest.raises(ValueError, match="no MoE layer"):
        ep_mod.apply_expert_parallel(GPT(GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=1, n_embd=8)), dist.world())
    with pytest.raises(ValueError, match="variant='ragged'"):
        ep_mod.apply_expert_parallel(moe_gpt(2, 0.0), dist.world(), variant="ragged")


@pytest.mark.world_size(2)
def test_all_to_all_function_backward_is_the_reverse_exchange():
    r = dist.get_rank()
    send = [1, 2] if r == 0 else [3, 1]
    recv = [send[r] for send in ([1, 2], [3, 1])]
    x = Tensor(xp.asarray(np.arange(sum(send) * 2, dtype=np.float64).reshape(-1, 2) + 100 * r), requires_grad=True)
    y = ep_mod.AllToAll.apply(x, send_sizes=send, recv_sizes=recv, group=dist.world())
    assert y.shape == (sum(recv), 2)
    up = np.random.default_rng(r).normal(size=y.shape)
    (y * xp.asarray(up)).sum().backward()
    back = dist.all_to_all(np.ascontiguousarray(up), recv, send)  # the gradient goes home
    np.testing.assert_array_equal(host(x.grad), back)
    assert math.isclose(float(np.abs(host(x.grad)).sum()), float(np.abs(back).sum()))
