"""``tinytrain bench checkpoint``: what a checkpoint every step costs, synchronous vs asynchronous.

The same model and batch as ``bench step`` (``--configs default wide``), trained by the loop's own
runner (``SerialRunner``; under ``mpirun -n N``, ``MeshRunner`` with ``--dp N``) in three modes,
in alternating blocks of ``--block`` steps (none, sync, async, none, ...) so that load from
elsewhere hits all three alike:

    none    the step alone (forward, backward, AdamW), the reference measured in the same run
    sync    the step, then ``runner.save``: every rank writes its pieces, rank 0 the manifest
    async   the step, then ``runner.save(background=True)`` (``--ckpt-async``): the pieces copied to
            host memory, a thread writes them while the next step runs; the manifest at a later
            step's end (``runner.settle_save``), once every rank's pieces are on disk

A block's time runs until its last checkpoint is on disk and named: the background write of one
step takes the cores while the next steps run (the cost ``async`` hides only where a core is
idle), and a block never leaves its last write to slow the next mode's block. Each mode saves
into its own folder under ``--out`` (a temporary folder by default) every step. It prints, per
config, the median over blocks of the time per step of each mode as a ratio of ``none``'s, the cost of a
checkpoint as a share of a step, the time ``save`` keeps the step waiting (async: the snapshot
and, when the last write is not done yet, the wait for it), and the checkpoint's bytes. A write
slower than a step makes ``async`` wait for the one before at each save, so its cost approaches
``sync``'s less the overlap: with a checkpoint every c steps, the write hides behind c steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

MODES = ("none", "sync", "async")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tinytrain.bench.step import CONFIGS

    p.add_argument("--configs", nargs="+", default=["default", "wide"], choices=list(CONFIGS))
    p.add_argument("--rounds", type=int, default=3, help="timed blocks per mode and config (after an untimed one)")
    p.add_argument("--block", type=int, default=16, help="steps per block (its last write is waited for in it)")
    p.add_argument("--every", type=int, default=1, help="a checkpoint every this many steps (the loop's --ckpt-every)")
    p.add_argument("--out", default=None, help="folder for the checkpoints (default: a temporary one, removed)")
    p.add_argument("--json", default=None, help="write the rows to this file")


class Side:
    """One mode of one config: its own model, optimizer and checkpoint folder, all from seed 0."""

    def __init__(self, name: str, mode: str, folder: Path, world: int):
        from tinytrain.backend import xp
        from tinytrain.bench.step import _batch
        from tinytrain.nn import GPT
        from tinytrain.optim import AdamW
        from tinytrain.parallel.plan import Plan
        from tinytrain.trainer.runners import make_runner

        config, x, y = _batch(name)
        self.mode, self.folder = mode, folder / mode
        self.model = GPT(config, seed=0)
        self.runner = make_runner(self.model, Plan(dp=world), len(x))
        self.optimizer = AdamW(self.runner.parameters(), lr=1e-4, weight_decay=0.0)
        self.x, self.y = xp.asarray(x), xp.asarray(y)
        self.times, self.waits, self.step = [], [], 0

    def run_block(self, steps: int, timed: bool, every: int = 1) -> float:
        """``steps`` steps with a checkpoint each, until the last is on disk; returns the last loss."""
        from tinytrain import distributed as dist

        if dist.is_initialized():
            dist.barrier()  # every rank starts together: the slowest rank's time is the block's
        start, waits = time.perf_counter(), []
        for _ in range(steps):
            self.step += 1
            self.optimizer.zero_grad()
            loss = self.runner.forward_backward(self.x, self.y)
            self.runner.step(self.optimizer)
            saving = time.perf_counter()
            self.runner.settle_save()  # (what the loop does at every step's end)
            if self.mode != "none" and self.step % every == 0:
                background = self.mode == "async"
                self.runner.save(self.folder, self.step, self.optimizer, {"step": self.step}, background=background)
            waits.append(time.perf_counter() - saving)
        self.runner.settle_save(wait=True)
        if timed:
            self.times.append((time.perf_counter() - start) / steps)
            self.waits.extend(waits)
        return loss

    def size(self) -> int:
        """The bytes of the checkpoint on disk."""
        return sum(f.stat().st_size for f in self.folder.rglob("*") if f.is_file()) if self.mode != "none" else 0


def measure(name: str, rounds: int, block: int, folder: Path, world: int, every: int = 1) -> dict:
    sides = [Side(name, mode, folder, world) for mode in MODES]
    for side in sides:  # untimed: BLAS warm-up, the first folders made
        side.run_block(block, timed=False, every=block)
    losses = {}
    for _ in range(rounds):
        for side in sides:
            losses[side.mode] = side.run_block(block, timed=True, every=every)
    if len(set(losses.values())) != 1:  # the same model and batch: a mode that changed the numbers is a bug
        raise RuntimeError(f"bench checkpoint: the modes' losses differ ({losses}); a save changed the training")
    base = statistics.median(sides[0].times)
    row = {"config": name, "world": world, "every": every, "step_ms": round(base * 1e3, 2), "bytes": sides[1].size()}
    for side in sides[1:]:
        median = statistics.median(side.times)
        row[side.mode] = {
            "ratio": round(median / base, 3),
            "share": round((median - base) / base, 3),
            "wait_ms": round(statistics.median(side.waits) * 1e3, 2),
        }
    return row


def print_table(rows: list, versions: str) -> None:
    every = rows[0]["every"] if rows else 1
    often = "step" if every == 1 else f"{every} steps"
    print(f"a checkpoint every {often}, median over alternating blocks ({versions})")
    print(f"{'config':8} {'ranks':>5} {'bytes':>12} {'sync/step':>10} {'async/step':>11} {'sync cost':>10} "
          f"{'async cost':>11} {'sync wait':>10} {'async wait':>11}")  # fmt: skip
    for r in rows:
        s, a = r["sync"], r["async"]
        print(
            f"{r['config']:8} {r['world']:>5} {r['bytes']:>12,} {s['ratio']:>9.2f}x {a['ratio']:>10.2f}x "
            f"{s['share']:>9.0%} {a['share']:>10.0%} {s['wait_ms']:>8.1f}ms {a['wait_ms']:>9.1f}ms"
        )
    print("cost: the step's extra time as a share of a step without a checkpoint; wait: the median time the "
          "step end keeps the step (async: the snapshot, and any wait for the write before)")  # fmt: skip


def run(args) -> int:
    import shutil

    import numpy

    from tinytrain import distributed as dist
    from tinytrain.trainer.runners import launched_world

    if min(args.rounds, args.block, args.every) < 1:
        got = f"{args.rounds}, {args.block}, {args.every}"
        raise ValueError(f"--rounds, --block and --every must be at least 1, got {got}")
    world = launched_world()[1]
    folder = Path(args.out) if args.out else scratch_folder(world)
    try:
        rows = [measure(name, args.rounds, args.block, folder / name, world, args.every) for name in args.configs]
    finally:
        if world > 1:
            dist.barrier()
        if args.out is None and (world == 1 or dist.get_rank() == 0):
            shutil.rmtree(folder, ignore_errors=True)
    if world > 1 and dist.get_rank() != 0:
        return 0
    versions = f"NumPy {numpy.__version__}, Python {sys.version.split()[0]}"
    print_table(rows, versions)
    if args.json:
        Path(args.json).write_text(json.dumps({"versions": versions, "rows": rows}, indent=1))
    return 0


def scratch_folder(world: int) -> Path:
    """A new temporary folder, the same one on every rank (rank 0 names it)."""
    import numpy

    from tinytrain import distributed as dist

    tag = numpy.array([numpy.random.default_rng().integers(1 << 62)], dtype=numpy.int64)
    if world > 1:
        dist.init()
        dist.broadcast(tag, src=0)
    return Path(tempfile.gettempdir()) / f"tinytrain-ckpt-bench-{int(tag[0]):x}"


def parse(argv=None):
    p = argparse.ArgumentParser(prog="tinytrain bench checkpoint")
    add_arguments(p)
    return p.parse_args(argv)
