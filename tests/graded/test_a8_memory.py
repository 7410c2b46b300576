"""Assignment 8 (memory), graded. Run: ``python -m grader --tasks 8.*``.

Every check compares with a computation in the test, never a stored number, on shapes, values and
step sequences drawn when the test runs:

* 8.1 ``checkpoint``: loss, input and parameter gradients equal a plain call's bit for bit (the
  recompute runs the same ops on the same arrays), the bytes kept for backward between forward and
  backward are the Tensor inputs' (the engine's ``saved_bytes``), nothing is kept after backward,
  each parameter's hook fires once, and the context is entered around the forward and around the
  recompute with its backward. Fixed hard cases: several inputs of which some need no gradient,
  a constant (token ids) as the only input, a strided (transposed) input, a tuple of outputs of
  which one gets no gradient, dropout inside the segment with other random settings in effect at
  backward time, and no grad mode.
* 8.2 ``grads_finite`` and ``LossScaler``: inf, -inf and NaN anywhere in float16/float32 arrays
  among None and empty ones; the scale after a drawn sequence of overflows and clean steps against
  the rule of the handout; fixed: an overflow on the first step then exactly N clean steps (the
  scale grows on the N-th, not before), an overflow in the middle of a count, a growth interval of
  1, and a loop of steps whose overflowing step leaves the parameters untouched while the others
  equal an unscaled run's bit for bit.
* 8.3 the mixed-precision step: bfloat16 and float16 parameters with SGD (momentum, weight decay)
  and AdamW, loss scales 1 and drawn powers of two: masters and moments stay float32 and equal a
  float32 run of the reference rule on the gradients divided by the scale in float32; each
  parameter is the master rounded, in place; the caller's gradient is not changed; updates below
  a bfloat16 parameter's spacing add up in the master; fixed: an empty parameter (a ZeRO piece
  can be one), a gradient that only the scale keeps above float16's underflow, a strided
  gradient, and state bytes 12 per element (AdamW) beside a float32 parameter's 8.

Seeds are drawn at run time; replay with ``TINYTRAIN_GRADER_SEED=<seed>``.
"""

from __future__ import annotations

import numpy as np
import pytest

from grader.seeds import grading_seed
from tinytrain import functional as F
from tinytrain import optim as reference_optim
from tinytrain import random
from tinytrain.autograd import Tensor, loss_scaling, no_grad, saved_bytes
from tinytrain.backend import precision_dtype, to_host, xp
from tinytrain.nn import Dropout, Embedding, Linear

LOW = ["fp16"] + (["bf16"] if xp is np else [])  # CuPy has no bfloat16


def seeded():
    seed = grading_seed()
    return np.random.default_rng(seed), seed


def host(a):
    return np.asarray(to_host(a))


# ================================================================================================
# 8.1 activation recomputation
# ================================================================================================


class Segment:
    """fc_2(dropout(gelu(fc_1(x) * scale + bias))) + y: a segment with parameters, a dropout with a
    site, a second Tensor input (``bias``, which may need no gradient) and a constant (``scale``)."""

    def __init__(self, rng, width, p=0.3):
        self.fc_1 = Linear(width, 3 * width, rng=rng)
        self.fc_2 = Linear(3 * width, width, rng=rng)
        self.drop = Dropout(p)
        self.drop.site = "segment.drop"
        self.params = self.fc_1.parameters() + self.fc_2.parameters()

    def __call__(self, x, bias, scale, y):
        return self.fc_2(self.drop(F.gelu(self.fc_1(x) * scale + bias))) + y


def leaf(rng, shape, grad=True):
    return Tensor(rng.standard_normal(shape).astype(np.float32), requires_grad=grad)


