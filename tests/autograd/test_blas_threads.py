"""NumPy's BLAS gets the elementwise kernels' share of the cores: one pool per rank, not one per core."""

import os
import subprocess
import sys

import pytest

from tinytrain import backend
from tinytrain.autograd import threads

pytestmark = pytest.mark.skipif(backend.blas_threads() is None, reason="this NumPy's BLAS is not an OpenBLAS")


def test_blas_threads_sets_the_pool_and_says_its_size():
    before = backend.blas_threads()
    try:
        assert backend.blas_threads(1) == 1
        assert backend.blas_threads() == 1
    finally:
        backend.blas_threads(before)


def test_the_environment_chooses_first(monkeypatch):
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    assert threads.blas_thread_count() == threads.THREADS
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    assert threads.blas_thread_count() is None


def _blas_threads_in_a_rank(**env) -> int:
    """The BLAS pool of a fresh process that the launcher says shares this machine with env's ranks."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    code = "import tinytrain.autograd; from tinytrain import backend; print(backend.blas_threads())"
    out = subprocess.run([sys.executable, "-c", code], env=clean | env, capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_ranks_on_one_machine_share_its_cores():
    cores = backend.usable_cores()
    assert _blas_threads_in_a_rank(MPI_LOCALNRANKS=str(2 * cores)) == 1  # more ranks than cores: one each
    assert _blas_threads_in_a_rank(MPI_LOCALNRANKS="1") == cores
    # the user's setting stays (OpenBLAS takes at most one thread per core)
    assert _blas_threads_in_a_rank(MPI_LOCALNRANKS=str(2 * cores), OPENBLAS_NUM_THREADS=str(cores)) == cores
