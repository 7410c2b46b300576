"""One pool per rank does the threading, products included: NumPy's BLAS runs one thread per call
and tinytrain.autograd.threads cuts the products among its own threads (one pool, not two that take
each other's cores), and the ranks on one machine share its cores."""

import os
import subprocess
import sys

import pytest

from tinytrain import backend

pytestmark = pytest.mark.skipif(backend.blas_threads() is None, reason="this NumPy's BLAS is not an OpenBLAS")


def test_blas_threads_sets_the_pool_and_says_its_size():
    before = backend.blas_threads()
    try:
        assert backend.blas_threads(1) == 1
        assert backend.blas_threads() == 1
    finally:
        backend.blas_threads(before)


def _threads_in_a_rank(**env) -> tuple[int, int]:
    """(tinytrain's threads, the BLAS's threads) of a fresh process with ``env`` (the launcher's
    count of ranks on this machine, a user's OMP_NUM_THREADS or OPENBLAS_NUM_THREADS)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    code = (
        "from tinytrain.autograd import threads; from tinytrain import backend; "
        "print(threads.THREADS, backend.blas_threads())"
    )
    out = subprocess.run([sys.executable, "-c", code], env=clean | env, capture_output=True, text=True, check=True)
    pool, blas = out.stdout.split()
    return int(pool), int(blas)


def test_the_blas_runs_one_thread_whatever_the_environment_asked():
    cores = backend.usable_cores()
    assert _threads_in_a_rank(MPI_LOCALNRANKS="1") == (cores, 1)
    assert _threads_in_a_rank(MPI_LOCALNRANKS="1", OPENBLAS_NUM_THREADS=str(cores)) == (cores, 1)


def test_ranks_on_one_machine_share_its_cores():
    cores = backend.usable_cores()
    assert _threads_in_a_rank(MPI_LOCALNRANKS=str(2 * cores)) == (1, 1)  # more ranks than cores: one each
    assert _threads_in_a_rank(MPI_LOCALNRANKS=str(2 * cores), OMP_NUM_THREADS="3") == (3, 1)  # the user's setting


def _kernel_with(**env) -> str:
    """The kernels a fresh process's OpenBLAS runs, with ``env`` in place of OPENBLAS_CORETYPE/L2_SIZE."""
    from tinytrain.bench.step import FORCED_KERNEL_VARIABLES

    clean = {k: v for k, v in os.environ.items() if k not in FORCED_KERNEL_VARIABLES}
    code = "from tinytrain import backend; print(backend.blas_kernel())"
    return subprocess.run([sys.executable, "-c", code], env=clean | env, capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="Haswell kernels exist in x86-64 builds only")
def test_the_kernels_the_blas_runs_are_the_ones_the_environment_forced_or_the_cpus_own():
    """blas_kernel says which CPU kernels run; the bench's note appears when they are not the CPU's own."""
    from tinytrain.bench.step import cpu_own_blas_kernel, forced_kernel_line

    own = _kernel_with()
    assert own and own != "None"
    assert _kernel_with(OPENBLAS_CORETYPE="Haswell") == "Haswell"
    assert cpu_own_blas_kernel() == own  # asked without the variables, whatever this process has
    assert forced_kernel_line({"blas_kernel": own}, own) is None
    assert forced_kernel_line({"blas_kernel": "Haswell"}, None) is None  # the CPU's own unknown: nothing claimed
    note = forced_kernel_line({"blas_kernel": "Haswell"}, "SkylakeX")
    assert "run Haswell kernels on a CPU whose own are SkylakeX" in note
    assert "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE tinytrain bench step" in note
