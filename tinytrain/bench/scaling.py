"""``mpirun -n 2 tinytrain bench scaling``: does training on 2 ranks take less time than on one?

The lecture's first promise (缩短时间: a shorter time to train), measured as a student would see
it: the same model and the same global batch, trained serially (rank 0 alone, while rank 1 waits
asleep) and on 2 ranks under each layout, each with its target (issues 25 and 40)::

    dp   --dp 2                                    on the default model        target 0.9 of its ideal
    tp   --tp 2                                    on the wide model           target 1.4x
    pp   --pp 2 --microbatches 8 --schedule 1f1b   on the wide model           target 1.4x

``default`` is ``tinytrain train`` without flags (the addition task: 2 layers x 128 wide, 4 heads,
batch 64 x 8 tokens, about 400k parameters); ``wide`` adds ``--layers 4 --width 512 --block-size
128 --batch-size 16`` on characters of a text (4 heads, about 13M parameters): a step big enough
that its matrix products outweigh Python and messages. ``--models default wide`` runs every
layout on both models instead.

Each side runs the trainer's own step (``trainer.loop.train_step``: the batch of (seed, step),
forward and backward through the runner ``make_runner`` builds for the plan, gradient clipping,
AdamW, the LR schedule; then the loop's per-step stop vote), with the trainer's defaults for every
flag not named above. Every rank computes with one thread: its BLAS pool is set to one thread
(``backend.blas_threads``) and so are the elementwise kernels (``autograd.threads``).

Timing: ``--warmup`` untimed steps per side, then ``--rounds`` rounds; in each round the serial
run of each model comes first, then each layout's run on that model, each of ``--steps`` steps
(default: 20 on the default model, 3 on the wide one), so load from elsewhere on the machine hits
both sides alike. A run takes its slowest rank's wall time; per side the best round is kept (noise
only ever adds time). Per layout and model::

    tok/s serial   tokens per step x steps / the serial run's seconds (best round)
    tok/s 2 ranks  the same on 2 ranks (best round)
    speedup        tok/s 2 ranks / tok/s serial
    efficiency     speedup / 2 (1.0: two ranks do the work of two)
    ideal          dp only: the serial step's time over the time of a serial step on one replica's
                   rows (rank 0 alone, half the batch, timed in the same rounds): what --dp 2 would
                   give if its communication were free. Below 2 because a step has costs that do not
                   shrink with the batch (AdamW and clipping over every weight, the Python of each
                   op), and every replica pays them whole
    of it          dp only: speedup / ideal, the share of the free-communication speedup reached
    busy           dp only: the serial step's time over the time of both ranks stepping at once,
                   each on one replica's rows, with no message between them: free communication,
                   but with the two cores sharing caches and memory bandwidth as in the 2-rank run
                   (what is left between busy and the speedup is the communication's own cost)
    comm           the share of the 2-rank step spent communicating, from the trace: per rank, the
                   time within the timed steps in which a communication span was open (a collective
                   from its call to its completion, a point-to-point message from its post to its
                   completion, the data-parallel wait for the gradients) and no compute span was
                   (forward, backward: messages hidden under compute do not count), over the timed
                   steps' wall time; in the kept round, the largest rank's
    loss diff      the largest |serial loss - 2-rank loss| over the same steps: the layout trains the
                   serial curve (float32 sums in another order differ around 1e-6)

Tracing is on during the 2-rank runs only (a serial run records nothing). ``--json FILE`` writes
the rows, with every round's figures and every rank's comm share. A figure, not a test: it depends
on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy

RANKS = 2
TARGET_OF_IDEAL = ("dp",)  # layouts whose target is a share of their ideal speedup, not a speedup
# layout -> (the model it is judged on, its Plan's fields, the target speedup)
LAYOUTS = {
    "dp": ("default", {"dp": 2}, 0.9),  # of its ideal (issue 40): see TARGET_OF_IDEAL
    "tp": ("wide", {"tp": 2}, 1.4),
    "pp": ("wide", {"pp": 2, "schedule": "1f1b", "microbatches": 8}, 1.4),
}
# model -> (`tinytrain train` flags on top of its defaults, timed steps per run)
MODELS = {
    "default": ([], 20),
    "wide": (["--layers", "4", "--width", "512", "--block-size", "128", "--batch-size", "16", "--data", "TEXT"], 3),
}
COMM_CATS = ("comm", "comm.step", "idle")  # a collective call, one of its messages, a wait
COMPUTE_CATS = ("compute", "forward", "backward")
BUSY = 0.10  # queued above this share of a run: the table says the machine was busy


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument(
        "--models",
        nargs="+",
        default=None,
        choices=list(MODELS),
        help="run every layout on these models (default: each layout on its own, see the table)",
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default: 20 default, 3 wide)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per side before the first round")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (serial, then each layout); best kept")
    p.add_argument("--json", default=None, help="also write the rows to this file")


def train_flags(model: str, text: str) -> argparse.Namespace:
    """The ``tinytrain train`` arguments of ``model`` (the trainer's parser, defaults and checks)."""
    from tinytrain.trainer.args import add_arguments as trainer_arguments
    from tinytrain.trainer.args import check_args

    parser = argparse.ArgumentParser()
    trainer_arguments(parser)
    args = parser.parse_args([text if f == "TEXT" else f for f in MODELS[model][0]])
    check_args(args)
    return args


def write_text(folder: str) -> str:
    """A text of 20,000 characters drawn from the 95 printable ASCII ones and the newline: the wide
    model's data, 96 characters (a vocabulary that --tp 2 splits)."""
    rng = numpy.random.default_rng(0)
    chars = numpy.array(["\n"] + [chr(c) for c in range(32, 127)])
    path = os.path.join(folder, "text.txt")
    with open(path, "w") as f:
        f.write("".join(rng.choice(chars, size=20_000)))
    return path


class Side:
    """One way of training ``model``: serially (``fields`` None) or under a 2-rank plan; it keeps its
    runner, optimizer and step count across rounds, and its losses."""

    def __init__(self, model: str, fields: dict | None, text: str, batch_size: int | None = None):
        from tinytrain.data import load_dataset
        from tinytrain.parallel.plan import Plan
        from tinytrain.trainer.args import build_model
        from tinytrain.trainer.loop import build_optimizer
        from tinytrain.trainer.runners import make_runner

        self.args = train_flags(model, text)
        self.args.batch_size = batch_size or self.args.batch_size
        self.dataset = load_dataset(self.args.data, self.args.block_size, self.args.digits)
        self.plan = Plan(**(fields or {}))
        self.model = build_model(self.args, self.dataset)
        self.runner = make_runner(self.model, self.plan, self.args.batch_size)
        self.optimizer, self.schedule = build_optimizer(self.args, self.runner.parameters())
        self.tokens = self.args.batch_size * self.dataset.block_size  # per step
        self.step, self.losses = 0, []

    def run(self, steps: int) -> list:
        """``steps`` steps as the training loop runs them; each one's (start, end) on the trace's clock."""
        from tinytrain import trace
        from tinytrain.trainer.loop import train_step

        windows = []
        for _ in range(steps):
            self.step += 1
            start = trace.now()
            loss, _, _ = train_step(self.runner, self.optimizer, self.schedule, self.dataset, self.args, self.step)
            self.runner.vote(0)  # the loop's agreement on stopping, once per step
            windows.append((start, trace.now()))
            self.losses.append(loss)
        return windows


def timed(side: Side | None, steps: int, together: bool = False) -> tuple[float, list, list]:
    """One run of ``side`` on every rank (None: this rank sits the run out, waiting in the gather):
    (the slowest rank's seconds, each rank's comm share, each rank's queued share: the part of the
    run it was ready to run but waited for a core that other programs held; NaN where unknown).
    ``together``: the ranks start at once even on serial sides (each its own replica, no messages)."""
    from tinytrain import distributed as dist
    from tinytrain import trace
    from tinytrain.bench.step import schedstat
    from tinytrain.viz import exposed_time

    parallel = side is not None and not side.plan.is_serial
    if parallel or together:
        dist.barrier()  # both ranks start the run together
        trace.clear()
        trace.enable()
    before = schedstat(os.getpid())
    start = time.perf_counter()
    windows = side.run(steps) if side is not None else []
    seconds = time.perf_counter() - start
    after = schedstat(os.getpid())
    queued = (after[1] - before[1]) / seconds if side is not None and before and after else float("nan")
    share = 0.0
    if parallel:
        trace.enable(False)
        spans = trace.spans()
        exposed = exposed_time(spans, windows, lambda s: s["cat"] in COMM_CATS, lambda s: s["cat"] in COMPUTE_CATS)
        share = exposed / sum(b - a for a, b in windows)
        trace.clear()
    rows = dist.all_gather(numpy.array([[seconds, share, queued]], dtype=numpy.float64))
    return float(rows[:, 0].max()), rows[:, 1].tolist(), rows[:, 2].tolist()


def measure(layouts: list, models: list | None, steps: int | None, warmup: int, rounds: int, text: str) -> list:
    """The rows (rank 0; an empty list elsewhere), from interleaved rounds; see the module docstring."""
    from tinytrain import distributed as dist

    rank = dist.get_rank()
    pairs = [(m, name) for name in layouts for m in (models or [LAYOUTS[name][0]])]
    used = list(dict.fromkeys(m for m, _ in pairs))
    serial = {m: Side(m, None, text) if rank == 0 else None for m in used}
    # DP's ideal: rank 0 alone on one replica's rows (a data-parallel step with free communication)
    replica = {m: None for m, name in pairs if name == "dp"}
    if rank == 0:
        replica = {m: Side(m, None, text, serial[m].args.batch_size // RANKS) for m in replica}
    # ... and every rank at once on its replica's rows, without a message: free communication, but
    # the cores' shared caches and memory as busy as in the data-parallel run
    apart = {m: Side(m, None, text, train_flags(m, text).batch_size // RANKS) for m in replica}
    sides = {(m, name): Side(m, LAYOUTS[name][1], text) for m, name in pairs}
    runs = {m: steps or MODELS[m][1] for m in used}
    for m in used:
        timed(serial[m], warmup)
        if m in replica:
            timed(replica[m], warmup)
            timed(apart[m], warmup, together=True)
        for (model, _), side in sides.items():
            if model == m:
                timed(side, warmup)
    seconds = {key: [] for key in [*used, *sides, *((m, "replica") for m in replica), *((m, "apart") for m in replica)]}
    shares, queued = {key: [] for key in sides}, {key: [] for key in [*used, *sides]}
    for _ in range(rounds):
        for m in used:
            s, _, q = timed(serial[m], runs[m])
            seconds[m].append(s)
            queued[m].append(q[0])
            if m in replica:
                seconds[(m, "replica")].append(timed(replica[m], runs[m])[0])
                seconds[(m, "apart")].append(timed(apart[m], runs[m], together=True)[0])
            for key, side in sides.items():
                if key[0] == m:
                    s, share, q = timed(side, runs[m])
                    seconds[key].append(s)
                    shares[key].append(share)
                    queued[key].append(max(q))
    if rank != 0:
        return []
    rows = []
    for (m, name), side in sides.items():
        tokens = side.tokens * runs[m]
        serial_tps = [tokens / s for s in seconds[m]]
        ranks_tps = [tokens / s for s in seconds[(m, name)]]
        best, best_serial = int(numpy.argmax(ranks_tps)), int(numpy.argmax(serial_tps))
        speedup = max(ranks_tps) / max(serial_tps)
        diffs = [abs(a - b) for a, b in zip(serial[m].losses, side.losses)]
        ideal = ideal_busy = None
        if name == "dp":  # the serial step's time over the time of one replica's rows alone
            ideal = min(seconds[m]) / min(seconds[(m, "replica")])
            ideal_busy = min(seconds[m]) / min(seconds[(m, "apart")])
        rows.append(
            {
                "layout": name,
                "model": m,
                "plan": _flags(side.plan),
                "parameters": side.model.num_parameters(),
                "tokens_per_step": side.tokens,
                "steps": runs[m],
                "rounds": rounds,
                "serial_tokens_per_s": max(serial_tps),
                "parallel_tokens_per_s": max(ranks_tps),
                "speedup": speedup,
                "efficiency": speedup / RANKS,
                "ideal_speedup": ideal,
                "of_ideal": None if ideal is None else speedup / ideal,
                "ideal_speedup_both_busy": ideal_busy,
                "comm_share": max(shares[(m, name)][best]),
                "comm_share_per_rank": shares[(m, name)][best],
                "loss_diff": max(diffs),
                "serial_queued": _known(queued[m][best_serial]),
                "parallel_queued": _known(queued[(m, name)][best]),
                "target_speedup": LAYOUTS[name][2] if m == LAYOUTS[name][0] else None,
                "serial_tokens_per_s_rounds": serial_tps,
                "parallel_tokens_per_s_rounds": ranks_tps,
                "median_speedup": statistics.median(ranks_tps) / statistics.median(serial_tps),
            }
        )
    return rows


def _known(value: float) -> float | None:
    return None if numpy.isnan(value) else value


def _flags(plan) -> str:
    from tinytrain.bench.strategies import _flags as strategy_flags

    return strategy_flags(plan)  # a pipeline's --microbatches is among the plan's own flags


def print_table(rows: list, warmup: int) -> None:
    print(
        f"# tinytrain bench scaling: {RANKS} ranks against one (rank 0 alone), the same global batch, one thread "
        f"per rank; best of {rows[0]['rounds']} alternating rounds after {warmup} warm-up steps"
    )
    print(
        f"# {'layout':<7}{'model':<9}{'plan':<44}{'params':>11}{'tok/s serial':>13}{'tok/s 2 ranks':>14}"
        f"{'speedup':>9}{'effic.':>8}{'ideal':>7}{'of it':>7}{'busy':>7}{'comm':>6}{'queued':>12}{'loss diff':>10}"
        "  target"
    )
    for r in rows:
        target = r["target_speedup"]
        if target is None:
            verdict = ""
        elif r["layout"] in TARGET_OF_IDEAL:
            verdict = f"{target:.1f} of ideal " + ("met" if r["of_ideal"] >= target else "BELOW")
        else:
            verdict = f"{target:.1f}x " + ("met" if r["speedup"] >= target else "BELOW")
        if target is not None and (r["parallel_queued"] or 0) > BUSY:
            verdict += " (busy machine)"
        print(
            f"  {r['layout']:<7}{r['model']:<9}{r['plan']:<44}{r['parameters']:>11,}{r['serial_tokens_per_s']:>13,.0f}"
            f"{r['parallel_tokens_per_s']:>14,.0f}{r['speedup']:>8.2f}x{r['efficiency']:>8.0%}{_times(r['ideal_speedup']):>7}"
            f"{_share(r['of_ideal']):>7}{_times(r['ideal_speedup_both_busy']):>7}{r['comm_share']:>6.0%}"
            f"{_share(r['serial_queued']):>6}/{_share(r['parallel_queued']):<5}{r['loss_diff']:>10.1e}  {verdict}",
            flush=True,
        )
    print("# speedup = tok/s on 2 ranks / tok/s serial; efficiency = speedup / 2")
    print(
        "# ideal (dp) = the serial step's time / the time of a serial step on one replica's rows: the speedup "
        "with free communication; of it = speedup / ideal (dp's target: 0.9 of it)"
    )
    print(
        "# busy (dp) = the serial step's time / the time of both ranks at once each on its replica's rows, no "
        "message: free communication, with the cores' caches and memory shared as in the 2-rank run"
    )
    print(
        "# comm = share of the 2-rank steps' wall time in which the rank communicated or waited for a message and "
        "did not compute (from the trace; the busiest rank)"
    )
    print("# queued = share of the run a rank was ready to compute but waited for a core (serial / 2 ranks)")
    busiest = max((q for r in rows for q in (r["serial_queued"], r["parallel_queued"]) if q is not None), default=0)
    if busiest > BUSY:
        print(
            f"note: other programs held the cores for up to {busiest:.0%} of a run: the 2-rank runs, which need "
            "both cores, lose more to them than the serial one; on an idle machine the speedups are higher"
        )


def _times(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _share(value) -> str:
    return "-" if value is None else f"{value:.0%}"


def run(args) -> int:
    from tinytrain.trainer.runners import launched_world

    for name in ("steps", "rounds"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name} must be positive, got {value}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be 0 or more steps, got {args.warmup}")
    world = launched_world()[1]
    if world != RANKS:
        raise ValueError(
            f"bench scaling trains on one rank and on {RANKS}, so it runs on exactly {RANKS} ranks: "
            f"mpirun -n {RANKS} tinytrain bench scaling (this run has {world})"
        )
    from tinytrain import backend
    from tinytrain import distributed as dist
    from tinytrain.autograd import threads
    from tinytrain.distributed import watchdog

    dist.init()
    watchdog.start_heartbeat()  # while rank 0 trains alone, rank 1 knows it is busy, not gone
    before = threads.THREADS, backend.blas_threads()  # put back after (an in-process caller: the tests)
    threads.THREADS = 1
    if backend.blas_threads(1) != 1 and dist.get_rank() == 0:
        print(
            "note: the BLAS threads of this NumPy cannot be set from inside the program: run it as "
            f"OMP_NUM_THREADS=1 mpirun -n {RANKS} tinytrain bench scaling for one thread per rank"
        )
    try:
        with tempfile.TemporaryDirectory() as folder:
            rows = measure(args.layouts, args.models, args.steps, args.warmup, args.rounds, write_text(folder))
    finally:
        threads.THREADS = before[0]
        if before[1] is not None:
            backend.blas_threads(before[1])
    if dist.get_rank() == 0:
        print_table(rows, args.warmup)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    return 0
