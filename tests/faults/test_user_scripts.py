"""A user's own script under mpirun: one rank's failure ends the whole job within seconds.

``import tinytrain.distributed as dist`` installs an exception hook (``group.py``): the failing rank
prints its traceback once, under a line naming it, and aborts the job; ranks whose error only echoes
it print one line each. Before, the others raised after 20 s and the job lived on until the last
rank exited by itself (121 s for a 120 s sleep).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from grader.run import mpi_environment
from tinytrain import launcher

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import numpy
    import tinytrain.distributed as dist
    from tinytrain import launcher

    case = sys.argv[1]
    rank = launcher.rank_and_size()[0] if case == "before-init" else dist.get_rank()  # as any MPI's launcher says
    if rank == 1 and case in ("others-wait", "others-compute", "before-init"):
        time.sleep(0.3)
        raise RuntimeError("injected on rank 1")
    if case == "others-compute":
        end = time.monotonic() + 120
        while time.monotonic() < end:  # computing, not waiting in a collective
            numpy.ones((64, 64)) @ numpy.ones((64, 64))
    if case == "other-op":  # no debug mode: the signature in the messages' tags tells
        dist.all_reduce(numpy.ones(4, dtype=numpy.float32), op="max" if rank == 3 else "sum")
    if case == "same-bytes":  # 8 float32 on rank 3 and 4 float64 elsewhere: 32 bytes each
        dist.all_reduce(numpy.ones(8, numpy.float32) if rank == 3 else numpy.ones(4, numpy.float64))
    if not (rank == 1 and case == "skip"):
        dist.all_reduce(numpy.ones(4, dtype=numpy.float32))
    time.sleep(120)
    """
)


def run_script(tmp_path, case: str, ranks: int = 4) -> tuple[int, float, str]:
    (tmp_path / "script.py").write_text(SCRIPT)
    env = dict(mpi_environment(), TINYTRAIN_DEVICE="cpu", TINYTRAIN_TIMEOUT="2")
    env.pop("TINYTRAIN_DEBUG", None)
    start = time.monotonic()
    r = subprocess.run(
        [*launcher.mpirun_command(ranks), sys.executable, "script.py", case],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    return r.returncode, time.monotonic() - start, r.stdout + r.stderr


@pytest.mark.parametrize("case", ["others-wait", "others-compute", "before-init"])
def test_an_uncaught_exception_on_one_rank_ends_the_job_at_once(tmp_path, case):
    rc, seconds, output = run_script(tmp_path, case)
    print(f"{case}: exit {rc} after {seconds:.1f} s\n{output}")
    assert rc == 1, output
    assert seconds < 15, (seconds, output)  # the others would sleep 120 s
    assert output.count("rank 1 of 4 failed") == 1, output
    assert output.count("Traceback") == 1 and "RuntimeError: injected on rank 1" in output, output
    others = [line for line in output.splitlines() if line.startswith(("rank 0:", "rank 2:", "rank 3:"))]
    assert len(others) <= 3, output  # one line each at most


def test_a_rank_that_skips_a_collective_ends_the_job_after_the_deadline(tmp_path):
    """Rank 1 skips the all-reduce and sleeps: the others time out (TINYTRAIN_TIMEOUT=2), say so in
    one line each, and the job ends instead of living on for the 120 s sleep."""
    rc, seconds, output = run_script(tmp_path, "skip")
    print(f"skip: exit {rc} after {seconds:.1f} s\n{output}")
    assert rc == 1, output
    assert seconds < 20, (seconds, output)
    assert "CommTimeout" in output and "rank 1" in output, output
    assert "Traceback" not in output, output


@pytest.mark.parametrize(
    "case,odd,usual,differ",
    [("other-op", r"all_reduce\(op=max, float32\)", r"all_reduce\(op=sum, float32\)", "reduce op"),
     ("same-bytes", r"all_reduce\(op=sum, float32\)", r"all_reduce\(op=sum, float64\)", "dtype and element count")],
)  # fmt: skip
def test_ranks_calling_different_collectives_are_named_without_debug_mode(tmp_path, case, odd, usual, differ):
    """Ranks that disagree on the op, or pass arrays of equal bytes but another dtype and size,
    used to return different results or garbage, exit 0; now both calls are named, and the job ends.
    Whichever side saw it first tells: rank 3 (the odd call) or one of its partners."""
    import re

    rc, seconds, output = run_script(tmp_path, case)
    print(f"{case}: exit {rc} after {seconds:.1f} s\n{output}")
    assert rc == 1, output
    assert seconds < 15, (seconds, output)
    seen_by_partner = rf"rank 3 called {odd}.* while rank [0-2] called {usual}"
    seen_by_rank_3 = rf"rank [0-2] called {usual}.* while rank 3 called {odd}"
    told = rf"collective mismatch on group world[^:]*: ({seen_by_partner}|{seen_by_rank_3}).*differ in {differ}"
    assert re.search(told, output), output
    assert output.count("Traceback") == 1, output  # one rank tells; the others say one line each