def run(checkpoint, seg, inputs, use, seed):
    """Loss, and the gradients of every Tensor input that needs one and of every parameter."""
    for t in [*seg.params, *inputs]:
        if isinstance(t, Tensor):
            t.grad = None
    random.manual_seed(seed)
    with random.batch_rows(0, 8):
        out = checkpoint(seg, *inputs) if use else seg(*inputs)
    random.manual_seed(seed + 1)  # another seed at backward time: the recompute must not see it
    loss = (out * out).sum()
    loss.backward()
    wanted = [t for t in inputs if isinstance(t, Tensor) and t.requires_grad]
    for i, t in enumerate([*wanted, *seg.params]):
        kind = f"Tensor input {i}" if i < len(wanted) else f"parameter {i - len(wanted)}"
        assert t.grad is not None, f"{kind} got no gradient ({'checkpoint' if use else 'plain call'}, seed {seed})"
    return loss.item(), [host(t.grad) for t in wanted], [host(p.grad) for p in seg.params]


def assert_same(plain, kept, what):
    assert plain[0] == kept[0], f"{what}: the loss differs from a plain call's ({kept[0]} vs {plain[0]})"
    for i, (a, b) in enumerate(zip(plain[1], kept[1])):
        assert np.array_equal(a, b), f"{what}: the gradient of Tensor input {i} differs from a plain call's"
    for i, (a, b) in enumerate(zip(plain[2], kept[2])):
        assert np.array_equal(a, b), (
            f"{what}: parameter {i}'s gradient differs from a plain call's (same dropout mask in the recompute?)"
        )


@pytest.mark.task("8.1")
@pytest.mark.parametrize("bias_grad", [True, False])
def test_the_same_loss_and_gradients_as_a_plain_call(impl, bias_grad):
    rng, seed = seeded()
    width, rows = int(rng.integers(2, 7)), int(rng.integers(1, 5))
    seg = Segment(rng, width)
    x = leaf(rng, (rows, 3, width))
    bias = leaf(rng, (3 * width,), grad=bias_grad)
    y = leaf(rng, (rows, 3, width))
    scale = float(rng.uniform(0.5, 2))
    inputs = [x, bias, scale, y]
    what = f"4 inputs (bias needs a gradient: {bias_grad}), dropout inside (seed {seed})"
    assert_same(run(None, seg, inputs, False, seed), run(impl.memory.checkpoint, seg, inputs, True, seed), what)


@pytest.mark.task("8.1")
def test_a_strided_input_gets_its_gradient(impl):
    rng, seed = seeded()
    width = int(rng.integers(2, 6))
    seg = Segment(rng, width)
    base = leaf(rng, (width, 2, 5))
    bias, y = leaf(rng, (3 * width,), grad=False), leaf(rng, (5, 2, width), grad=False)
    x = Tensor(base.data.T, requires_grad=True)  # (5, 2, width), not contiguous
    inputs = [x, bias, 1.0, y]
    what = f"a transposed (strided) input (seed {seed})"
    assert_same(run(None, seg, inputs, False, seed), run(impl.memory.checkpoint, seg, inputs, True, seed), what)


@pytest.mark.task("8.1")
def test_only_the_inputs_are_kept_until_backward(impl):
    rng, seed = seeded()
    width, rows = int(rng.integers(3, 8)), int(rng.integers(2, 6))
    seg = Segment(rng, width)
    x, bias, y = leaf(rng, (rows, width)), leaf(rng, (3 * width,), grad=False), leaf(rng, (rows, width))
    before = saved_bytes()
    random.manual_seed(seed)
    plain = seg(x, bias, 2.0, y)
    kept_by_plain = saved_bytes() - before
    del plain
    live = []  # saved_bytes() as the segment's last op has run: in the forward, then in the recompute

    def watched(*args):
        result = seg(*args)
        live.append(saved_bytes() - before)
        return result

    out = impl.memory.checkpoint(watched, x, bias, 2.0, y)
    kept = saved_bytes() - before
    inputs = x.nbytes + bias.nbytes + y.nbytes
    assert kept == inputs < kept_by_plain, (
        f"between forward and backward the segment keeps {kept} bytes; its Tensor inputs are {inputs} "
        f"(a plain call keeps {kept_by_plain}) (seed {seed})"
    )
    assert live and live[0] <= inputs, (
        f"during the checkpoint's forward, as the segment's last op had run, {live[0] if live else '?'} bytes were "
        f"saved; its Tensor inputs are {inputs} (a plain call keeps {kept_by_plain}): the ops inside recorded a "
        f"graph while the segment ran, freed only when the forward returned (a Function's forward runs in the "
        f"caller's grad mode) (seed {seed})"
    )
    out.sum().backward()
    assert saved_bytes() == before, (
        f"after backward {saved_bytes() - before} bytes are still saved: the recomputed graph lives on (seed {seed})"
    )


