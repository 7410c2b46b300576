"""The measurements behind ``python -m grader report``, on the student's own code.

Run under ``mpirun -n 4 python -m grader.lab OUT.json`` (the report does it): ``use_assignments()``
puts every assignment file's code in place of the framework's, then each section measures what its
handout asks about -- bytes against the formula, memory per rank, bubbles, drops -- on the same
small GPT ``tinytrain bench strategies`` uses. A section whose code is still a TODO records that
TODO instead; an error records its message. Rank 0 writes the JSON.
"""

from __future__ import annotations

import json
import sys
import time

import numpy

RANKS = 4
SIZES = (1024, 65536, 1048576)  # float32 elements of each collective measured in section 1


def _attempt(fn) -> dict:
    """fn()'s figures, or why there are none: its TODO (unfinished), or its error."""
    try:
        return {"rows": fn()}
    except NotImplementedError as exc:
        return {"todo": str(exc).splitlines()[0]}
    except Exception as exc:  # a report shows what it could measure; the grader scores the code
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}


def collectives() -> list[dict]:
    """Assignment 1: bytes each rank sent against the ring's formula; time against MPI's own.
    Through the assignment file's own functions: they run its algorithms, never a stand-in."""
    import assignments.a1_collectives as a1
    from tinytrain import distributed as dist
    from tinytrain.distributed._mpi import MPI
    from tinytrain.parallel import costs

    n, comm, rows = dist.get_world_size(), dist.world().comm, []
    for count in SIZES:
        x = numpy.ones(count, dtype=numpy.float32)
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            full = count if op != "all_gather" else count * n
            run = {
                "all_reduce": lambda: a1.all_reduce(x.copy(), algo="ring"),
                "all_gather": lambda: a1.all_gather(x),
                "reduce_scatter": lambda: a1.reduce_scatter(numpy.ones(count * n, dtype=numpy.float32)),
            }[op]
            mpi = {
                "all_reduce": lambda: comm.Allreduce(MPI.IN_PLACE, x.copy()),
                "all_gather": lambda: comm.Allgather(x, numpy.empty(count * n, dtype=numpy.float32)),
                "reduce_scatter": lambda: comm.Reduce_scatter_block(
                    numpy.ones(count * n, dtype=numpy.float32), numpy.empty(count, dtype=numpy.float32)
                ),
            }[op]
            with dist.comm_stats() as stats:
                run()
            sent = max(comm.allgather(stats.sent(op)))
            ours, theirs = _best(run, comm), _best(mpi, comm)
            formula = costs.collective_bytes(op, 4 * (full if op != "reduce_scatter" else count * n), n)
            rows.append(
                {"op": op, "elements": full, "sent": sent, "formula": round(formula), "ours_us": ours, "mpi_us": theirs}
            )
    return rows


def _best(fn, comm, rounds: int = 5) -> float:
    """Microseconds of the slowest rank, best of ``rounds`` (noise only adds time)."""
    best = float("inf")
    for _ in range(rounds):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        best = min(best, max(comm.allgather(time.perf_counter() - start)))
    return 1e6 * best


def strategies(names) -> list[dict]:
    """Assignments 2-5: one step per strategy (``bench strategies``' measure): bytes sent by all
    ranks together against the planner's formula, memory per rank, and the step time."""
    from tinytrain import distributed as dist
    from tinytrain import planner
    from tinytrain.bench import strategies as bench
    from tinytrain.nn import GPT, GPTConfig

    config = GPTConfig(**bench.MODEL)
    tensors = len(GPT(config, seed=0).parameters())  # parameters, each cut into uneven pieces
    spec = planner.ModelSpec(
        layers=config.n_layer, hidden=config.n_embd, heads=config.n_head, vocab=config.vocab_size,
        seq=config.block_size, batch=8,
    )  # fmt: skip
    rows = []
    for name in names:
        try:
            mine = bench.measure(name, config, batch=8, steps=1)
        except NotImplementedError as exc:  # this strategy's chapter is unfinished; the others may run
            rows.append({"strategy": name, "todo": str(exc).splitlines()[0]})
            continue
        every = dist.world().comm.allgather(mine)
        plan = bench.plan_of(name)
        layout = {k: getattr(plan, k) for k in ("dp", "zero", "tp", "sp", "pp") if getattr(plan, k)}
        if plan.pp > 1:
            layout["microbatches"] = plan.n_microbatches
        want = sum(planner.run_bytes(spec, **layout).values()) if plan.pp == 1 or plan.chunks == 1 else None
        rows.append(
            {
                "strategy": name,
                "flags": bench._flags(plan),
                "sent_total": int(sum(r["sent"] for r in every if r)),
                "formula_total": None if want is None else int(round(want)),
                "per_rank": [{k: int(r[k]) for k in bench.MEMORY_KEYS if k in r} for r in every if r],
                "ms": 1e3 * max(r["seconds"] for r in every if r),
                "tensors": tensors,
            }
        )
    return rows


