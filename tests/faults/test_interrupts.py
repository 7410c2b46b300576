"""Preemption: SIGINT/SIGTERM in the middle of `tinytrain train` finishes the step, saves, exits
128 + signal; `--resume` then continues on the uninterrupted run's curve (serial and data parallel)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy
import pytest

from grader.run import mpi_environment
from tinytrain import launcher

TINY = (
    "--layers 1 --width 32 --heads 2 --batch-size 8 --steps 300 --eval-every 1000 --eval-batches 1 --warmup 1 "
    "--no-plot --ckpt-every 1000"
).split()
# 300 steps: long enough (a second or more) that a rank whose launcher died of the signal sees it
# is gone (it looks every 0.1 s) before the run would end anyway.


def command(ranks: int) -> list[str]:
    train = [sys.executable, "-m", "tinytrain.cli", "train", *TINY]
    return [*launcher.mpirun_command(ranks), *train, "--dp", str(ranks)] if ranks > 1 else train


def open_mpi() -> bool:
    return launcher.kind(launcher.find_mpirun()) == "openmpi"


def preemption() -> int:
    """The signal a scheduler sends mpirun to preempt a job: SIGTERM, or SIGUSR1 for Open MPI's (it
    ends the job on SIGTERM: the README says to send it SIGUSR1)."""
    return signal.SIGUSR1 if open_mpi() else signal.SIGTERM


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


def stopped_by(rc: int, signum: int) -> bool:
    """Exit 128 + N, or died of signal N (Intel MPI's mpirun, a shell script, does): a shell shows
    both as 128 + N."""
    return rc in (128 + signum, -signum)


def losses(out) -> list[float]:
    return [s["loss"] for s in json.loads((out / "metrics.json").read_text())["steps"]]


@pytest.mark.parametrize(
    "ranks,signum",
    [(1, signal.SIGINT), (2, signal.SIGTERM), (2, signal.SIGUSR1)],
    ids=["serial-SIGINT", "dp2-SIGTERM", "dp2-SIGUSR1"],
)
def test_a_signal_saves_and_resume_continues_the_curve(tmp_path, ranks, signum):
    """The signal goes to the launcher (mpirun), as a scheduler or Ctrl-C sends it."""
    if ranks > 1 and shutil.which("mpirun") is None:
        pytest.skip("needs mpirun")
    if signum == signal.SIGTERM and ranks > 1 and open_mpi():
        pytest.skip("Open MPI's mpirun ends the job on SIGTERM (README: send it SIGUSR1): the SIGUSR1 case")
    straight = subprocess.run(
        command(ranks) + ["--out", "straight", "--quiet"], cwd=tmp_path, env=environment(), timeout=120
    )
    assert straight.returncode == 0
    rc, err = interrupt_at_step(command(ranks) + ["--out", "cut"], tmp_path, signum, 9)
    assert stopped_by(rc, signum), err
    name = signal.Signals(signum).name
    # Said once, not per rank. (Intel MPI's script mpirun dies of the signal and passes nothing on:
    # the ranks stop because their launcher is gone, and say so.)
    assert err.count(f"tinytrain: {name}: finishing this step") + err.count("has exited): finishing") == 1, err
    manifest = json.loads((tmp_path / "cut" / "ckpt" / "manifest.json").read_text())
    stopped = manifest["step"]
    assert 9 <= stopped < 300
    assert f"stopped after step {stopped}" in err and "--resume" in err
    assert len(losses(tmp_path / "cut")) == stopped  # metrics.json kept what was done
    resumed = subprocess.run(
        command(ranks) + ["--out", "cut", "--resume", "--quiet"], cwd=tmp_path, env=environment(), timeout=120
    )
    assert resumed.returncode == 0
    numpy.testing.assert_allclose(losses(tmp_path / "cut"), losses(tmp_path / "straight"), rtol=1e-6)


def test_after_a_signal_a_run_that_cannot_resume_names_the_continuation_that_works(tmp_path):
    """--resume is refused for --dp-algo local-sgd (each replica's state is its own): the hint after
    SIGTERM must not say to run the same command with --resume, but what does continue."""
    if shutil.which("mpirun") is None:
        pytest.skip("needs mpirun")
    signum = preemption()
    rc, err = interrupt_at_step(
        command(2) + ["--dp-algo", "local-sgd", "--local-steps", "4", "--out", "cut"], tmp_path, signum, 9
    )
    assert stopped_by(rc, signum), err
    assert "--dp-algo local-sgd cannot resume" in err and "--resume and --dp-algo allreduce in place of" in err, err
    assert "Run the same command with --resume (and" not in err
    stopped = json.loads((tmp_path / "cut" / "ckpt" / "manifest.json").read_text())["step"]
    resumed = subprocess.run(
        command(2) + ["--dp-algo", "allreduce", "--out", "cut", "--resume", "--quiet"],
        cwd=tmp_path,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert len(losses(tmp_path / "cut")) == 300 > stopped


RANK_NAMES = [rank for rank, _ in launcher.RANK_AND_SIZE]  # each launcher's own


def rank_pid(launcher_pid: int, rank: int, wait: float = 20.0) -> int:
    """The process id of MPI rank ``rank`` among the descendants of ``launcher_pid`` (mpirun)."""
    end = time.monotonic() + wait
    while time.monotonic() < end:
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                environ = (proc / "environ").read_bytes().split(b"\0")
                ancestors = _ancestors(int(proc.name))
            except OSError:
                continue
            if launcher_pid in ancestors and any(f"{name}={rank}".encode() in environ for name in RANK_NAMES):
                return int(proc.name)
        time.sleep(0.1)
    raise AssertionError(f"no process of rank {rank} under mpirun (pid {launcher_pid}) within {wait} s")


def _ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the parent's pid (the name may hold spaces)
        chain.append(pid)
    return chain


@pytest.mark.parametrize("layout,rank", [("--dp 2 --tp 2", 1), ("--dp 2", 0)], ids=["dp2tp2-rank1", "dp2-rank0"])
def test_a_signal_to_one_rank_checkpoints_the_whole_job_and_exits_143(tmp_path, layout, rank):
    """A scheduler preempting one process: every rank stops after the same step, the checkpoint is
    written, and the job exits 128 + SIGTERM with the resume hint, said once."""
    if shutil.which("mpirun") is None:
        pytest.skip("needs mpirun")
    ranks = 4 if "--tp" in layout else 2
    train = [sys.executable, "-m", "tinytrain.cli", "train", *TINY, *layout.split(), "--out", "cut"]
    proc = subprocess.Popen([*launcher.mpirun_command(ranks), *train], cwd=tmp_path, env=environment(),
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("step") and int(line.split()[1].split("/")[0]) >= 5:
            os.kill(rank_pid(proc.pid, rank), signal.SIGTERM)
            break
    lines.extend(proc.stderr)
    rc, err = proc.wait(timeout=60), "".join(lines)
    assert rc == 128 + signal.SIGTERM, err
    stopped = json.loads((tmp_path / "cut" / "ckpt" / "manifest.json").read_text())["step"]
    assert 5 <= stopped < 300, err
    assert err.count(f"SIGTERM received: stopped after step {stopped}") == 1, err
    assert "--resume" in err and "Traceback" not in err and "error" not in err, err


def test_no_rank_outlives_a_launcher_killed_without_passing_the_signal_on(tmp_path):
    """Intel MPI's mpirun is a shell script: SIGTERM ends the script and the launcher it started goes
    on, with every rank. Any MPI's mpirun behind such a script does the same, so the test makes one.
    Each rank watches its launcher: the run stops after a step every rank agrees on, writes its
    checkpoint, says how to resume, and no process of the run is left."""
    if shutil.which("mpirun") is None:
        pytest.skip("needs mpirun")
    script = tmp_path / "bin" / "mpirun"  # named mpirun, as Intel's is: the kernel calls it that
    script.parent.mkdir()
    script.write_text(f'#!/bin/sh\n"{launcher.find_mpirun()}" "$@"\n')  # a child, not exec: as Intel's
    script.chmod(0o755)
    argv = [str(script), *command(2)[1:], "--out", "cut"]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=environment(), stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("step") and int(line.split()[1].split("/")[0]) >= 5:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == -signal.SIGTERM  # the script died of it at once
            break
    lines.extend(proc.stderr)  # to the end: every process holding the pipe (the launcher) has exited
    err = "".join(lines)
    assert (tmp_path / "cut" / "ckpt" / "manifest.json").is_file(), err
    stopped = json.loads((tmp_path / "cut" / "ckpt" / "manifest.json").read_text())["step"]
    assert 5 <= stopped < 300, err
    assert f"(mpirun (pid {proc.pid}) has exited): finishing this step" in err, err
    assert err.count(f"stopped after step {stopped}") == 1 and "--resume" in err, err
    assert len(losses(tmp_path / "cut")) == stopped
    left = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _runs_in(p, tmp_path)]
    assert not left, f"processes of the run still alive: {left}"


def _runs_in(proc: Path, folder: Path) -> bool:
    try:
        return os.readlink(proc / "cwd") == str(folder)
    except OSError:
        return False
