"""Preemption: SIGINT/SIGTERM in the middle of `tinytrain train` finishes the step, saves, exits
128 + signal; `--resume` then continues on the uninterrupted run's curve (serial and data parallel)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys

import numpy
import pytest

from grader.run import mpi_environment

TINY = (
    "--layers 1 --width 32 --heads 2 --batch-size 8 --steps 60 --eval-every 1000 --eval-batches 1 --warmup 1 "
    "--no-plot --ckpt-every 1000"
).split()


def command(ranks: int) -> list[str]:
    train = [sys.executable, "-m", "tinytrain.cli", "train", *TINY]
    return ["mpirun", "-n", str(ranks), *train, "--dp", str(ranks)] if ranks > 1 else train


def environment() -> dict:
    return dict(mpi_environment(), TINYTRAIN_DEVICE="cpu", TINYTRAIN_TIMEOUT="20")


def interrupt_at_step(argv, cwd, signum, step: int) -> tuple[int, str]:
    """Start ``argv``, send ``signum`` once the progress line reaches ``step``; (exit code, stderr)."""
    proc = subprocess.Popen(argv, cwd=cwd, env=environment(), stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("step") and int(line.split()[1].split("/")[0]) >= step:
            proc.send_signal(signum)
            break
    lines.extend(proc.stderr)
    return proc.wait(timeout=60), "".join(lines)


def losses(out) -> list[float]:
    return [s["loss"] for s in json.loads((out / "metrics.json").read_text())["steps"]]


@pytest.mark.parametrize(
    "ranks,signum", [(1, signal.SIGINT), (2, signal.SIGTERM)], ids=["serial-SIGINT", "dp2-SIGTERM"]
)
def test_a_signal_saves_and_resume_continues_the_curve(tmp_path, ranks, signum):
    if ranks > 1 and shutil.which("mpirun") is None:
        pytest.skip("needs mpirun")
    straight = subprocess.run(
        command(ranks) + ["--out", "straight", "--quiet"], cwd=tmp_path, env=environment(), timeout=120
    )
    assert straight.returncode == 0
    rc, err = interrupt_at_step(command(ranks) + ["--out", "cut"], tmp_path, signum, 9)
    assert rc == 128 + signum, err
    name = signal.Signals(signum).name
    assert err.count(f"tinytrain: {name}: finishing this step") == 1, err  # said once, not per rank
    manifest = json.loads((tmp_path / "cut" / "ckpt" / "manifest.json").read_text())
    stopped = manifest["step"]
    assert 9 <= stopped < 60
    assert f"stopped after step {stopped}" in err and "--resume" in err
    assert len(losses(tmp_path / "cut")) == stopped  # metrics.json kept what was done
    resumed = subprocess.run(
        command(ranks) + ["--out", "cut", "--resume", "--quiet"], cwd=tmp_path, env=environment(), timeout=120
    )
    assert resumed.returncode == 0
    numpy.testing.assert_allclose(losses(tmp_path / "cut"), losses(tmp_path / "straight"), rtol=1e-6)