@pytest.mark.task("8.1")
def test_hooks_fire_once_and_the_context_wraps_forward_and_recompute(impl):
    rng, seed = seeded()
    width = int(rng.integers(2, 6))
    seg = Segment(rng, width, p=0.0)
    events = []
    for i, p in enumerate(seg.params):
        p.register_post_accumulate_grad_hook(lambda p, i=i: events.append(f"hook {i}"))

    class Context:
        def __init__(self, phase):
            self.phase = phase

        def __enter__(self):
            events.append(f"enter {self.phase}")

        def __exit__(self, *exc):
            events.append(f"exit {self.phase}")

    x, bias, y = leaf(rng, (2, width)), leaf(rng, (3 * width,), grad=False), leaf(rng, (2, width), grad=False)
    out = impl.memory.checkpoint(seg, x, bias, 1.0, y, context=Context)
    assert events == ["enter forward", "exit forward"], f"forward entered {events} (seed {seed})"
    out.sum().backward()
    hooks = sorted(e for e in events[2:] if e.startswith("hook"))
    assert hooks == sorted(f"hook {i}" for i in range(len(seg.params))), (
        f"each parameter's hook must fire once, in the recompute's backward; got {hooks} (seed {seed})"
    )
    assert events[2] == "enter backward" and events[-1] == "exit backward", (
        f"the recompute and its backward run inside context('backward'); events: {events} (seed {seed})"
    )


@pytest.mark.task("8.1")
def test_token_ids_as_the_only_input_still_train_the_segment(impl):
    rng, seed = seeded()
    vocab, width = int(rng.integers(5, 12)), int(rng.integers(2, 6))
    emb = Embedding(vocab, width, rng=rng)
    ids = xp.asarray(rng.integers(0, vocab, size=(2, 4)))
    emb.weight.grad = None
    (emb(ids) * emb(ids)).sum().backward()
    want = host(emb.weight.grad)
    emb.weight.grad = None
    out = impl.memory.checkpoint(emb, ids)
    (out * out).sum().backward()
    assert emb.weight.grad is not None and np.array_equal(host(emb.weight.grad), want), (
        f"a segment whose only input is token ids (a constant) must still give its parameters their "
        f"gradients in the recompute (seed {seed})"
    )


@pytest.mark.task("8.1")
def test_a_tuple_of_outputs_one_of_them_unused(impl):
    rng, seed = seeded()
    width = int(rng.integers(2, 6))
    fc_1, fc_2 = Linear(width, width, rng=rng), Linear(width, width, rng=rng)
    params = fc_1.parameters() + fc_2.parameters()

    def two(x, z):
        h = F.gelu(fc_1(x))
        return fc_2(h) * z, h.tanh(), h.sum()

    x, z = leaf(rng, (3, width)), leaf(rng, (3, width))

    def grads(use):
        for t in [*params, x, z]:
            t.grad = None
        a, b, _ = impl.memory.checkpoint(two, x, z) if use else two(x, z)
        (a.sum() + (b * b).sum()).backward()  # the third output gets no gradient
        return [host(t.grad) for t in [x, z, *params]]

    for i, (want, got) in enumerate(zip(grads(False), grads(True))):
        assert np.array_equal(want, got), (
            f"3 outputs, 2 used: gradient {i} (x, z, then the parameters) differs from a plain call's (seed {seed})"
        )


