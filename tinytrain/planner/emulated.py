"""``tinytrain plan --measure``: the planner's ranking of layouts against steps really run under an
emulated topology (``distributed/topology.py``: ``TINYTRAIN_TOPOLOGY=2x2``, a slow link between nodes).

Every rank of an ``mpirun -n N`` run takes part. Three measurements calibrate the planner's
``Cluster`` for this emulated machine, then every candidate layout runs a few steps:

1. the intra-node link: α and bandwidth fitted to ring all-reduces inside each node, all nodes at
   once (:func:`node_link`); the inter-node link is the emulated one in series with that
   (``costs.series_link``: a held message then still crosses shared memory);
2. compute: a serial forward + backward + AdamW step on every rank at once (the cores shared as in
   the parallel runs), of the whole batch and of one sequence: its seconds are c·(tokens + h), so
   the peak is ``costs.gpt_flops`` per token / c and h the planner's ``half_tokens`` (the tokens
   at which a step spends half its time on per-operation overhead, ``costs.matmul_efficiency``);
3. each layout of dp × tp × pp ranks the planner considers (``layouts``, without CP, EP, SP, ZeRO
   and recomputation; at most one pipeline stage per node, see :func:`candidates`), with the
   micro-batches ``tinytrain train`` uses (one, or 2·pp under a pipeline), on the launchers'
   placement; and where TP fits in a node, the same layout with ranks
   placed round-robin (``TINYTRAIN_PLACEMENT=cyclic``, ``mpirun --map-by node``), which puts each TP
   group across the nodes and keeps the mesh as it is. All layouts are built first, then run one
   step each in turn, ``steps`` rounds (the machine's noise falls on all alike); a layout's time is
   its best step, each step the slowest rank's; its inter-node bytes per step (``CommStats.by_link``)
   are summed over ranks.

The planner (``estimate``, fp32 on the wire) prices each layout on that cluster (its all-reduces are
flat rings, as tinytrain's strategies ask for ``algo="ring"``: the textbook volumes);
:func:`measure` returns both, and the command prints the two rankings.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict

import numpy

from tinytrain.parallel import costs

from .layouts import Cluster, Layout, ModelSpec, estimate, layouts


def node_link(world, rounds: int = 3) -> tuple[float, float]:
    """(α seconds, bandwidth bytes/s) of the links inside a node of the active emulated topology,
    fitted to our ring all-reduce over each node's ranks at 16 KiB, 256 KiB and 4 MiB (every node at
    once, as the intra-node phases of a layout run), each the best of ``rounds``."""
    from tinytrain import distributed as dist
    from tinytrain.distributed import topology

    links = topology.active
    nodes = links.nodes_of(world.world_ranks)
    mine = next(ranks for ranks in nodes if world.rank in ranks)
    node = dist.new_group(mine, name=f"node{links.node[world.world_ranks[world.rank]]}")
    local, points = len(mine), []
    for size in (16 << 10, 256 << 10, 4 << 20):
        a = numpy.zeros(size // 4, dtype=numpy.float32)
        dist.all_reduce(a, group=node, algo="ring")  # warm up
        best = float("inf")
        for _ in range(rounds):
            world.comm.Barrier()  # MPI's own: not delayed by the emulation
            start = time.perf_counter()
            for _ in range(5):
                dist.all_reduce(a, group=node, algo="ring")
            best = min(best, world.comm.allreduce((time.perf_counter() - start) / 5, op=_max()))
        steps, nbytes = costs.collective_steps("all_reduce", local), costs.collective_bytes("all_reduce", size, local)
        points.append((steps, nbytes, best))
    return costs.fit_alpha_beta(points)


def _max():
    from tinytrain.distributed._mpi import MPI

    return MPI.MAX


def config_of(model: ModelSpec):
    """The tinytrain GPT of a planner model (fp32, no dropout)."""
    from tinytrain.nn import GPTConfig

    return GPTConfig(
        vocab_size=model.vocab,
        block_size=model.seq,
        n_layer=model.layers,
        n_head=model.heads,
        n_embd=model.hidden,
        bias=model.bias,
        tie_weights=model.tied,
    )


def candidates(model: ModelSpec, nodes: int, per_node: int) -> list[tuple[Layout, str]]:
    """(layout, placement) pairs to run: every dp × tp × pp of the planner's layouts with tinytrain
    train's micro-batches and at most one pipeline stage per node (the lecture's rule: a pipeline
    spans nodes; on a machine of shared cores a stage in its bubble lends its core to the others,
    which the planner's bubble does not model), on block placement; those whose TP fits in a node
    also on cyclic."""
    out, seen = [], set()
    for lo in layouts(model, nodes * per_node, microbatches=range(1, model.batch + 1), without=_WITHOUT):
        rows = model.batch // lo.dp
        m = 2 * lo.pp if lo.pp > 1 else 1  # Plan's default micro-batches
        if (lo.dp, lo.tp, lo.pp) in seen or rows % m or lo.microbatch != rows // m or lo.pp > nodes:
            continue
        seen.add((lo.dp, lo.tp, lo.pp))
        out.append((lo, "block"))
        if 1 < lo.tp <= per_node and nodes > 1:
            out.append((lo, "cyclic"))
    return out


_WITHOUT = ("cp", "ep", "sp", "zero", "recompute")


def _name(lo: Layout, placement: str, per_node: int) -> str:
    sizes = [f"{k}{v}" for k, v in (("dp", lo.dp), ("pp", lo.pp), ("tp", lo.tp)) if v > 1]
    name = " x ".join(sizes) or "serial"
    if lo.tp > 1:
        name += ", TP across nodes" if placement == "cyclic" or lo.tp > per_node else ", TP inside nodes"
    return name


def _compute(model: ModelSpec, world, rounds: int) -> tuple[float, float]:
    """(peak FLOP/s, half_tokens) of one rank while every rank computes (see the module docstring)."""
    seconds = {b: _serial_step(model, b, world, rounds) for b in (1, model.batch)}
    tokens = {b: b * model.seq for b in seconds}
    per_token = (seconds[model.batch] - seconds[1]) / (tokens[model.batch] - tokens[1])
    if model.batch == 1 or per_token <= 0:  # one point, or noise: no overhead to fit
        per_token, half = seconds[model.batch] / tokens[model.batch], 0.0
    else:
        half = max(0.0, seconds[1] / per_token - tokens[1])
    flops = costs.gpt_flops(model.batch, model.seq, model.layers, model.hidden, model.vocab) / tokens[model.batch]
    return flops / per_token, half


def _serial_step(model: ModelSpec, batch: int, world, rounds: int) -> float:
    """Best seconds of a serial step on ``batch`` sequences, the slowest rank's, all ranks at once."""
    from tinytrain.nn import GPT
    from tinytrain.optim import AdamW

    rng = numpy.random.default_rng(0)
    x, y = (rng.integers(0, model.vocab, size=(batch, model.seq)) for _ in range(2))
    serial = GPT(config_of(model), seed=0)
    optimizer = AdamW(serial.parameters(), lr=1e-3)
    best = float("inf")
    for _ in range(rounds + 1):  # the first warms up
        world.comm.Barrier()
        start = time.perf_counter()
        serial.loss(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        best = min(best, world.comm.allreduce(time.perf_counter() - start, op=_max()))
    return best


class _Run:
    """One candidate layout built on every rank, its placement, and its best step so far."""

    def __init__(self, model: ModelSpec, lo: Layout, placed, world):
        from tinytrain.nn import GPT
        from tinytrain.optim import AdamW
        from tinytrain.parallel.hybrid import parallelize
        from tinytrain.parallel.plan import Plan

        self.placed, self.world = placed, world
        plan = Plan(dp=lo.dp, tp=lo.tp, pp=lo.pp)
        config = config_of(model)
        plan.check(world.size, config, model.batch)
        with _placed(placed):  # the model's groups and its first broadcasts on this placement
            self.parallel = parallelize(GPT(config, seed=0), plan)
        self.optimizer = AdamW(self.parallel.parameters(), lr=1e-3)
        rng = numpy.random.default_rng(0)
        self.x, self.y = (rng.integers(0, model.vocab, size=(model.batch, model.seq)) for _ in range(2))
        self.best, self.crossed = float("inf"), 0

    def step(self) -> None:
        """One step, timed (the slowest rank's seconds); its inter-node bytes, this rank's."""
        from tinytrain import distributed as dist

        with _placed(self.placed):
            self.world.comm.Barrier()  # MPI's own: not delayed by the emulation
            start = time.perf_counter()
            with dist.comm_stats() as stats:
                self.parallel.forward_backward(self.x, self.y)
                self.parallel.step(self.optimizer)
            seconds = self.world.comm.allreduce(time.perf_counter() - start, op=_max())
        self.best = min(self.best, seconds)
        self.crossed = sum(n for link, n in stats.by_link(topology=self.placed).items() if "->" in link)


@contextlib.contextmanager
def _placed(placed):
    from tinytrain.distributed import topology

    before = topology.install(placed)
    try:
        yield
    finally:
        topology.install(before)


def measure(model: ModelSpec, steps: int = 3, rounds: int = 3) -> dict | None:
    """Calibrate, run every candidate layout ``steps`` steps under the active emulated topology and
    estimate each on the calibrated cluster (see the module docstring). Every rank calls it; rank 0
    gets ``{"topology", "cluster", "layouts": [...]}`` (fastest measured first), the
    others None. Each layout row: name, layout, placement, predicted_s, measured_s, the planner's
    links and inter_node_bytes (per step, all ranks)."""
    from tinytrain import distributed as dist
    from tinytrain.distributed import topology

    links, world = topology.active, dist.world()
    if links is None:
        raise ValueError(
            "plan --measure runs the layouts on an emulated cluster: set TINYTRAIN_TOPOLOGY (e.g. "
            "TINYTRAIN_TOPOLOGY=2x2 mpirun -n 4 tinytrain plan --measure --model tinytrain)"
        )
    if steps < 1:
        raise ValueError(f"--steps must be at least 1, got {steps}")
    intra = node_link(world, rounds)
    inter = costs.series_link((links.inter_latency, links.inter_bw), intra)
    flops, half_tokens = _compute(model, world, rounds)
    runs, rows = [], []
    for lo, placement in candidates(model, links.nodes, links.per_node):
        cluster = Cluster(
            nodes=links.nodes,
            gpus_per_node=links.per_node,
            memory=float("inf"),
            peak_flops=flops,
            efficiency=1.0,
            half_tokens=round(half_tokens),
            intra_alpha=intra[0],
            intra_bw=intra[1],
            inter_alpha=inter[0],
            inter_bw=inter[1],
            placement=placement,
        )
        predicted = estimate(model, cluster, lo, itemsize=4)
        placed = topology.Topology(links.nodes, links.per_node, links.inter_bw, links.inter_latency, placement)
        runs.append(_Run(model, lo, placed, world))
        rows.append(
            {
                "name": _name(lo, placement, links.per_node),
                "layout": asdict(lo),
                "placement": placement,
                "predicted_s": predicted["time"]["step"],
                "links": predicted["links"],
            }
        )
    for _ in range(steps + 1):  # interleaved, so that the machine's noise falls on every layout alike
        for run in runs:
            run.step()
    for run, row in zip(runs, rows):
        row["measured_s"] = run.best  # the first round warms up, but can only be slower
        row["inter_node_bytes"] = world.comm.allreduce(run.crossed)
    if world.rank != 0:
        return None
    for key in ("predicted_s", "measured_s"):
        for place, row in enumerate(sorted(rows, key=lambda r: r[key]), start=1):
            row[key.replace("_s", "_rank")] = place
    rows.sort(key=lambda r: r["measured_s"])
    cluster = asdict(Cluster(nodes=links.nodes, gpus_per_node=links.per_node))
    cluster.update(intra_alpha=intra[0], intra_bw=intra[1], inter_alpha=inter[0], inter_bw=inter[1])
    cluster.update(peak_flops=flops, efficiency=1.0, half_tokens=round(half_tokens), memory=None)
    return {"topology": repr(links), "cluster": cluster, "layouts": rows}


def report(result: dict) -> list[str]:
    """The two rankings side by side, as lines."""
    c, rows = result["cluster"], result["layouts"]
    lines = [
        f"measured under the emulated {result['topology']}",
        f"calibrated: inside a node {c['intra_alpha'] * 1e6:.0f} us, {c['intra_bw'] / 1e9:.2f} GB/s; between "
        f"nodes {c['inter_alpha'] * 1e6:.0f} us, {c['inter_bw'] / 1e9:.2f} GB/s (emulated + shared memory); "
        f"compute {c['peak_flops'] / 1e9:.2f} GFLOP/s per rank, half of it at {c['half_tokens']} tokens",
        f"  {'layout':<36}{'measured ms':>12}{'#':>3}{'predicted ms':>14}{'#':>3}   TP link     inter-node MB/step",
    ]
    for r in rows:
        lines.append(
            f"  {r['name']:<36}{r['measured_s'] * 1e3:12.1f}{r['measured_rank']:3d}{r['predicted_s'] * 1e3:14.1f}"
            f"{r['predicted_rank']:3d}   {r['links']['tp'] if r['layout']['tp'] > 1 else '-':<12}"
            f"{r['inter_node_bytes'] / 1e6:10.2f}"
        )
    measured = rows[0]["name"]
    predicted = min(rows, key=lambda r: r["predicted_s"])["name"]
    verdict = "they agree" if measured == predicted else "they differ"
    lines.append(f"fastest measured: {measured}; fastest predicted: {predicted} ({verdict})")
    return lines
