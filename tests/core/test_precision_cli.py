"""``tinytrain train --precision fp32|bf16|fp16`` (issue 27 item 2): the loss stays near fp32's, fp16
logs its loss scale and skipped steps, a checkpoint holds the float32 master weights, a serial
low-precision run resumes bit for bit, and a run resumes in another precision from the same numbers."""

from __future__ import annotations

import functools
import json

import numpy
import pytest

from tinytrain import checkpoint
from tinytrain.autograd import no_grad
from tinytrain.backend import device, precision_dtype, to_host
from tinytrain.cli import main
from tinytrain.data import AdditionDataset
from tinytrain.nn import GPT, GPTConfig
from tinytrain.optim import AdamW, LossScaler

TINY = ["--layers", "1", "--width", "32", "--heads", "2", "--batch-size", "8", "--eval-every", "1000"]
TINY += ["--eval-batches", "1", "--warmup", "2", "--quiet", "--no-plot"]
LOW = ["fp16"] + (["bf16"] if device == "cpu" else [])  # CuPy has no bfloat16
FAST = ["--lr", "1e-2", "--min-lr", "1e-3"]
# max |loss - fp32's loss| over 30 steps of TINY + FAST, measured: bf16 0.022, fp16 0.0034
GAP = {"bf16": 0.06, "fp16": 0.01}


def train(out, *extra):
    assert main(["train", *TINY, "--out", str(out), *extra]) == 0
    return json.loads((out / "metrics.json").read_text())


def losses(m):
    return [s["loss"] for s in m["steps"]]


@pytest.mark.parametrize("precision", LOW)
def test_a_low_precision_run_stays_near_the_fp32_curve(tmp_path, precision):
    fp32 = losses(train(tmp_path / "fp32", "--steps", "30", *FAST))
    m = train(tmp_path / precision, "--steps", "30", "--precision", precision, *FAST)
    gap = max(abs(a - b) for a, b in zip(losses(m), fp32))
    assert gap < GAP[precision], f"--precision {precision}: the loss parts from fp32's by {gap:.4f}"
    assert fp32[-1] < fp32[0] - 0.5  # (a curve that moves)
    assert m["config"]["args"]["precision"] == precision
    assert ("loss_scale" in m["steps"][0]) == (precision == "fp16")


