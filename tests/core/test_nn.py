"""nn: Module bookkeeping, the basic layers against NumPy formulas, GPTConfig checks, GPT behaviour."""

from __future__ import annotations

import math

import numpy
import pytest

from tinytrain import functional as F
from tinytrain import random as _random
from tinytrain.autograd import Parameter, Tensor, no_grad
from tinytrain.backend import to_host, xp
from tinytrain.nn import GPT, Dropout, Embedding, GPTConfig, LayerNorm, Linear, Module, ModuleList
from tinytrain.testing import assert_close


def host(t):
    return to_host(t.data if isinstance(t, Tensor) else t)


# --- Module bookkeeping -----------------------------------------------------------------------


class Pair(Module):
    def __init__(self):
        super().__init__()
        self.first = Linear(3, 4)
        self.scale = Parameter(xp.ones(4, dtype=xp.float32))
        self.second = Linear(4, 2, bias=False)

    def forward(self, x):
        return self.second(self.first(x) * self.scale)


def test_named_parameters_follow_assignment_order():
    m = Pair()
    names = [n for n, _ in m.named_parameters()]
    # a module's own parameters come before its children's (it is visited first)
    assert names == ["scale", "first.weight", "first.bias", "second.weight"]
    assert [id(p) for p in m.parameters()] == [id(p) for _, p in m.named_parameters()]
    assert list(m.children()) == [m.first, m.second]
    assert m.num_parameters() == 4 + 3 * 4 + 4 + 4 * 2
    assert list(m.state_dict()) == names


def test_reassigning_an_attribute_replaces_the_registration():
    m = Pair()
    m.second = Linear(4, 5, bias=True)
    names = [n for n, _ in m.named_parameters()]
    assert names == ["scale", "first.weight", "first.bias", "second.weight", "second.bias"]
    m.scale = None  # no longer a parameter
    assert "scale" not in dict(m.named_parameters())
    del m.first
    assert [n for n, _ in m.named_parameters()] == ["second.weight", "second.bias"]


def test_module_without_super_init_is_a_clear_error():
    class Bad(Module):
        def __init__(self):
            self.w = Parameter(xp.zeros(2, dtype=xp.float32))

    with pytest.raises(RuntimeError, match=r"super\(\)\.__init__"):
        Bad()


def test_shared_parameter_is_listed_once():
    class Shared(Module):
        def __init__(self):
            super().__init__()
            self.a = Linear(3, 3)
            self.b = Linear(3, 3)
            self.b.weight = self.a.weight

    m = Shared()
    names = [n for n, _ in m.named_parameters()]
    assert names == ["a.weight", "a.bias", "b.bias"]
    assert len(m.parameters()) == 3


def test_state_dict_round_trip_and_strict_errors():
    rng = numpy.random.default_rng()
    a, b = Pair(), Pair()
    for p in a.parameters():
        p.data[...] = xp.asarray(rng.standard_normal(p.shape).astype(numpy.float32))
    state = a.state_dict()
    b.load_state_dict(state)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        numpy.testing.assert_array_equal(host(pa), host(pb))
    # the state dict is a copy, not a view of the live parameters
    state["scale"][...] = 123.0
    assert not numpy.any(host(a.scale) == 123.0)

    missing = dict(state)
    del missing["first.bias"]
    with pytest.raises(KeyError, match="first.bias"):
        b.load_state_dict(missing)
    extra = dict(state, stray=numpy.zeros(1, dtype=numpy.float32))
    with pytest.raises(KeyError, match="stray"):
        b.load_state_dict(extra)
    b.load_state_dict(missing, strict=False)  # non-strict ignores the gap
    wrong = dict(state, scale=numpy.zeros(5, dtype=numpy.float32))
    with pytest.raises(ValueError, match="scale"):
        b.load_state_dict(wrong)


def test_train_eval_propagates_to_every_submodule():
    model = GPT(GPTConfig(vocab_size=7, block_size=4, n_layer=2, n_head=2, n_embd=8, dropout=0.1))
    assert all(m.training for m in model.modules())
    assert model.eval() is model
    assert not any(m.training for m in model.modules())
    model.train()
    assert all(m.training for m in model.modules())


def test_zero_grad_clears_every_gradient():
    m = Pair()
    x = Tensor(xp.asarray(numpy.random.default_rng().standard_normal((5, 3)).astype(numpy.float32)))
    m(x).sum().backward()
    assert all(p.grad is not None for p in m.parameters())
    m.zero_grad()
    assert all(p.grad is None for p in m.parameters())


def test_module_list_indexes_and_registers():
    ml = ModuleList([Linear(2, 2), Linear(2, 3)])
    assert len(ml) == 2 and ml[1].out_features == 3
    assert [n for n, _ in ml.named_parameters()] == ["0.weight", "0.bias", "1.weight", "1.bias"]


# --- layers against NumPy ---------------------------------------------------------------------


