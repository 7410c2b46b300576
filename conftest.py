"""Root conftest: load the MPI test harness (see grader/mpi_plugin.py).

``python -m pytest`` runs single-process tests; ``mpirun -n 4 python -m pytest`` runs everything,
reported once by rank 0.
"""

pytest_plugins = ["grader.mpi_plugin", "grader.impl_plugin"]
