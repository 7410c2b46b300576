"""`tinytrain doctor` prints what a user needs when something is off: versions, the device and why,
the MPI library, CUDA-awareness, every rank with its GPU, and the settings in effect."""

from __future__ import annotations

import json
import os
import platform

import mpi4py
import numpy as np
import pytest

from tinytrain import backend, cli
from tinytrain import distributed as dist
from tinytrain.distributed import p2p
from tinytrain.distributed._mpi import MPI


@pytest.mark.world_size(2)
def test_doctor_reports_versions_device_mpi_ranks_and_settings(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TINYTRAIN_TIMEOUT", "17")
    monkeypatch.delenv("TINYTRAIN_GPU", raising=False)
    path = tmp_path / "doctor.json"
    assert cli.main(["doctor", "--json", str(path)]) == 0
    if dist.get_rank() != 0:
        assert capsys.readouterr().out == ""  # one report, from rank 0
        return
    out = capsys.readouterr().out
    report = json.loads(path.read_text())
    assert report["numpy"] == np.__version__ and report["mpi4py"] == mpi4py.__version__
    assert report["python"].startswith(platform.python_version())
    assert report["device"] == backend.device and report["device_reason"] == backend.device_reason
    assert report["mpi_library"].split()[0] == MPI.Get_library_version().split()[0]  # "MPICH" / "Open"
    assert [report["cuda_aware"], report["cuda_aware_reason"]] == list(p2p.cuda_aware_reason())
    ranks = report["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and len({r["pid"] for r in ranks}) == 2
    if backend.on_device:  # each rank on GPU local_rank mod count
        assert all(r["gpu"] == r["local_rank"] % r["gpus_visible"] for r in ranks)
    else:
        assert all(r["gpu"] is None for r in ranks) and "no GPU" in out
    assert report["settings"]["TINYTRAIN_TIMEOUT"] == "=17"
    assert report["settings"]["TINYTRAIN_GPU"].startswith("  (unset:")
    for name in ("MPIR_CVAR_CH4_PROGRESS_THROTTLE",):  # MPICH's throttle, if in effect (TINYTRAIN_MPI_THROTTLE=1)
        if name in os.environ:
            assert report["settings"][name] == f"={os.environ[name]}"
    for line in (
        f"  numpy         {np.__version__}",
        f"  device        {backend.device}: {backend.device_reason}",
        "  CUDA-aware    ",
        "  ranks         2 on 1 node(s)",
        "    TINYTRAIN_TIMEOUT=17",
    ):
        assert line in out, line
