"""Checkpoints: a round trip of model, optimizer state and metadata; atomic writes."""

from __future__ import annotations

import os

import numpy
import pytest

from tinytrain import checkpoint
from tinytrain.backend import xp
from tinytrain.nn import GPT, GPTConfig
from tinytrain.optim import AdamW


def trained_state(seed):
    rng = numpy.random.default_rng(seed)
    model = GPT(GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=2, n_embd=8), seed=seed)
    opt = AdamW(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = xp.asarray(rng.standard_normal(p.shape).astype(numpy.float32))
    opt.step()
    return model, opt


def test_round_trip(tmp_path):
    model, opt = trained_state(int(numpy.random.default_rng().integers(1 << 30)))
    meta = {"step": 7, "note": "hello", "losses": [1.5, 1.25]}
    path = tmp_path / "sub" / "ckpt.npz"
    checkpoint.save(path, model.state_dict(), opt.state_dict(), meta)
    model_state, optim_state, meta2 = checkpoint.load(path)
    assert meta2 == meta
    assert list(model_state) == list(model.state_dict())
    for k, v in model.state_dict().items():
        numpy.testing.assert_array_equal(model_state[k], v)
        assert model_state[k].dtype == v.dtype
    ref = opt.state_dict()
    assert optim_state["lr"] == ref["lr"]
    assert set(optim_state["state"]) == set(ref["state"])
    for i, s in ref["state"].items():
        assert set(optim_state["state"][i]) == set(s)
        assert optim_state["state"][i]["step"] == s["step"] == 1
        numpy.testing.assert_array_equal(optim_state["state"][i]["exp_avg"], s["exp_avg"])
        numpy.testing.assert_array_equal(optim_state["state"][i]["exp_avg_sq"], s["exp_avg_sq"])
    # and the loaded state goes back into a model and an optimizer
    fresh, fresh_opt = trained_state(0)
    fresh.load_state_dict(model_state)
    fresh_opt.load_state_dict(optim_state)
    for (_, a), (_, b) in zip(fresh.named_parameters(), model.named_parameters()):
        numpy.testing.assert_array_equal(numpy.asarray(a.data), numpy.asarray(b.data))


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        checkpoint.load(tmp_path / "nope.npz")


def test_crash_mid_write_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    old_model, old_opt = trained_state(1)
    new_model, new_opt = trained_state(2)
    path = tmp_path / "ckpt.npz"
    checkpoint.save(path, old_model.state_dict(), old_opt.state_dict(), {"step": 1})
    before = path.read_bytes()

    real_savez = numpy.savez

    def crashing_savez(f, **arrays):
        f.write(b"PK\x03\x04 half a zip file")  # some bytes reach the file, then the process dies
        raise KeyboardInterrupt("simulated crash")

    monkeypatch.setattr(numpy, "savez", crashing_savez)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(path, new_model.state_dict(), new_opt.state_dict(), {"step": 2})
    monkeypatch.setattr(numpy, "savez", real_savez)

    assert path.read_bytes() == before  # the old checkpoint, untouched
    assert os.listdir(tmp_path) == ["ckpt.npz"]  # no temporary file left behind
    model_state, _, meta = checkpoint.load(path)
    assert meta == {"step": 1}
    for k, v in old_model.state_dict().items():
        numpy.testing.assert_array_equal(model_state[k], v)

    # a later successful save replaces it
    checkpoint.save(path, new_model.state_dict(), new_opt.state_dict(), {"step": 2})
    assert checkpoint.load(path)[2] == {"step": 2}
    assert os.listdir(tmp_path) == ["ckpt.npz"]