@pytest.mark.task("8.1")
def test_without_grad_mode_it_is_a_plain_call(impl):
    rng, seed = seeded()
    width = int(rng.integers(2, 6))
    seg = Segment(rng, width, p=0.0)
    x, bias, y = leaf(rng, (2, width)), leaf(rng, (3 * width,)), leaf(rng, (2, width))
    recorded = impl.memory.checkpoint(seg, x, bias, 1.0, y)  # in grad mode: a step of the graph
    with no_grad():
        want = seg(x, bias, 1.0, y)
        got = impl.memory.checkpoint(seg, x, bias, 1.0, y)
    assert np.array_equal(host(got.data), host(want.data)) and not got.requires_grad, (
        f"under no_grad() checkpoint(fn, ...) is fn(...) (seed {seed})"
    )
    assert np.array_equal(host(recorded.data), host(want.data)) and recorded.requires_grad, (
        f"in grad mode checkpoint's output has fn's values and requires grad (seed {seed})"
    )


# ================================================================================================
# 8.2 dynamic loss scaling
# ================================================================================================


@pytest.mark.task("8.2")
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_grads_finite_finds_one_bad_entry_anywhere(impl, bad):
    rng, seed = seeded()
    arrays = [None, np.zeros(0, dtype=np.float16)]
    for _ in range(int(rng.integers(1, 4))):
        dtype = [np.float16, np.float32][int(rng.integers(0, 2))]
        arrays.append(rng.standard_normal(int(rng.integers(1, 30))).astype(dtype))
    arrays = [a if a is None else xp.asarray(a) for a in arrays]
    assert impl.memory.grads_finite(arrays) is True, f"finite arrays (and None, an empty one) (seed {seed})"
    assert impl.memory.grads_finite([]) is True, f"no arrays at all: nothing overflowed (seed {seed})"
    arrays.append(xp.asarray(rng.standard_normal(int(rng.integers(2, 9))), dtype=np.float32))
    # a drawn entry of a drawn array, and (fixed) the last entry of the last array after many
    for which, at in ((int(rng.integers(2, len(arrays))), None), (len(arrays) - 1, arrays[-1].size - 1)):
        at = int(rng.integers(0, arrays[which].size)) if at is None else at
        kept = arrays[which][at].copy()
        arrays[which][at] = bad
        assert impl.memory.grads_finite(arrays) is False, (
            f"{bad} at entry {at} of array {which} of {len(arrays)} ({arrays[which].dtype}) was not found (seed {seed})"
        )
        arrays[which][at] = kept
    with np.errstate(over="ignore"):
        overflowed = (xp.asarray([70000.0], dtype=np.float32)).astype(np.float16)  # beyond float16's 65504
    assert impl.memory.grads_finite([overflowed]) is False, f"a float16 overflow (70000: inf) is missed (seed {seed})"


def expected_scales(flags, scale, growth, backoff, interval):
    """The scale after each update, and whether each step is taken: the rule of the handout."""
    out, clean = [], 0
    for found_inf in flags:
        if found_inf:
            scale, clean, take = scale * backoff, 0, False
        else:
            clean, take = clean + 1, True
            if clean == interval:
                scale, clean = scale * growth, 0
        out.append((scale, take))
    return out


def check_scaler(impl, flags, scale, growth, backoff, interval, what):
    scaler = impl.memory.LossScaler(scale=scale, growth=growth, backoff=backoff, growth_interval=interval)
    want = expected_scales(flags, scale, growth, backoff, interval)
    for step, (found_inf, (w_scale, w_take)) in enumerate(zip(flags, want)):
        take = scaler.update(found_inf)
        assert take == w_take and scaler.skipped == (not w_take), (
            f"{what}: step {step} ({'overflow' if found_inf else 'clean'}) must be "
            f"{'taken' if w_take else 'skipped'}; update returned {take}, skipped={scaler.skipped}"
        )
        assert scaler.scale == w_scale, (
            f"{what}: after step {step} ({'overflow' if found_inf else 'clean'}) the scale is {scaler.scale}, "
            f"want {w_scale} (growth interval {interval}, flags so far {[int(f) for f in flags[: step + 1]]})"
        )


