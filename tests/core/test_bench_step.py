"""`tinytrain bench step` times each framework in its own process, in alternating runs, and checks
that the worker not being timed stays idle. PyTorch is not needed here: a fake reference (the same
tinytrain step in a second worker, or one whose "thread pool" keeps spinning) stands in for it."""

import argparse
import json

import numpy as np
import pytest

from tinytrain import backend
from tinytrain.bench import step as bench

FAKES = '''
import threading
import time

from tinytrain.bench.step import tinytrain_step


def quiet_step(name, threads):
    return tinytrain_step(name, threads)


def spinning_step(name, threads):
    """A reference whose pool keeps a core busy for 2 s after every step (as spinning BLAS/OpenMP
    threads do), so it takes the cores from whatever is timed next."""
    step = tinytrain_step(name, threads)

    def spin():
        end = time.perf_counter() + 2.0
        while time.perf_counter() < end:
            pass

    def step_then_spin():
        loss = step()
        threading.Thread(target=spin, daemon=True).start()
        return loss

    return step_then_spin


def any_precision_step(name, threads, precision="fp32"):
    return tinytrain_step(name, threads, precision)


def float32_only_step(name, threads, precision="fp32"):
    return tinytrain_step(name, threads)  # ignores the precision asked for


def other_model_step(name, threads):
    step = tinytrain_step(name, threads)
    return lambda: step() + 1.0
'''


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    (tmp_path / "bench_fakes.py").write_text(FAKES)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the workers import it
    return "bench_fakes"


def test_each_framework_runs_in_its_own_worker_and_the_idle_one_stays_idle(fakes):
    row = bench.compare("default", steps=4, threads=1, reference=f"{fakes}:quiet_step", block=2, settle=0.2)
    assert row["first_loss_diff"] == 0.0  # the same model from the same weights
    assert row["ratio"] == pytest.approx(row["tinytrain_ms"] / row["torch_ms"])
    assert set(row["idle_cpu"]) == {"tinytrain", f"{fakes}:quiet_step"}
    assert not row["disturbed"], row["idle_cpu"]  # asleep on its pipe: next to no CPU
    assert "ok: tinytrain " in bench._check(row)


def test_the_check_catches_a_neighbour_whose_threads_keep_spinning(fakes):
    """The distortion of timing both in one process, brought back on purpose: the check must see it."""
    row = bench.compare("default", steps=2, threads=1, reference=f"{fakes}:spinning_step", block=1, settle=0.0)
    assert row["disturbed"] and row["idle_cpu"][f"{fakes}:spinning_step"] > bench.IDLE_LIMIT, row["idle_cpu"]
    assert bench._check(row).startswith("DISTURBED: ")


def test_precision_times_each_framework_in_16_bits_beside_its_float32(fakes):
    precision = "bf16"  # (fp16, with its loss scaler: the next test but one)
    row = bench.compare("default", steps=2, threads=1, reference=f"{fakes}:any_precision_step", precision=precision)
    ref = f"{fakes}:any_precision_step"
    assert set(row["idle_cpu"]) == {"tinytrain", ref, f"tinytrain {precision}", f"{ref} {precision}"}
    assert row["low_ratio"] == pytest.approx(row["tinytrain_low_ms"] / row["tinytrain_ms"])
    assert row["torch_low_ratio"] == pytest.approx(row["torch_low_ms"] / row["torch_ms"])
    assert row["low_vs_torch"] == pytest.approx(row["tinytrain_low_ms"] / row["torch_low_ms"])
    losses = row["first_losses"]
    # the 16-bit model is the float32 one rounded: a loss near float32's, not equal to it
    assert losses[f"tinytrain {precision}"] != losses["tinytrain"]
    assert losses[f"tinytrain {precision}"] == pytest.approx(losses["tinytrain"], rel=bench.LOW_PRECISION_LOSS)
    assert f"{precision}: tinytrain " in bench.low_precision_line(row) and "x its fp32" in bench.low_precision_line(row)


def test_a_reference_that_stays_in_float32_under_precision_is_refused(fakes):
    with pytest.raises(RuntimeError, match="in bf16: the first loss is float32's to the last bit"):
        bench.compare("default", steps=1, threads=1, reference=f"{fakes}:float32_only_step", precision="bf16")


def test_different_models_are_refused(fakes):
    with pytest.raises(RuntimeError, match="models differ: first loss"):
        bench.compare("default", steps=1, threads=1, reference=f"{fakes}:other_model_step")


def test_without_torch_tinytrain_is_timed_alone_and_the_table_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "torch_available", lambda: False)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "rows.json"
    args = parser.parse_args(["--configs", "default", "--steps", "2", "--threads", "1", "--json", str(out)])
    assert bench.run(args) == 0
    printed = capsys.readouterr().out
    assert "PyTorch is not importable" in printed
    assert "ratio = tinytrain step time / PyTorch step time (above 1: tinytrain slower" in printed
    assert "- (tinytrain alone)" in printed
    (row,) = json.loads(out.read_text())
    assert row["config"] == "default" and row["tinytrain_ms"] > 0 and "ratio" not in row


