"""Ranks bind to GPUs: local rank r uses GPU r mod the GPU count, TINYTRAIN_GPU overrides, CPU is a no-op.

No GPU is needed: the device count and the binding are faked.
"""

from __future__ import annotations

import pytest

from tinytrain import backend
from tinytrain.distributed import group
from tinytrain.distributed._mpi import MPI


def test_local_rank_mod_device_count(monkeypatch):
    monkeypatch.delenv("TINYTRAIN_GPU", raising=False)
    assert [backend.gpu_for_rank(r, 4) for r in range(9)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert [backend.gpu_for_rank(r, 3) for r in range(4)] == [0, 1, 2, 0]
    assert backend.gpu_for_rank(5, 1) == 0


def test_tinytrain_gpu_overrides_on_every_rank(monkeypatch):
    monkeypatch.setenv("TINYTRAIN_GPU", "2")
    assert [backend.gpu_for_rank(r, 4) for r in range(4)] == [2, 2, 2, 2]
    monkeypatch.setenv("TINYTRAIN_GPU", "4")
    with pytest.raises(backend.BackendError, match="TINYTRAIN_GPU='4' is not a GPU index"):
        backend.gpu_for_rank(0, 4)


def test_select_device_uses_the_count_and_is_a_no_op_on_the_cpu(monkeypatch):
    monkeypatch.delenv("TINYTRAIN_GPU", raising=False)
    if not backend.on_device:
        assert backend.select_device_for_rank(3) is None
        assert backend.gpu_count() == 0
        return
    count = backend.gpu_count()
    assert backend.select_device_for_rank(count + 1) == 1 % count


def test_local_rank_from_the_launcher_or_from_mpi(monkeypatch):
    monkeypatch.setenv("MPI_LOCALRANKID", "3")
    assert group.local_rank(MPI.COMM_SELF) == 3
    monkeypatch.delenv("MPI_LOCALRANKID")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "2")
    assert group.local_rank(MPI.COMM_SELF) == 2
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_RANK")
    assert group.local_rank(MPI.COMM_SELF) == 0  # shared-memory split of a one-rank communicator


def test_init_binds_the_rank_to_its_gpu(monkeypatch):
    """init() hands the local rank to backend.select_device_for_rank (only on a GPU)."""
    chosen = []
    monkeypatch.setattr(group, "_world", None)  # pretend nothing started; the harness's world is restored after
    monkeypatch.setattr(group, "_install_world", lambda comm: None)
    monkeypatch.setattr(group, "_install_excepthook", lambda: None)
    monkeypatch.setattr(backend, "select_device_for_rank", lambda local: chosen.append(local) or local % 2)
    monkeypatch.setenv("MPI_LOCALRANKID", "5")
    monkeypatch.setattr(backend, "on_device", True)
    group.init()
    assert chosen == [5]
    monkeypatch.setattr(backend, "on_device", False)
    group.init()
    assert chosen == [5]  # on the CPU nothing is bound
