"""``mpirun -n 4 tinytrain bench strategies``: one training step of the same GPT under every strategy.

Each strategy is a ``Plan`` run by the training stack itself (``trainer.runners.make_runner``, so
``hybrid.parallelize``), on the same model, batch and seed: serial (rank 0 alone, the others wait),
DP, ZeRO-1/2/3, TP, TP+SP, PP with each schedule (gpipe, 1f1b, interleaved), and ZeRO-3 composed
with TP and with PP (2 x 2). Per strategy::

    time        seconds of one step (forward, backward, AdamW), the slowest rank's, best of --steps
                after one warm-up step (noise only ever adds time)
    sent        bytes each rank sent in one step (``distributed.comm_stats``), the most of any rank
    params      bytes of parameters this rank holds   \\
    grads       bytes of gradients it holds            |  measured from the arrays after backward
    optimizer   bytes of AdamW state it holds          /   (ZeRO: ``held_bytes`` of its pieces)
    activations peak bytes saved for backward in the step (``autograd.peak_saved_bytes``)
    peak        params + grads + optimizer + activations (+ ZeRO-3's gathered layers): an upper
                bound of the rank's peak, all four at once; the table shows the largest rank's
    planned     the planner's figure for the same layout (``planner.tinytrain_memory``: AdamW in the
                run's precision, tinytrain's activation terms); the JSON has it as ``planned_bytes``

``--precision bf16|fp16`` runs every strategy in that precision (16-bit parameters, gradients and
activations, AdamW's float32 masters and moments: the ZeRO paper's 2Ψ + 2Ψ + 12Ψ).
``--json FILE`` writes every rank's figures (lists indexed by rank) for the planner and notebooks.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import numpy

# name -> the Plan's fields on 4 ranks ("serial": one rank alone)
STRATEGIES = {
    "serial": {},
    "dp": {"dp": 4},
    "zero1": {"dp": 4, "zero": 1},
    "zero2": {"dp": 4, "zero": 2},
    "zero3": {"dp": 4, "zero": 3},
    "tp": {"tp": 4},
    "tp+sp": {"tp": 4, "sp": True},
    "pp-gpipe": {"pp": 4, "schedule": "gpipe"},
    "pp-1f1b": {"pp": 4, "schedule": "1f1b"},
    "pp-interleaved": {"pp": 4, "schedule": "interleaved", "chunks": 2},
    "pp-zb-h1": {"pp": 4, "schedule": "zb-h1"},
    "pp-zb-v": {"pp": 4, "schedule": "zb-v"},
    "zero3+tp": {"dp": 2, "tp": 2, "zero": 3},
    "zero3+pp": {"dp": 2, "pp": 2, "zero": 3},
}
RANKS = 4
# tiny by default: 8 layers so the interleaved pipeline has 2 per stage, 4 heads for --tp 4
MODEL = dict(vocab_size=32, block_size=16, n_layer=8, n_head=4, n_embd=64)
MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "gathered")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--steps", type=int, default=3, help="timed steps per strategy after a warm-up (best kept)")
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    parser.add_argument("--n-embd", type=int, default=MODEL["n_embd"], help="model width (a multiple of 4)")
    parser.add_argument("--n-layer", type=int, default=MODEL["n_layer"], help="layers (a multiple of 8)")
    parser.add_argument("--block-size", type=int, default=MODEL["block_size"], help="context length")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"), help="of every strategy")
    parser.add_argument("--json", default=None, help="also write every rank's figures as JSON to this file")


def plan_of(name: str, precision: str = "fp32"):
    from tinytrain.parallel.plan import Plan

    return Plan(**STRATEGIES[name], precision=precision)


def _memory(runner, optimizer) -> dict:
    """Bytes this rank holds after backward: ZeRO's measured pieces, else its parameters' arrays."""
    zero = getattr(getattr(runner, "parallel", None), "zero", None)
    if zero is not None:
        held = zero.memory()
        return {k: held[k] for k in ("params", "grads", "optimizer")} | {"gathered": held["gathered_peak"]}
    params = runner.parameters()
    return {
        "params": sum(p.data.nbytes for p in params),
        "grads": sum(p.grad.nbytes for p in params if p.grad is not None),
        "optimizer": optimizer.state_bytes(),
        "gathered": 0,
    }


def _step_bytes(stats) -> int:
    """Bytes this rank sent for the step itself: debug mode's signature checks (``"debug_check"``,
    on under the test harness) are not the strategy's traffic."""
    return sum(stats.sent(op, group) for group, op in stats.rows if op != "debug_check")


