"""Every layout the mesh can express trains the serial model, with dropout on.

``tinytrain train`` under each layout (data, tensor, sequence, pipeline parallel, ZeRO, and their
combinations on one mesh) must give the serial run's loss curve, clipped gradient norms and final
evaluation: same batches, same dropout masks (keyed by site, cut to each rank's piece), float32
rounding only. Layouts that cannot work are refused before any rank computes.
"""

from __future__ import annotations

import json

import numpy as np
import parallel_cases
import pytest

from tinytrain import distributed as dist
from tinytrain import launcher
from tinytrain.cli import main
from tinytrain.parallel.simulator import bubble_formula

TINY = (
    "--layers 4 --width 32 --heads 4 --batch-size 8 --steps 4 --eval-every 2 --eval-batches 1 --warmup 1 "
    "--dropout 0.1 --quiet --no-plot"
).split()


def text_data(tmp_path) -> list[str]:
    """Context parallel cuts sequences into 2·CP chunks: characters of a text, 16 per sequence."""
    words = np.random.default_rng(0).choice(["the ", "cat ", "sat ", "on ", "a ", "mat. ", "\n"], size=800)
    path = tmp_path / "text.txt"
    path.write_text("".join(words))
    return ["--data", str(path), "--block-size", "16"]


_serial: dict = {}  # the serial run's metrics, computed once (rank 0)


def metrics(out) -> dict:
    return json.loads((out / "metrics.json").read_text())


def serial_metrics(tmp_path, extra=(), key="addition") -> dict:
    if key not in _serial:
        assert main(["train", *TINY, *extra, "--out", str(tmp_path / "serial")]) == 0
        _serial[key] = metrics(tmp_path / "serial")
    return _serial[key]


def assert_on_serial_curve(out, tmp_path, extra=(), key="addition") -> None:
    """Loss, clipped gradient norm per step and the final evaluation equal the serial run's."""
    got, want = metrics(out), serial_metrics(tmp_path, extra, key)
    assert got["config"]["parameters"] == want["config"]["parameters"]  # the whole model's, not this rank's part
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(
            [s[key] for s in got["steps"]], [s[key] for s in want["steps"]], rtol=2e-5, atol=1e-6, err_msg=key
        )
    np.testing.assert_allclose(got["final"]["val_loss"], want["final"]["val_loss"], rtol=2e-5)


def run_layout(tmp_path, layout: str, extra=(), key="addition") -> None:
    out = parallel_cases.shared_dir(tmp_path) / "run"
    assert main(["train", *TINY, *extra, *layout.split(), "--out", str(out)]) == 0
    if dist.get_rank() == 0:
        assert_on_serial_curve(out, tmp_path, extra, key)


@pytest.mark.world_size(4)
@pytest.mark.parametrize(
    "layout",
    [
        "--dp 4",
        "--dp 4 --zero 1",
        "--dp 4 --zero 2",
        "--dp 4 --zero 3",
        "--tp 4",
        "--tp 4 --sp",
        "--dp 2 --tp 2 --sp",
        "--dp 2 --tp 2 --sp --zero 1",
        "--dp 2 --tp 2 --sp --zero 2",
        "--pp 4",
        "--pp 2 --dp 2 --zero 1",
        "--pp 2 --dp 2 --schedule gpipe",
        "--pp 2 --tp 2 --sp",
        "--pp 2 --tp 2 --schedule interleaved --chunks 2 --microbatches 4",
        "--pp 4 --schedule zb-h1",
        "--pp 2 --dp 2 --zero 1 --schedule zb-h1",
        "--pp 2 --tp 2 --sp --schedule zb-h1",
        "--dp 2 --tp 2 --zero 3",
        "--dp 2 --tp 2 --sp --zero 3",
        "--pp 2 --dp 2 --zero 3",
        "--pp 2 --dp 2 --zero 3 --schedule interleaved --chunks 2 --microbatches 4",
        "--pp 2 --dp 2 --zero 3 --schedule zb-h1",  # ZeRO-3's units are recomputed segments: whole in B
        "--pp 2 --dp 2 --zero 1 --schedule zb-v",
        "--pp 2 --tp 2 --sp --schedule zb-v",
        "--pp 2 --dp 2 --zero 3 --schedule zb-v",
    ],
)
def test_four_rank_layouts_lie_on_the_serial_curve(tmp_path, layout):
    run_layout(tmp_path, layout)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("layout", ["--pp 4 --schedule zb-v", "--pp 4 --schedule interleaved --chunks 2"])
def test_eight_parts_on_four_stages_lie_on_the_serial_curve(tmp_path, layout):
    # 4 stages x 2 chunks need 8 blocks; ZB-V's stage 0 holds the embedding and the head (tied)
    run_layout(tmp_path, layout, ["--layers", "8"], key="layers8")


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layout", ["--dp 2 --zero 3", "--pp 2 --schedule interleaved --chunks 2 --microbatches 4"])
def test_two_rank_layouts_lie_on_the_serial_curve(tmp_path, layout):
    run_layout(tmp_path, layout)


