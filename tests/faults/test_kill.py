"""Nothing lost: ``kill -9`` at any moment (even in the middle of writing a checkpoint file) leaves a
checkpoint that loads, and ``--resume`` continues on the uninterrupted run's curve."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy
import pytest

from grader.run import mpi_environment
from tinytrain import checkpoint, launcher
from tinytrain.cli import main

# 64 steps: the serial run lasts about 0.3 s to its first checkpoint and 9 ms a step after it (2
# cores, measured), so the kill at a random moment of the next 0.2 s always meets it running (with
# 24 steps, 0.22 s were left: a CI run once found it finished)
STEPS = 64
TINY = (
    f"--layers 1 --width 32 --heads 2 --batch-size 8 --steps {STEPS} --eval-every 1000 --eval-batches 1 "
    "--warmup 1 --no-plot --quiet --ckpt-every 1"
).split()

# Write a few bytes of step 3's piece, then die: the kill lands inside the write itself.
DIES_WHILE_WRITING = textwrap.dedent(
    """
    import os, signal, sys
    from tinytrain import checkpoint
    from tinytrain.cli import main

    real = checkpoint.atomic_write

    def atomic_write(path, write):
        if "step-000000003" in str(path) and str(path).endswith(".npz"):
            def half(f):
                f.write(b"x" * 10000)
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return real(path, half)
        return real(path, write)

    checkpoint.atomic_write = atomic_write
    sys.exit(main())
    """
)


def environment() -> dict:
    return dict(mpi_environment(), TINYTRAIN_DEVICE="cpu")


def command(ranks: int, python=("-m", "tinytrain.cli")) -> list[str]:
    train = [sys.executable, *python, "train", *TINY, "--out", "run"]
    return [*launcher.mpirun_command(ranks), *train, "--dp", str(ranks)] if ranks > 1 else train


def losses(out) -> list[float]:
    return [s["loss"] for s in json.loads((out / "metrics.json").read_text())["steps"]]


def resume_onto_the_curve(tmp_path, ranks: int, straight) -> None:
    """The checkpoint left behind loads; --resume ends where the uninterrupted run ended."""
    step = checkpoint.Reader(tmp_path / "run" / "ckpt").meta["step"]
    assert 1 <= step <= STEPS
    r = subprocess.run(command(ranks) + ["--resume"], cwd=tmp_path, env=environment(), timeout=120)
    assert r.returncode == 0
    # serial: the same numbers; data parallel: the serial run's to float32 reordering
    numpy.testing.assert_allclose(losses(tmp_path / "run"), losses(straight), rtol=0 if ranks == 1 else 2e-5)
    assert not list((tmp_path / "run").rglob("*.tmp"))  # what the killed write left is gone


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    assert main(["train", *TINY, "--out", str(out)]) == 0
    return out


def test_kill_during_the_write_itself(tmp_path, straight):
    r = subprocess.run(command(1, ("-c", DIES_WHILE_WRITING)), cwd=tmp_path, env=environment(), timeout=120)
    assert r.returncode == -signal.SIGKILL
    assert list((tmp_path / "run" / "ckpt").glob("step-000000003/rank-00000.npz*.tmp"))  # died mid-write
    assert checkpoint.Reader(tmp_path / "run" / "ckpt").meta["step"] == 2
    resume_onto_the_curve(tmp_path, 1, straight)


@pytest.mark.parametrize("ranks", [1, 2], ids=["serial", "dp2"])
def test_kill_at_a_random_moment(tmp_path, straight, ranks):
    if ranks > 1 and shutil.which("mpirun") is None:
        pytest.skip("needs mpirun")
    proc = subprocess.Popen(command(ranks), cwd=tmp_path, env=environment(), start_new_session=True)
    manifest = tmp_path / "run" / "ckpt" / "manifest.json"
    deadline = time.monotonic() + 60
    while not manifest.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    time.sleep(random.uniform(0, 0.2))  # then at some moment of the saves that follow every step
    assert proc.poll() is None, "the run ended before the kill: give it more --steps"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    kill_every_process_in(tmp_path)
    resume_onto_the_curve(tmp_path, ranks, straight)


def kill_every_process_in(folder, timeout: float = 30.0) -> None:
    """SIGKILL whatever still runs in ``folder`` and wait until nothing does. mpirun's launcher puts
    each rank in a session of its own, out of mpirun's process group: killing the group ends mpirun
    at once, and the ranks a moment later, when the launcher's death reaches them. A rank still
    running meanwhile would save another checkpoint while the test reads this one."""
    folder = os.path.realpath(folder)
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.path.realpath(f"/proc/{pid}/cwd") == folder and int(pid) != os.getpid():
                    alive.append(int(pid))
            except OSError:  # it ended meanwhile, or is not ours to look at
                continue
        if not alive:
            return
        assert time.monotonic() < deadline, f"processes {alive} in {folder} outlived SIGKILL for {timeout} s"
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)