def bubbles() -> list[dict]:
    """Assignment 5: each schedule's bubble share, simulated from the student's schedule (F = 1,
    B = 2; split, B = W = 1), next to the textbook formula; and the most micro-batches a stage
    holds at once. A schedule still a TODO is left out (ZB-H1, 5.6, is optional for the rest)."""
    from tinytrain.parallel.pipeline import simulate_schedule
    from tinytrain.parallel.simulator import bubble_formula

    rows = []
    for name, chunks in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2)):
        for m in (4, 8, 16):
            try:
                t = simulate_schedule(name, RANKS, m, chunks)
            except NotImplementedError:
                if name == "zb-h1":
                    break
                raise
            rows.append(
                {
                    "schedule": name,
                    "microbatches": m,
                    "bubble": round(t.bubble_share, 4),
                    "formula": round(bubble_formula(RANKS, m, chunks, schedule=name), 4),
                    "peak_held": list(t.peak_activations),
                }
            )
    return rows


def drops() -> list[dict]:
    """Assignment 6: the share of token assignments capacity drops, against the capacity factor,
    on a 4-expert GPT over 4 expert-parallel ranks (top-1 and top-2)."""
    from tinytrain.nn import GPT, GPTConfig
    from tinytrain.parallel.plan import Plan
    from tinytrain.trainer.runners import make_runner

    rows = []
    for k in (1, 2):
        for factor in (1.0, 1.25, 2.0, 0.0):
            config = GPTConfig(
                vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32, n_experts=4, moe_top_k=k,
                moe_capacity_factor=factor,
            )  # fmt: skip
            runner = make_runner(GPT(config, seed=0), Plan(ep=RANKS), 8)
            rng = numpy.random.default_rng(0)
            x, y = (rng.integers(0, 32, size=(8, 16)) for _ in range(2))
            runner.forward_backward(x, y)
            stats = runner.step_stats()
            rows.append(
                {"top_k": k, "capacity_factor": factor or None, "dropped": stats["dropped"], "load": stats["load"]}
            )
    return rows


def context() -> list[dict]:
    """Assignment 7: bytes of one step under ring and all-to-all attention against the formula."""
    from tinytrain import distributed as dist
    from tinytrain import planner
    from tinytrain.nn import GPTConfig
    from tinytrain.parallel.plan import Plan

    config = GPTConfig(vocab_size=16, block_size=16, n_layer=2, n_head=4, n_embd=32)
    spec = planner.ModelSpec(layers=2, hidden=32, heads=4, vocab=16, seq=16, batch=8)
    rows = []
    for algo in ("ring", "alltoall"):
        stats, seconds = planner.measure_step(Plan(cp=RANKS, cp_algo=algo), config, batch_size=8)
        mine = sum(stats.sent(op, group) for group, op in stats.rows if op != "debug_check")
        total = int(sum(dist.world().comm.allgather(mine)))
        want = int(round(sum(planner.run_bytes(spec, cp=RANKS, cp_algo=algo).values())))
        rows.append({"algo": algo, "sent_total": total, "formula_total": want, "ms": 1e3 * seconds})
    return rows


