"""Optimizers, clipping and the LR schedule against hand-written formulas (no torch needed)."""

from __future__ import annotations

import math

import numpy
import pytest

from tinytrain.autograd import Parameter
from tinytrain.backend import to_host, xp
from tinytrain.optim import SGD, AdamW, WarmupCosine, clip_grad_norm_


def param(values):
    return Parameter(xp.array(values, dtype=xp.float32))  # a copy: updates must not touch `values`


def host(a):
    return to_host(a.data if hasattr(a, "data") and not isinstance(a, numpy.ndarray) else a)


def test_adamw_first_step_is_lr_times_sign():
    rng = numpy.random.default_rng()
    v = rng.standard_normal(20).astype(numpy.float32)
    g = rng.standard_normal(20).astype(numpy.float32)
    p = param(v)
    p.grad = xp.asarray(g)
    AdamW([p], lr=0.01, weight_decay=0.0).step()
    # bias correction: m̂ = g, v̂ = g², so the step is lr·g/(|g|+eps) ≈ lr·sign(g)
    numpy.testing.assert_allclose(host(p), v - 0.01 * numpy.sign(g), atol=1e-6)


def test_adamw_decay_is_decoupled():
    rng = numpy.random.default_rng()
    v = rng.standard_normal(10).astype(numpy.float32)
    p = param(v)
    p.grad = xp.zeros(10, dtype=xp.float32)
    opt = AdamW([p], lr=0.1, weight_decay=0.2)
    opt.step()
    # a zero gradient moves nothing through m/v; only the decay lr·wd·p acts
    numpy.testing.assert_allclose(host(p), v * (1 - 0.1 * 0.2), rtol=1e-6)
    # and the decay does not enter the moments
    assert numpy.all(to_host(opt.state[p]["exp_avg"]) == 0)