def test_linear_matches_numpy():
    rng = numpy.random.default_rng()
    lin = Linear(5, 3)
    lin.bias.data[...] = xp.asarray(rng.standard_normal(3).astype(numpy.float32))
    x = rng.standard_normal((2, 4, 5)).astype(numpy.float32)
    expected = x @ host(lin.weight) + host(lin.bias)
    assert_close(lin(Tensor(xp.asarray(x))), expected, atol=1e-5, what="Linear")
    nob = Linear(5, 3, bias=False)
    assert nob.bias is None
    assert_close(nob(Tensor(xp.asarray(x))), x @ host(nob.weight), atol=1e-5, what="Linear no bias")


def test_layer_constructors_reject_bad_sizes():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError):
            Linear(bad, 3)
        with pytest.raises(ValueError):
            Embedding(bad, 3)
    with pytest.raises(ValueError):
        LayerNorm(0)
    for p in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError):
            Dropout(p)


def test_embedding_looks_up_rows_and_rejects_out_of_range_ids():
    rng = numpy.random.default_rng()
    emb = Embedding(6, 4)
    ids = rng.integers(0, 6, size=(3, 5))
    assert_close(emb(ids), host(emb.weight)[ids], atol=0, rtol=0, what="Embedding")
    with pytest.raises(IndexError, match=r"\[0, 6\)"):
        emb(numpy.array([[0, 6]]))
    with pytest.raises(IndexError):
        emb(numpy.array([-1, 2]))


def test_embedding_gradient_sums_repeated_ids():
    emb = Embedding(4, 3)
    ids = numpy.array([1, 1, 3, 1])
    emb(ids).sum().backward()
    expected = numpy.zeros((4, 3), dtype=numpy.float32)
    expected[1] = 3
    expected[3] = 1
    assert_close(emb.weight.grad, expected, atol=0, rtol=0, what="embedding grad")


def test_layer_norm_matches_numpy():
    rng = numpy.random.default_rng()
    ln = LayerNorm(6)
    ln.weight.data[...] = xp.asarray(rng.standard_normal(6).astype(numpy.float32))
    ln.bias.data[...] = xp.asarray(rng.standard_normal(6).astype(numpy.float32))
    x = (rng.standard_normal((2, 3, 6)) * 3 + 1).astype(numpy.float32)
    mu = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    expected = (x - mu) / numpy.sqrt(var + 1e-5) * host(ln.weight) + host(ln.bias)
    assert_close(ln(Tensor(xp.asarray(x))), expected, atol=1e-5, what="LayerNorm")
    with pytest.raises(ValueError, match="last axis"):
        ln(Tensor(xp.zeros((2, 5), dtype=xp.float32)))


def test_dropout_train_and_eval():
    rng = numpy.random.default_rng()
    x = rng.standard_normal((64, 64)).astype(numpy.float32) + 3.0  # no exact zeros
    d = Dropout(0.25)
    out = host(d(Tensor(xp.asarray(x)), generator=_random.generator(1)))
    kept = out != 0
    # kept entries are scaled by 1/(1-p); about 75% are kept
    assert_close(out[kept], x[kept] / 0.75, atol=1e-6, what="kept entries")
    assert 0.70 < kept.mean() < 0.80
    # same generator seed -> same mask; another seed -> another mask
    again = host(d(Tensor(xp.asarray(x)), generator=_random.generator(1)))
    numpy.testing.assert_array_equal(out, again)
    other = host(d(Tensor(xp.asarray(x)), generator=_random.generator(2)))
    assert not numpy.array_equal(out, other)
    d.eval()
    numpy.testing.assert_array_equal(host(d(Tensor(xp.asarray(x)))), x)


# --- GPTConfig --------------------------------------------------------------------------------


def test_config_width_not_divisible_by_heads_names_divisors():
    with pytest.raises(ValueError, match=r"n_head among \[1, 2, 3, 4, 6, 8, 12, 24\]"):
        GPTConfig(n_embd=24, n_head=5)


@pytest.mark.parametrize("field", ["vocab_size", "block_size", "n_layer", "n_head", "n_embd"])
@pytest.mark.parametrize("value", [0, -2, 1.5])
def test_config_rejects_non_positive_sizes(field, value):
    with pytest.raises(ValueError, match=field):
        GPTConfig(**{field: value})


@pytest.mark.parametrize("p", [-0.1, 1.0])
def test_config_rejects_bad_dropout(p):
    with pytest.raises(ValueError, match="dropout"):
        GPTConfig(dropout=p)


def test_config_rejects_bad_moe_top_k():
    with pytest.raises(ValueError, match="moe_top_k"):
        GPTConfig(n_experts=2, moe_top_k=3)
    with pytest.raises(ValueError, match="moe_top_k"):
        GPTConfig(n_experts=2, moe_top_k=0)
    with pytest.raises(ValueError):
        GPTConfig(n_experts=-1)
    GPTConfig(n_experts=2, moe_top_k=2)  # fine


# --- GPT --------------------------------------------------------------------------------------

SMALL = dict(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)


def random_ids(rng, B, T, vocab=SMALL["vocab_size"]):
    return rng.integers(0, vocab, size=(B, T))