@pytest.mark.world_size(4)
@pytest.mark.parametrize(
    "layout",
    [
        "--cp 4",
        "--cp 4 --cp-split contiguous",
        "--cp 4 --cp-algo alltoall",
        "--dp 2 --cp 2",
        "--cp 2 --tp 2",
        "--dp 2 --cp 2 --zero 1",
        "--dp 2 --cp 2 --zero 3",
        "--dp 2 --cp 2 --zero 3 --cp-algo alltoall",
    ],
)
def test_context_parallel_layouts_lie_on_the_serial_curve(tmp_path, layout):
    run_layout(tmp_path, layout, text_data(tmp_path), key="text")


@pytest.mark.world_size(2)
def test_two_rank_context_parallel_lies_on_the_serial_curve(tmp_path):
    run_layout(tmp_path, "--cp 2 --cp-algo alltoall --cp-split contiguous", text_data(tmp_path), key="text")


@pytest.mark.world_size(2)
@pytest.mark.parametrize("algo", ["ring", "alltoall"])
def test_context_parallel_trace_reports_the_overlap(tmp_path, capsys, algo):
    """With --trace the run prints the share of CP message time hidden behind attention: the ring
    posts each K/V transfer before the block it overlaps; all-to-all waits before attention."""
    out = parallel_cases.shared_dir(tmp_path)
    layout = ["--cp", "2", "--cp-algo", algo, "--steps", "1", "--trace", str(out / "t.json")]
    assert main(["train", *TINY, *text_data(tmp_path), *layout, "--out", str(out / "r")]) == 0
    if dist.get_rank() == 0:
        line = next(x for x in capsys.readouterr().err.splitlines() if "overlapped attention compute" in x)
        share = int(line.split("): ")[1].split("%")[0]) / 100
        assert (share > 0) if algo == "ring" else (share == 0), line


MOE = ["--experts", "4", "--dropout", "0"]  # expert dropout masks follow the layout's token order: refused


@pytest.mark.world_size(4)
@pytest.mark.parametrize(
    "layout, routing",
    [
        ("--ep 4", ""),
        ("--ep 2 --dp 2", ""),
        ("--dp 4", ""),
        ("--ep 4", "--topk 1"),
        ("--ep 4", "--capacity-factor 1.0"),
    ],
)
def test_expert_parallel_layouts_lie_on_the_serial_curve(tmp_path, layout, routing):
    """Same routing, same drops (GShard queues over the whole batch), same aux loss as one process."""
    extra = [*MOE, *routing.split()]
    run_layout(tmp_path, layout, extra, key=f"moe {routing}")


@pytest.mark.world_size(2)
def test_expert_parallel_reports_and_draws_the_expert_load(tmp_path):
    out = parallel_cases.shared_dir(tmp_path)
    args = [*TINY, *MOE, "--capacity-factor", "1.0", "--ep", "2", "--out", str(out / "r")]
    assert main(["train", *[a for a in args if a != "--no-plot"]]) == 0
    if dist.get_rank() == 0:
        steps = metrics(out / "r")["steps"]
        for s in steps:
            assert len(s["moe"]["load"]) == 4 and 0 <= s["moe"]["dropped"] < 1 and s["moe"]["aux"] > 0
        assert sum(steps[0]["moe"]["load"]) == 2 * 8 * 8 * 4  # top-2 x batch x tokens x layers
        assert (out / "r" / "expert_load.png").stat().st_size > 5000


@pytest.mark.world_size(8)
@pytest.mark.parametrize("zero", ["1", "3"])
def test_every_strategy_at_once_lies_on_the_serial_curve(tmp_path, zero):
    """Needs `mpirun -n 8` (the suite's 4 ranks skip it): DP x PP x TP with SP and ZeRO-1 or 3."""
    run_layout(tmp_path, f"--dp 2 --pp 2 --tp 2 --sp --zero {zero}")


@pytest.mark.world_size(4)
def test_zero_prints_memory_per_rank_and_trace_shows_every_rank(tmp_path, capsys):
    out = parallel_cases.shared_dir(tmp_path)
    trace = out / "trace.json"
    assert (
        main(
            [
                "train",
                *TINY,
                "--steps",
                "1",
                "--dp",
                "2",
                "--tp",
                "2",
                "--zero",
                "1",
                "--out",
                str(out / "r"),
                "--trace",
                str(trace),
            ]
        )
        == 0
    )
    if dist.get_rank() == 0:
        assert "ZeRO-1 memory per rank" in capsys.readouterr().err
        events = json.loads(trace.read_text())
        events = events["traceEvents"] if isinstance(events, dict) else events
        assert {e["pid"] for e in events if e.get("name") == "all_reduce"} == {0, 1, 2, 3}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("schedule,m", [("1f1b", 4), ("zb-v", 4), ("zb-v", 1)])
