"""`tinytrain bench scaling`: serial against 2 ranks per layout; the figures add up (not the machine's speed)."""

import argparse
import json

import pytest

from tinytrain import distributed as dist
from tinytrain.bench import scaling as bench


def _args(*argv):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.world_size(2)
def test_every_layout_has_a_row_whose_figures_add_up(tmp_path, capsys):
    out = tmp_path / f"rows{dist.get_rank()}.json"
    args = _args("--models", "default", "--steps", "2", "--warmup", "1", "--rounds", "2", "--json", str(out))
    assert bench.run(args) == 0
    if dist.get_rank() != 0:
        assert not out.exists()
        return
    rows = json.loads(out.read_text())
    assert [r["layout"] for r in rows] == list(bench.LAYOUTS)
    for r in rows:
        assert r["model"] == "default" and r["steps"] == 2 and r["rounds"] == 2
        assert r["tokens_per_step"] == 64 * 8  # `tinytrain train`'s batch 64 x the addition task's 8 tokens
        assert len(r["serial_tokens_per_s_rounds"]) == len(r["parallel_tokens_per_s_rounds"]) == 2
        assert r["serial_tokens_per_s"] == max(r["serial_tokens_per_s_rounds"]) > 0  # the best round is kept
        assert r["parallel_tokens_per_s"] == max(r["parallel_tokens_per_s_rounds"]) > 0
        assert r["speedup"] == pytest.approx(r["parallel_tokens_per_s"] / r["serial_tokens_per_s"])
        assert r["efficiency"] == pytest.approx(r["speedup"] / 2)
        assert len(r["comm_share_per_rank"]) == 2 and r["comm_share"] == max(r["comm_share_per_rank"])
        assert all(0.0 <= share <= 1.0 for share in r["comm_share_per_rank"]), r["layout"]
        assert all(q is None or q >= 0 for q in (r["serial_queued"], r["parallel_queued"]))
        assert r["loss_diff"] < 1e-4, r["layout"]  # the layout trains the serial curve
    by_layout = {r["layout"]: r for r in rows}
    assert by_layout["dp"]["plan"] == "--dp 2" and by_layout["dp"]["target_speedup"] == 0.9
    assert by_layout["pp"]["plan"] == "--pp 2 --microbatches 8 --schedule 1f1b"
    assert by_layout["tp"]["target_speedup"] is None  # judged on the wide model, not this one
    # DP's ideal: a serial step on one replica's rows, timed beside; only DP has one
    assert by_layout["dp"]["ideal_speedup"] > 0
    # judged as a share of its ideal, and beside the ideal with both cores busy (no messages)
    assert by_layout["dp"]["of_ideal"] == pytest.approx(by_layout["dp"]["speedup"] / by_layout["dp"]["ideal_speedup"])
    assert by_layout["dp"]["ideal_speedup_both_busy"] > 0 and by_layout["tp"]["of_ideal"] is None
    assert by_layout["tp"]["ideal_speedup"] is None and by_layout["pp"]["ideal_speedup"] is None
    # every layout talks: TP all-reduces activations, PP sends them, DP waits for the last bucket
    assert all(r["comm_share"] > 0 for r in rows)
    printed = capsys.readouterr().out
    assert "speedup = tok/s on 2 ranks / tok/s serial" in printed
    for r in rows:
        assert f"  {r['layout']:<7}default  {r['plan']}" in printed


def test_another_rank_count_says_what_to_run():
    with pytest.raises(ValueError, match=r"exactly 2 ranks: mpirun -n 2 tinytrain bench scaling \(this run has 1\)"):
        bench.run(_args())


def test_bad_counts_are_refused_in_one_sentence():
    with pytest.raises(ValueError, match="--rounds must be positive, got 0"):
        bench.run(_args("--rounds", "0"))
