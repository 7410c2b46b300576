"""`tinytrain train --dp N [--zero S]` end to end: the loss curve lies on the serial one."""

from __future__ import annotations

import numpy as np
import pytest

from tinytrain import distributed as dist

import parallel_cases

BASE = ["--steps", "4", "--batch-size", "8", "--width", "32", "--layers", "1", "--eval-every", "100",
        "--eval-batches", "1", "--no-plot", "--quiet"]


def train_cli(out, *extra) -> list[float]:
    return parallel_cases.train_cli(out, BASE, *extra)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("zero", ["0", "2", "3"])
def test_dp2_losses_match_the_serial_run(tmp_path, zero, capsys):
    serial = train_cli(tmp_path / "serial", "--dp", "1") if dist.get_rank() == 0 else []
    parallel = train_cli(tmp_path / "dp", "--dp", "2", "--zero", zero, "--bucket-mb", "0.01")
    if dist.get_rank() == 0:
        # Same global batch per step; DDP sums two half-batch gradients: float32 rounding only.
        np.testing.assert_allclose(parallel, serial, rtol=1e-5, atol=1e-6)
        if zero != "0":
            err = capsys.readouterr().err
            assert f"ZeRO-{zero} memory per rank" in err and "unsharded" in err


@pytest.mark.world_size(2)
@pytest.mark.parametrize("extra, message", [
    (["--dp", "4"], "must equal the number of ranks"),
    (["--dp", "2", "--batch-size", "7"], "does not split over 2 ranks"),
    (["--dp", "2", "--zero", "3", "--dropout", "0.1"], "needs --dropout 0"),
    (["--dp", "2", "--bucket-mb", "0"], "--bucket-mb must be positive"),
    (["--dp", "2", "--pp", "2"], "needs exactly 4 ranks"),
    (["--dp", "2", "--zero", "1", "--pp", "2"], "--zero with --pp is not supported"),
])
def test_impossible_settings_are_refused_with_what_to_change(tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        train_cli(tmp_path, *extra)
