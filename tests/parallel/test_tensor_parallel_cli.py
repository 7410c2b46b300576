"""`tinytrain train --tp T [--sp] [--dp D]` end to end: the loss curve lies on the serial one."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tinytrain import distributed as dist

import parallel_cases

BASE = ["--steps", "3", "--batch-size", "8", "--width", "32", "--layers", "1", "--dropout", "0.1",
        "--eval-every", "100", "--eval-batches", "1", "--no-plot", "--quiet"]


def train_cli(out, *extra) -> list[float]:
    return parallel_cases.train_cli(out, BASE, *extra)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("layout", [["--tp", "4"], ["--tp", "2", "--sp", "--dp", "2"]], ids=["tp4", "dp2-tp2-sp"])
def test_losses_match_the_serial_run(tmp_path, layout):
    serial = train_cli(tmp_path / "serial") if dist.get_rank() == 0 else []
    parallel = train_cli(tmp_path / "tp", *layout)
    if dist.get_rank() == 0:
        # Same global batch and dropout masks per step; AdamW + clipping: float32 rounding only.
        np.testing.assert_allclose(parallel, serial, rtol=1e-4, atol=1e-5)


@pytest.mark.world_size(2)
def test_trace_shows_the_tp_all_reduces(tmp_path):
    trace_path = tmp_path / "trace.json"
    train_cli(tmp_path / "tp", "--tp", "2", "--steps", "1", "--trace", str(trace_path))
    if dist.get_rank() == 0:
        events = json.loads(trace_path.read_text())
        events = events["traceEvents"] if isinstance(events, dict) else events
        ranks_reducing = {e["pid"] for e in events if e.get("name") == "all_reduce"}
        assert len(ranks_reducing) == 2, f"all-reduce spans from both ranks, got pids {ranks_reducing}"


@pytest.mark.world_size(2)
@pytest.mark.parametrize("extra, message", [
    (["--tp", "4"], "needs exactly 4 ranks"),
    (["--tp", "2", "--heads", "3", "--width", "33"], "number of attention heads = 3"),
    (["--sp"], "add --tp 2 or more"),
    (["--tp", "2", "--pp", "2"], "needs exactly 4 ranks"),
    (["--tp", "2", "--pp", "2", "--sp"], "--sp with --pp is not supported"),
    (["--tp", "2", "--zero", "1"], "--zero with --tp is not supported"),
])
def test_impossible_settings_are_refused_with_what_to_change(tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        train_cli(tmp_path, *extra)