def memory() -> list[dict]:
    """Assignment 8: the bytes one GPT block keeps for backward under each recompute mode (the
    model with two blocks minus the one with one, as the engine counts them) against the formula,
    and AdamW's state bytes per parameter in float32 and with 16-bit parameters (the masters)."""
    from tinytrain import random
    from tinytrain.autograd import saved_bytes
    from tinytrain.backend import precision_dtype
    from tinytrain.nn import GPT, GPTConfig
    from tinytrain.nn.recompute import apply_recompute
    from tinytrain.optim import AdamW
    from tinytrain.parallel import costs

    seq, rows, width, heads = 16, 4, 32, 4
    x, y = (numpy.random.default_rng(i).integers(0, 16, size=(rows, seq)) for i in range(2))

    def kept(mode, n_layer):
        config = GPTConfig(vocab_size=16, block_size=seq, n_layer=n_layer, n_head=heads, n_embd=width, dropout=0.1)
        model = GPT(config, seed=0)
        apply_recompute(model, mode)
        random.manual_seed((0, 1))
        before = saved_bytes()
        loss = model.loss(x, y)
        held = saved_bytes() - before
        loss.backward()
        return held

    out = []
    for mode in ("none", "selective", "full"):
        got = kept(mode, 2) - kept(mode, 1)
        want = costs.tinytrain_activation_bytes(seq, rows, width, heads, recompute=mode)
        out.append({"what": f"activation bytes per block, --recompute {mode}", "got": got, "formula": want})
    for precision, per in (("fp32", 8), ("bf16", 12)):
        model = GPT(GPTConfig(vocab_size=16, block_size=seq, n_layer=1, n_head=heads, n_embd=width), seed=0)
        model.to(precision_dtype(precision))
        params = model.parameters()
        optimizer = AdamW(params, lr=1e-3)
        model.loss(x, y).backward()
        optimizer.step()
        psi = sum(p.size for p in params)
        what = f"AdamW state bytes, {precision} parameters ({per}Ψ)"
        out.append({"what": what, "got": optimizer.state_bytes(), "formula": per * psi})
    return out


FED_CLIENTS, FED_ROUNDS, FED_TARGET = 8, 40, 1.70  # assignment 9: clients, rounds per run, the target loss


def federated() -> dict:
    """Assignment 9, through the assignment file's own FedAvg: the bytes all ranks sent and
    received for one round of each aggregation against ``costs.fedavg_round_volume``, and the
    rounds a small GPT on two-digit addition needs to reach a loss of ``FED_TARGET`` on a fixed
    sample of the pool (every client, 4 local steps of SGD a round) with iid and label-skewed
    clients. A row whose code is still a TODO records it; the others are measured."""
    import assignments.a9_federated as a9
    from tinytrain import distributed as dist
    from tinytrain import random
    from tinytrain.backend import xp
    from tinytrain.data import AdditionDataset
    from tinytrain.nn import GPT, GPTConfig
    from tinytrain.optim import SGD
    from tinytrain.parallel import costs

    dataset = AdditionDataset(2)
    config = GPTConfig(vocab_size=dataset.vocab_size, block_size=dataset.block_size, n_layer=1, n_head=2, n_embd=32)
    comm = dist.world().comm

    def run(scheme, rounds, local_steps=4, **kw):
        data = a9.ClientData(dataset, FED_CLIENTS, scheme, seed=0)
        model = GPT(config, seed=0)
        wrapper = a9.FedAvg(model, data, 64, 1.0, local_steps, **kw)
        optimizer = SGD(model.parameters(), lr=0.1, momentum=0.9)
        picks = numpy.random.default_rng(1).choice(data.keys.size, 256, replace=False)
        x, y = (xp.asarray(a) for a in dataset.rows(data.keys[picks]))
        losses = []
        for r in range(rounds):
            random.manual_seed((0, r))
            wrapper.round_gradients()
            wrapper.optimizer = optimizer
            wrapper.step()
            random.manual_seed((0, 1 << 20))  # the evaluation: no dropout in this model, but a seed of its own
            losses.append(model.loss(x, y).item())
        return wrapper, data, losses

    def attempt(row, fn):
        try:
            return {**row, **fn()}
        except NotImplementedError as exc:
            return {**row, "todo": str(exc).partition(":")[0]}  # "TODO 9.2": the stub's hint is in your file

    def volume(kw):
        wrapper, _, _ = run("iid", 1, local_steps=1, **kw)
        got = int(sum(comm.allgather(wrapper.moved)))
        return {"got": got, "formula": round(costs.fedavg_round_volume(wrapper.size, RANKS, "clip" not in kw))}

    def to_target(scheme):
        _, data, losses = run(scheme, FED_ROUNDS)
        reached = next((r + 1 for r, loss in enumerate(losses) if loss <= FED_TARGET), None)
        counts = [data.count(c) for c in range(FED_CLIENTS)]
        return {"rounds": reached, "final": losses[-1], "samples": f"{min(counts)}-{max(counts)}"}

    modes = [
        ("FedAvg, the plain sum", "", {}),
        ("FedAvg, secure aggregation", " --secure-agg", {"secure": True}),
        ("DP-FedAvg (the noise adds no bytes)", " --clip 1", {"clip": 1.0}),
        ("DP-FedAvg, secure aggregation", " --clip 1 --secure-agg", {"clip": 1.0, "secure": True}),
    ]
    bytes_rows = [
        attempt({"what": what, "flags": f"--dp-algo fedavg --clients {FED_CLIENTS}{flags}"}, lambda kw=kw: volume(kw))
        for what, flags, kw in modes
    ]
    rounds_rows = [attempt({"partition": s}, lambda s=s: to_target(s)) for s in ("iid", "skew:0.1")]
    return {"bytes": bytes_rows, "rounds": rounds_rows}