def test_pipeline_plot_and_trace_leave_their_files(tmp_path, capsys, schedule, m):
    out = parallel_cases.shared_dir(tmp_path)
    layout = ["--pp", "2", "--schedule", schedule, "--microbatches", str(m), "--plot", "--trace", str(out / "t.json")]
    assert main(["train", *TINY, *layout, "--out", str(out / "r")]) == 0
    if dist.get_rank() == 0:
        # the measured bubble next to the simulated one and the formula, and each stage's peak bytes
        line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith(f"pipeline ({schedule})"))
        formula = f"{bubble_formula(2, m, 2 if schedule == 'zb-v' else 1, schedule=schedule):.1%}"
        assert "measured bubble share" in line and f"formula {formula}" in line, line
        assert ("(a floor below m = 2)" in line) == (schedule == "zb-v" and m < 2), line  # exact from m = p
        peaks = json.loads(line.split("peak activation bytes per stage ")[1].split(";")[0])
        assert len(peaks) == 2 and min(peaks) > 0, line
        for name in ("pipeline.png", "activation_memory.png", "metrics.json", "ckpt/manifest.json"):
            assert (out / "r" / name).stat().st_size > 0, name
        events = json.loads((out / "t.json").read_text())
        events = events["traceEvents"] if isinstance(events, dict) else events
        assert {e.get("pid") for e in events if e.get("name", "").startswith("F")} >= {0, 1}


@pytest.mark.world_size(2)
@pytest.mark.parametrize(
    "extra, message",
    [
        (["--dp", "4"], "needs exactly 4 ranks"),
        (["--pp", "2", "--dp", "2"], "needs exactly 4 ranks"),
        (["--dp", "2", "--batch-size", "7"], "does not split into 2 replicas; use a multiple of 2"),
        (["--dp", "2", "--bucket-mb", "0"], "--bucket-mb must be positive"),
        (["--pp", "2", "--microbatches", "3"], "does not split into 1 replicas x 3 micro-batches"),
        (["--pp", "2", "--chunks", "2"], "needs --schedule interleaved"),
        (["--pp", "2", "--layers", "1"], "one would be empty"),
        (
            ["--pp", "2", "--layers", "3", "--schedule", "zb-v"],
            "zb-v puts two chunks of blocks on each of the 2 stages",
        ),
        (
            ["--pp", "2", "--schedule", "zb-v", "--chunks", "3"],
            "zb-v runs two chunks per stage in a V; drop --chunks 3",
        ),
        (["--pp", "2", "--zero", "2"], "use --zero 1 with --pp"),
        (["--tp", "2", "--heads", "3", "--width", "33"], "number of attention heads = 3"),
        (["--sp"], "add --tp 2 or more"),
        (["--ep", "2"], "--ep places experts on ranks: add --experts"),
        (["--ep", "2", "--experts", "3"], "--experts 3 does not split over --ep 2"),
        (["--ep", "2", "--experts", "4"], "use --dropout 0 with --experts across ranks"),
        (
            ["--dp", "2", "--experts", "2", "--dropout", "0", "--zero", "1"],
            "--experts composes with --dp and --ep only",
        ),
        (["--cp", "2", "--pp", "2"], "--cp with --pp is not composed here"),
        (["--cp", "2", "--tp", "2", "--sp"], "--cp and --sp both cut the sequence"),
        (["--cp", "2", "--digits", "3"], "a sequence has 11 tokens: choose --block-size"),
    ],
)
def test_impossible_layouts_are_refused_with_what_to_change(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exc:
        main(["train", *TINY, "--out", str(tmp_path), *extra])
    assert exc.value.code == 2
    if dist.get_rank() == 0:
        assert message in capsys.readouterr().err


@pytest.mark.world_size(2)
def test_the_mesh_runner_implements_the_runner_protocol():
    from tinytrain.nn import GPT, GPTConfig
    from tinytrain.parallel.plan import Plan
    from tinytrain.trainer.runners import MeshRunner, Runner

    model = GPT(GPTConfig(vocab_size=6, block_size=4, n_layer=2, n_head=2, n_embd=8))
    assert isinstance(MeshRunner(model, Plan(pp=2), batch_size=4), Runner)


def test_mpirun_without_a_layout_is_data_parallel_over_every_rank(tmp_path):
    """`mpirun -n 2 tinytrain train` with no layout flag: one data-parallel run over both ranks (said
    once, on rank 0), on the serial curve; not two serial runs racing on one --out. Starts its own
    mpirun (no world_size marker: under an outer mpirun it runs on rank 0 only)."""
    import shutil
    import subprocess
    import sys

    from grader.run import mpi_environment

    if shutil.which("mpirun") is None:
        pytest.skip("needs mpirun")
    tiny = [a for a in TINY if a != "--quiet"]
    argv = [
        *launcher.mpirun_command(2),
        sys.executable,
        "-m",
        "tinytrain.cli",
        "train",
        *tiny,
        "--out",
        str(tmp_path / "run"),
    ]
    env = dict(mpi_environment(), TINYTRAIN_DEVICE="cpu")
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("2 ranks, no layout flag: data parallel over all 2 (--dp 2)") == 1, r.stderr
    assert r.stderr.count("tinytrain: GPT with") == 1, r.stderr  # one run, one banner
    manifest = json.loads((tmp_path / "run" / "ckpt" / "manifest.json").read_text())
    assert manifest["layout"] == "--dp 2" and manifest["world_size"] == 2
    assert_on_serial_curve(tmp_path / "run", tmp_path)