@pytest.mark.skipif(device == "cpu", reason="a device's refusal (TINYTRAIN_DEVICE=gpu or strict): NumPy has bfloat16")
def test_bf16_on_a_device_is_refused_with_what_to_use_instead(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", *TINY, "--steps", "3", "--precision", "bf16", "--out", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "CuPy has no bfloat16" in err and "use --precision fp16" in err, err


def test_fp16_logs_its_scale_and_the_steps_an_overflow_skipped(tmp_path, monkeypatch):
    """Starting from 2^40 every gradient overflows float16: each step is skipped and halves the
    scale until the gradients fit; the skipped steps leave the weights alone."""
    monkeypatch.setattr(LossScaler.__init__, "__defaults__", (2.0**40, 2.0, 0.5, 200))
    steps = train(tmp_path, "--steps", "40", "--precision", "fp16", *FAST)["steps"]
    first = next(s["step"] for s in steps if not s.get("skipped"))  # measured: step 24, at 2^17
    assert 10 < first < 40 and all(s.get("skipped") for s in steps[: first - 1])
    assert steps[0]["loss_scale"] == 2.0**40
    for s, after in zip(steps, steps[1:]):  # halved after a skipped step, else kept (no growth in 40 steps)
        assert after["loss_scale"] == s["loss_scale"] / (2 if s.get("skipped") else 1), (s, after)
        assert ("grad_norm" in s) != bool(s.get("skipped"))  # a skipped step neither clips nor updates
    # the weights the first update found were the initial ones: its loss is the untouched model's
    task = AdditionDataset(2)
    config = GPTConfig(vocab_size=task.vocab_size, block_size=task.block_size, n_layer=1, n_head=2, n_embd=32)
    model = GPT(config, seed=0).to(precision_dtype("fp16"))
    with no_grad():
        assert model.loss(*task.batch("train", 8, seed=0, step=first)).item() == steps[first - 1]["loss"]
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.1


def test_a_checkpoint_holds_the_float32_master_weights(tmp_path):
    precision = LOW[-1]
    train(tmp_path, "--steps", "4", "--precision", precision)
    reader = checkpoint.Reader(tmp_path / "ckpt")
    w = reader.read("blocks.0.mlp.fc_1.weight")
    assert w.dtype == numpy.float32
    rounded = w.astype(precision_dtype(precision)).astype(numpy.float32)
    assert not numpy.array_equal(w, rounded), "saved the 16-bit parameter, not its master"
    assert set(reader.fields("blocks.0.mlp.fc_1.weight")) == {"param", "exp_avg", "exp_avg_sq"}  # no copy


@pytest.mark.parametrize("precision", LOW)
def test_a_low_precision_run_resumes_bit_for_bit(tmp_path, monkeypatch, precision):
    """Killed after its step-3 checkpoint and resumed, it equals the uninterrupted run: the masters,
    the moments and (fp16) the loss scale and its count of clean steps come back."""
    monkeypatch.setattr(LossScaler.__init__, "__defaults__", (2.0**20, 2.0, 0.5, 2))  # the scale moves
    common = ["--steps", "8", "--ckpt-every", "3", "--precision", precision]
    straight = train(tmp_path / "straight", *common)
    real_batch = AdditionDataset.batch

    def dies_at_step_4(self, split, batch_size, seed, step):
        if split == "train" and step == 4:
            raise KeyboardInterrupt("simulated crash")
        return real_batch(self, split, batch_size, seed, step)

    monkeypatch.setattr(AdditionDataset, "batch", dies_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "crashed", *common)
    monkeypatch.setattr(AdditionDataset, "batch", real_batch)
    resumed = train(tmp_path / "crashed", *common, "--resume")
    assert losses(resumed) == losses(straight)
    if precision == "fp16":
        assert [s["loss_scale"] for s in resumed["steps"]] == [s["loss_scale"] for s in straight["steps"]]
    a, b = checkpoint.Reader(tmp_path / "straight" / "ckpt"), checkpoint.Reader(tmp_path / "crashed" / "ckpt")
    for name in a.names():
        for field in a.fields(name):
            numpy.testing.assert_array_equal(a.read(name, field), b.read(name, field), err_msg=f"{name} {field}")


@pytest.mark.parametrize("saved, resumed", [("fp32", LOW[-1]), (LOW[-1], "fp32"), ("fp16", LOW[-1])])
def test_a_run_resumes_in_another_precision_from_the_same_numbers(tmp_path, saved, resumed):
    constant = ["--warmup", "0", "--lr", "3e-3", "--min-lr", "3e-3"]  # a schedule that --steps 6 extends
    train(tmp_path, "--steps", "3", "--precision", saved, *constant)
    reader = checkpoint.Reader(tmp_path / "ckpt")
    model = GPT(GPTConfig(**reader.meta["model_config"])).to(precision_dtype(resumed))
    optimizer = AdamW(model.parameters())
    named = [(checkpoint.Placement(n), p) for n, p in model.named_parameters()]
    checkpoint.restore(reader, named, optimizer)
    dtype = precision_dtype(resumed)
    for placement, p in named:
        values = reader.read(placement.name)
        assert p.data.dtype == dtype
        numpy.testing.assert_array_equal(to_host(p.data), values.astype(dtype), err_msg=placement.name)
        state = optimizer.state[p]
        if resumed == "fp32":
            assert "master" not in state
        else:  # the master is the saved float32 value itself, not its rounding
            numpy.testing.assert_array_equal(to_host(state["master"]), values, err_msg=placement.name)
        assert state["exp_avg"].dtype == numpy.float32 and state["step"] == 3
    m = train(tmp_path, "--steps", "6", "--precision", resumed, "--resume", *constant)
    assert [s["step"] for s in m["steps"]] == [1, 2, 3, 4, 5, 6]


@functools.cache  # fp32's, once for both precisions
def first_steps_of_the_default_run(precision: str, steps: int) -> tuple[float, ...]:
    """The losses of the first ``steps`` steps of ``tinytrain train --precision P`` (its 600-step schedule)."""
    import argparse

    from tinytrain.data import load_dataset
    from tinytrain.trainer.args import add_arguments, build_model, check_args, plan_of
    from tinytrain.trainer.loop import build_optimizer, train_step
    from tinytrain.trainer.runners import make_runner

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--precision", precision])
    check_args(args)
    dataset = load_dataset(args.data, args.block_size, args.digits)
    runner = make_runner(build_model(args, dataset), plan_of(args), args.batch_size)
    optimizer, schedule = build_optimizer(args, runner.parameters())
    scaler = LossScaler() if precision == "fp16" else None
    return tuple(train_step(runner, optimizer, schedule, dataset, args, s, scaler)[0] for s in range(1, steps + 1))


@pytest.mark.slow
@pytest.mark.parametrize("precision", LOW)
def test_the_default_run_in_low_precision_stays_near_fp32_for_its_first_100_steps(precision):
    """Measured over the first 100 steps of the default run, seeds 0-2: max |Δloss| bf16 0.0068, fp16
    0.0024. Later the runs part as any float32 reordering does (the README): each leaves the loss
    plateau near 0.8 at its own step, and with the default seed bf16 had not by step 600 (docs/design.md)."""
    fp32, low = first_steps_of_the_default_run("fp32", 100), first_steps_of_the_default_run(precision, 100)
    gap = max(abs(a - b) for a, b in zip(low, fp32))
    assert gap < {"bf16": 0.02, "fp16": 0.01}[precision], f"--precision {precision}: {gap:.4f} from fp32"
    assert fp32[-1] < fp32[0] - 0.8