ELASTIC_LAUNCHES = (  # assignment 10: a launch's options, and the worlds it is asked about
    ("--dp 4 --batch-size 12", range(1, 9)),
    ("--pp 2 --dp 4 --batch-size 48", range(2, 13)),
)


def elastic() -> list[dict]:
    """Assignment 10, through the assignment file's own ``layout_for``: the layout each world size
    gets for two launches, 4 replicas each (one without a pipeline, one of ``--pp 2`` whose
    micro-batches held 3 rows), as the world shrinks and grows. A row whose code is still a TODO
    (yours, or the pipeline schedule's that ``schedule_takes`` asks) records it."""
    import argparse

    import assignments.a10_elastic as a10
    from tinytrain.trainer.args import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    rows = []
    for flags, worlds in ELASTIC_LAUNCHES:
        args = parser.parse_args(flags.split())
        for world in worlds:
            row = {"flags": flags, "available": world}
            try:
                layout = a10.layout_for(world, args)
            except NotImplementedError as exc:
                row["todo"] = str(exc).partition(":")[0]
            except ValueError as exc:
                row["refused"] = str(exc)
            else:
                shards = layout.dp * args.ep * layout.microbatches
                row.update(dp=layout.dp, world=layout.world, microbatches=layout.microbatches)
                row.update(rows=args.batch_size / shards, batch=args.batch_size)
            rows.append(row)
    return rows


SECTIONS = {
    "1": collectives,
    "2": lambda: strategies(["dp"]),
    "3": lambda: strategies(["dp", "zero1", "zero2", "zero3"]),
    "4": lambda: strategies(["tp", "tp+sp"]),
    "5": lambda: {"bubbles": bubbles(), "steps": strategies(["pp-gpipe", "pp-1f1b", "pp-interleaved"])},
    "6": drops,
    "7": context,
    "8": memory,
    "9": federated,
    "10": elastic,
}


def main(out: str, only: list[str] | None = None) -> int:
    from assignments.use import use_assignments
    from tinytrain import distributed as dist

    dist.init()
    if dist.get_world_size() != RANKS:
        print(f"error: the report's measurements need {RANKS} ranks (mpirun -n {RANKS})", file=sys.stderr)
        return 2
    use_assignments()
    figures = {a: _attempt(fn) for a, fn in SECTIONS.items() if not only or a in only}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:] or None))
