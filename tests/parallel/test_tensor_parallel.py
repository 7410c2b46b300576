"""Tensor and sequence parallel against the serial GPT: outputs, every gradient, parameters after
optimizer steps, per-block communication bytes and activation memory against their formulas."""

from __future__ import annotations

import numpy as np
import pytest

from tinytrain import distributed as dist
from tinytrain import functional as F
from tinytrain import random as _random
from tinytrain.autograd import Tensor, saved_bytes
from tinytrain.backend import to_host, xp
from tinytrain.nn import GPT, GPTConfig
from tinytrain.nn.layers import Dropout
from tinytrain.optim import SGD
from tinytrain.parallel import tensor_parallel as tp

VOCAB, T, B = 32, 8, 4
# float32; parallel sums run in another order than serial ones (and Adam divides by small
# second moments), so values agree to rounding, not bit for bit.
RTOL, ATOL = 1e-4, 2e-6


def tiny_gpt(dropout=0.0, n_head=4, width=16, n_layer=2, vocab=VOCAB):
    return GPT(
        GPTConfig(vocab_size=vocab, block_size=T, n_layer=n_layer, n_head=n_head, n_embd=width, dropout=dropout), seed=3
    )


def batch(step, rows=B):
    rng = np.random.default_rng([7, step])
    y = rng.integers(0, VOCAB, size=(rows, T))
    y[:, :2] = -100  # some ignored targets, like the addition task's prompts
    return rng.integers(0, VOCAB, size=(rows, T)), y


def serial_step(model, step):
    _random.manual_seed((1, step))  # dropout masks: the same stream the parallel ranks use
    x, y = batch(step)
    loss = F.cross_entropy(model(xp.asarray(x)), xp.asarray(y))
    loss.backward()
    return loss


def parallel_step(model, step):
    _random.manual_seed((1, step))
    x, y = batch(step)
    loss = model.loss(x, y)
    loss.backward()  # SP's partial gradients are summed over the group by the model's hooks
    return loss


def assert_matches_serial(parallel, serial, what, field="grad"):
    named = dict(serial.named_parameters())
    # A gradient that should be 0 (the key bias: softmax ignores a per-query constant) holds
    # float32 noise relative to the other gradients' size: allow 1e-5 of the largest one.
    atol = ATOL + 1e-5 * max(float(np.abs(to_host(getattr(p, field))).max()) for p in serial.parameters())
    for s in parallel.shards():
        full = getattr(named[s.name], field)
        want = full if s.replicated else np.take(to_host(full), range(s.start, s.stop), axis=s.axis)
        np.testing.assert_allclose(
            to_host(getattr(s.param, field)),
            to_host(want),
            rtol=RTOL,
            atol=atol,
            err_msg=f"{what}: {field} of {s.name} (axis {s.axis}, [{s.start}:{s.stop}])",
        )


@pytest.mark.world_size(2)
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tp2_loss_and_every_gradient_match_serial_with_dropout(sp):
    serial = tiny_gpt(dropout=0.2)
    parallel = tp.tensor_parallel_gpt(tiny_gpt(dropout=0.2), dist.world(), sequence_parallel=sp)
    want = serial_step(serial, 0)
    got = parallel_step(parallel, 0)
    np.testing.assert_allclose(got.item(), want.item(), rtol=RTOL)
    assert_matches_serial(parallel, serial, f"TP 2, SP {sp}")


@pytest.mark.world_size(4)
@pytest.mark.parametrize("sp", [False, True], ids=["tp4", "tp4-sp"])
def test_tp4_params_after_optimizer_steps_match_serial(sp):
    serial = tiny_gpt(dropout=0.1)
    parallel = tp.tensor_parallel_gpt(tiny_gpt(dropout=0.1), dist.world(), sequence_parallel=sp)
    # SGD, not Adam: the key bias's true gradient is 0 (softmax ignores a per-query constant), so
    # both runs hold float32 noise there, and Adam would scale noise of either sign up to lr.
    opt_s = SGD(serial.parameters(), lr=0.5, momentum=0.9)
    opt_p = SGD(parallel.parameters(), lr=0.5, momentum=0.9)
    for step in range(3):
        opt_s.zero_grad(), opt_p.zero_grad()
        want, got = serial_step(serial, step), parallel_step(parallel, step)
        np.testing.assert_allclose(got.item(), want.item(), rtol=RTOL, err_msg=f"loss at step {step}")
        assert_matches_serial(parallel, serial, f"TP 4, SP {sp}, step {step}")
        opt_s.step(), opt_p.step()
    assert_matches_serial(parallel, serial, f"TP 4, SP {sp}, after 3 SGD steps", field="data")


