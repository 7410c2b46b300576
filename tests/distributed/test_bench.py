"""`tinytrain bench collectives` runs under the harness and writes the documented JSON rows; its
baseline is MPI as it comes: timed in this launch when it runs under MPI's own settings, else in a
second mpirun launch without tinytrain's MPICH settings."""

import argparse
import json
import os
import shutil

import pytest

from tinytrain import distributed as dist
from tinytrain.bench import collectives as bench
from tinytrain.distributed._mpi import MPICH_THROTTLE


def _run(tmp_path, *flags):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / f"rows{dist.get_rank()}.json"
    assert bench.run(parser.parse_args([*flags, "--rounds", "1", "--json", str(out)])) == 0
    return json.loads(out.read_text()) if dist.get_rank() == 0 else None


@pytest.mark.world_size(4)
def test_bench_rows_have_nccl_tests_fields(tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / f"rows{dist.get_rank()}.json"
    args = parser.parse_args(
        ["--sizes", "1K", "64K", "--collectives", "all_reduce", "all_gather", "--rounds", "1", "--json", str(out)]
    )
    assert bench.run(args) == 0
    if dist.get_rank() != 0:
        assert not out.exists()
        return
    rows = json.loads(out.read_text())
    assert [(r["collective"], r["size_bytes"]) for r in rows] == [
        ("all_reduce", 1024),
        ("all_reduce", 65536),
        ("all_gather", 1024),
        ("all_gather", 65536),
    ]
    for r in rows:
        assert r["ranks"] == 4
        factor = 2 * 3 / 4 if r["collective"] == "all_reduce" else 3 / 4
        assert r["busbw_gbps"] == pytest.approx(r["size_bytes"] / (r["time_us"] * 1e-6) / 1e9 * factor)
        assert r["ratio"] == pytest.approx(r["busbw_gbps"] / r["mpi_busbw_gbps"])


@pytest.mark.world_size(4)
def test_bench_runs_a_students_assignment_and_lists_its_todos(tmp_path, capsys):
    """--impl assignments benches assignments/a1_collectives.py; stubs still at TODO are named."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "rows.json"
    args = parser.parse_args(
        [
            "--impl",
            "assignments",
            "--sizes",
            "1K",
            "--collectives",
            "all_reduce",
            "all_gather",
            "--algo",
            "recursive_doubling",
            "--rounds",
            "1",
            "--json",
            str(out),
        ]
    )
    assert bench.run(args) == 0
    if dist.get_rank() == 0:
        printed = capsys.readouterr().out
        # all_gather's ring is a task of assignment 1 (a TODO in the checked-in stubs); recursive
        # doubling is not, so the student's copy of it runs.
        assert [r["collective"] for r in json.loads(out.read_text())] == ["all_reduce"]
        assert "all_gather     not benched: TODO 1.2:" in printed


@pytest.mark.world_size(4)
def test_baseline_is_mpi_as_it_comes_and_both_columns_point_the_same_way(tmp_path, capsys):
    rows = _run(tmp_path, "--sizes", "1K", "--collectives", "all_reduce", "reduce_scatter", "--mpi", "both")
    if dist.get_rank() != 0:
        return
    printed = capsys.readouterr().out
    # the second launch read no MPICH setting of ours at its MPI_Init; this one ran under its own
    as_it_comes = bench.mpich_settings(bench.baseline_environment())  # none, or only what the user set
    assert f"# MPI as it comes: a second mpirun -n 4 launch, MPICH settings: {as_it_comes}" in printed
    assert f"# ours (tinytrain's collectives): this launch, MPICH settings: {bench.mpich_settings()}" in printed
    assert f"# MPI here: this launch, MPICH settings: {bench.mpich_settings()}" in printed
    assert "# ratio = our busbw / busbw of MPI as it comes (above 1: ours faster; below 1: MPI faster)" in printed
    assert [r["collective"] for r in rows] == ["all_reduce", "reduce_scatter"]
    for r in rows:
        assert r["mpi_settings"] == "as it comes"
        assert r["ratio"] == pytest.approx(r["busbw_gbps"] / r["mpi_busbw_gbps"])
        assert r["ratio_here"] == pytest.approx(r["busbw_gbps"] / r["mpi_here_busbw_gbps"])
        assert r["mpi_time_us"] > 0 and r["mpi_here_time_us"] > 0


@pytest.mark.world_size(4)
def test_the_here_baseline_runs_in_this_launch_and_says_under_which_settings(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "BaselineLaunch", None)  # would fail if a second launch were started
    rows = _run(tmp_path, "--sizes", "1K", "--collectives", "broadcast", "--mpi", "here")
    if dist.get_rank() == 0:
        printed = capsys.readouterr().out
        assert "MPI as it comes" not in printed
        assert "# ratio = our busbw / busbw of MPI here (above 1: ours faster; below 1: MPI faster)" in printed
        assert [r["mpi_settings"] for r in rows] == [f"this launch's: {bench.mpich_settings()}"]


@pytest.mark.world_size(4)
def test_the_default_baseline_is_timed_in_this_launch_when_it_runs_mpi_as_it_comes(tmp_path, capsys, monkeypatch):
    """No throttle here: MPI as it comes is this launch, timed interleaved with ours (a second launch,
    measured, gave MPI's own collectives lower figures, which flattered our ratios)."""
    monkeypatch.setattr(bench, "BaselineLaunch", None)  # would fail if a second launch were started
    assert bench.runs_as_it_comes()
    rows = _run(tmp_path, "--sizes", "1K", "--collectives", "all_reduce")
    if dist.get_rank() == 0:
        printed = capsys.readouterr().out
        assert (
            f"# MPI as it comes: this launch, interleaved with ours (MPICH settings: {bench.mpich_settings()})"
            in printed
        )
        assert "# ratio = our busbw / busbw of MPI as it comes (above 1: ours faster; below 1: MPI faster)" in printed
        [row] = rows
        assert row["mpi_settings"] == "as it comes" and row["mpi_time_us"] > 0
        assert row["ratio"] == pytest.approx(row["busbw_gbps"] / row["mpi_busbw_gbps"])


class _FakeLaunch:
    """Stands in for the second launch: records that it was started and answers like the worker."""

    started = []

    def __init__(self, comm, on_device=False):
        self.settings = bench.mpich_settings(bench.baseline_environment())  # what a real second launch reads
        _FakeLaunch.started.append(comm.Get_rank())

    def ask(self, request):
        return {"seconds": 1e-3} if request["op"] == "time" else {}

    def close(self):
        pass


@pytest.mark.world_size(4)
def test_a_throttled_launch_times_mpi_as_it_comes_in_a_second_launch(tmp_path, capsys, monkeypatch):
    for key, value in MPICH_THROTTLE.items():  # what MPI_Init read under TINYTRAIN_MPI_THROTTLE=1
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(bench, "BaselineLaunch", _FakeLaunch)
    _FakeLaunch.started.clear()
    assert not bench.runs_as_it_comes()
    rows = _run(tmp_path, "--sizes", "1K", "--collectives", "broadcast")
    assert _FakeLaunch.started == [dist.get_rank()]
    if dist.get_rank() == 0:
        printed = capsys.readouterr().out
        as_it_comes = bench.mpich_settings(bench.baseline_environment())  # none, or only what the user set
        assert f"# MPI as it comes: a second mpirun -n 4 launch, MPICH settings: {as_it_comes}" in printed
        assert "MPIR_CVAR_CH4_PROGRESS_THROTTLE=1" in printed  # ours: this launch's settings, said
        [row] = rows
        assert row["mpi_time_us"] == pytest.approx(1e3)  # the second launch's figure is the baseline


def test_the_baseline_environment_drops_our_settings_and_this_launchs_wiring(monkeypatch):
    monkeypatch.setenv("PMI_RANK", "3")
    monkeypatch.setenv("HYDI_CONTROL_FD", "7")
    monkeypatch.setenv("SOME_USER_SETTING", "kept")
    for key in [k for k in os.environ if k.startswith("MPIR_CVAR_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("MPIR_CVAR_NOLOCAL", "1")  # the user's (the network path): MPI as it comes keeps it
    for key, value in MPICH_THROTTLE.items():
        monkeypatch.setenv(key, value)
    env = bench.baseline_environment()
    assert not set(MPICH_THROTTLE) & set(env)
    assert "PMI_RANK" not in env and "HYDI_CONTROL_FD" not in env
    assert env["TINYTRAIN_MPI_THROTTLE"] == "0" and env["SOME_USER_SETTING"] == "kept"
    assert bench.mpich_settings(env) == "MPIR_CVAR_NOLOCAL=1"
    monkeypatch.delenv("MPIR_CVAR_NOLOCAL")
    assert bench.mpich_settings(bench.baseline_environment()) == "none (MPICH's own defaults)"


@pytest.mark.world_size(4)
def test_a_baseline_launch_that_dies_fails_every_rank_in_one_message(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "_mpirun", lambda: shutil.which("false"))  # exits at once, replies nothing
    with pytest.raises(RuntimeError, match=r"baseline launch failed: RuntimeError: the worker exited \(code 1\)"):
        _run(tmp_path, "--sizes", "1K", "--collectives", "all_reduce", "--mpi", "both")


@pytest.mark.world_size(4)
def test_the_floor_loops_compute_what_mpi_computes():
    """bench/floor.py's bare loops (the --floor column): recursive doubling, all-to-all and
    broadcast compute MPI's own results; the ring loops move the ring's messages (n-1 steps, one
    chunk to the right neighbour and one from the left each), which chunk in which step being
    assignment 1's to work out."""
    import numpy as np

    from tinytrain.bench import floor
    from tinytrain.distributed import work
    from tinytrain.distributed._mpi import MPI

    # Its messages can never match ours: its tag lies between our collectives' tags and the debug signature's.
    assert work._TAG_BASE + work._TAG_SPAN <= floor._TAG < work._SIG_TAG
    comm = dist.init().comm
    r, n = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(100 + r)
    for count in (8, 1001):
        x = rng.standard_normal(count).astype(np.float32)
        expect = np.empty_like(x)
        comm.Allreduce(x, expect, op=MPI.SUM)
        got = x.copy()
        floor.all_reduce_recursive_doubling(comm, got, np.empty_like(x))
        np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-5)

        steps = []
        real_step = floor._step
        floor._step = lambda comm_, sends, recvs: (  # record each step's messages, then send them
            steps.append(([(b.nbytes, p) for b, p in sends], [(b.nbytes, p) for b, p in recvs])),
            real_step(comm_, sends, recvs),
        )
        try:
            full, out = np.zeros(count * n, np.float32), np.zeros(count, np.float32)
            floor.ring_reduce_scatter(comm, full, out, [np.empty(count, np.float32) for _ in range(2)])
            floor.ring_all_gather(comm, x, np.empty(count * n, np.float32))
        finally:
            floor._step = real_step
        right, left = [1, 2, 3, 0][r], [3, 0, 1, 2][r]  # the ring of 4 ranks
        one_step = ([(4 * count, right)], [(4 * count, left)])
        assert steps == [one_step] * (2 * (n - 1)), steps  # the ring's messages, phase after phase

        whole = rng.standard_normal(count * n).astype(np.float32)
        swapped = np.empty_like(whole)
        floor.pairwise_all_to_all(comm, whole, swapped)
        expect_a2a = np.empty_like(whole)
        comm.Alltoall(whole, expect_a2a)
        np.testing.assert_array_equal(swapped, expect_a2a)

        sent = comm.bcast(x if r == 0 else None, root=0)
        got = x.copy()
        floor.binomial_broadcast(comm, got)
        np.testing.assert_array_equal(got, sent)


@pytest.mark.world_size(4)
def test_the_floor_column_is_the_bare_algorithm_against_the_same_baseline(tmp_path, capsys):
    rows = _run(tmp_path, "--sizes", "1K", "--collectives", "all_reduce", "all_gather", "--mpi", "here", "--floor")
    if rows is None:
        return
    for row in rows:
        assert row["floor_time_us"] > 0
        assert row["floor_ratio"] == pytest.approx(row["mpi_time_us"] / row["floor_time_us"])
    assert "floor ratio" in capsys.readouterr().out


def test_reduce_scatter_is_read_against_all_gather_for_ours_and_for_mpi():
    """The printed bound of issue 18's item 3: reduce_scatter's busbw over all_gather's, both sides."""
    size = 16 << 20
    rows = [
        bench._row("all_gather", "ring", size, 4, {"ours": 0.010, "mpi_default": 0.008}, "default"),
        bench._row("reduce_scatter", "ring", size, 4, {"ours": 0.020, "mpi_default": 0.012}, "default"),
        bench._row("reduce_scatter", "ring", 1 << 20, 4, {"ours": 0.002, "mpi_default": 0.001}, "default"),
        {"receive_check_ns_per_message": 1.0, "exchange_ns": 2.0},  # not a collective row: skipped
    ]
    # busbw is size / time x the same factor for both collectives: the ratio is a ratio of times
    assert bench.reduce_scatter_vs_all_gather(rows) == [
        "# reduce_scatter / all_gather busbw at 16M: ours 0.50, MPI's 0.67"
    ]


def test_bench_checkpoint_times_each_mode_against_the_step_alone_and_writes_twelve_bytes_a_parameter(tmp_path):
    """The three modes train the same numbers (the bench refuses otherwise); a checkpoint of AdamW's
    run holds 4 bytes of weight and 8 of moments per parameter (12Ψ), plus its indexes."""
    from tinytrain import distributed as dist
    from tinytrain.bench import checkpoint as bench
    from tinytrain.bench.step import CONFIGS
    from tinytrain.nn import GPT, GPTConfig

    world = dist.get_world_size() if dist.is_initialized() else 1
    out = tmp_path / "rows.json"
    folder = tmp_path / "ckpt" if world == 1 else None  # under mpirun: the bench names one folder for all
    args = bench.parse(["--configs", "default", "--rounds", "1", "--block", "2", "--json", str(out)])
    args.out = str(folder) if folder else None
    assert bench.run(args) == 0
    if world > 1 and dist.get_rank() != 0:
        return
    (row,) = json.loads(out.read_text())["rows"]
    psi = GPT(GPTConfig(**CONFIGS["default"]["model"]), seed=0).num_parameters()
    assert row["world"] == world and 12 * psi <= row["bytes"] <= 12 * psi + 64 * 1024, (row["bytes"], 12 * psi)
    for mode in ("sync", "async"):
        assert row[mode]["ratio"] > 0 and row[mode]["wait_ms"] >= 0, row
