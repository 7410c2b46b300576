"""Checkpoints: layout-free pieces, a manifest committed last, reading back under any cut."""

from __future__ import annotations

import json
import os

import numpy
import pytest

from tinytrain import checkpoint
from tinytrain.backend import to_host, xp
from tinytrain.checkpoint import Piece, Placement
from tinytrain.nn import GPT, GPTConfig
from tinytrain.optim import AdamW


def trained(seed):
    rng = numpy.random.default_rng(seed)
    model = GPT(GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=2, n_embd=8), seed=seed)
    opt = AdamW(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = xp.asarray(rng.standard_normal(p.shape).astype(numpy.float32))
    opt.step()
    return model, opt


def save(folder, model, opt, step):
    named = [(Placement(name), p) for name, p in model.named_parameters()]
    pieces, scalars = checkpoint.collect(named, opt)
    checkpoint.write_pieces(folder, step, 0, pieces, scalars)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    checkpoint.commit(folder, step, 1, shapes, {"step": step, "note": "hello"})
    return named


def test_round_trip_of_parameters_and_optimizer_state(tmp_path):
    model, opt = trained(int(numpy.random.default_rng().integers(1 << 30)))
    save(tmp_path, model, opt, 7)
    fresh, fresh_opt = trained(0)
    reader = checkpoint.Reader(tmp_path)
    assert reader.meta["step"] == 7 and reader.meta["note"] == "hello"
    checkpoint.restore(reader, [(Placement(n), p) for n, p in fresh.named_parameters()], fresh_opt)
    for (name, a), b in zip(fresh.named_parameters(), model.parameters()):
        numpy.testing.assert_array_equal(to_host(a.data), to_host(b.data), err_msg=name)
        for field in ("exp_avg", "exp_avg_sq"):
            numpy.testing.assert_array_equal(to_host(fresh_opt.state[a][field]), to_host(opt.state[b][field]))
        assert fresh_opt.state[a]["step"] == opt.state[b]["step"] == 1


def test_pieces_cut_along_an_axis_and_flattened_are_assembled(tmp_path):
    """Three 'ranks' hold a (6, 4) tensor as TP halves along axis 1, the second half further cut
    into two flat ZeRO pieces; any reader gets the whole tensor back, and a missing piece is named."""
    full = numpy.random.default_rng().standard_normal((6, 4)).astype(numpy.float32)
    left, right = full[:, :2], full[:, 2:].reshape(-1)
    by_rank = [
        [(Piece("w", "param", 1, 0, 2), left)],
        [(Piece("w", "param", 1, 2, 4, 0, 5), right[:5])],
        [(Piece("w", "param", 1, 2, 4, 5, 12), right[5:])],
    ]
    for rank, pieces in enumerate(by_rank):
        checkpoint.write_pieces(tmp_path, 1, rank, pieces, {})
    checkpoint.commit(tmp_path, 1, 3, {"w": (6, 4)}, {"step": 1})
    numpy.testing.assert_array_equal(checkpoint.Reader(tmp_path).read("w"), full)
    assert Placement("w", 1, 2, 4).cut(full).shape == (6, 2)

    checkpoint.write_pieces(tmp_path, 2, 0, by_rank[0], {})
    checkpoint.write_pieces(tmp_path, 2, 1, by_rank[1], {})
    checkpoint.write_pieces(tmp_path, 2, 2, [], {})  # this rank lost its piece
    checkpoint.commit(tmp_path, 2, 3, {"w": (6, 4)}, {"step": 2})
    with pytest.raises(ValueError, match="pieces of 'w' .* do not cover it"):
        checkpoint.Reader(tmp_path).read("w")


def test_missing_checkpoint_and_missing_rank_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        checkpoint.Reader(tmp_path / "nope")
    checkpoint.write_pieces(tmp_path, 1, 0, [], {})
    with pytest.raises(RuntimeError, match=r"ranks \[1\] wrote no pieces"):
        checkpoint.commit(tmp_path, 1, 2, {}, {"step": 1})


def test_a_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    old_model, old_opt = trained(1)
    new_model, new_opt = trained(2)
    save(tmp_path, old_model, old_opt, 1)
    manifest = (tmp_path / checkpoint.MANIFEST).read_bytes()

    def crashing_savez(f, **arrays):
        f.write(b"PK\x03\x04 half a zip file")  # some bytes reach the file, then the process dies
        raise KeyboardInterrupt("simulated crash")

    real_savez = numpy.savez
    monkeypatch.setattr(numpy, "savez", crashing_savez)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, new_model, new_opt, 2)
    monkeypatch.setattr(numpy, "savez", real_savez)

    assert (tmp_path / checkpoint.MANIFEST).read_bytes() == manifest  # still names step 1
    assert not list((tmp_path / "step-000000002").glob("*.tmp"))  # no temporary file left behind
    reader = checkpoint.Reader(tmp_path)
    assert reader.meta["step"] == 1
    for name, p in old_model.named_parameters():
        numpy.testing.assert_array_equal(reader.read(name), to_host(p.data))

    save(tmp_path, new_model, new_opt, 2)  # a later save replaces it, and removes the old folder
    assert checkpoint.Reader(tmp_path).meta["step"] == 2
    assert sorted(os.listdir(tmp_path)) == [checkpoint.MANIFEST, "step-000000002"]
    assert json.loads((tmp_path / checkpoint.MANIFEST).read_text())["folder"] == "step-000000002"