def test_adamw_matches_hand_loop_over_steps():
    rng = numpy.random.default_rng()
    v = rng.standard_normal(6)
    p = param(v)
    lr, b1, b2, eps, wd = 0.02, 0.9, 0.99, 1e-8, 0.05
    opt = AdamW([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    m = numpy.zeros(6)
    s = numpy.zeros(6)
    ref = v.astype(numpy.float32).astype(numpy.float64)
    for t in range(1, 5):
        g = rng.standard_normal(6).astype(numpy.float32)
        p.grad = xp.asarray(g)
        opt.step()
        m = b1 * m + (1 - b1) * g
        s = b2 * s + (1 - b2) * g * g
        ref = ref * (1 - lr * wd) - lr * (m / (1 - b1**t)) / (numpy.sqrt(s / (1 - b2**t)) + eps)
        numpy.testing.assert_allclose(host(p), ref, rtol=1e-5, atol=1e-6)
    assert opt.state[p]["step"] == 4


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_sgd_momentum_matches_hand_loop(wd):
    rng = numpy.random.default_rng()
    v = rng.standard_normal((3, 4)).astype(numpy.float32)
    p = param(v)
    opt = SGD([p], lr=0.05, momentum=0.9, weight_decay=wd)
    ref = v.astype(numpy.float64)
    buf = numpy.zeros_like(ref)
    for _ in range(4):
        g = rng.standard_normal((3, 4)).astype(numpy.float32)
        p.grad = xp.asarray(g)
        opt.step()
        d = g + wd * ref
        buf = 0.9 * buf + d
        ref = ref - 0.05 * buf
        numpy.testing.assert_allclose(host(p), ref, rtol=1e-5, atol=1e-6)


def test_plain_sgd_has_no_state_and_skips_params_without_grad():
    a, b = param([1.0, 2.0]), param([3.0])
    a.grad = xp.asarray(numpy.array([1.0, -1.0], dtype=numpy.float32))
    opt = SGD([a, b], lr=0.5)
    opt.step()
    numpy.testing.assert_allclose(host(a), [0.5, 2.5])
    numpy.testing.assert_allclose(host(b), [3.0])
    assert b not in opt.state
    assert opt.state[a] == {} and opt.state_bytes() == 0
    opt.zero_grad()
    assert a.grad is None


def test_clip_grad_norm():
    rng = numpy.random.default_rng()
    ps = [param(numpy.zeros(s)) for s in [(3, 4), (5,), (2,)]]
    grads = [rng.standard_normal(p.shape).astype(numpy.float32) for p in ps]
    for p, g in zip(ps, grads):
        p.grad = xp.asarray(g.copy())
    ps[2].grad = None  # a parameter without gradient is skipped
    norm = math.sqrt(sum(float((g.astype(numpy.float64) ** 2).sum()) for g in grads[:2]))

    returned = clip_grad_norm_(ps, max_norm=norm * 2)  # no clipping below the limit
    assert returned == pytest.approx(norm, rel=1e-6)
    for p, g in zip(ps[:2], grads):
        numpy.testing.assert_array_equal(host(p.grad), g)

    returned = clip_grad_norm_(ps, max_norm=norm / 3)
    assert returned == pytest.approx(norm, rel=1e-6)  # the norm before clipping
    clipped = math.sqrt(sum(float((host(p.grad).astype(numpy.float64) ** 2).sum()) for p in ps[:2]))
    assert clipped == pytest.approx(norm / 3, rel=1e-5)
    for p, g in zip(ps[:2], grads):  # direction kept
        numpy.testing.assert_allclose(host(p.grad), g / 3, rtol=1e-5, atol=1e-7)
    assert ps[2].grad is None


def test_clip_grad_norm_uses_a_given_total():
    p = param(numpy.zeros(2))
    p.grad = xp.asarray(numpy.array([3.0, 4.0], dtype=numpy.float32))
    assert clip_grad_norm_([p], 1.0, total_norm=10.0) == 10.0
    numpy.testing.assert_allclose(host(p.grad), [0.3, 0.4], rtol=1e-5)


def test_warmup_cosine_values():
    opt = SGD([param([0.0])], lr=1.0)
    sched = WarmupCosine(opt, warmup=4, total=14, min_lr=0.1)
    assert sched.lr_at(1) == pytest.approx(0.25)  # warmup starts above 0: update 1 uses lr/warmup
    assert opt.lr == pytest.approx(0.25)  # the first update already uses it
    assert sched.lr_at(4) == pytest.approx(1.0)  # warmup end: the base lr
    assert sched.lr_at(9) == pytest.approx(0.1 + 0.9 * 0.5)  # midpoint of the cosine
    assert sched.lr_at(14) == pytest.approx(0.1)  # end: min_lr
    assert sched.lr_at(100) == pytest.approx(0.1)  # and after
    seen = [opt.lr]
    for _ in range(13):
        sched.step()
        seen.append(opt.lr)
    assert seen == pytest.approx([sched.lr_at(s) for s in range(1, 15)])
    assert all(a >= b for a, b in zip(seen[3:], seen[4:]))  # decays monotonically


def test_warmup_zero_and_bad_schedules():
    opt = SGD([param([0.0])], lr=2.0)
    sched = WarmupCosine(opt, warmup=0, total=10)
    assert sched.lr_at(1) < 2.0 and sched.lr_at(10) == pytest.approx(0.0)
    for warmup, total in [(5, 4), (-1, 4), (0, 0)]:
        with pytest.raises(ValueError, match="warmup"):
            WarmupCosine(opt, warmup=warmup, total=total)


def test_bad_optimizer_arguments():
    p = param([1.0])
    with pytest.raises(ValueError, match="no parameters"):
        SGD([], lr=0.1)
    with pytest.raises(ValueError, match="twice"):
        SGD([p, p], lr=0.1)
    with pytest.raises(ValueError, match="learning rate"):
        AdamW([p], lr=-1.0)
    with pytest.raises(ValueError, match="momentum"):
        SGD([p], lr=0.1, momentum=1.0)
    with pytest.raises(ValueError, match="betas"):
        AdamW([p], betas=(0.9, 1.0))


def test_state_is_inspectable_and_round_trips():
    rng = numpy.random.default_rng()
    ps = [param(rng.standard_normal((4, 3))), param(rng.standard_normal(7))]
    opt = AdamW(ps, lr=0.01)
    for _ in range(2):
        for p in ps:
            p.grad = xp.asarray(rng.standard_normal(p.shape).astype(numpy.float32))
        opt.step()
    for p in ps:
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
        assert opt.state[p]["exp_avg"].shape == p.shape
    assert opt.state_bytes() == 2 * 4 * (12 + 7)

    saved = opt.state_dict()
    copies = [host(p).copy() for p in ps]
    # a fresh optimizer over fresh copies, loaded from the state dict, takes the same next step
    qs = [param(c) for c in copies]
    opt2 = AdamW(qs, lr=0.5)
    opt2.load_state_dict(saved)
    assert opt2.lr == 0.01 and opt2.state[qs[0]]["step"] == 2
    grads = [rng.standard_normal(p.shape).astype(numpy.float32) for p in ps]
    for a, b, g in zip(ps, qs, grads):
        a.grad, b.grad = xp.asarray(g), xp.asarray(g.copy())
    opt.step()
    opt2.step()
    for a, b in zip(ps, qs):
        numpy.testing.assert_array_equal(host(a), host(b))
    # the saved state is a copy: later steps did not change it
    assert saved["state"][0]["step"] == 2


def test_sgd_momentum_state_round_trips():
    rng = numpy.random.default_rng()
    p = param(rng.standard_normal(5))
    opt = SGD([p], lr=0.1, momentum=0.9)
    p.grad = xp.asarray(rng.standard_normal(5).astype(numpy.float32))
    opt.step()
    assert set(opt.state[p]) == {"momentum"} and opt.state_bytes() == 20
    q = param(host(p).copy())
    opt2 = SGD([q], lr=0.1, momentum=0.9)
    opt2.load_state_dict(opt.state_dict())
    g = rng.standard_normal(5).astype(numpy.float32)
    p.grad, q.grad = xp.asarray(g), xp.asarray(g.copy())
    opt.step()
    opt2.step()
    numpy.testing.assert_array_equal(host(p), host(q))


def test_loading_a_state_dict_does_not_alias_it():
    """A state dict is a snapshot: stepping the optimizer that loaded it must not rewrite it."""
    rng = numpy.random.default_rng()
    p = param(rng.standard_normal(4))
    opt = AdamW([p], lr=0.01)
    p.grad = xp.asarray(rng.standard_normal(4).astype(numpy.float32))
    opt.step()
    saved = opt.state_dict()
    snapshot = {k: numpy.array(v, copy=True) for k, v in saved["state"][0].items() if hasattr(v, "shape")}
    opt.load_state_dict(saved)
    p.grad = xp.asarray(rng.standard_normal(4).astype(numpy.float32))
    opt.step()
    for k, v in snapshot.items():
        numpy.testing.assert_array_equal(saved["state"][0][k], v, err_msg=k)


def test_sgd_nesterov_looks_one_step_ahead():
    """v = μ·v + g; p -= lr·(g + μ·v) (Sutskever et al. 2013, as torch.optim.SGD(nesterov=True))."""
    p = Parameter(numpy.array([1.0, -2.0]))
    opt = SGD([p], lr=0.5, momentum=0.9, nesterov=True)
    want, velocity = p.data.copy(), numpy.zeros(2)
    for g in ([0.1, 0.2], [0.3, -0.1], [-0.2, 0.05]):
        p.grad = numpy.array(g)
        opt.step()
        velocity = 0.9 * velocity + numpy.array(g)
        want = want - 0.5 * (numpy.array(g) + 0.9 * velocity)
        numpy.testing.assert_allclose(p.data, want, rtol=1e-12)
    with pytest.raises(ValueError, match="nesterov=True needs a momentum above 0"):
        SGD([p], lr=0.1, nesterov=True)
