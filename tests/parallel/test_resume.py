"""Checkpoints are layout-free: stop under one layout, resume under another, stay on the curve.

A run is stopped after its step-3 checkpoint (a crash at step 4, on every rank), then resumed to
step 6 under a different layout (another number of ranks too: elastic training). Its losses, LR,
final parameters and AdamW state must equal an uninterrupted serial run's. And a rank that dies
while writing a checkpoint leaves the previous one loadable.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import parallel_cases
import pytest

from grader.run import mpi_environment
from tinytrain import checkpoint
from tinytrain import distributed as dist
from tinytrain.cli import main
from tinytrain.data import AdditionDataset
from tinytrain.distributed import DistributedError

TINY = (
    "--layers 4 --width 32 --heads 4 --batch-size 8 --steps 6 --ckpt-every 3 --eval-every 5 --eval-batches 1 "
    "--warmup 1 --dropout 0.1 --quiet --no-plot"
).split()


def train(out, layout: str, *extra) -> None:
    assert main(["train", *TINY, *layout.split(), "--out", str(out), *extra]) == 0


def crash_at_step_4(monkeypatch):
    real_batch = AdditionDataset.batch

    def batch(self, split, batch_size, seed, step):
        if split == "train" and step == 4:
            raise KeyboardInterrupt("simulated crash at step 4")
        return real_batch(self, split, batch_size, seed, step)

    monkeypatch.setattr(AdditionDataset, "batch", batch)
    return lambda: monkeypatch.setattr(AdditionDataset, "batch", real_batch)


def assert_same_run(resumed, straight) -> list:
    """Losses and LR per step, then every parameter and AdamW moment of the final checkpoint; returns
    the step count of every parameter."""
    got, want = (json.loads((d / "metrics.json").read_text()) for d in (resumed, straight))
    assert [s["step"] for s in got["steps"]] == list(range(1, 7))
    np.testing.assert_allclose([s["loss"] for s in got["steps"]], [s["loss"] for s in want["steps"]], rtol=2e-5)
    assert [s["lr"] for s in got["steps"]] == [s["lr"] for s in want["steps"]]
    a, b = checkpoint.Reader(resumed / "ckpt"), checkpoint.Reader(straight / "ckpt")
    assert a.names() == b.names() and a.meta["step"] == b.meta["step"] == 6
    for name in b.names():
        assert a.fields(name) == b.fields(name) == ["exp_avg", "exp_avg_sq", "param"], name
        for field in b.fields(name):
            # Adam divides by sqrt(v): float32 reordering across layouts is amplified a little, and
            # most for a gradient that is zero in exact arithmetic (the key bias: softmax ignores it),
            # where Adam steps on rounding alone (1.03e-6 seen on the strict stand-in's seeds)
            np.testing.assert_allclose(
                a.read(name, field), b.read(name, field), rtol=1e-3, atol=1e-5, err_msg=f"{name} {field}"
            )
        # AdamW counts a parameter's own steps: an expert no token reached has no gradient and is
        # skipped, on every layout alike (--bias-rate 0.05 starves some); every other parameter steps 6
        assert a.scalars[name] == b.scalars[name], name
        assert b.scalars[name] == {"step": 6} or ".experts." in name, (name, b.scalars[name])
    return [b.scalars[name]["step"] for name in b.names()]


def straight_serial(tmp_path, model: str = ""):
    out = tmp_path / "straight"
    train(out, model)
    return out


MOE = "--experts 4 --dropout 0 --capacity-factor 1.0"  # experts split over EP ranks, tokens dropped


@pytest.mark.world_size(4)
@pytest.mark.parametrize(
    "first, then, model",
    [
        ("--dp 2 --tp 2", "--pp 4", ""),
        ("--dp 2 --tp 2 --sp", "", ""),
        ("--pp 2 --dp 2 --zero 1", "--tp 4 --sp", ""),
        ("--dp 4 --zero 3", "--pp 2 --tp 2", ""),
        ("", "--dp 4 --zero 2", ""),
        ("", "--dp 4 --zero 3", ""),
        ("--dp 2 --pp 2", "--dp 4 --zero 3", ""),
        ("--pp 4 --schedule zb-h1", "--pp 2 --dp 2 --zero 1", ""),
        ("--dp 2 --cp 2", "--cp 4 --cp-algo alltoall", ""),
        ("--cp 2 --tp 2", "", ""),
        ("--dp 2 --ep 2", "", MOE),
        ("", "--ep 4", MOE),
        ("--dp 2 --ep 2", "", MOE + " --balance bias --bias-rate 0.05"),  # the bias resumes; it starves experts
        ("--dp 2 --tp 2 --zero 3", "--pp 2 --dp 2 --zero 3", ""),
        ("--dp 2 --cp 2 --zero 3", "--dp 2 --tp 2 --sp --zero 3", ""),
        ("--pp 2 --dp 2 --zero 3", "", ""),
        ("--pp 2 --dp 2 --zero 1 --schedule zb-v", "--pp 4 --schedule zb-h1", ""),  # a V's stage 0 holds both ends
    ],
    ids=[
        "dp2tp2-to-pp4",
        "dp2tp2sp-to-serial",
        "pp2dp2zero1-to-tp4sp",
        "zero3-to-pp2tp2",
        "serial-to-zero2",
        "serial-to-zero3",
        "dp2pp2-to-zero3",
        "pp4zbh1-to-pp2dp2zero1",
        "dp2cp2-to-cp4alltoall",
        "cp2tp2-to-serial",
        "dp2ep2-to-serial",
        "serial-to-ep4",
        "dp2ep2-bias-to-serial",
        "dp2tp2zero3-to-pp2dp2zero3",
        "dp2cp2zero3-to-dp2tp2spzero3",
        "pp2dp2zero3-to-serial",
        "pp2dp2zero1zbv-to-pp4zbh1",
    ],
)
def test_resume_under_another_layout_stays_on_the_serial_curve(tmp_path, monkeypatch, first, then, model):
    out = parallel_cases.shared_dir(tmp_path) / "elastic"
    if not first:  # a serial first run: rank 0 alone writes the checkpoint
        if dist.get_rank() == 0:
            restore = crash_at_step_4(monkeypatch)
            with pytest.raises(KeyboardInterrupt):
                train(out, f"{first} {model}")
            restore()
        dist.barrier()
    else:
        restore = crash_at_step_4(monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            train(out, f"{first} {model}")
        restore()
    assert checkpoint.Reader(out / "ckpt").meta["step"] == 3
    if then or dist.get_rank() == 0:
        train(out, f"{then} {model}", "--resume")
    if dist.get_rank() == 0:
        steps = assert_same_run(out, straight_serial(tmp_path, model))
        if "--bias-rate 0.05" in model:  # the hard case that row is for: experts some steps left out
            assert min(steps) < 6, steps


@pytest.mark.world_size(2)
def test_resume_on_fewer_ranks_with_zero3(tmp_path, monkeypatch):
    """Elastic: written by 2 data-parallel ranks with ZeRO-3 pieces, resumed on 1 rank, and back."""
    out = parallel_cases.shared_dir(tmp_path) / "elastic"
    restore = crash_at_step_4(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        train(out, "--dp 2 --zero 3")
    restore()
    if dist.get_rank() == 0:
        assert sorted(p.name for p in (out / "ckpt" / "step-000000003").glob("*.npz")) == [
            "rank-00000.npz",
            "rank-00001.npz",
        ]  # each rank wrote its own pieces
        train(out, "", "--resume")
        assert_same_run(out, straight_serial(tmp_path))


@pytest.mark.world_size(2)
def test_a_rank_dying_mid_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """Rank 1 writes half its pieces at step 6 and dies; the manifest still names step 3, from
    which the job restarts (serially here) and ends as the uninterrupted run."""
    out = parallel_cases.shared_dir(tmp_path) / "run"
    rank = dist.get_rank()  # after the failure the group is unusable, as in a real job
    real_write = checkpoint.write_pieces

    def dies_mid_write(folder, step, rank, pieces, scalars):
        if step == 6 and rank == 1:
            real_write(folder, step, rank, pieces[: len(pieces) // 2], scalars)  # a partial write...
            dist.report_failure("rank 1 killed while saving")  # ...then the process is gone
            raise SystemError("rank 1 killed while saving")
        return real_write(folder, step, rank, pieces, scalars)

    straight = straight_serial(tmp_path) if rank == 0 else None  # while the world still works
    monkeypatch.setattr(checkpoint, "write_pieces", dies_mid_write)
    with pytest.raises((SystemError, DistributedError)):  # rank 0 learns of it in the barrier
        train(out, "--dp 2 --zero 1")
    monkeypatch.setattr(checkpoint, "write_pieces", real_write)
    if rank == 0:  # the job is over (its world is broken); it restarts as a new, serial process
        assert checkpoint.Reader(out / "ckpt").meta["step"] == 3  # step 6 was never committed
        argv = [sys.executable, "-m", "tinytrain.cli", "train", *TINY, "--out", str(out), "--resume"]
        env = dict(mpi_environment(), TINYTRAIN_DEVICE="cpu")  # not this job's rank: a job of its own
        restart = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
        assert restart.returncode == 0, restart.stderr
        assert_same_run(out, straight)