def _one_step(runner, optimizer, x, y) -> tuple[float, object, dict]:
    """(seconds, comm_stats, memory) of one step on this rank, as the training loop runs it."""
    from tinytrain import distributed as dist
    from tinytrain.autograd import peak_saved_bytes, reset_peak_saved_bytes, saved_bytes

    # A graph still alive elsewhere in this process (another run's, one an exception's traceback
    # holds) has its saved arrays counted too: collect what is garbage, count only what the step adds.
    gc.collect()
    before = saved_bytes()
    reset_peak_saved_bytes()
    start = time.perf_counter()
    with dist.comm_stats() as stats:
        optimizer.zero_grad()
        runner.forward_backward(x, y)
        memory = _memory(runner, optimizer)  # gradients exist now; the optimizer state after step 1
        runner.step(optimizer)
    seconds = time.perf_counter() - start
    return seconds, stats, memory | {"activations": peak_saved_bytes() - before}


def measure(name: str, config, batch: int, steps: int, precision: str = "fp32") -> dict | None:
    """One strategy on every rank: its figures on this rank (``None`` on a rank that sat out)."""
    from tinytrain import distributed as dist
    from tinytrain.nn import GPT
    from tinytrain.optim import AdamW
    from tinytrain.trainer.runners import make_runner

    plan = plan_of(name, precision)
    if plan.is_serial and dist.get_rank() != 0:
        return None
    runner = make_runner(GPT(config, seed=0), plan, batch)
    optimizer = AdamW(runner.parameters(), lr=1e-3, weight_decay=0.0)
    rng = numpy.random.default_rng(0)
    x, y = (rng.integers(0, config.vocab_size, size=(batch, config.block_size)) for _ in range(2))
    _one_step(runner, optimizer, x, y)  # warm-up: optimizer state, buffers, first-touch pages
    best, sent, memory = float("inf"), 0, {}
    for _ in range(steps):
        seconds, stats, memory = _one_step(runner, optimizer, x, y)
        best, sent = min(best, seconds), _step_bytes(stats)
    if not plan.is_serial:
        runner.dist.stop_progress_thread()
    return {"seconds": best, "sent": sent, **memory}


FIELDS = ("seconds", "sent", *MEMORY_KEYS)


def _gather(mine: dict | None) -> list:
    """Every rank's figures, on every rank (a rank that sat out has None). Through our all_gather,
    whose deadline names the rank that never came, rather than a blocking MPI call that would hang."""
    from tinytrain import distributed as dist
    from tinytrain.backend import to_host, xp

    row = numpy.array([[mine is not None] + [mine[k] if mine else 0 for k in FIELDS]], dtype=numpy.float64)
    rows = to_host(dist.all_gather(xp.asarray(row)))
    return [dict(zip(FIELDS, r[1:].tolist())) if r[0] else None for r in rows]


def _flags(plan) -> str:
    """The plan as ``tinytrain train`` flags, the pipeline's schedule included."""
    if plan.pp == 1:
        return plan.flags()
    return plan.flags() + f" --schedule {plan.schedule}" + (f" --chunks {plan.chunks}" if plan.chunks > 1 else "")


def planned_memory(name: str, config, batch: int, precision: str = "fp32") -> dict:
    """The planner's bytes per rank for strategy ``name`` on this GPT (``planner.tinytrain_memory``)."""
    from tinytrain.planner import Layout, ModelSpec, tinytrain_memory

    plan = plan_of(name, precision)
    c = config
    spec = ModelSpec(c.n_layer, c.n_embd, c.n_head, c.vocab_size, c.block_size, batch, c.tie_weights, c.bias)
    microbatch = batch // (plan.dp * (plan.n_microbatches if plan.pp > 1 else 1))
    layout = Layout(plan.dp, plan.tp, plan.pp, plan.cp, plan.sp, plan.zero, microbatch)
    state, itemsize = ((4, 4, 8), 4) if precision == "fp32" else ((2, 2, 12), 2)
    return tinytrain_memory(
        spec, layout, state, plan.schedule, plan.chunks, plan.n_microbatches, config.dropout > 0, itemsize
    )


