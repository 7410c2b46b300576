"""``mpirun -n 4 tinytrain bench dp-algos``: communication against convergence, measured.

Trains the same GPT on the built-in addition task, from the same seed and batches, under each
``--dp-algo`` over all ranks: synchronous data parallel (all-reduce), the synchronous parameter
server, the asynchronous one (seeded serving order, so a rerun draws the same schedule), local
SGD and DiLoCo with ``--local-steps H``. Each step is the trainer's own (``trainer.loop.train_step``);
the bytes every rank sent in it are counted (``dist.comm_stats``) and summed over the ranks. It
prints, per algorithm, the bytes per step (all ranks; and sent + received by the busiest rank,
the parameter server's bottleneck: the ring spreads the same total evenly), the loss at the end
and the first step at which the loss (averaged over ``--window`` steps) reaches ``--target``,
with the bytes sent until then, and draws ``OUT/dp_algos.png``: loss against steps, loss against
bytes sent, and the asynchronous server's staleness histogram. ``OUT/dp_algos.json`` keeps every number.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ALGOS = ("allreduce", "ps", "async-ps", "local-sgd", "diloco")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--local-steps", type=int, default=8, help="H of local-sgd and diloco")
    p.add_argument("--target", type=float, default=1.2, help="the loss to reach (averaged over --window steps)")
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--out", default="runs/dp_algos", help="folder for dp_algos.png and dp_algos.json")
    p.add_argument("--algos", nargs="+", choices=ALGOS, default=list(ALGOS))


def train_flags(algo: str, args, ranks: int) -> argparse.Namespace:
    """The ``tinytrain train`` arguments of one run (the trainer's parser, defaults and checks)."""
    from tinytrain.trainer.args import add_arguments as trainer_arguments
    from tinytrain.trainer.args import check_args

    parser = argparse.ArgumentParser()
    trainer_arguments(parser)
    flags = ["--steps", str(args.steps), "--width", str(args.width), "--dp", str(ranks), "--dp-algo", algo]
    if algo in ("local-sgd", "diloco"):
        flags += ["--local-steps", str(args.local_steps)]
    if algo == "async-ps":
        flags += ["--ps-order", "seeded"]
    train_args = parser.parse_args(flags)
    check_args(train_args)
    return train_args


def measure(algo: str, args, ranks: int) -> dict:
    """One run: loss and bytes (all ranks together) per step; the staleness of every update."""
    import numpy

    from tinytrain import distributed as dist
    from tinytrain.data import load_dataset
    from tinytrain.trainer.args import build_model, plan_of
    from tinytrain.trainer.loop import build_optimizer, train_step
    from tinytrain.trainer.runners import make_runner

    flags = train_flags(algo, args, ranks)
    dataset = load_dataset(flags.data, flags.block_size, flags.digits)
    model = build_model(flags, dataset)
    runner = make_runner(model, plan_of(flags), flags.batch_size)
    optimizer, schedule = build_optimizer(flags, runner.parameters())
    losses, sent, link = [], [], 0
    for step in range(1, flags.steps + 1):
        with dist.comm_stats() as stats:
            loss, _, _ = train_step(runner, optimizer, schedule, dataset, flags, step)
        losses.append(loss)
        sent.append(stats.sent() - stats.sent("debug_check"))
        link += stats.sent() + stats.recv() - stats.sent("debug_check") - stats.recv("debug_check")
    total = dist.all_reduce(numpy.asarray(sent, dtype=numpy.int64))  # every rank's bytes, per step
    busiest = dist.all_reduce(numpy.asarray([link], dtype=numpy.int64), op="max")  # sent + received
    wrapper = runner.parallel.dp
    return {
        "algo": algo,
        "loss": losses,
        "bytes": total.tolist(),
        "busiest_link_per_step": int(busiest[0]) / flags.steps,
        "staleness": list(getattr(wrapper, "staleness", [])),
        "local_steps": flags.local_steps,
    }


def reached(result: dict, target: float, window: int) -> tuple[int | None, int | None]:
    """(first step whose mean loss over the last ``window`` steps is at most ``target``, bytes sent
    by then), or (None, None)."""
    loss, cumulative = result["loss"], 0
    for i, b in enumerate(result["bytes"]):
        cumulative += b
        if i + 1 >= window and sum(loss[i + 1 - window : i + 1]) / window <= target:
            return i + 1, cumulative
    return None, None


def name_of(result: dict) -> str:
    local = result["algo"] in ("local-sgd", "diloco")
    return f"{result['algo']} H={result['local_steps']}" if local else result["algo"]


def table(results: list, target: float, window: int) -> str:
    lines = [
        f"{'algorithm':<16}{'bytes/step':>12}{'busiest rank':>14}{'final loss':>12}{f'step to {target:g}':>14}"
        f"{'bytes to it':>16}",
    ]
    for r in results:
        step, sent = reached(r, target, window)
        final = sum(r["loss"][-window:]) / min(window, len(r["loss"]))
        per = sum(r["bytes"]) / len(r["bytes"])
        lines.append(
            f"{name_of(r):<16}{per:>12,.0f}{r['busiest_link_per_step']:>14,.0f}{final:>12.4f}"
            f"{step if step else '-':>14}"
            f"{(f'{sent:,}' if sent else 'not reached'):>16}"
        )
    best = [r for r in results if reached(r, target, window)[1] is not None]
    if best:
        winner = min(best, key=lambda r: reached(r, target, window)[1])
        lines.append(f"fewest bytes to loss {target:g}: {name_of(winner)}")
    return "\n".join(lines)


def run(args) -> int:
    from tinytrain import distributed as dist

    dist.init()
    ranks, rank = dist.get_world_size(), dist.get_rank()
    if ranks < 2:
        raise ValueError("bench dp-algos compares data-parallel algorithms: run it under mpirun -n 4")
    results = []
    for algo in args.algos:
        results.append(measure(algo, args, ranks))
        if rank == 0:
            print(f"{name_of(results[-1])}: done", file=sys.stderr, flush=True)
    if rank != 0:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from tinytrain import checkpoint
    from tinytrain.viz import plot_dp_algos

    summary = {"ranks": ranks, "steps": args.steps, "target": args.target, "window": args.window, "runs": results}
    checkpoint.atomic_write(out / "dp_algos.json", lambda f: f.write(json.dumps(summary).encode()))
    names = [name_of(r) for r in results]
    checkpoint.atomic_write(out / "dp_algos.png", lambda f: plot_dp_algos(results, names, f, args.target))
    print(f"{ranks} ranks, {args.steps} steps, --width {args.width}, seed 0 for every run")
    print(table(results, args.target, args.window))
    print(f"wrote {out / 'dp_algos.png'} and {out / 'dp_algos.json'}", file=sys.stderr)
    return 0