@pytest.mark.task("8.2")
def test_the_scale_follows_a_drawn_sequence_of_overflows(impl):
    rng, seed = seeded()
    interval = int(rng.integers(1, 6))
    flags = [bool(f) for f in rng.random(int(rng.integers(10, 40))) < 0.2]
    scale = float(2.0 ** int(rng.integers(4, 20)))
    growth, backoff = float(rng.choice([2.0, 4.0])), float(rng.choice([0.5, 0.25]))
    check_scaler(impl, flags, scale, growth, backoff, interval, f"seed {seed}")


@pytest.mark.task("8.2")
@pytest.mark.parametrize("interval", [1, 3, 7])
def test_an_overflow_first_then_growth_after_exactly_n_clean_steps(impl, interval):
    # Fixed cases: an overflow on the first step, then N clean steps (growth on the N-th, not
    # before), then N - 1 clean steps and an overflow (the count starts again), then N clean.
    _, seed = seeded()  # nothing drawn: the seed only names the run
    flags = [True] + [False] * interval + [False] * (interval - 1) + [True] + [False] * interval
    check_scaler(impl, flags, 2.0**16, 2.0, 0.5, interval, f"growth interval {interval} (seed {seed})")
    many = [True] * 40  # overflow after overflow: halving on, never stuck, never zero
    check_scaler(impl, many, 2.0**16, 2.0, 0.5, interval, f"40 overflows in a row (seed {seed})")


@pytest.mark.task("8.2")
def test_a_loop_skips_the_overflowing_step_and_matches_an_unscaled_run(impl):
    """SGD on float32 parameters: backward on loss × S (``loss_scaling``), the optimizer divides by
    S (``loss_scale``). S = 2^120 makes step 0's gradients overflow float32 (the term 1024·w gives
    each 2^10 · S = 2^130), as a large S overflows float16's 65504; the back-off 2^-100 then leaves S = 2^20, and
    it grows every 2 clean steps.
    The skipped step leaves the parameters as they were; after every other step they equal an
    unscaled run's bit for bit (S a power of two: scaling and unscaling are exact)."""
    rng, seed = seeded()
    width = int(rng.integers(2, 6))
    w0 = rng.standard_normal((width, width)).astype(np.float32)
    xs = [rng.standard_normal((3, width)).astype(np.float32) for _ in range(6)]

    def loss_of(w, x):  # d(loss)/dw has 2^10 added to every entry: S = 2^120 makes it overflow
        h = Tensor(xp.asarray(x)) @ w
        return (h * h).sum() + (w * 1024.0).sum()

    w, ref = (Tensor(xp.asarray(w0.copy()), requires_grad=True) for _ in range(2))
    opt, ref_opt = reference_optim.SGD([w], lr=1e-4), reference_optim.SGD([ref], lr=1e-4)
    scaler = impl.memory.LossScaler(scale=2.0**120, backoff=2.0**-100, growth_interval=2)
    for step, x in enumerate(xs):
        scale = scaler.scale
        w.grad = None
        with loss_scaling(scale), np.errstate(over="ignore", invalid="ignore"):  # step 0 overflows
            loss_of(w, x).backward()
        take = scaler.update(not impl.memory.grads_finite([w.grad]))
        assert take == (step > 0), (
            f"step {step} with S = {scale}: {'an overflow' if step == 0 else 'clean gradients'} must be "
            f"{'skipped' if step == 0 else 'taken'}; update returned {take} (seed {seed})"
        )
        if take:
            opt.loss_scale = scale
            opt.step()
            ref.grad = None
            loss_of(ref, x).backward()
            ref_opt.step()
        assert np.array_equal(host(w.data), host(ref.data)), (
            f"after step {step} the parameters differ from an unscaled run's that skipped step 0 (seed {seed})"
        )
    assert scaler.scale == 2.0**22, (
        f"S = 2^20 after the overflow, doubled after 2 and 4 clean steps, is 2^22; got {scaler.scale} (seed {seed})"
    )


