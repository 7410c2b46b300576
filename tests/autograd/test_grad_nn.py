"""Gradient checks for the neural-network ops, and their forward values against plain NumPy.

The fused ops (gelu, layer_norm, cross_entropy, attention, linear) compute their own backward, so
each is checked both ways: forward against the textbook formula, backward against gradcheck.
"""

import numpy as np
import pytest

import tinytrain.functional as F
from tinytrain import random as tt_random
from tinytrain.autograd import Tensor, ops
from tinytrain.backend import to_host
from tinytrain.testing import assert_close, gradcheck


def T(a, grad=True):
    return Tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def rand_shape(rng, ndim, lo=1, hi=4):
    return tuple(int(n) for n in rng.integers(lo, hi + 1, size=ndim))


def np_log_softmax(x, axis=-1):
    shifted = x - x.max(axis=axis, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


# --- softmax family -------------------------------------------------------------------------


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_and_log_softmax(rng, axis):
    x = T(rng.standard_normal(rand_shape(rng, 3, lo=2)) * 2)
    assert_close(F.softmax(x, axis=axis), np.exp(np_log_softmax(x.data, axis)), atol=1e-12, what="softmax")
    assert_close(F.log_softmax(x, axis=axis), np_log_softmax(x.data, axis), atol=1e-12, what="log_softmax")
    gradcheck(lambda t: F.softmax(t, axis=axis), [x], what=f"softmax axis={axis}")
    gradcheck(lambda t: t.softmax(axis=axis), [x], what="Tensor.softmax")
    gradcheck(lambda t: F.log_softmax(t, axis=axis), [x], what=f"log_softmax axis={axis}")


def test_softmax_family_is_stable_for_large_logits():
    for dtype in (np.float32, np.float64):
        x = Tensor(np.array([[1000.0, 0.0, -1000.0], [1000.0, 1000.0, 999.0]], dtype=dtype), requires_grad=True)
        out = F.log_softmax(x)
        assert np.isfinite(out.numpy()).all()
        assert_close(out[0], [0.0, -1000.0, -2000.0], atol=1e-3, what=f"log_softmax {dtype.__name__}")
        assert_close(out[1], np_log_softmax(np.array([1.0, 1.0, 0.0])), atol=1e-5, what="log_softmax row 2")
        assert_close(F.softmax(x)[0], [1.0, 0.0, 0.0], atol=1e-6, what="softmax of 1000")
        loss = F.cross_entropy(x, np.array([2, 0]))
        assert np.isfinite(loss.item())
        assert_close(loss, (2000.0 - np_log_softmax(np.array([1.0, 1.0, 0.0]))[0]) / 2, rtol=1e-6, what="CE")
        loss.backward()
        assert np.isfinite(x.grad).all()


# --- cross-entropy --------------------------------------------------------------------------


def np_cross_entropy(logits, targets, ignore_index=-100, reduction="mean"):
    logp = np_log_softmax(logits.reshape(-1, logits.shape[-1]))
    tgt = targets.reshape(-1)
    valid = tgt != ignore_index
    nll = -logp[np.arange(len(tgt))[valid], tgt[valid]]
    return nll.mean() if reduction == "mean" else nll.sum()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignore_index", [-100, 0])
def test_cross_entropy(rng, reduction, ignore_index):
    lead = rand_shape(rng, int(rng.integers(1, 3)), lo=2)
    n_classes = int(rng.integers(2, 6))
    logits = T(rng.standard_normal(lead + (n_classes,)) * 2)
    targets = rng.integers(0, n_classes, size=lead)
    targets.flat[0] = ignore_index  # some entries ignored
    targets.flat[-1] = 1  # at least one counted (ignore_index=0 could otherwise hit every one)
    loss = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)
    assert loss.shape == ()
    expected = np_cross_entropy(logits.data, targets, ignore_index, reduction)
    assert_close(loss, expected, atol=1e-12, what="cross_entropy forward")
    gradcheck(
        lambda x: F.cross_entropy(x, Tensor(targets), ignore_index=ignore_index, reduction=reduction),
        [logits],
        what=f"cross_entropy {reduction}, ignore_index={ignore_index}",
    )
    ignored = targets == ignore_index
    logits.grad = None
    F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction).backward()
    assert (logits.grad[ignored] == 0).all(), "ignored entries must get no gradient"


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_with_every_target_ignored(reduction):
    """PyTorch's answer: the mean over no target is NaN, the sum 0; the gradient is 0 either way (no
    target pulls on any logit). It was NaN everywhere, and one such batch poisoned every parameter."""
    logits = T(np.random.default_rng(0).standard_normal((3, 4, 5)))
    targets = np.full((3, 4), -100)
    with np.errstate(all="raise"):  # no 0/0 on the way
        loss = F.cross_entropy(logits, targets, reduction=reduction)
        loss.backward()
    assert np.isnan(float(loss.data)) if reduction == "mean" else float(loss.data) == 0.0
    assert logits.grad.shape == logits.shape and (logits.grad == 0).all()


