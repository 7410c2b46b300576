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


def test_after_a_signal_a_run_that_cannot_resume_names_the_continuation_that_works(tmp_path):
    """--resume is refused for --dp-algo local-sgd (each replica's state is its own): the hint after
    SIGTERM must not say to run the same command with --resume, but what does continue."""
    if shutil.which("mpirun") is None:
        pytest.skip("needs mpirun")
    rc, err = interrupt_at_step(
        command(2) + ["--dp-algo", "local-sgd", "--local-steps", "4", "--out", "cut"], tmp_path, signal.SIGTERM, 9
    )
    assert rc == 143, err
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
    assert len(losses(tmp_path / "cut")) == 60 > stopped


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
            if launcher_pid in ancestors and f"PMI_RANK={rank}".encode() in environ:
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
    proc = subprocess.Popen(["mpirun", "-n", str(ranks), *train], cwd=tmp_path, env=environment(),
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
    assert 5 <= stopped < 60, err
    assert err.count(f"SIGTERM received: stopped after step {stopped}") == 1, err
    assert "--resume" in err and "Traceback" not in err and "error" not in err, err
