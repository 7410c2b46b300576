"""Nothing is overwritten without being asked: a run into an --out that holds a checkpoint needs
--resume or --overwrite; a second run into an --out that a live run holds is refused (a lock that a
killed run does not leave behind); metrics.json is written even when the last checkpoint cannot be."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from grader.run import mpi_environment
from tinytrain import checkpoint
from tinytrain.cli import main

TINY = (
    "--layers 1 --width 32 --heads 2 --batch-size 8 --eval-every 1000 --eval-batches 1 --warmup 1 --no-plot --quiet"
).split()


def train(out, *extra) -> int:
    return main(["train", *TINY, "--out", str(out), *extra])


def losses(out) -> list[float]:
    return [s["loss"] for s in json.loads((out / "metrics.json").read_text())["steps"]]


def test_a_run_without_resume_into_a_checkpoint_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--steps", "3") == 0
    before = (out / "ckpt" / "manifest.json").read_bytes()
    with pytest.raises(SystemExit) as exc:
        train(out, "--steps", "2")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--out {out} holds a checkpoint of step 3; add --resume to continue it, --overwrite" in err, err
    assert (out / "ckpt" / "manifest.json").read_bytes() == before  # untouched
    assert len(losses(out)) == 3
    assert train(out, "--steps", "2", "--overwrite") == 0  # asked for: a fresh run
    assert checkpoint.Reader(out / "ckpt").meta["step"] == 2 and len(losses(out)) == 2
    with pytest.raises(SystemExit) as exc:
        train(out, "--steps", "2", "--overwrite", "--resume")
    assert exc.value.code == 2 and "give one of them" in capsys.readouterr().err


def test_metrics_are_kept_when_the_last_checkpoint_cannot_be_written(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    real = checkpoint.tempfile.mkstemp

    def disk_full_for_checkpoints(*args, dir=None, **kwargs):
        if "ckpt" in str(dir):
            raise OSError(28, "No space left on device")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(checkpoint.tempfile, "mkstemp", disk_full_for_checkpoints)
    with pytest.raises(SystemExit) as exc:
        train(out, "--steps", "3")
    assert exc.value.code == 2 and "No space left on device" in capsys.readouterr().err
    assert len(losses(out)) == 3  # the run's steps are not lost with its checkpoint


def _start(tmp_path, *extra, quiet: bool = True) -> subprocess.Popen:
    env = dict(mpi_environment(), TINYTRAIN_DEVICE="cpu")
    env.pop("TINYTRAIN_DEBUG", None)
    flags = TINY if quiet else [f for f in TINY if f != "--quiet"]
    argv = [sys.executable, "-m", "tinytrain.cli", "train", *flags, "--out", "run", *extra]
    return subprocess.Popen(argv, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)


def test_a_second_run_into_a_live_runs_out_is_refused_and_a_killed_run_leaves_no_lock(tmp_path):
    first = _start(tmp_path, "--steps", "100000", "--ckpt-every", "1", quiet=False)
    for line in first.stderr:  # wait until it trains (and so holds --out)
        if "GPT with" in line:
            break
    else:
        raise AssertionError(f"the first run ended before it trained (exit {first.wait()})")
    try:
        second = _start(tmp_path, "--steps", "2", "--resume")
        err = second.communicate(timeout=60)[1]
        assert second.returncode == 2, err
        assert "--out run is in use by a run that is still going (pid" in err, err
        assert f"pid {first.pid} " in err, err  # it names the holder
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    # the kernel dropped the lock with the process: the folder is free again
    third = _start(tmp_path, "--steps", "2", "--overwrite")
    err = third.communicate(timeout=60)[1]
    assert third.returncode == 0, err
