"""Faults a new user still hits (issue 26, "rough edges"): each is one sentence in the flags' own
names, exit 2, refused before any work; a reader that goes away (``| head -1``) ends quietly.

The CLI runs in-process where a subprocess adds nothing; subprocesses only for the pipe, a bad
environment variable read at import, and ``mpirun``. No world_size marker: under the suite's
``mpirun -n 4 python -m pytest`` these run on rank 0 only.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

import pytest

from grader.run import mpi_environment
from tinytrain import backend, launcher
from tinytrain.cli import main
from tinytrain.trainer import args as train_args

TINY = ["--layers", "1", "--width", "32", "--heads", "2", "--batch-size", "8", "--steps", "1", "--no-plot", "--quiet"]
HUGE = ["--width", str(1 << 20), "--layers", "2"]  # 2.6e13 parameters: no machine holds them


def refused(capsys, argv) -> str:
    """The one sentence ``tinytrain ARGV`` (in-process) prints, checking exit 2 and no traceback."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def environment(**extra) -> dict:
    env = dict(mpi_environment(), TINYTRAIN_DEVICE="cpu", **extra)
    env.pop("TINYTRAIN_DEBUG", None)  # the test harness turns it on; the program runs as a user's
    return env


# --- 1. bench collectives ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "size, says",
    [
        ("0", "--sizes 0: a message must hold at least one float32, 4 bytes"),
        ("-1", "--sizes -1: a message must hold at least one float32"),
        ("3", "--sizes 3: a message must hold at least one float32"),
        ("abc", "--sizes abc: not a message size"),
        ("inf", "--sizes inf: not a message size"),
    ],
)
def test_a_size_that_is_no_message_is_refused_before_mpi_starts(capsys, size, says):
    err = refused(capsys, ["bench", "collectives", "--sizes", "1K", size])
    assert says in err, err