def test_fp16_alone_prints_tinytrains_16_bit_step_over_its_float32(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "torch_available", lambda: False)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "rows.json"
    argv = ["--configs", "default", "--steps", "1", "--threads", "1", "--precision", "fp16", "--json", str(out)]
    assert bench.run(parser.parse_args(argv)) == 0
    printed = capsys.readouterr().out
    (row,) = json.loads(out.read_text())
    assert "float32 and fp16" in printed and f"fp16: tinytrain {row['tinytrain_low_ms']:.2f} ms" in printed
    assert row["first_losses"]["tinytrain fp16"] != row["first_losses"]["tinytrain"]
    assert "torch_low_ms" not in row
    assert row["low_ratio"] == pytest.approx(row["tinytrain_low_ms"] / row["tinytrain_ms"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--precision", "int8"])


def test_profile_times_each_op_in_each_worker(fakes):
    """--profile: after the timing, each worker profiles steps of its own and reports ms per op;
    the table shows both columns, the ratio, the time outside ops and the whole step."""
    row = bench.compare("default", steps=1, threads=1, reference=f"{fakes}:quiet_step", settle=0.0, profile=1)
    ops = row["ops"]
    assert set(ops) == {"tinytrain", f"{fakes}:quiet_step"}
    for per_op in ops.values():  # the stand-in reference is a tinytrain step, profiled as tinytrain
        assert {"linear forward", "linear backward", "attention forward", "gelu backward", "AdamW step"} <= set(per_op)
        assert 0 < sum(v for k, v in per_op.items() if k != "step") <= per_op["step"]
    table = bench.profile_table(row, 1)
    assert "default: per op, ms per step, 1 profiled steps each" in table
    for label in ("linear forward", "AdamW step", "(outside ops: Python, engine)", "step"):
        assert f"\n  {label}" in table
    assert table.count("x\n") >= 3  # a ratio column


def test_profile_option_and_the_long_config(tmp_path, capsys, monkeypatch):
    """The long-context config (T >= 256, attention dominates) runs, here tinytrain alone, with
    --profile's default of 5 steps; a negative --profile is refused in one sentence."""
    assert bench.CONFIGS["long"]["model"]["block_size"] >= 256
    monkeypatch.setattr(bench, "torch_available", lambda: False)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--configs", "long", "--steps", "1", "--threads", "1", "--profile"])
    assert args.profile == 5
    assert bench.run(args) == 0
    printed = capsys.readouterr().out
    assert "long: per op, ms per step, 5 profiled steps each" in printed and "attention forward" in printed
    with pytest.raises(ValueError, match="--profile must be a positive number of steps"):
        bench.run(parser.parse_args(["--profile", "-1"]))


def test_the_reference_is_pinned_where_pip_installs_it():
    """pyproject's `bench` extra pins the PyTorch that PINNED_TORCH names, and only that one counts
    as the pinned reference (a local build tag such as +cpu aside)."""
    import pathlib
    import re

    pyproject = (pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text()
    (extra,) = re.findall(r"^bench = \[(.*?)\]", pyproject, flags=re.M)
    assert f'"torch=={bench.PINNED_TORCH}"' in extra
    assert bench.pinned({"torch": f"{bench.PINNED_TORCH}+cpu"}) and bench.pinned({"torch": bench.PINNED_TORCH})
    assert not bench.pinned({"torch": "2.14.1"}) and not bench.pinned({})


def test_the_table_names_what_each_side_ran_on_and_marks_an_unpinned_reference(fakes, capsys, monkeypatch):
    """The workers report their versions (NumPy, its BLAS, threads); a ratio against anything but
    the pinned PyTorch is marked * and a line says so."""
    row = bench.compare("default", steps=1, threads=1, reference=f"{fakes}:quiet_step", settle=0.0, warmup=2)
    mine = row["versions"]["tinytrain"]
    assert mine["numpy"] == np.__version__ and mine["threads"] == 1 and mine["blas"]
    assert mine["blas_kernel"] == backend.blas_kernel()
    assert row["pinned_reference"] is False  # a stand-in, not PyTorch
    monkeypatch.setattr(bench, "torch_available", lambda: True)
    monkeypatch.setattr(bench, "compare", lambda *a, **k: row)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(["--configs", "default", "--steps", "1", "--threads", "1"])) == 0
    printed = capsys.readouterr().out
    assert "CPU: " in printed and f"tinytrain: tinytrain on NumPy {np.__version__}" in printed
    assert f"{row['ratio']:5.2f}*" in printed
    assert f"* not against the pinned reference: PyTorch {bench.PINNED_TORCH}" in printed
    with pytest.raises(ValueError, match="--warmup must be 0 or more"):
        bench.run(parser.parse_args(["--warmup", "-1"]))