def _row(name: str, per_rank: list, planned: dict) -> dict:
    ran = [r for r in per_rank if r is not None]
    memory = {k: [r[k] for r in ran] for k in MEMORY_KEYS}
    peaks = [sum(r[k] for k in MEMORY_KEYS) for r in ran]
    return {
        "strategy": name,
        "plan": _flags(plan_of(name)),
        "ranks": len(ran),
        "time_ms": 1e3 * max(r["seconds"] for r in ran),  # a step is done when its last rank is
        "sent_bytes": [int(r["sent"]) for r in ran],
        **{f"{k}_bytes": [int(b) for b in v] for k, v in memory.items()},
        "peak_bytes": [int(b) for b in peaks],
        "planned_bytes": int(planned["total"]),
    }


def _print_table(rows: list, config, batch: int, steps: int, precision: str) -> None:
    def mib(b):
        return f"{b / 2**20:8.3f}"

    print(
        f"# tinytrain bench strategies: GPT {config.n_layer} layers x {config.n_embd} wide, T={config.block_size}, "
        f"batch {batch}, AdamW ({precision}), {RANKS} ranks (serial: rank 0 alone); "
        f"best of {steps} steps after a warm-up"
    )
    print("# sent: bytes one rank sent in the step; memory in MiB on the rank with the largest peak")
    print("# planned: the planner's peak per rank for the layout (planner.tinytrain_memory)")
    print(
        f"# {'strategy':<16}{'plan':<44}{'time ms':>9}{'sent KiB':>10}{'params':>9}{'grads':>9}"
        f"{'optim':>9}{'activ':>9}{'peak':>9}{'planned':>9}{'x serial':>9}"
    )
    serial = next((r["time_ms"] for r in rows if r["strategy"] == "serial"), None)
    for r in rows:
        top = int(numpy.argmax(r["peak_bytes"]))
        memory = "".join(f" {mib(r[f'{k}_bytes'][top])}" for k in ("params", "grads", "optimizer", "activations"))
        versus = f"{r['time_ms'] / serial:9.2f}" if serial else f"{'-':>9}"
        print(
            f"  {r['strategy']:<16}{r['plan']:<44}{r['time_ms']:9.1f}{max(r['sent_bytes']) / 1024:10.1f}"
            f"{memory} {mib(r['peak_bytes'][top])} {mib(r['planned_bytes'])}{versus}",
            flush=True,
        )
    if serial:
        print("# x serial = this strategy's step time / the serial step time (above 1: slower than one rank alone)")


def run(args) -> int:
    from tinytrain import distributed as dist
    from tinytrain.nn import GPTConfig

    if args.steps <= 0:
        raise ValueError(f"--steps must be positive, got {args.steps}")
    if args.batch <= 0 or args.batch % 8:
        raise ValueError(
            f"--batch must be a positive multiple of 8 (4 replicas x pipeline microbatches), got {args.batch}"
        )
    if args.n_layer <= 0 or args.n_layer % 8:
        raise ValueError(
            f"--n-layer must be a positive multiple of 8 (4 stages x 2 interleaved chunks), got {args.n_layer}"
        )
    if args.n_embd <= 0 or args.n_embd % 4:
        raise ValueError(f"--n-embd must be a positive multiple of 4 (4 heads, --tp 4), got {args.n_embd}")
    from tinytrain.distributed import watchdog

    dist.init()
    watchdog.start_heartbeat()  # while rank 0 runs the serial step alone, the others know it is busy, not gone
    if dist.get_world_size() != RANKS:
        raise ValueError(f"bench strategies runs on {RANKS} ranks: mpirun -n {RANKS} tinytrain bench strategies")
    config = GPTConfig(**dict(MODEL, n_embd=args.n_embd, n_layer=args.n_layer, block_size=args.block_size))
    rows = []
    # Each step's gc.collect (see _one_step) walks every object the process holds: 0.3 s a step in a
    # test suite's process (376k objects). Collected once here and frozen, what lives now is left out
    # of those walks, which then look only at what the bench made since: its graphs, cycles included.
    gc.collect()
    gc.freeze()
    try:
        for name in args.strategies:
            mine = measure(name, config, args.batch, args.steps, args.precision)
            per_rank = _gather(mine)  # the serial run's idle ranks wait here
            if dist.get_rank() == 0:
                rows.append(_row(name, per_rank, planned_memory(name, config, args.batch, args.precision)))
    finally:
        gc.unfreeze()
    if dist.get_rank() == 0:
        _print_table(rows, config, args.batch, args.steps, args.precision)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    return 0
