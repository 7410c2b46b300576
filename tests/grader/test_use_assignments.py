"""``assignments.use.use_assignments``: the mechanism behind ``tinytrain train --impl assignments``."""

import shutil
import subprocess
import sys

import pytest

from grader.config import ROOT
from grader.run import mpi_environment

pytestmark = pytest.mark.deadline(300)


def test_impl_assignments_runs_the_students_code_so_a_stub_stops_the_run_at_its_todo(tmp_path):
    cmd = [shutil.which("mpirun") or "mpirun", "-n", "2", sys.executable, "-m", "tinytrain.cli", "train", "--pp", "2"]
    cmd += ["--layers", "2", "--width", "16", "--steps", "1", "--quiet", "--no-plot", "--out", str(tmp_path / "o")]
    cmd += ["--impl", "assignments"]
    proc = subprocess.run(cmd, cwd=ROOT, env=mpi_environment(), capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    # The checked-in assignments are stubs: the run reaches the student's pipeline code and stops
    # at its first TODO (the reference pipeline would have trained).
    assert proc.returncode != 0 and "TODO 5." in out, out[-3000:]


def test_every_assignment_function_replaces_the_references_everywhere():
    code = """
import tinytrain.parallel.pipeline as pl
from assignments.use import use_assignments
import assignments.a5_pipeline as a5
import assignments.a1_collectives as a1
import tinytrain.distributed.algorithms as alg
swapped = use_assignments()
assert pl.make_schedule is a5.make_schedule and pl.gpipe is a5.gpipe
assert alg._ring_reduce_scatter is a1._ring_reduce_scatter
assert "tinytrain.parallel.data_parallel.BucketedDDP" in swapped
import tinytrain.parallel.federated as fed
import assignments.a9_federated as a9
assert fed.FedAvg is a9.FedAvg and fed.weighted_average is a9.weighted_average  # --dp-algo fedavg runs yours
import tinytrain.elastic as elastic
import assignments.a10_elastic as a10
assert elastic.layout_for is a10.layout_for and elastic.Agent is a10.Agent  # the elastic agent decides with yours
print("ok", len(swapped))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=mpi_environment(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr


def test_tasks_in_use_swaps_the_files_of_those_tasks_for_the_block_only():
    """What a student copy's grader does for 3.3 (which requires 8.1): ZeRO-3's layers recompute
    with the student's checkpoint during the test, and with the framework's after it. Only the file
    holding 8.1 is swapped: the optimizers (8.2, 8.3's file) stay the framework's."""
    code = """
import tinytrain.parallel.zero_parts as zp
import tinytrain.autograd as ag
import tinytrain.optim as optim
from assignments.use import tasks_in_use
import importlib
a8 = importlib.import_module("assignments.a8_memory.checkpoint")  # the package's .checkpoint is the function
reference = zp.checkpoint
with tasks_in_use(["8.1"]):
    assert zp.checkpoint is a8.checkpoint and ag.checkpoint is a8.checkpoint
    assert optim.AdamW.__module__ == "tinytrain.optim"
assert zp.checkpoint is reference and ag.checkpoint is reference
print("ok")
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=mpi_environment(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr
