"""The planner against this machine: the bytes a step of ``tinytrain train --dp`` sends (exact),
α-β fitted to ``tinytrain bench collectives --json`` rows, a step's time predicted from them, the
memory a tinytrain rank holds under a layout (``tinytrain_memory``, against ``bench strategies``'
measured peak), and one measured step of any plan (for the tests and ``notebooks/communication.ipynb``)."""

from __future__ import annotations

from dataclasses import replace

from tinytrain.parallel import costs
from tinytrain.parallel.costs import collective_bytes

from .layouts import Layout, ModelSpec, memory_per_gpu


def run_bytes(
    model: ModelSpec,
    dp: int = 1,
    zero: int = 0,
    itemsize: int = 4,
    tp: int = 1,
    sp: bool = False,
    pp: int = 1,
    microbatches: int | None = None,
    cp: int = 1,
    cp_algo: str = "ring",
    ep: int = 1,
    rows_away: int | None = None,
    clip: bool = False,
) -> dict:
    """Bytes all ranks together send in one ``forward_backward`` + ``step`` of ``tinytrain train``
    with these flags (fp32), and with ``clip`` the gradient clipping between them (``--grad-clip``,
    on by default: ``clipping_bytes``), by (group, op), each term a formula of ``parallel/costs.py``
    summed over the ranks that send it (summed, a ring's uneven chunks cancel, so these are exact).

    Data parallel (the data group: dp × cp ranks holding the same weights): the gradient sync
    (``data_parallel_volume``, ring; a tied embedding counts once in Ψ and, under ZeRO-3, is gathered
    by both layers that use it) of this rank's TP shard, and the loss average (one float64
    all-reduce, whose algorithm tinytrain picks by size). TP: the blocks' all-reduces
    (``tensor_parallel_volume``; under SP half all-gathers, half reduce-scatters) and the embedding,
    head and loss (``vocab_parallel_volume``). PP: the boundary messages (``pipeline_volume``), the
    tied embedding's gradient swapped between first and last stage, the loss sent from the last
    stage (an all-reduce), then every stage's gradients averaged over dp (one all-reduce per
    parameter: exact for dp ≤ 2, where every algorithm sends the buffer once). CP:
    ``context_parallel_volume``. EP (dropless, as ``tinytrain train --experts E --ep n`` runs it):
    per MoE layer the counts each rank sends each rank (an all-to-all of E integers), the routing
    statistics (an all-gather of k·(E+1) integers), and the rows in both passes (``routed_volume``
    of ``rows_away``: rows the forward sent to another rank, summed over ranks and layers; routing
    decides it, so pass the measured count; None: the even share (ep-1)/ep of every token's top_k
    rows); then the dense gradients, with one has-gradient flag per tensor, averaged over the EP
    group. Other combinations (TP with PP, CP or ZeRO; PP with ZeRO, CP or dp > 2; CP with DP or
    ZeRO; EP with anything) are refused rather than guessed: the tests measure the ones above."""
    from tinytrain.distributed.choice import choose_all_reduce_algo

    if (
        (ep > 1 and (dp > 1 or tp > 1 or pp > 1 or cp > 1 or zero))
        or (tp > 1 and (pp > 1 or cp > 1 or zero))
        or (pp > 1 and (cp > 1 or zero or dp > 2))
        or (cp > 1 and (dp > 1 or zero))
    ):
        raise ValueError(
            "run_bytes is exact for --dp [--zero], --tp [--sp] with --dp, --pp with --dp <= 2, --cp and --ep alone"
        )
    clipping = clipping_bytes(dp, tp, pp, cp, ep, zero) if clip else {}
    if ep > 1:
        return _merged(_expert_parallel_bytes(model, ep, rows_away, itemsize), clipping)
    h, s, rows = model.hidden, model.seq, model.batch // dp  # rows: one replica's sequences
    data = dp * cp  # the ranks that hold the same weights and average their gradients
    out: dict = {}

    def add(group: str, op: str, nbytes: float) -> None:
        if nbytes:
            out[(group, op)] = out.get((group, op), 0) + nbytes

    def loss_average(n: int, groups: int) -> float:  # one float64, over ``groups`` groups of n ranks
        return groups * n * collective_bytes("all_reduce", 8, n, choose_all_reduce_algo(8))

    tied = model.vocab * h if model.tied else 0
    norm = 2 * h if model.bias else h  # one LayerNorm's weight (and bias)
    # replicated over TP: the LayerNorms and the row layers' biases (under SP their gradients are
    # partial sums, all-reduced), and the position embedding
    norms_and_biases = model.layers * (2 * norm + (2 * h if model.bias else 0)) + norm
    if pp > 1:
        m = microbatches or 2 * pp
        add("pp", "send", dp * costs.pipeline_volume(rows // m * s * h * itemsize, pp, m))
        add("pp", "sendrecv", dp * 2 * tied * itemsize)  # first and last stage swap the tied gradient
        add("pp", "all_reduce", loss_average(pp, dp))
        add("dp", "all_reduce", dp * collective_bytes("all_reduce", (model.parameters + tied) * itemsize, dp))
        add("dp", "all_reduce", loss_average(dp, pp))
        return _merged(out, clipping)
    if tp > 1:
        activation, tokens = rows * s * h * itemsize, rows * s * itemsize
        partial = norms_and_biases * itemsize
        blocks = model.layers * costs.tensor_parallel_volume(activation, tp)
        edges = costs.vocab_parallel_volume(activation, tokens, tp, sp, partial)
        for op, nbytes in edges.items():
            add("tp", op, dp * tp * nbytes)
        if sp:  # the blocks' all-reduces become all-gathers and reduce-scatters of the same bytes
            add("tp", "all_gather", dp * tp * blocks / 2)
            add("tp", "reduce_scatter", dp * tp * blocks / 2)
        else:
            add("tp", "all_reduce", dp * tp * blocks)
    if cp > 1:
        op = "send" if cp_algo == "ring" else "all_to_all"
        local = rows * s // cp * h * itemsize  # one (b, s/cp, h) tensor of a context rank
        add("cp", op, dp * cp * model.layers * costs.context_parallel_volume(local, cp, cp_algo))
    group = "cp" if cp > 1 else "dp"
    replicated = s * h + norms_and_biases
    psi = (model.parameters - replicated) / tp + replicated  # the weights one TP rank holds
    if zero == 0:
        add(group, "all_reduce", tp * data * collective_bytes("all_reduce", psi * itemsize, data))
    else:
        gathered = 2 * (psi + tied) if zero == 3 else psi  # ZeRO-3: for forward and again for backward
        add(group, "reduce_scatter", data * collective_bytes("reduce_scatter", psi * itemsize, data))
        add(group, "all_gather", data * collective_bytes("all_gather", gathered * itemsize, data))
    add(group, "all_reduce", loss_average(data, tp))
    return _merged(out, clipping)


def clipping_bytes(dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, zero: int = 0) -> dict:
    """Bytes all ranks send to clip by the global gradient norm (``clip_grad_norm_`` of
    ``parallel/hybrid.py``): sums of squares, float64, all-reduced over each group whose ranks hold
    different gradients: 3 over the data group (ZeRO's pieces) and the pipeline (its stages), then
    one over TP (its shards) and one over EP (its experts). Each is a recursive doubling."""
    from tinytrain.distributed.choice import choose_all_reduce_algo

    world, data = dp * tp * pp * cp * ep, dp * cp * ep
    sums = {"dp": 3 * 8 if zero else 0, "pp": 3 * 8, "tp": 8, "ep": 8}
    sizes = {"dp": data, "pp": pp, "tp": tp, "ep": ep}
    if cp > 1:  # the data group of a context-parallel run is counted as "cp" (run_bytes)
        sums["cp"], sizes["cp"] = sums.pop("dp"), sizes.pop("dp")
    return {
        (group, "all_reduce"): world * collective_bytes("all_reduce", sums[group], n, choose_all_reduce_algo(8))
        for group, n in sizes.items()
        if n > 1 and sums[group]
    }


def _merged(*parts: dict) -> dict:
    """The (group, op) bytes of ``parts`` added up, as integers."""
    out: dict = {}
    for part in parts:
        for key, nbytes in part.items():
            out[key] = out.get(key, 0) + nbytes
    return {key: round(nbytes) for key, nbytes in out.items()}


def _expert_parallel_bytes(model: ModelSpec, ep: int, rows_away: int | None, itemsize: int) -> dict:
    """``run_bytes`` of ``--experts E --ep ep`` (every rank its own B/ep rows; see there)."""
    from tinytrain.distributed.choice import choose_all_reduce_algo

    E, k, l, h = model.experts, model.top_k, model.layers, model.hidden  # noqa: E741
    if rows_away is None:  # the even share: each token's k rows, (ep-1)/ep of them to other ranks
        rows_away = model.batch * model.seq * k * l * (ep - 1) / ep
    per_layer = ep * l  # every rank, every MoE layer
    one = 2 if model.bias else 1  # tensors of a layer: weight (and bias)
    tensors = l * ((2 + 4) * one + 1) + 2 + one + (0 if model.tied else 1)  # LayerNorms, q k v proj, gate; wte wpe ln_f
    dense = (model.parameters - model.expert_parameters + tensors) * itemsize
    loss = ep * collective_bytes("all_reduce", 8, ep, choose_all_reduce_algo(8))
    return {
        ("ep", "all_to_all"): round(
            2 * costs.routed_volume(rows_away, h * itemsize) + per_layer * collective_bytes("all_to_all", 8 * E, ep)
        ),
        ("ep", "all_gather"): round(per_layer * collective_bytes("all_gather", ep * k * (E + 1) * 8, ep)),
        ("ep", "all_reduce"): round(
            ep * collective_bytes("all_reduce", dense, ep, choose_all_reduce_algo(dense)) + loss
        ),
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


def measure_step(plan, config, batch_size: int = 8, seed: int = 0, max_norm: float = 0.0):
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
        if max_norm:  # `tinytrain train --grad-clip` (1.0 by default) clips between them
            parallel.clip_grad_norm_(max_norm)
        parallel.step(optimizer)
    return stats, time.perf_counter() - start


def tinytrain_memory(
    model: ModelSpec,
    lo: Layout,
    state_bytes=(4, 4, 8),
    schedule: str = "1f1b",
    chunks: int = 1,
    microbatches: int | None = None,
    dropout: bool = False,
    itemsize: int = 4,
) -> dict:
    """Bytes a rank of ``tinytrain train`` holds at its peak under ``lo`` (fp32 AdamW by default), by
    the planner's ``memory_per_gpu`` with tinytrain's own terms in place of Megatron's: a layer's
    activations as the engine counts them (``costs.tinytrain_activation_bytes``: float32 arrays,
    bool masks; ``itemsize`` 2, a 16-bit run's, scales the arrays, not the masks); the layer
    activations stage 0 holds at once as the schedule's simulation finds them (``simulator.simulate``:
    GPipe all m micro-batches, 1F1B min(p, m), interleaved in chunks); and ZeRO-3 without a pipeline
    keeps each unit's input only (its units recompute in backward, as full recompute does). Not
    counted: the embeddings', final norm's, logits' and loss's activations, a TP rank's replicated
    weights (counted as 1/t) and a stage's uneven share of the embeddings."""
    from tinytrain.parallel.pipeline.schedules import chunks_of, simulate_schedule

    h, a = model.hidden, model.heads

    def layer_bytes(s, b, recompute):
        mode = "full" if recompute else "none"
        floats = costs.tinytrain_activation_bytes(s, b, h, a, lo.tp, lo.sp, mode, False, lo.cp)
        masks = costs.tinytrain_activation_bytes(s, b, h, a, lo.tp, lo.sp, mode, dropout, lo.cp) - floats
        return floats * itemsize / 4 + masks

    held = None
    if lo.pp > 1:
        m = microbatches or 2 * lo.pp
        chunks = chunks_of(schedule, chunks)
        peak = simulate_schedule(schedule, lo.pp, m, chunks).peak_activations[0]
        held = peak * model.layers / (lo.pp * chunks)  # each chunk: layers / (p·v) of them
    elif lo.zero == 3:
        lo = replace(lo, recompute=True)
    return memory_per_gpu(model, lo, state_bytes, itemsize, layer_bytes=layer_bytes, held=held)


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
