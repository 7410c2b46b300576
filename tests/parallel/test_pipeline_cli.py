"""`tinytrain train --pp N [--dp D] [--tp T]`: the loss curve lies on the serial one; --trace and --plot leave files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tinytrain import distributed as dist
from tinytrain.cli import main

TINY = ["--layers", "4", "--width", "32", "--heads", "2", "--batch-size", "8", "--steps", "4",
        "--eval-every", "2", "--eval-batches", "1", "--warmup", "1", "--quiet", "--no-plot"]


def losses(out):
    return np.array([s["loss"] for s in json.loads((out / "metrics.json").read_text())["steps"]])


@pytest.mark.world_size(2)
@pytest.mark.parametrize("extra", [["--schedule", "1f1b"], ["--schedule", "interleaved", "--chunks", "2", "--microbatches", "4"]])
def test_pipeline_training_matches_serial(tmp_path, extra):
    pp = tmp_path / "pp"
    assert main(["train", *TINY, "--pp", "2", "--out", str(pp), "--plot", "--trace", str(tmp_path / "t.json"), *extra]) == 0
    if dist.get_rank() != 0:
        return  # outputs are rank 0's
    serial = tmp_path / "serial"
    assert main(["train", *TINY, "--out", str(serial)]) == 0
    np.testing.assert_allclose(losses(pp), losses(serial), rtol=1e-5, atol=1e-6)
    for name in ("pipeline.png", "activation_memory.png", "ckpt.npz", "metrics.json"):
        assert (pp / name).stat().st_size > 0, name
    trace = json.loads((tmp_path / "t.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert {e.get("pid") for e in events if e.get("name", "").startswith("F")} >= {0, 1}


@pytest.mark.world_size(4)
def test_data_parallel_pipelines_match_serial(tmp_path):
    """--dp 2 --pp 2: two replicas of a two-stage pipeline, each on half of the global batch."""
    out = tmp_path / "dp_pp"
    assert main(["train", *TINY, "--dp", "2", "--pp", "2", "--microbatches", "2", "--dropout", "0", "--out", str(out)]) == 0
    if dist.get_rank() != 0:
        return
    serial = tmp_path / "serial"
    assert main(["train", *TINY, "--out", str(serial)]) == 0
    np.testing.assert_allclose(losses(out), losses(serial), rtol=1e-5, atol=1e-6)


def grad_norms(out):
    return np.array([s["grad_norm"] for s in json.loads((out / "metrics.json").read_text())["steps"]])


@pytest.mark.world_size(4)
@pytest.mark.parametrize("extra", [["--layers", "2"], ["--layers", "4", "--schedule", "interleaved", "--chunks", "2",
                                                       "--microbatches", "4"]], ids=["1f1b", "interleaved"])
def test_tensor_parallel_stages_match_serial(tmp_path, extra):
    """--pp 2 --tp 2: mesh {pp: 2, tp: 2}; each stage's blocks split over a TP pair, vocab-parallel loss."""
    out = tmp_path / "pp_tp"
    assert main(["train", *TINY, "--pp", "2", "--tp", "2", *extra, "--out", str(out)]) == 0
    if dist.get_rank() != 0:
        return
    serial = tmp_path / "serial"
    assert main(["train", *TINY, *extra[:2], "--out", str(serial)]) == 0
    np.testing.assert_allclose(losses(out), losses(serial), rtol=1e-5, atol=1e-6)
    # the clipped global norm counts every shard once and replicated weights once
    np.testing.assert_allclose(grad_norms(out), grad_norms(serial), rtol=1e-4)
    final = [json.loads((d / "metrics.json").read_text())["final"]["val_loss"] for d in (out, serial)]
    np.testing.assert_allclose(*final, rtol=1e-5)  # evaluated on the gathered model


@pytest.mark.world_size(2)
def test_pipeline_settings_are_checked(tmp_path, capsys):
    for bad, message in [(["--pp", "4"], "needs exactly 4 ranks"),
                         (["--pp", "2", "--dp", "2"], "needs exactly 4 ranks"),
                         (["--pp", "2", "--zero", "1"], "--zero with --pp is not supported"),
                         (["--pp", "2", "--tp", "2"], "needs exactly 4 ranks"),
                         (["--pp", "2", "--tp", "2", "--sp"], "--sp with --pp is not supported"),
                         (["--pp", "2", "--microbatches", "3"], "does not split into 3 micro-batches"),
                         (["--pp", "2", "--chunks", "2"], "needs --schedule interleaved"),
                         (["--pp", "2", "--layers", "1"], "one would be empty")]:
        with pytest.raises(SystemExit) as exc:
            main(["train", *TINY, "--out", str(tmp_path), *bad])
        assert exc.value.code == 2
        if dist.get_rank() == 0:
            assert message in capsys.readouterr().err
