"""``tinytrain plan``: which layouts of a model fit a cluster, and which is fastest, with the reason
in numbers. The estimates are ``layouts.py``'s (see its docstring), the checks against this machine
``measured.py``'s; this file is the command.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace

from .layouts import (
    GB,
    OPTIONAL,
    PRESETS,
    Cluster,
    Layout,
    ModelSpec,
    best,
    estimate,
    layouts,
    memory_per_gpu,
    most_gpus,
    no_layout,
    plan,
)
from .measured import bench_points, calibrate, measure_step, run_bytes, run_time, tinytrain_memory

__all__ = [
    "GB",
    "OPTIONAL",
    "PRESETS",
    "Cluster",
    "Layout",
    "ModelSpec",
    "best",
    "estimate",
    "layouts",
    "memory_per_gpu",
    "most_gpus",
    "no_layout",
    "plan",
    "bench_points",
    "calibrate",
    "measure_step",
    "run_bytes",
    "run_time",
    "tinytrain_memory",
    "add_arguments",
    "run",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt3-175b", help=f"a preset: {', '.join(PRESETS)}")
    for name, what in (
        ("experts", "experts per MoE layer (0: dense)"),
        ("top_k", "experts each token runs"),
        ("layers", "transformer blocks"),
        ("hidden", "width"),
        ("heads", "attention heads"),
        ("vocab", "vocabulary size"),
        ("seq", "sequence length"),
        ("batch", "global batch in sequences"),
    ):
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=None, help=f"{what} (overrides the preset)"
        )
    parser.add_argument(
        "--capacity-factor", type=float, default=None, help="the busiest EP rank's tokens over the even share"
    )
    c = Cluster()
    parser.add_argument("--nodes", type=int, default=c.nodes)
    parser.add_argument("--gpus-per-node", type=int, default=c.gpus_per_node)
    parser.add_argument("--memory-gb", type=float, default=c.memory / GB, help="memory per GPU")
    parser.add_argument("--peak-tflops", type=float, default=c.peak_flops / 1e12, help="peak per GPU")
    parser.add_argument("--efficiency", type=float, default=c.efficiency, help="share of peak large matmuls reach")
    parser.add_argument(
        "--half-tokens",
        type=int,
        default=c.half_tokens,
        help="tokens per GPU and micro-batch at which matmuls reach half",
    )
    parser.add_argument("--intra-gbps", type=float, default=c.intra_bw / GB, help="intra-node GB/s per GPU")
    parser.add_argument("--inter-gbps", type=float, default=c.inter_bw / GB, help="inter-node GB/s per GPU")
    parser.add_argument("--intra-latency-us", type=float, default=c.intra_alpha * 1e6)
    parser.add_argument("--inter-latency-us", type=float, default=c.inter_alpha * 1e6)
    parser.add_argument(
        "--without", nargs="+", default=[], choices=OPTIONAL, help="leave strategies out (e.g. a paper's search space)"
    )
    parser.add_argument("--top", type=int, default=5, help="how many layouts to print")
    parser.add_argument("--json", action="store_true", help="print every layout's estimate as JSON")
    parser.add_argument(
        "--measure",
        action="store_true",
        help="under mpirun and an emulated topology (TINYTRAIN_TOPOLOGY=2x2): run a few steps of each "
        "dp x tp x pp layout and print the measured ranking next to the predicted one (the cluster flags "
        "are then calibrated, not read)",
    )
    parser.add_argument("--steps", type=int, default=3, help="--measure: timed steps per layout (best is kept)")


def from_args(args) -> tuple[ModelSpec, Cluster]:
    if args.model not in PRESETS:
        raise ValueError(f"--model {args.model} is not a preset; choose one of {', '.join(PRESETS)}")
    overrides = {
        k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab", "seq", "batch", "experts", "top_k")
    }
    overrides["capacity_factor"] = args.capacity_factor
    model = replace(PRESETS[args.model], **{k: v for k, v in overrides.items() if v is not None})
    for k, v in asdict(model).items():
        if isinstance(v, int) and not isinstance(v, bool) and v < (0 if k == "experts" else 1):
            raise ValueError(f"--{k.replace('_', '-')} must be at least {0 if k == 'experts' else 1}, got {v}")
    if model.experts and model.top_k > model.experts:
        raise ValueError(f"--top-k {model.top_k} is more than --experts {model.experts}")
    if not model.capacity_factor >= 1:
        raise ValueError(f"--capacity-factor must be at least 1, got {model.capacity_factor}")
    if model.hidden % model.heads:
        raise ValueError(f"--hidden {model.hidden} does not split into --heads {model.heads}")
    positive = ("nodes", "gpus_per_node", "memory_gb", "peak_tflops", "efficiency", "intra_gbps", "inter_gbps")
    for k in ("half_tokens", "intra_latency_us", "inter_latency_us"):
        if not getattr(args, k) >= 0:
            raise ValueError(f"--{k.replace('_', '-')} must be at least 0, got {getattr(args, k)}")
    for k in positive:
        if not getattr(args, k) > 0:  # nan too
            raise ValueError(f"--{k.replace('_', '-')} must be positive, got {getattr(args, k)}")
    if args.top < 1:
        raise ValueError(f"--top must be at least 1, got {args.top}")
    if not args.efficiency <= 1:
        raise ValueError(f"--efficiency is a share of peak: at most 1, got {args.efficiency}")
    cluster = Cluster(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        memory=args.memory_gb * GB,
        peak_flops=args.peak_tflops * 1e12,
        efficiency=args.efficiency,
        half_tokens=args.half_tokens,
        intra_bw=args.intra_gbps * GB,
        inter_bw=args.inter_gbps * GB,
        intra_alpha=args.intra_latency_us * 1e-6,
        inter_alpha=args.inter_latency_us * 1e-6,
    )
    return model, cluster


def _row(r: dict) -> str:
    mem, t = r["memory"], r["time"]
    return (
        f"{r['flags']:<52} {mem['total'] / GB:6.1f} GB  step {t['step']:8.3f} s  {r['mfu']:5.1%} MFU  "
        f"(compute {t['compute']:.2f}, TP {t['tensor_parallel']:.2f} {r['links']['tp']}, "
        f"bubble {t['bubble_share']:.0%}, PP {t['pipeline_messages']:.2f}, DP {t['data_parallel_exposed']:.2f}"
        + (f", EP {t['expert_parallel']:.2f} {r['links']['ep']}" if r["layout"]["ep"] > 1 else "")
        + ")"
    )


def run(args) -> int:
    model, cluster = from_args(args)
    if args.measure:
        return _measure(model, args)
    rows = plan(model, cluster, without=args.without)
    if not rows:
        raise ValueError(no_layout(model, cluster.gpus, args.without))
    if args.json:
        json.dump({"model": asdict(model), "cluster": asdict(cluster), "layouts": rows}, sys.stdout)
        print()
        return 0
    fitting = [r for r in rows if r["fits"]]
    print(
        f"{args.model}: {model.parameters / 1e9:.1f}B parameters, batch {model.batch} x {model.seq} tokens, "
        f"on {cluster.nodes} x {cluster.gpus_per_node} GPUs of {cluster.memory / GB:.0f} GB"
    )
    if not fitting:
        smallest = min(rows, key=lambda r: r["memory"]["total"])
        more = "add GPUs or memory" if cluster.gpus < most_gpus(model, args.without) else "add memory"
        if more == "add memory":
            more += " (this model cannot use more GPUs) or make the model smaller"
        print(f"no layout fits (the smallest needs {smallest['memory']['total'] / GB:.4g} GB per GPU): {more}")
        return 1
    print(f"{len(fitting)} of {len(rows)} layouts fit; the fastest:")
    for r in fitting[: args.top]:
        print("  " + _row(r))
    inside = next((r for r in fitting if r["links"]["tp"] == "intra-node"), None)
    across = next((r for r in fitting if r["links"]["tp"] == "inter-node"), None)
    if inside and across:
        print(
            f"TP inside a node: best {inside['time']['step']:.3f} s/step; TP across nodes: best "
            f"{across['time']['step']:.3f} s/step ({across['flags']}), its TP all-reduces cost "
            f"{across['time']['tensor_parallel']:.2f} s on the {cluster.inter_bw / GB:g} GB/s link"
        )
    return 0


def _measure(model: ModelSpec, args) -> int:
    """``--measure``: the predicted and the measured ranking under the emulated topology (``emulated.py``)."""
    from tinytrain.distributed import topology

    from . import emulated

    wanted = topology.active or topology.from_env()  # a bad setting: one sentence, before MPI starts
    if wanted is None:
        raise ValueError(
            "plan --measure runs the layouts on an emulated cluster: set TINYTRAIN_TOPOLOGY (e.g. "
            "TINYTRAIN_TOPOLOGY=2x2 mpirun -n 4 tinytrain plan --measure --model tinytrain)"
        )
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    from tinytrain import distributed as dist

    dist.init()
    before = topology.install(wanted)
    try:
        result = emulated.measure(model, steps=args.steps)
    finally:
        topology.install(before)
    if result is None:
        return 0
    if args.json:
        json.dump({"model": asdict(model), **result}, sys.stdout)
        print()
    else:
        print("\n".join(emulated.report(result)))
    return 0
