"""``tinytrain bench plan``: the calibrated planner's data-parallel step time against a measured one.

    mpirun -n 4 tinytrain bench plan

Three measurements in one run, each the best of ``--rounds`` (noise on a shared machine only ever
adds time): the α-β links of this machine, fitted to our ring all-reduce at two sizes (``bench
collectives``); the compute of one rank's rows, a serial forward + backward + AdamW step run on every
rank at once (so the cores are shared as in the data-parallel run); and a real ``--dp N`` step. The
planner's step (``planner.run_time``: compute + the gradients' all-reduce + the loss average) is
printed next to the measured one, as a ratio. A figure, not a test: it depends on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import types

import numpy


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--rounds", type=int, default=3, help="each measurement's best of this many")


def run(args) -> int:
    from tinytrain import distributed as dist
    from tinytrain import planner
    from tinytrain.bench import collectives
    from tinytrain.nn import GPT, GPTConfig
    from tinytrain.optim import AdamW
    from tinytrain.parallel.plan import Plan

    if args.rounds < 1:
        raise ValueError(f"--rounds must be positive, got {args.rounds}")
    n, rank = dist.get_world_size(), dist.get_rank()
    if n < 2 or args.batch_size % n:
        raise ValueError(
            f"bench plan compares a data-parallel step over the ranks of this run ({n}): run it under "
            f"mpirun -n 2 or more, with a --batch-size ({args.batch_size}) that the ranks divide"
        )
    config = GPTConfig(vocab_size=16, block_size=8, n_layer=args.layers, n_head=args.heads, n_embd=args.width)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "links.json") if rank == 0 else None
        calibration = types.SimpleNamespace(
            sizes=["16K", "256K", "4M"], collectives=["all_reduce"], algo="ring", rounds=args.rounds, json=path,
            overlap=False, impl="reference",
        )  # fmt: skip
        collectives.run(calibration)
        rows = json.load(open(path)) if rank == 0 else None
    rng = numpy.random.default_rng(0)
    x, y = (rng.integers(0, 16, size=(args.batch_size // n, 8)) for _ in range(2))
    serial = []
    for _ in range(args.rounds):
        model = GPT(config, seed=0)
        optimizer = AdamW(model.parameters(), lr=1e-3)
        start = time.perf_counter()
        model.loss(x, y).backward()
        optimizer.step()
        serial.append(time.perf_counter() - start)
    compute = float(dist.all_reduce(numpy.array([min(serial)]), op="max")[0])
    measured = min(
        float(dist.all_reduce(numpy.array([planner.measure_step(Plan(dp=n), config, args.batch_size)[1]]), op="max")[0])
        for _ in range(args.rounds)
    )
    if rank != 0:
        return 0
    alpha, bandwidth = planner.calibrate(rows)
    spec = planner.ModelSpec(
        layers=args.layers, hidden=args.width, heads=args.heads, vocab=16, seq=8, batch=args.batch_size
    )
    predicted = planner.run_time(spec, n, compute, alpha, bandwidth, buckets=[4 * spec.parameters])
    print(f"# tinytrain bench plan: --dp {n}, GPT {args.layers} x {args.width}, batch {args.batch_size}")
    print(f"# links fitted to our ring all-reduce: alpha {alpha * 1e6:.0f} us, {bandwidth / 1e9:.3f} GB/s")
    print(
        f"predicted step {predicted['step'] * 1e3:.2f} ms (compute {predicted['compute'] * 1e3:.2f}, "
        f"gradients {predicted['gradients'] * 1e3:.2f}, loss average {predicted['loss'] * 1e3:.2f})"
    )
    print(f"measured step {measured * 1e3:.2f} ms; ratio predicted / measured {predicted['step'] / measured:.2f}")
    return 0