def test_cross_entropy_errors():
    with pytest.raises(ValueError, match="targets"):
        F.cross_entropy(T(np.zeros((2, 3))), np.zeros(3, dtype=int))
    with pytest.raises(ValueError, match="outside"):
        F.cross_entropy(T(np.zeros((2, 3))), np.array([0, 3]))
    with pytest.raises(ValueError, match="reduction"):
        F.cross_entropy(T(np.zeros((2, 3))), np.array([0, 1]), reduction="none")


# --- layers ---------------------------------------------------------------------------------


def test_embedding_with_repeated_ids(rng):
    vocab, dim = int(rng.integers(3, 6)), int(rng.integers(1, 4))
    weight = T(rng.standard_normal((vocab, dim)))
    ids = rng.integers(0, vocab, size=rand_shape(rng, 2, lo=2))
    ids.flat[1] = ids.flat[0]  # a repeated id gets both gradients
    assert_close(F.embedding(ids, weight), weight.data[ids], atol=0, what="embedding forward")
    gradcheck(lambda w: F.embedding(ids, w), [weight], what="embedding")
    gradcheck(lambda w: F.embedding(Tensor(ids), w), [weight], what="embedding with Tensor ids")
    with pytest.raises(TypeError, match="integers"):
        F.embedding(np.zeros(2), weight)


def np_layer_norm(x, w, b, eps):
    out = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)
    return out * (1 if w is None else w) + (0 if b is None else b)


@pytest.mark.parametrize("affine", ["weight_and_bias", "weight_only", "none"])
def test_layer_norm(rng, affine):
    shape = rand_shape(rng, int(rng.integers(1, 4)), lo=2)
    dim = shape[-1]
    x = T(rng.standard_normal(shape) * 3 + 1)
    w = T(rng.standard_normal(dim)) if affine != "none" else None
    b = T(rng.standard_normal(dim)) if affine == "weight_and_bias" else None
    eps = 1e-5
    expected = np_layer_norm(x.data, None if w is None else w.data, None if b is None else b.data, eps)
    assert_close(F.layer_norm(x, w, b, eps=eps), expected, atol=1e-10, what="layer_norm forward")
    inputs = [t for t in (x, w, b) if t is not None]
    fn = {
        "weight_and_bias": lambda x, w, b: F.layer_norm(x, w, b, eps=eps),
        "weight_only": lambda x, w: F.layer_norm(x, w, eps=eps),
        "none": lambda x: F.layer_norm(x, eps=eps),
    }[affine]
    gradcheck(fn, inputs, what=f"layer_norm ({affine})")


@pytest.mark.parametrize("bias", [True, False])
def test_linear(rng, bias):
    lead = rand_shape(rng, int(rng.integers(1, 4)))
    d_in, d_out = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    x, w = T(rng.standard_normal(lead + (d_in,))), T(rng.standard_normal((d_in, d_out)))
    b = T(rng.standard_normal(d_out)) if bias else None
    expected = x.data @ w.data + (b.data if bias else 0)
    assert_close(F.linear(x, w, b), expected, atol=1e-12, what="linear forward")
    if bias:
        gradcheck(F.linear, [x, w, b], what="linear with bias")
    else:
        gradcheck(F.linear, [x, w], what="linear without bias")


# --- dropout --------------------------------------------------------------------------------


