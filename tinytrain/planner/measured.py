"""The planner against this machine: the bytes a step of ``tinytrain train --dp`` sends (exact),
α-β fitted to ``tinytrain bench collectives --json`` rows, a step's time predicted from them, and
one measured step of any plan (for the tests and ``notebooks/communication.ipynb``)."""

from __future__ import annotations

from tinytrain.parallel import costs
from tinytrain.parallel.costs import collective_bytes

from .layouts import ModelSpec


def run_bytes(model: ModelSpec, dp: int, zero: int = 0, itemsize: int = 4) -> dict:
    """Bytes all ranks together send in one ``forward_backward`` + ``step`` of ``tinytrain train
    --dp dp [--zero zero]`` (fp32, ring collectives), by (group, op): the gradient sync
    (``data_parallel_volume``; a tied embedding counts once in Ψ and, under ZeRO-3, is gathered by
    both layers that use it) and the loss average (one float64 all-reduce, whose algorithm tinytrain
    picks by size). Summed over ranks the ring's uneven chunks cancel, so these are exact."""
    from tinytrain.distributed.choice import choose_all_reduce_algo

    psi, n = model.parameters, dp
    tied = model.vocab * model.hidden if model.tied else 0
    loss = n * collective_bytes("all_reduce", 8, n, choose_all_reduce_algo(8))
    if zero == 0:
        return {("dp", "all_reduce"): round(n * collective_bytes("all_reduce", psi * itemsize, n) + loss)}
    gathered = 2 * (psi + tied) if zero == 3 else psi  # ZeRO-3: for forward and again for backward
    return {
        ("dp", "reduce_scatter"): round(n * collective_bytes("reduce_scatter", psi * itemsize, n)),
        ("dp", "all_gather"): round(n * collective_bytes("all_gather", gathered * itemsize, n)),
        ("dp", "all_reduce"): round(loss),
    }


def bench_points(rows: list) -> list[tuple[int, float, float]]:
    """``bench collectives --json`` rows as ``(steps, bytes each rank sends, seconds)`` for
    ``fit_alpha_beta`` (the nccl-tests size is the whole buffer for every collective but broadcast,
    whose tree has no step count here and is left out)."""
    points = []
    for r in rows:
        if r["collective"] == "broadcast":
            continue
        algo = r["algo"] if r["collective"] == "all_reduce" else "ring"
        n = r["ranks"]
        points.append(
            (
                costs.collective_steps(r["collective"], n, algo),
                costs.collective_bytes(r["collective"], r["size_bytes"], n, algo),
                r["time_us"] * 1e-6,
            )
        )
    return points


def measure_step(plan, config, batch_size: int = 8, seed: int = 0):
    """One ``forward_backward`` + optimizer step of the GPT ``config`` under ``plan`` (every rank
    calls it, under mpirun with ``plan.world_size`` ranks): the ``comm_stats`` of the step, and its
    seconds on this rank. Traced, the step is a ``"step"`` span (building the model, whose
    data-parallel wrapper broadcasts the weights, comes before it)."""
    import time

    import numpy

    from tinytrain import distributed as dist
    from tinytrain import trace
    from tinytrain.nn import GPT
    from tinytrain.optim import AdamW
    from tinytrain.parallel.hybrid import parallelize

    plan.check(dist.get_world_size(), config, batch_size)
    parallel = parallelize(GPT(config, seed=seed), plan)
    optimizer = AdamW(parallel.parameters(), lr=1e-3)
    rng = numpy.random.default_rng(seed)
    x, y = (rng.integers(0, config.vocab_size, size=(batch_size, config.block_size)) for _ in range(2))
    start = time.perf_counter()
    with dist.comm_stats() as stats, trace.span("step", cat="step", step=1):  # as `tinytrain train` traces a step
        parallel.forward_backward(x, y)
        parallel.step(optimizer)
    return stats, time.perf_counter() - start


def calibrate(rows: list) -> tuple[float, float]:
    """(α seconds, bandwidth bytes/s) of this machine's links, fitted to ``bench collectives --json`` rows."""
    return costs.fit_alpha_beta(bench_points(rows))


def run_time(model: ModelSpec, dp: int, compute: float, alpha: float, bandwidth: float, buckets: list[int]) -> dict:
    """The step time of ``tinytrain train --dp dp`` on a calibrated machine: ``compute`` (seconds of
    one rank's forward + backward + optimizer step on its B/dp rows, measured serially) + each
    gradient bucket's ring all-reduce (``buckets``: bytes of each) + the loss average, in the α-β model
    (on CPU ranks share cores, so nothing is counted as hidden behind compute)."""
    from tinytrain.distributed.choice import choose_all_reduce_algo

    grads = sum(costs.collective_time("all_reduce", b, dp, alpha, bandwidth) for b in buckets)
    loss = costs.collective_time("all_reduce", 8, dp, alpha, bandwidth, choose_all_reduce_algo(8))
    return {"compute": compute, "gradients": grads, "loss": loss, "step": compute + grads + loss}
