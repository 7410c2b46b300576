"""``mpirun -n 4 tinytrain bench fed``: what each piece of federated learning costs, measured.

Trains the same GPT on the built-in addition task, from the same seed, under ``--dp-algo fedavg``
in six settings: iid and skewed data (``skew:ALPHA``), every client or a quarter of them a round,
secure aggregation on, and DP-FedAvg's clipping and noise. Each round is the trainer's own step
(``trainer.loop.train_step``); the bytes the ranks sent in it are counted (``dist.comm_stats``)
and summed over the ranks; after each round the global model's loss on a fixed validation batch
is measured. It prints, per setting, the bytes per round (the ranks' all-reduce, and what a deployment's
clients would upload and download: 2·S·Ψ·4), the final validation loss, the first
round whose validation loss (mean over ``--window`` rounds) reaches ``--target`` and the bytes sent
by then, ε where noise is added, and how far secure aggregation's curve is from the plain one's;
it draws ``OUT/fed.png`` (loss against rounds and against bytes, and the skewed clients' label
shares) and keeps every number in ``OUT/fed.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tinytrain.bench.dp_algos import reached
from tinytrain.parallel.federated import selected_count


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--local-steps", type=int, default=4, help="H: each client's steps a round")
    p.add_argument("--alpha", type=float, default=0.3, help="the skewed runs' --partition skew:ALPHA")
    p.add_argument("--clip", type=float, default=1.0, help="DP-FedAvg's bound on each update's norm")
    p.add_argument("--sigma", type=float, default=0.02, help="DP-FedAvg's noise multiplier")
    p.add_argument("--client-batch", type=int, default=8, help="rows of each client's local step (in every setting)")
    p.add_argument("--target", type=float, default=1.6, help="the validation loss to reach (mean over --window)")
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--out", default="runs/fed", help="folder for fed.png and fed.json")


def settings(args) -> list[tuple[str, list[str]]]:
    skew, quarter = f"skew:{args.alpha:g}", str(max(0.25, 2 / args.clients))
    return [
        ("iid, all", ["--partition", "iid"]),
        (f"{skew}, all", ["--partition", skew]),
        ("iid, 25 %", ["--partition", "iid", "--participation", quarter]),
        (f"{skew}, 25 %", ["--partition", skew, "--participation", quarter]),
        ("iid, 25 %, secure", ["--partition", "iid", "--participation", quarter, "--secure-agg"]),
        (
            f"iid, 25 %, σ {args.sigma:g}",
            [
                "--partition",
                "iid",
                "--participation",
                quarter,
                "--clip",
                f"{args.clip:g}",
                "--dp-noise",
                f"{args.sigma:g}",
            ],
        ),
    ]


def train_flags(extra: list[str], args, ranks: int) -> argparse.Namespace:
    from tinytrain.trainer.args import add_arguments as trainer_arguments
    from tinytrain.trainer.args import check_args

    parser = argparse.ArgumentParser()
    trainer_arguments(parser)
    flags = ["--steps", str(args.rounds), "--width", str(args.width), "--dp", str(ranks), "--dp-algo", "fedavg"]
    flags += ["--clients", str(args.clients), "--local-steps", str(args.local_steps), *extra]
    train_args = parser.parse_args(flags)
    chosen = selected_count(args.clients, train_args.participation)
    train_args.batch_size = args.client_batch * chosen  # (the rows of a local step over the round's clients)
    check_args(train_args)
    return train_args


def measure(name: str, extra: list[str], args, ranks: int) -> dict:
    """One run: per round the validation loss, the bytes of all ranks; ε at the end (with noise)."""
    import numpy

    from tinytrain import distributed as dist
    from tinytrain.autograd import no_grad
    from tinytrain.backend import xp
    from tinytrain.data import load_dataset
    from tinytrain.trainer.args import build_model, plan_of
    from tinytrain.trainer.loop import build_optimizer, train_step
    from tinytrain.trainer.runners import make_runner

    flags = train_flags(extra, args, ranks)
    dataset = load_dataset(flags.data, flags.block_size, flags.digits)
    model = build_model(flags, dataset)
    runner = make_runner(model, plan_of(flags), flags.batch_size, dataset)
    optimizer, schedule = build_optimizer(flags, runner.parameters())
    x_val, y_val = (xp.asarray(a) for a in dataset.batch("val", 256, seed=flags.seed + 1, step=0))
    losses, sent = [], []
    for step in range(1, flags.steps + 1):
        with dist.comm_stats() as stats:
            train_step(runner, optimizer, schedule, dataset, flags, step)
        sent.append(stats.sent() - stats.sent("debug_check"))
        with no_grad():  # (every rank holds the same global model)
            losses.append(float(model.loss(x_val, y_val).item()))
    total = dist.all_reduce(numpy.asarray(sent, dtype=numpy.int64))
    fed = runner.parallel.dp
    return {
        "name": name,
        "flags": extra,
        "loss": losses,
        "bytes": total.tolist(),
        "psi": fed.size,
        "clients_per_round": len(fed.selected),
        "client_bytes_per_round": 2 * len(fed.selected) * fed.size * 4,  # each uploads Ψ and downloads Ψ
        "epsilon": fed.epsilon,
        "label_shares": fed.data.label_shares().tolist(),
    }


def table(results: list, target: float, window: int) -> str:
    lines = [
        f"{'setting':<22}{'clients':>8}{'ranks bytes':>13}{'clients bytes':>15}{'final val':>11}"
        f"{f'round to {target:g}':>15}{'bytes to it':>15}{'ε (δ 1e-5)':>12}",
    ]
    for r in results:
        at, sent = reached(r, target, window)
        final = sum(r["loss"][-window:]) / min(window, len(r["loss"]))
        eps = f"{r['epsilon']:.3g}" if r["epsilon"] is not None else "-"
        by_then = f"{sent:,}" if sent else "not reached"
        lines.append(
            f"{r['name']:<22}{r['clients_per_round']:>8}{sum(r['bytes']) / len(r['bytes']):>13,.0f}"
            f"{r['client_bytes_per_round']:>15,}{final:>11.4f}{at if at else '-':>15}{by_then:>15}{eps:>12}"
        )
    plain = next((r for r in results if r["name"] == "iid, 25 %"), None)
    secure = next((r for r in results if r["name"].endswith("secure")), None)
    if plain and secure:
        gaps = [abs(a - b) for a, b in zip(plain["loss"], secure["loss"])]
        more = sum(secure["bytes"]) / max(sum(plain["bytes"]), 1)
        lines.append(
            f"secure aggregation: the plain curve within {max(gaps):.1e} (round 1: {gaps[0]:.1e}, the last: "
            f"{gaps[-1]:.1e}; the fixed point's 2^-32 rounding, grown where training is chaotic), {more:.2f}x the "
            "bytes (8-byte integers, as the float64 sum)"
        )
    return "\n".join(lines)


def run(args) -> int:
    from tinytrain import distributed as dist

    dist.init()
    ranks, rank = dist.get_world_size(), dist.get_rank()
    if args.clients % ranks:
        raise ValueError(f"--clients {args.clients} does not split over {ranks} ranks: use a multiple of {ranks}")
    results = []
    for name, extra in settings(args):
        if "--dp-noise" in extra:
            try:
                import dp_accounting  # noqa: F401
            except ImportError:
                if rank == 0:
                    print(f"{name}: skipped (ε needs dp-accounting: pip install 'tinytrain[privacy]')", file=sys.stderr)
                continue
        results.append(measure(name, extra, args, ranks))
        if rank == 0:
            print(f"{name}: done", file=sys.stderr, flush=True)
    if rank != 0:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from tinytrain import checkpoint
    from tinytrain.viz import plot_fed

    summary = {"ranks": ranks, "rounds": args.rounds, "target": args.target, "window": args.window, "runs": results}
    checkpoint.atomic_write(out / "fed.json", lambda f: f.write(json.dumps(summary).encode()))
    checkpoint.atomic_write(out / "fed.png", lambda f: plot_fed(results, f, args.target))
    print(
        f"{ranks} ranks, {args.clients} clients, {args.rounds} rounds of --local-steps {args.local_steps}, "
        f"--width {args.width}, seed 0 for every run"
    )
    print(table(results, args.target, args.window))
    print(f"wrote {out / 'fed.png'} and {out / 'fed.json'}", file=sys.stderr)
    return 0