def test_dropout_is_reproducible_and_preserves_the_mean(rng):
    seed = int(rng.integers(2**31))
    x = Tensor(np.ones((200, 100), dtype=np.float32))
    a = F.dropout(x, p=0.3, generator=tt_random.generator(seed)).numpy()
    b = F.dropout(x, p=0.3, generator=tt_random.generator(seed)).numpy()
    c = F.dropout(x, p=0.3, generator=tt_random.generator(seed + 1)).numpy()
    assert (a == b).all(), "same generator seed, same mask"
    assert (a != c).any(), "another seed, another mask"
    assert set(np.unique(a)) <= {0.0, np.float32(1 / 0.7)}
    assert abs((a == 0).mean() - 0.3) < 0.02  # 20000 draws: std of the rate ~0.003
    assert abs(a.mean() - 1.0) < 0.03  # expectation preserved by the 1/(1-p) scale
    assert F.dropout(x, p=0.3, training=False) is x
    assert F.dropout(x, p=0.0) is x
    with pytest.raises(ValueError, match="probability"):
        F.dropout(x, p=1.0)


def test_dropout_gradcheck(rng):
    seed = int(rng.integers(2**31))
    x = T(rng.standard_normal(rand_shape(rng, 2, lo=2)))
    # a generator re-created from the same seed on every call: the same mask each evaluation
    gradcheck(lambda t: F.dropout(t, p=0.4, generator=tt_random.generator(seed)), [x], what="dropout")
    tt_random.manual_seed(seed)  # the global generator gives masks too
    y = F.dropout(x, p=0.4)
    tt_random.manual_seed(seed)
    assert (F.dropout(x, p=0.4).data == y.data).all()


# --- attention ------------------------------------------------------------------------------


def np_attention(q, k, v, causal, scale=None):
    q, k, v = (to_host(a) for a in (q, k, v))  # the reference runs on the host, whatever the device
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ np.swapaxes(k, -1, -2) * scale
    if causal:
        T_ = q.shape[-2]
        scores = np.where(np.tril(np.ones((T_, T_), dtype=bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("causal", [True, False])
def test_scaled_dot_product_attention(rng, causal):
    batch = rand_shape(rng, int(rng.integers(0, 3)), hi=2)
    t, d = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    s = t if causal else int(rng.integers(1, 4))  # non-causal: keys may outnumber queries
    q = T(rng.standard_normal(batch + (t, d)))
    k = T(rng.standard_normal(batch + (s, d)))
    v = T(rng.standard_normal(batch + (s, d)))
    out = F.scaled_dot_product_attention(q, k, v, causal=causal)
    assert_close(out, np_attention(q.data, k.data, v.data, causal), atol=1e-12, what="attention forward")
    gradcheck(
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, causal=causal),
        [q, k, v],
        what=f"sdpa causal={causal} q{q.shape} k{k.shape}",
    )
    gradcheck(
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, causal=causal, scale=0.3),
        [q, k, v],
        what="sdpa with a given scale",
    )


@pytest.mark.parametrize("causal", [True, False])
def test_attention_in_query_blocks_matches_the_whole_matrix(rng, causal, monkeypatch):
    """Attention runs in blocks of ATTENTION_BLOCK query rows (causal blocks skip the keys above
    the diagonal). Blocks of 2 rows over 7 positions (the last block short): the same values as the
    textbook formula on the whole T x T matrix, and gradients that pass gradcheck."""
    monkeypatch.setattr(ops, "ATTENTION_BLOCK", 2)
    q, k, v = (T(rng.standard_normal((2, 3, 7, 4))) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, causal=causal)
    assert_close(out, np_attention(q.data, k.data, v.data, causal), atol=1e-12, what="blocked attention forward")
    gradcheck(
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, causal=causal, scale=0.7),
        [q, k, v],
        what=f"blocked attention causal={causal}",
    )


def test_attention_broadcast_heads_and_causality(rng):
    q = T(rng.standard_normal((2, 3, 4, 2)))
    kv = T(rng.standard_normal((2, 1, 4, 2)))  # one key/value head shared by three query heads
    gradcheck(lambda a, b: F.scaled_dot_product_attention(a, b, b), [q, kv], what="broadcast heads")
    # causal: changing the last position's key and value leaves earlier outputs unchanged
    k2, v2 = kv.numpy().copy(), kv.numpy().copy()
    k2[..., -1, :] += 5
    v2[..., -1, :] -= 5
    a = F.scaled_dot_product_attention(q, kv, kv).numpy()
    b = F.scaled_dot_product_attention(q, T(k2), T(v2)).numpy()
    assert_close(a[..., :-1, :], b[..., :-1, :], atol=0, what="outputs before the changed position")
    with pytest.raises(ValueError, match="causal"):
        F.scaled_dot_product_attention(q, T(np.zeros((2, 3, 5, 2))), T(np.zeros((2, 3, 5, 2))))