@pytest.mark.parametrize(
    "damage,where",
    [
        (lambda step: (step / "rank-00000.npz").unlink(), "step-000000003/rank-00000: FileNotFoundError"),
        (lambda step: (step / "rank-00000.json").write_text("{"), "step-000000003/rank-00000: JSONDecodeError"),
        (lambda step: (step.parent / "manifest.json").write_text('{"format": 1'), "manifest.json: JSONDecodeError"),
        (
            lambda step: (step / "rank-00000.npz").write_bytes(b"PK\x03\x04" + b"\0" * 40),
            "step-000000003/rank-00000: BadZipFile",
        ),
    ],
    ids=["missing-piece", "broken-index", "truncated-manifest", "corrupt-npz"],
)
def test_a_damaged_checkpoint_is_one_checkpoint_error(tmp_path, damage, where):
    model, opt = trained(0)
    save(tmp_path, model, opt, 3)
    damage(tmp_path / checkpoint.step_folder(3))
    with pytest.raises(checkpoint.CheckpointError, match=rf"checkpoint {tmp_path} is damaged or truncated \({where}"):
        reader = checkpoint.Reader(tmp_path)
        for name in reader.names():
            reader.read(name)


def test_a_failed_save_keeps_the_previous_checkpoint_and_says_why(tmp_path, monkeypatch):
    model, opt = trained(0)
    save(tmp_path, model, opt, 3)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.numpy, "savez", full)
    with pytest.raises(checkpoint.CheckpointError, match=r"step 5 .*No space left on device.*previous checkpoint"):
        save(tmp_path, model, opt, 5)
    monkeypatch.undo()
    assert checkpoint.Reader(tmp_path).meta["step"] == 3
    assert not list(tmp_path.rglob("*.tmp"))  # the failed write removed its temporary


# --- --ckpt-async: the pieces on a thread, the manifest once they are on disk ----------------------


def slowed_writes(monkeypatch):
    """``write_pieces`` that waits for the test's go-ahead (a slow disk), and how to give it."""
    import threading

    go = threading.Event()
    real = checkpoint.write_pieces

    def slow(*args, **kwargs):
        assert go.wait(30), "the test never let the write go on"
        real(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "write_pieces", slow)
    return go