@pytest.mark.world_size(2)
def test_gathered_logits_equal_serial_and_write_into_restores_the_model():
    serial = tiny_gpt()
    parallel = tp.tensor_parallel_gpt(tiny_gpt(), dist.world())
    x, _ = batch(0)
    logits = tp.GatherFromRegion.apply(parallel(x), group=dist.world())
    np.testing.assert_allclose(to_host(logits.data), to_host(serial(xp.asarray(x)).data), rtol=RTOL, atol=ATOL)
    blank = tiny_gpt()
    for p in blank.parameters():
        p.data[...] = 0
    parallel.write_into(blank)
    for (name, a), b in zip(serial.named_parameters(), blank.parameters()):
        np.testing.assert_array_equal(to_host(a.data), to_host(b.data), err_msg=name)


@pytest.mark.world_size(2)
def test_shards_cover_the_serial_parameters_and_dropout_sites_the_serial_dropouts():
    serial = tiny_gpt(dropout=0.1)
    parallel = tp.tensor_parallel_gpt(tiny_gpt(dropout=0.1), dist.world(), sequence_parallel=True)
    shards = parallel.shards()
    assert sorted(s.name for s in shards) == sorted(dict(serial.named_parameters()))
    assert {s.name for s in shards if s.replicated} == {s.name for s in shards if s.partial} | {"wpe.weight"}
    wte = next(s for s in shards if s.name == "wte.weight")
    assert (wte.axis, wte.start, wte.stop) == (0, dist.get_rank() * VOCAB // 2, (dist.get_rank() + 1) * VOCAB // 2)
    assert wte.placement.cut(serial.wte.weight.data).shape == wte.param.shape
    sites = {m.dropout_site for m in parallel.modules() if hasattr(m, "dropout_site")}
    assert sites == {name for name, m in serial.named_modules() if isinstance(m, Dropout)}


@pytest.mark.world_size(2)
def test_region_functions_forward_and_backward():
    g, r = dist.world(), dist.get_rank()
    rng = np.random.default_rng(5)
    full = rng.normal(size=(2, 4, 6)).astype(np.float32)  # the same on both ranks
    mine = Tensor(xp.asarray(full * (r + 1)), requires_grad=True)
    cases = {  # name: (function, forward result, gradient of sum(out * w) for w = ones)
        "copy": (tp.CopyToRegion, full * (r + 1), np.full_like(full, 2.0)),
        "reduce": (tp.ReduceFromRegion, full * 3, np.ones_like(full)),
    }
    for name, (fn, want, want_grad) in cases.items():
        mine.grad = None
        out = fn.apply(mine, group=g)
        np.testing.assert_allclose(to_host(out.data), want, rtol=1e-6, err_msg=name)
        out.sum().backward()
        np.testing.assert_allclose(to_host(mine.grad), want_grad, rtol=1e-6, err_msg=name)
    for fn, axis in ((tp.GatherFromRegion, -1), (tp.GatherFromSequenceRegion, 1)):
        piece = Tensor(xp.asarray(np.split(full, 2, axis=axis)[r]), requires_grad=True)
        out = fn.apply(piece, group=g)
        np.testing.assert_array_equal(to_host(out.data), full, err_msg=fn.__name__)
        out.backward(xp.asarray(full))  # each rank sends the same upstream gradient
        scale = 2.0 if fn is tp.GatherFromSequenceRegion else 1.0  # reduce-scatter sums 2 ranks
        np.testing.assert_allclose(to_host(piece.grad), scale * np.split(full, 2, axis=axis)[r], err_msg=fn.__name__)
    for fn, axis in ((tp.ScatterToRegion, -1), (tp.ReduceScatterToSequenceRegion, 1)):
        whole = Tensor(xp.asarray(full), requires_grad=True)
        out = fn.apply(whole, group=g)
        scale = 2.0 if fn is tp.ReduceScatterToSequenceRegion else 1.0
        np.testing.assert_allclose(to_host(out.data), scale * np.split(full, 2, axis=axis)[r], err_msg=fn.__name__)
        out.backward(xp.asarray(np.split(full, 2, axis=axis)[r]))
        np.testing.assert_array_equal(to_host(whole.grad), full, err_msg=fn.__name__)


@pytest.mark.world_size(4)
@pytest.mark.parametrize(
    "config, message",
    [
        ({"n_head": 2, "width": 16}, "number of attention heads = 2"),
        ({"vocab": 30}, "vocabulary size = 30"),
    ],
)
def test_impossible_splits_say_what_to_change(config, message):
    with pytest.raises(ValueError, match=message):
        tp.tensor_parallel_gpt(tiny_gpt(**config), dist.world())


@pytest.mark.world_size(4)
def test_sequence_not_divisible_is_refused():
    parallel = tp.tensor_parallel_gpt(tiny_gpt(), dist.world(), sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence length.*= 6 does not split over .* 4 ranks"):
        parallel.loss(*[a[:, :6] for a in batch(0)])


# --- measured, not claimed: bytes on the wire and bytes saved for backward, per block ---------------

WIDTH, HEADS = 16, 4


def one_block(t, sp, rank):
    """Block 0 of the tiny GPT split over the world, and its input (my sequence shard under SP)."""
    serial = tiny_gpt(dropout=0.1, n_head=HEADS, width=WIDTH, n_layer=1)
    block = tp.ParallelBlock(serial.blocks[0], dist.world(), "blocks.0", sequence_parallel=sp)
    x = np.random.default_rng(0).normal(size=(B, T, WIDTH)).astype(np.float32)
    if sp:
        x = np.split(x, t, axis=1)[rank]
    return block, Tensor(xp.asarray(x), requires_grad=True)


def tp_size_param(t):
    return pytest.param(t, marks=pytest.mark.world_size(t), id=f"tp{t}")


@pytest.mark.parametrize("t", [tp_size_param(2), tp_size_param(4)])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_block_communication_bytes_match_the_formula(t, sp):
    block, x = one_block(t, sp, dist.get_rank())
    _random.manual_seed(0)
    g = dist.world().name
    with dist.comm_stats() as fwd:
        y = block(x)
    with dist.comm_stats() as bwd:
        y.sum().backward()
    activation = B * T * WIDTH * 4  # one (B, T, C) float32 activation
    ring_all_reduce = 2 * (t - 1) * activation // t  # bytes each rank sends in a ring all-reduce
    for what, stats in (("forward", fwd), ("backward", bwd)):
        # two all-reduces a pass (attention and MLP), or under SP the same bytes as
        # all-gathers (entering a region) + reduce-scatters (leaving it, or their gradients)
        sent = sum(stats.sent(op, group=g) for op in ("all_reduce", "all_gather", "reduce_scatter"))
        assert sent == 2 * ring_all_reduce, f"{what}:\n{stats.table()}"
        assert {op for _, op in stats.rows} <= {"all_reduce", "all_gather", "reduce_scatter", "debug_check"}
        if sp:
            assert stats.sent("all_reduce", group=g) == 0, f"{what}:\n{stats.table()}"
            assert stats.sent("all_gather", group=g) == stats.sent("reduce_scatter", group=g) == ring_all_reduce
        else:
            assert stats.messages("all_reduce", group=g) == 2 * 2 * (t - 1), f"{what}: two ring all-reduces"


def block_activation_bytes(t, rank, sp):
    """Bytes saved for backward by one block's forward (dropout on), excluding parameters."""
    block, x = one_block(t, sp, rank)
    _random.manual_seed(0)
    before = saved_bytes()
    y = block(x)
    held = saved_bytes() - before
    del y
    return held


@pytest.mark.parametrize("t", [tp_size_param(2), tp_size_param(4)])
def test_sequence_parallel_divides_the_replicated_activations_by_t(t):
    """What one block saves (float32 4 bytes, dropout masks 1 byte, C=width, h=heads):

    in the sequence regions R = 2 LayerNorms (x̂: 4BTC, 1/σ: 4BT) + 2 dropout masks (BTC),
    in the parallel regions S = q/k/v and fc_1 inputs (4BTC each, all-gathered or copied: whole)
        + q, k, v, attention output (4·4BTC/t) + probabilities (4B(h/t)T²)
        + fc_1 output and its σ(2u) for GELU (2·16BTC/t) + fc_2 input (16BTC/t).
    TP keeps S + R on every rank, SP keeps S + R/t.
    """
    C, h = WIDTH, HEADS
    R = 2 * (4 * B * T * C + 4 * B * T) + 2 * B * T * C
    S = 2 * 4 * B * T * C + 4 * 4 * B * T * C // t + 4 * B * (h // t) * T * T + 3 * 16 * B * T * C // t
    tp_bytes = block_activation_bytes(t, dist.get_rank(), sp=False)
    sp_bytes = block_activation_bytes(t, dist.get_rank(), sp=True)
    assert tp_bytes == S + R, f"TP block saved {tp_bytes} bytes, formula S + R = {S} + {R}"
    assert sp_bytes == S + R // t, f"SP block saved {sp_bytes} bytes, formula S + R/t = {S} + {R // t}"