# ================================================================================================
# 8.3 the mixed-precision optimizer step
# ================================================================================================


def optimizers(kind, lr):
    """(the optimizer under test's class, the reference's) with the same settings."""
    if kind == "sgd":
        return lambda m, ps: m.SGD(ps, lr=lr, momentum=0.9, weight_decay=0.01)
    return lambda m, ps: m.AdamW(ps, lr=lr, weight_decay=0.1, eps=1e-6)


def mixed_run(impl, kind, precision, shapes, steps, scale, rng, lr=1e-2, strided=False):
    """Train 16-bit parameters ``steps`` times with the optimizer under test and float32 copies with
    the reference's rule on the gradients divided by ``scale`` in float32; return both sides."""
    dtype = precision_dtype(precision)
    make = optimizers(kind, lr)
    draw = [xp.asarray(rng.standard_normal(s), dtype=np.float32) for s in shapes]
    params = [Tensor(a.astype(dtype), requires_grad=True) for a in draw]
    masters = [Tensor(p.data.astype(np.float32), requires_grad=True) for p in params]
    opt, ref = make(impl.memory, params), make(reference_optim, masters)
    opt.loss_scale = scale
    arrays = [p.data for p in params]
    for _ in range(steps):
        for p, m in zip(params, masters):
            g = (rng.standard_normal(p.shape[::-1] if strided else p.shape) * scale).astype(np.float32)
            g = g.T if strided else g
            p.grad = xp.asarray(g).astype(dtype)
            m.grad = p.grad.astype(np.float32) / np.float32(scale)
        sent = [host(p.grad).copy() for p in params]
        opt.step()
        ref.step()
        for i, p in enumerate(params):
            assert np.array_equal(host(p.grad).view(np.uint16), sent[i].view(np.uint16)), (
                f"parameter {i}: the step changed the caller's gradient array (work on a float32 copy)"
            )
    for i, p in enumerate(params):
        assert p.data is arrays[i] and p.data.dtype == dtype, (
            f"parameter {i} must stay the same {dtype} array, updated in place (got a {p.data.dtype} array"
            f"{'' if p.data is arrays[i] else ', a new one'})"
        )
    return params, masters, opt


@pytest.mark.task("8.3")
@pytest.mark.parametrize("precision", LOW)
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_masters_follow_a_float32_run_and_parameters_are_them_rounded(impl, precision, kind):
    rng, seed = seeded()
    shapes = [tuple(int(d) for d in rng.integers(1, 6, size=int(rng.integers(1, 3)))) for _ in range(3)]
    scale = float(2.0 ** int(rng.integers(0, 12)))  # scaled N(0, 1) gradients stay below float16's 65504
    steps = int(rng.integers(1, 4))
    params, masters, opt = mixed_run(impl, kind, precision, shapes, steps, scale, rng)
    what = f"{kind}, {precision} parameters of shapes {shapes}, loss scale {scale}, {steps} steps (seed {seed})"
    for i, (p, m) in enumerate(zip(params, masters)):
        state = opt.state[p]
        assert "master" in state and state["master"].dtype == np.float32, (
            f"{what}: parameter {i}'s state needs its float32 copy under 'master'"
        )
        floats = {k: v.dtype for k, v in state.items() if hasattr(v, "dtype")}
        assert all(d == np.float32 for d in floats.values()), f"{what}: parameter {i}'s state must be float32: {floats}"
        assert np.array_equal(host(state["master"]), host(m.data)), (
            f"{what}: parameter {i}'s master differs from a float32 run of the rule on gradient / scale"
        )
        rounded = host(state["master"]).astype(p.data.dtype)
        assert np.array_equal(host(p.data).view(np.uint16), rounded.view(np.uint16)), (
            f"{what}: parameter {i} is not its master rounded to {precision}"
        )