def test_sizes_whose_buffers_cannot_fit_are_refused_with_the_bytes(monkeypatch):
    """--sizes 10G on 2 ranks: all_reduce holds our buffer and scratch (2 x 10 GiB) and MPI's send,
    receive and temporary (3 x 10 GiB) per rank; the sentence says so, and the largest size that fits."""
    from tinytrain.bench import collectives

    need = collectives.buffer_bytes("all_reduce", 10 << 30, 2)
    assert (need["ours"], need["mpi"], need["total"]) == (20 << 30, 30 << 30, 50 << 30)
    assert collectives.buffer_bytes("all_gather", 4 << 20, 4, floor=True)["total"] == 3 * (5 << 20)
    args = type("Args", (), {"collectives": ["broadcast", "all_reduce"], "mpi": "default", "floor": False})()
    sizes = [collectives._parse_size(s) for s in ("1K", "10G")]
    collectives.check_memory(args, sizes, 2, 2, share=float(50 << 30))  # exactly fits: no error
    with pytest.raises(ValueError) as exc:
        collectives.check_memory(args, sizes, 2, 2, share=float(16 << 30))
    message = str(exc.value)
    assert message.startswith("--sizes 10G needs at least 50 GiB per rank for all_reduce"), message
    assert "our buffers 20 GiB, MPI's 30 GiB" in message and "100 GiB for the 2 ranks" in message
    assert "32 GiB available (MemAvailable): use sizes up to 2G" in message


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_sizes_too_big_for_this_machine_are_refused_under_mpirun(tmp_path):
    r = subprocess.run(
        [
            *launcher.mpirun_command(2),
            sys.executable,
            "-m",
            "tinytrain.cli",
            "bench",
            "collectives",
            "--sizes",
            "1024G",
        ],
        cwd=tmp_path,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--sizes 1024G needs at least 5.12e+03 GiB per rank for all_reduce" in r.stderr, r.stderr
    assert "available (MemAvailable): use sizes up to" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "Abort" not in r.stdout + r.stderr, r.stderr  # every rank refused alike: no MPI_Abort, no banner of one


def test_one_rank_is_told_to_use_mpirun(tmp_path):
    """Without mpirun there is one rank: every bus bandwidth would be 0 (it was a ZeroDivisionError)."""
    r = subprocess.run(
        [sys.executable, "-m", "tinytrain.cli", "bench", "collectives", "--sizes", "1K"],
        cwd=tmp_path,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (
        "tinytrain bench: error: bench collectives measures ranks talking to each other and this run has one: "
        "run it under mpirun -n 2 or more (`mpirun -n 4 tinytrain bench collectives`)"
    )


# --- 2. a reader that goes away -----------------------------------------------------------------------


def test_a_reader_that_stops_reading_ends_the_command_quietly(tmp_path):
    """`tinytrain plan ... | head -1`: 800 KB of rows into a pipe whose reader left after one line."""
    command = f"{sys.executable} -m tinytrain.cli plan --nodes 192 --top 100000 | head -1"
    r = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {command}"],
        cwd=tmp_path,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.stdout.startswith("gpt3-175b: ") and r.stdout.count("\n") == 1, r.stdout
    assert r.stderr == "", r.stderr  # was: "tinytrain plan: error: BrokenPipeError: [Errno 32] Broken pipe ..."
    assert r.returncode == 1  # the status the Python docs' recipe gives (a pipeline without pipefail: head's 0)


# --- 3. plan: absurd clusters and models ----------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, says",
    [
        (
            ["--nodes", "1000000"],
            "no layout splits this model over 8,000,000 GPUs: a layout's dp x ep x pp x cp x tp must be exactly "
            "8,000,000, with dp x ep dividing --batch 1536, pp dividing --layers 96",
        ),
        (["--nodes", "1000000"], "the nearest GPU counts that have one: 6,291,456 or 8,388,608"),
        (["--model", "tinytrain", "--nodes", "3", "--gpus-per-node", "7"], "GPU counts that have one: 16 or 32"),
        (
            ["--model", "tinytrain", "--nodes", "1000000"],
            "8,000,000 GPUs are more than this model can use: at most 2,048 (--batch 8 replicas",
        ),
        (["--nodes", "99999999999999999999"], "GPUs are more than this model can use: at most 75,497,472"),
        (["--nodes", "0"], "--nodes must be positive, got 0"),
        (["--gpus-per-node", "-8"], "--gpus-per-node must be positive, got -8"),
        (["--memory-gb", "-1"], "--memory-gb must be positive, got -1.0"),
        (["--top", "0"], "--top must be at least 1, got 0"),
    ],
)
def test_a_cluster_no_layout_fits_says_why(capsys, argv, says):
    err = refused(capsys, ["plan", *argv])
    assert err.startswith("tinytrain plan: error: ") and says in err, err
    assert "add GPUs" not in err


def test_a_huge_model_is_planned_in_a_moment_and_said_not_to_fit(capsys):
    """--layers 10**8 used to loop over every stage count (range(layers)) per TP/CP/EP size: minutes."""
    assert main(["plan", "--layers", "100000000"]) == 1
    out = capsys.readouterr().out
    assert "no layout fits (the smallest needs 3.63e+08 GB per GPU): add GPUs or memory" in out, out


def test_a_cluster_with_every_gpu_the_model_can_use_is_not_told_to_add_gpus(capsys):
    assert main(["plan", "--model", "tinytrain", "--nodes", "256", "--memory-gb", "1e-7"]) == 1
    out = capsys.readouterr().out
    assert "add memory (this model cannot use more GPUs) or make the model smaller" in out, out


# --- 4. the grader's outputs --------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["file", "/proc/tinytrain-results"])
def test_grader_out_that_is_no_writable_folder_is_one_sentence(tmp_path, capsys, where):
    from grader.__main__ import main as grader_main

    (tmp_path / "file").write_text("")
    out = str(tmp_path / "file") if where == "file" else where
    assert grader_main(["--out", out, "--tasks", "1.1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {out} ") and len(err.strip().splitlines()) == 1, err
    assert "is not a folder this grader can write" in err, err
    assert ("(it is a file)" in err) if where == "file" else ("(No such file or directory)" in err), err


def test_a_release_into_an_unwritable_place_is_one_sentence(capsys):
    from grader.config import is_release

    if is_release():
        pytest.skip("a student copy makes no releases")
    from grader.__main__ import main as grader_main

    assert grader_main(["release", "/proc/tinytrain-release"]) == 2
    out = capsys.readouterr().out
    assert out.startswith("error: cannot write the student copy in /proc/tinytrain-release"), out
    assert len(out.strip().splitlines()) == 1, out


def test_a_report_into_an_unwritable_place_is_refused_before_measuring(capsys, monkeypatch):
    from grader import analysis

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured before checking --out")

    monkeypatch.setattr(analysis.subprocess, "run", no_measuring)
    assert analysis.main("/proc/tinytrain-report/report.md") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write /proc/tinytrain-report/report.md") and "--out" in err, err


# --- 5. a model too big for this machine --------------------------------------------------------------


def test_a_model_too_big_for_memory_is_refused_before_it_is_built(tmp_path, capsys, monkeypatch):
    import tinytrain.nn.transformer as transformer

    def never(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(transformer.GPT, "__init__", never)
    err = refused(capsys, ["train", *TINY, *HUGE, "--out", str(tmp_path / "run")])
    assert "the model of --width 1048576 --layers 2 (26,388,329,398,272 parameters) needs at least" in err, err
    assert "weights 1.06e+05 GB, gradients 1.06e+05 GB, AdamW state 2.11e+05 GB" in err, err
    assert "available (MemAvailable): use a smaller --width or --layers" in err, err
    assert not (tmp_path / "run").exists()  # refused before its outputs were made


def test_the_refusal_uses_the_memory_this_machines_ranks_share(tmp_path, capsys, monkeypatch):
    """A model that fits one rank's share but not the machine's 4 ranks: the sentence counts all 4."""
    width = ["--width", "1024", "--layers", "2", "--heads", "4"]  # 25,214,976 parameters: 0.403 GB of state
    monkeypatch.setattr(backend, "host_memory_available", lambda: 1_000_000_000)
    monkeypatch.setenv("MPI_LOCALNRANKS", "1")
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_SIZE", raising=False)
    parser = argparse.ArgumentParser()
    train_args.add_arguments(parser)
    train_args.check_args(parser.parse_args([*TINY, *width]))  # one rank: 0.403 GB fits in 1 GB
    monkeypatch.setenv("MPI_LOCALNRANKS", "4")
    with pytest.raises(ValueError) as exc:
        train_args.check_args(parser.parse_args([*TINY, *width]))
    message = str(exc.value)
    assert "(25,214,976 parameters) needs at least 0.403 GB per rank" in message, message
    assert "1.61 GB for the 4 ranks here, and this machine has 1 GB available" in message, message


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_a_model_too_big_is_refused_on_every_tp_rank_in_a_second(tmp_path):
    argv = [sys.executable, "-m", "tinytrain.cli", "train", *TINY, *HUGE, "--tp", "2", "--out", "run"]
    r = subprocess.run(
        [*launcher.mpirun_command(2), *argv],
        cwd=tmp_path,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("error: the model of --width 1048576 --layers 2") == 1, r.stderr
    assert "per rank (weights 5.28e+04 GB" in r.stderr and "for the 2 ranks here" in r.stderr, r.stderr  # TP halves
    assert "MemoryError" not in r.stderr and "Traceback" not in r.stderr
    assert "Abort" not in r.stdout + r.stderr, r.stderr  # every rank refused alike: no MPI_Abort, no banner of one


# --- 6. GPTConfig's checks in the flags' names ----------------------------------------------------------


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--width", "30", "--heads", "4"], "--width 30 does not split into --heads 4"),
        (["--width", "30", "--heads", "4"], "choose --heads among [1, 2, 3, 5, 6, 10, 15, 30]"),
        (["--width", "1000000007", "--heads", "2"], "choose --heads among [1, 1000000007]"),  # no loop to 10**9
        (["--dropout", "1"], "--dropout must be at least 0 and below 1, got 1.0"),
        (["--experts", "-1"], "--experts must be 0 (a dense MLP) or positive, got -1"),
        (["--experts", "4", "--topk", "5"], "--topk 5 must be between 1 and --experts 4"),
    ],
)
def test_model_errors_name_the_flags_not_the_config_fields(tmp_path, capsys, argv, says):
    err = refused(capsys, ["train", *TINY, *argv, "--out", str(tmp_path)])
    assert says in err, err
    for field in ("n_embd", "n_head", "n_layer", "moe_top_k", "n_experts"):
        assert field not in err, err


# --- 7. settings from the environment --------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, value, says",
    [
        ("TINYTRAIN_TRACE", "abc", "TINYTRAIN_TRACE='abc' is not a setting it takes: 1 (record spans) or 0 (off)"),
        ("TINYTRAIN_DEBUG", "yes", "TINYTRAIN_DEBUG='yes' is not a setting it takes: 1 (show tracebacks) or 0"),
        ("TINYTRAIN_KEEP_FREED_MEMORY", "no", "TINYTRAIN_KEEP_FREED_MEMORY='no' is not a setting it takes: 1"),
        ("TINYTRAIN_DEVICE", "tpu", "TINYTRAIN_DEVICE='tpu' is not one of cpu, gpu, auto, strict"),
    ],
)
def test_a_bad_setting_in_the_environment_is_one_sentence(tmp_path, name, value, says):
    """Read at import (tracing, the backend): only a fresh process reads them."""
    r = subprocess.run(
        [sys.executable, "-m", "tinytrain.cli", "train", *TINY, "--out", "run"],
        cwd=tmp_path,
        env=dict(environment(), **{name: value}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("tinytrain train: error: ") and says in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists(), r.stderr


def test_the_strict_stand_ins_gpu_count_must_be_a_number(monkeypatch):
    from tinytrain.backend import strict

    monkeypatch.setenv("TINYTRAIN_STRICT_GPUS", "four")
    with pytest.raises(ValueError, match=r"TINYTRAIN_STRICT_GPUS='four' is not a setting it takes: a whole number"):
        strict._device_count()
    monkeypatch.setenv("TINYTRAIN_STRICT_GPUS", "3")
    assert strict._device_count() == 3


def test_the_harness_settings_must_be_numbers(monkeypatch):
    from grader import mpi_plugin, seeds

    monkeypatch.setenv("TINYTRAIN_TEST_TIMEOUT", "soon")
    with pytest.raises(pytest.UsageError, match=r"TINYTRAIN_TEST_TIMEOUT='soon' is not a setting it takes: seconds"):
        mpi_plugin.test_deadline()
    monkeypatch.setenv("TINYTRAIN_TEST_TIMEOUT", "7.5")
    assert mpi_plugin.test_deadline() == 7.5
    monkeypatch.setenv("TINYTRAIN_GRADER_SEED", "0x1f")
    with pytest.raises(ValueError, match=r"TINYTRAIN_GRADER_SEED='0x1f' is not a setting it takes: a whole number"):
        seeds.grading_seed()