def test_gpt_forward_shape_and_length_errors():
    model = GPT(GPTConfig(**SMALL))
    rng = numpy.random.default_rng()
    assert model(random_ids(rng, 3, 5)).shape == (3, 5, SMALL["vocab_size"])
    assert model(random_ids(rng, 2, 8)).shape == (2, 8, SMALL["vocab_size"])
    with pytest.raises(ValueError, match="block_size=8"):
        model(random_ids(rng, 2, 9))
    with pytest.raises(ValueError, match="batch, time"):
        model(random_ids(rng, 2, 3)[0])


def test_gpt_is_causal():
    model = GPT(GPTConfig(**SMALL), seed=3)
    rng = numpy.random.default_rng()
    ids = random_ids(rng, 2, 8)
    t = int(rng.integers(1, 8))
    changed = ids.copy()
    changed[:, t:] = (changed[:, t:] + 1 + rng.integers(0, 9, size=changed[:, t:].shape)) % SMALL["vocab_size"]
    with no_grad():
        a, b = host(model(ids)), host(model(changed))
    numpy.testing.assert_allclose(a[:, :t], b[:, :t], rtol=1e-5, atol=1e-6)
    assert not numpy.allclose(a[:, t], b[:, t])  # the changed position itself does change


def test_gpt_seed_fixes_weights():
    cfg = GPTConfig(**SMALL)
    a, b, c = GPT(cfg, seed=5), GPT(cfg, seed=5), GPT(cfg, seed=6)
    for (n, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        numpy.testing.assert_array_equal(host(pa), host(pb))
        if n.endswith("weight") and "ln" not in n:
            assert not numpy.array_equal(host(pa), host(pc)), n


def test_gpt_tied_head_gets_gradient_from_both_uses():
    cfg = GPTConfig(**SMALL)
    model = GPT(cfg, seed=1)
    names = [n for n, _ in model.named_parameters()]
    assert model.head is None and not any(n.startswith("head") for n in names)
    rng = numpy.random.default_rng()
    ids = random_ids(rng, 2, 6)
    targets = random_ids(rng, 2, 6)
    F.cross_entropy(model(ids), xp.asarray(targets)).backward()
    total = host(model.wte.weight.grad).copy()

    # gradient through the head alone: the embedding lookup's input is detached from wte
    model.zero_grad()
    W = model.wte.weight
    x = Tensor(xp.asarray(host(W)[ids])) + model.wpe(xp.arange(6))
    for block in model.blocks:
        x = block(x)
    F.cross_entropy(model.logits(x), xp.asarray(targets)).backward()
    head_only = host(W.grad).copy()

    # and through the embedding alone: the head uses a constant copy of wte
    model.zero_grad()
    x = model.embed(ids)
    for block in model.blocks:
        x = block(x)
    logits = F.linear(model.ln_f(x), Tensor(xp.asarray(host(W).T.copy())))
    F.cross_entropy(logits, xp.asarray(targets)).backward()
    embed_only = host(W.grad).copy()

    assert numpy.abs(head_only).sum() > 0 and numpy.abs(embed_only).sum() > 0
    # rows never looked up get gradient from the head only
    unused = sorted(set(range(cfg.vocab_size)) - set(ids.ravel().tolist()))
    if unused:
        assert numpy.abs(embed_only[unused]).sum() == 0
    assert_close(total, head_only + embed_only, atol=1e-6, rtol=1e-4, what="tied wte grad")


def test_gpt_untied_head_is_its_own_parameter():
    model = GPT(GPTConfig(**SMALL, tie_weights=False))
    names = [n for n, _ in model.named_parameters()]
    assert "head.weight" in names
    assert model(random_ids(numpy.random.default_rng(), 1, 4)).shape == (1, 4, SMALL["vocab_size"])


def test_gpt_dropout_train_vs_eval():
    model = GPT(GPTConfig(**SMALL, dropout=0.3), seed=0)
    ids = random_ids(numpy.random.default_rng(), 2, 8)
    _random.manual_seed(1)
    a = host(model(ids))
    _random.manual_seed(1)
    a2 = host(model(ids))
    _random.manual_seed(2)
    b = host(model(ids))
    numpy.testing.assert_array_equal(a, a2)  # same seed -> same masks
    assert not numpy.allclose(a, b)
    model.eval()
    e1, e2 = host(model(ids)), host(model(ids))
    numpy.testing.assert_array_equal(e1, e2)
    assert not numpy.allclose(a, e1)
    # an eval forward equals the same model built without dropout
    plain = GPT(GPTConfig(**SMALL, dropout=0.0), seed=0)
    numpy.testing.assert_allclose(host(plain(ids)), e1, rtol=1e-6, atol=1e-6)


def test_gpt_every_parameter_gets_a_gradient():
    model = GPT(GPTConfig(**SMALL), seed=0)
    rng = numpy.random.default_rng()
    ids = random_ids(rng, 2, 8)
    F.cross_entropy(model(ids), xp.asarray(random_ids(rng, 2, 8))).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert p.grad.shape == p.shape, name
        assert numpy.isfinite(host(p.grad)).all(), name
        assert numpy.abs(host(p.grad)).sum() > 0, name
    assert math.isfinite(model.moe_aux_loss()) and model.moe_aux_loss() == 0.0