@pytest.mark.task("8.3")
@pytest.mark.parametrize("precision", LOW)
def test_the_hard_cases(impl, precision):
    rng, seed = seeded()
    dtype = precision_dtype(precision)
    what = f"{precision} (seed {seed})"
    # An empty parameter (a ZeRO piece can be one) beside a full one, and a transposed gradient.
    params, masters, opt = mixed_run(impl, "adamw", precision, [(0,), (3, 4)], 2, 2.0**8, rng, strided=True)
    assert opt.state[params[0]]["master"].shape == (0,), f"{what}: an empty parameter has an empty master"
    assert np.array_equal(host(opt.state[params[1]]["master"]), host(masters[1].data)), (
        f"{what}: a transposed (strided) gradient gave another master than the float32 run"
    )
    # State bytes: master + two moments, 12 per element, beside a float32 parameter's 8.
    low = Tensor(xp.zeros(10, dtype=dtype), requires_grad=True)
    full = Tensor(xp.zeros(10, dtype=np.float32), requires_grad=True)
    adam = impl.memory.AdamW([low, full], lr=1e-3)
    low.grad, full.grad = xp.ones(10, dtype=dtype), xp.ones(10, dtype=np.float32)
    adam.step()
    assert "master" not in adam.state[full], f"{what}: a float32 parameter needs no master"
    assert adam.state_bytes() == 12 * 10 + 8 * 10, (
        f"{what}: AdamW holds {adam.state_bytes()} bytes for 10 {precision} + 10 float32 elements; want 12·10 + 8·10"
    )


@pytest.mark.task("8.3")
def test_small_updates_add_up_in_the_master(impl):
    """A bfloat16 (or float16) 1.0 has a spacing of 2^-7 (2^-10): an SGD step of lr·g = 2^-10 (2^-13)
    rounds away in the parameter, but the master keeps it, and 16 of them move the parameter."""
    rng, seed = seeded()
    for precision in LOW:
        dtype = precision_dtype(precision)
        tiny = 2.0**-10 if precision == "bf16" else 2.0**-13
        p = Tensor(xp.ones(int(rng.integers(1, 5)), dtype=dtype), requires_grad=True)
        opt = impl.memory.SGD([p], lr=1.0)
        for step in range(16):
            p.grad = xp.full(p.shape, -tiny, dtype=dtype)
            opt.step()
            if step == 0:
                assert np.all(host(p.data).astype(np.float32) == 1.0), (
                    f"{precision}: 1 + {tiny} rounds to 1 in the parameter after one step (seed {seed})"
                )
        master = host(opt.state[p]["master"])
        assert np.all(master == np.float32(1 + 16 * tiny)), (
            f"{precision}: 16 steps of {tiny} must add up in the float32 master: {master} (seed {seed})"
        )
        assert np.all(host(p.data).astype(np.float32) == np.float32(1 + 16 * tiny)), (
            f"{precision}: after 16 steps the parameter is its master rounded, {1 + 16 * tiny} (seed {seed})"
        )


@pytest.mark.task("8.3")
def test_a_gradient_only_the_scale_keeps_above_float16_underflow(impl):
    """g = 2^-26 is below float16's smallest number (2^-24): scaled by S = 2^16 it is 2^-10 in
    float16, and divided by S in float32 the master moves by lr·2^-26; divided in float16 it is 0."""
    rng, seed = seeded()
    n = int(rng.integers(1, 6))
    p = Tensor(xp.zeros(n, dtype=np.float16), requires_grad=True)
    opt = impl.memory.SGD([p], lr=1.0)
    opt.loss_scale = 2.0**16
    p.grad = xp.full(n, 2.0**-10, dtype=np.float16)
    opt.step()
    master = host(opt.state[p]["master"])
    assert np.all(master == np.float32(-(2.0**-26))), (
        f"the master must move by lr·2^-26 (the gradient divided by the scale in float32): {master} (seed {seed})"
    )