def test_a_background_save_copies_the_state_at_once_and_commits_only_once_written(tmp_path, monkeypatch):
    from tinytrain.trainer.runners import SerialRunner

    model, opt = trained(3)
    runner = SerialRunner(model)
    runner.save(tmp_path, 1, opt, {"step": 1})  # synchronous: committed on return
    go = slowed_writes(monkeypatch)
    before = {name: to_host(p.data).copy() for name, p in model.named_parameters()}
    runner.save(tmp_path, 2, opt, {"step": 2}, background=True)  # returns while the write waits
    for p in model.parameters():  # training goes on and changes the parameters in place
        p.data[...] = p.data + 1
    assert runner.settle_save() is None, "the write is not on disk: no manifest for it yet"
    assert checkpoint.Reader(tmp_path).meta["step"] == 1, "the previous checkpoint stays the manifest's"
    go.set()
    assert runner.settle_save(wait=True) == 2
    reader = checkpoint.Reader(tmp_path)
    assert reader.meta["step"] == 2 and reader.meta["layout"] == "(serial)"
    for name, value in before.items():  # the snapshot of save time, not the parameters of later steps
        numpy.testing.assert_array_equal(reader.read(name), value, err_msg=name)
    assert sorted(os.listdir(tmp_path)) == [checkpoint.MANIFEST, "step-000000002"]


def test_a_save_waits_for_the_background_one_before_it(tmp_path, monkeypatch):
    from tinytrain.trainer.runners import SerialRunner

    model, opt = trained(4)
    runner = SerialRunner(model)
    go = slowed_writes(monkeypatch)
    runner.save(tmp_path, 5, opt, {"step": 5}, background=True)
    go.set()
    runner.save(tmp_path, 6, opt, {"step": 6})  # one write at a time: 5 is committed first, then 6
    assert checkpoint.Reader(tmp_path).meta["step"] == 6 and runner.pending is None


def test_a_failed_background_write_is_the_checkpoint_error_at_the_next_step(tmp_path, monkeypatch):
    from tinytrain.trainer.runners import SerialRunner

    model, opt = trained(5)
    runner = SerialRunner(model)
    runner.save(tmp_path, 3, opt, {"step": 3})

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.numpy, "savez", full)
    runner.save(tmp_path, 4, opt, {"step": 4}, background=True)
    with pytest.raises(checkpoint.CheckpointError, match=r"step 4 .*No space left on device.*previous checkpoint"):
        runner.settle_save(wait=True)
    monkeypatch.undo()
    assert checkpoint.Reader(tmp_path).meta["step"] == 3 and runner.pending is None


def test_pieces_are_packed_one_array_per_dtype_and_unpacked_checkpoints_still_read(tmp_path):
    model, opt = trained(6)
    named = save(tmp_path, model, opt, 2)
    members = numpy.load(tmp_path / "step-000000002" / "rank-00000.npz").files
    assert members == ["float32"], members  # 3 fields x every parameter, in one member
    # a checkpoint written before the packing: a member per piece, no offsets in the index
    old = tmp_path / "old"
    pieces, scalars = checkpoint.collect(named, opt)
    (old / "step-000000002").mkdir(parents=True)
    numpy.savez(old / "step-000000002" / "rank-00000.npz", **{f"a{i}": a for i, (_, a) in enumerate(pieces)})
    index = {"pieces": [dict(vars(p), array=f"a{i}") for i, (p, _) in enumerate(pieces)], "scalars": scalars}
    (old / "step-000000002" / "rank-00000.json").write_text(json.dumps(index))
    shapes = {name: p.shape for name, p in model.named_parameters()}
    checkpoint.commit(old, 2, 1, shapes, {"step": 2})
    new, before = checkpoint.Reader(tmp_path), checkpoint.Reader(old)
    for name in new.names():
        for field in new.fields(name):
            numpy.testing.assert_array_equal(new.read(name, field), before.read(name, field), err_msg=name)
