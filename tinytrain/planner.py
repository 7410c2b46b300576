"""``tinytrain plan``: which layouts of a model fit a cluster, and which is fastest, with the reason
in numbers.

For every layout (dp × pp × ep × cp × tp ranks, SP on or off, ZeRO stage, micro-batch size,
activation recomputation) it computes, with the formulas of ``tinytrain/parallel/costs.py`` (the handouts'):

* memory per GPU: parameters, gradients and optimizer state (``zero_memory`` over the data group,
  of this GPU's 1/(tp·pp) of the model) + activations (``activation_bytes_per_layer`` × layers of a
  stage × micro-batches a 1F1B stage holds, min(p, m));
* step time: compute (``gpt_flops`` / (peak × ``matmul_efficiency``: lower for the few tokens of a
  small micro-batch or a short context shard)) per micro-batch, plus per micro-batch
  each TP all-reduce, CP ring transfer beyond what attention hides, PP boundary message, on the link
  it crosses (α-β: ``collective_time``), times (m + p - 1) micro-batch slots (the bubble,
  ``bubble_formula``), plus the data-parallel gradient sync that backward does not hide.

The mesh is tinytrain's: TP innermost (neighbouring GPUs), then CP, EP, PP, DP outermost; a group whose
ranks lie within ``gpus_per_node`` consecutive GPUs talks over the intra-node link, otherwise over
the inter-node one. A mixture of experts (``--experts``) adds EP: each EP rank holds 1/ep of the
experts and takes its own rows; per MoE layer and pass two all-to-alls (dispatch, combine) of its
tokens × top-k, padded to the capacity factor, which also scales the busiest rank's expert compute
(the imbalance). What is not modelled: the optimizer step's time, the logits' memory, a MoE layer's
extra activations, overlap of TP, EP or PP messages with compute, interleaved schedules.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import asdict, dataclass, replace

from tinytrain.parallel import costs
from tinytrain.parallel.costs import (
    activation_bytes_per_layer,
    attention_share,
    bubble_formula,
    collective_bytes,
    collective_time,
    data_parallel_volume,
    expert_parallel_volume,
    gpt_flops,
    gpt_parameters,
    matmul_efficiency,
    mlp_parameters,
    tensor_parallel_volume,
    zero_memory,
)

GB = 1e9


@dataclass(frozen=True)
class ModelSpec:
    """A GPT by its shape and the global batch (sequences per step) it trains with."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    batch: int
    tied: bool = True
    bias: bool = True
    experts: int = 0  # > 0: every MLP is a mixture of this many experts
    top_k: int = 1  # experts each token runs
    capacity_factor: float = 1.25  # the busiest expert-parallel rank's work over the even share

    @property
    def parameters(self) -> int:
        return gpt_parameters(self.layers, self.hidden, self.vocab, self.seq, self.bias, self.tied, self.experts)

    @property
    def expert_parameters(self) -> int:
        return self.layers * self.experts * mlp_parameters(self.hidden, self.bias)


# Shapes from the papers; a LLaMA's SwiGLU MLP and grouped-query attention are counted as a GPT's
# 12h² per layer (llama2-7b: 6.7B parameters here, 6.7B in the paper; llama2-70b: 65B here, 69B).
PRESETS = {
    "gpt3-175b": ModelSpec(layers=96, hidden=12288, heads=96, vocab=51200, seq=2048, batch=1536),
    "gpt3-1.3b": ModelSpec(layers=24, hidden=2048, heads=16, vocab=51200, seq=2048, batch=512),
    "llama2-7b": ModelSpec(layers=32, hidden=4096, heads=32, vocab=32000, seq=4096, batch=1024, tied=False, bias=False),
    "llama2-70b": ModelSpec(
        layers=80, hidden=8192, heads=64, vocab=32000, seq=4096, batch=1024, tied=False, bias=False
    ),
    # a Mixtral-8x7B shape, its SwiGLU experts counted as 8h² MLPs (37B parameters here, 47B in the paper)
    "mixtral-8x7b": ModelSpec(
        layers=32, hidden=4096, heads=32, vocab=32000, seq=4096, batch=1024, tied=False, bias=False, experts=8, top_k=2
    ),
    # tinytrain's own defaults (GPTConfig() and `tinytrain train`'s batch)
    "tinytrain": ModelSpec(layers=4, hidden=128, heads=4, vocab=32, seq=32, batch=8),
}


@dataclass(frozen=True)
class Cluster:
    """Nodes of GPUs. Defaults: 8 A100-80GB per node on NVLink (300 GB/s each way per GPU), one
    200 Gb/s InfiniBand HDR port per GPU (25 GB/s), 312 TFLOP/s bf16 peak."""

    nodes: int = 1
    gpus_per_node: int = 8
    memory: float = 80 * GB
    peak_flops: float = 312e12
    efficiency: float = 0.85  # share of peak a large matmul reaches
    half_tokens: int = 512  # a matmul over this many tokens reaches half of that (costs.matmul_efficiency)
    intra_bw: float = 300 * GB
    intra_alpha: float = 5e-6
    inter_bw: float = 25 * GB
    inter_alpha: float = 10e-6

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def link(self, span: int) -> tuple[float, float]:
        """(α, bandwidth) of a group whose ranks lie within ``span`` consecutive GPUs."""
        if span <= self.gpus_per_node:
            return self.intra_alpha, self.intra_bw
        return self.inter_alpha, self.inter_bw


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sp: bool = False
    zero: int = 0
    microbatch: int = 1  # sequences per micro-batch
    recompute: bool = False
    ep: int = 1

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp * self.ep

    def flags(self) -> str:
        sizes = (("dp", self.dp), ("pp", self.pp), ("ep", self.ep), ("cp", self.cp), ("tp", self.tp))
        parts = [f"--{k} {v}" for k, v in sizes if v > 1]
        parts += ["--sp"] if self.sp else []
        parts += [f"--zero {self.zero}"] if self.zero else []
        parts += [f"(micro-batch {self.microbatch}{', recompute' if self.recompute else ''})"]
        return " ".join(parts)


ACTIVATION_BYTES = 2  # bf16 activations and gradients on the wire; fp32 master state in K


def shards(model: ModelSpec, lo: Layout) -> tuple[float, float]:
    """(dense, expert) parameters on one GPU: 1/(tp·pp) of the dense model, and 1/(tp·pp·ep) of the
    experts (each EP rank holds its own)."""
    expert = model.expert_parameters / (lo.tp * lo.pp * lo.ep)
    return (model.parameters - model.expert_parameters) / (lo.tp * lo.pp), expert


def memory_per_gpu(model: ModelSpec, lo: Layout) -> dict:
    """Bytes one GPU holds: model state (``zero_memory``; the dense weights sharded over the data
    group dp·ep·cp, the experts over dp·cp) and the activations of stage 0, which under 1F1B holds
    min(p, m) micro-batches of its layers (and, recomputing, one layer's full set at a time)."""
    dense, expert = shards(model, lo)
    state = zero_memory(dense, lo.dp * lo.ep * lo.cp, lo.zero)
    experts = zero_memory(expert, lo.dp * lo.cp, lo.zero)
    s, m = model.seq // lo.cp, model.batch // (lo.dp * lo.ep * lo.microbatch)
    layer = activation_bytes_per_layer(s, lo.microbatch, model.hidden, model.heads, lo.tp, lo.sp, lo.recompute)
    activations = layer * model.layers / lo.pp * (min(lo.pp, m) if lo.pp > 1 else 1)
    if lo.recompute:
        activations += activation_bytes_per_layer(s, lo.microbatch, model.hidden, model.heads, lo.tp, lo.sp)
    memory = {k: state[k] + experts[k] for k in ("params", "grads", "optimizer")}
    memory["activations"] = activations
    memory["total"] = sum(memory.values())
    return memory


def estimate(model: ModelSpec, cluster: Cluster, layout: Layout) -> dict:
    """Memory per GPU (bytes) and step time (seconds), each with its parts; see the module docstring."""
    lo, cl = layout, cluster
    world = lo.gpus
    m = model.batch // (lo.dp * lo.ep * lo.microbatch)  # micro-batches per replica and step
    s = model.seq // lo.cp  # positions each context rank holds
    dense_gpu, expert_gpu = shards(model, lo)
    data_group = lo.dp * lo.ep * lo.cp  # CP and EP are data parallel for the dense weights
    memory = memory_per_gpu(model, lo)

    # --- one micro-batch on one stage -------------------------------------------------------------
    layers = model.layers / lo.pp
    shape = (lo.microbatch, model.seq, model.layers, model.hidden, model.vocab, lo.recompute)
    flops = gpt_flops(*shape, top_k=model.top_k if model.experts else 1)
    if lo.ep > 1:  # the busiest EP rank's experts run capacity_factor times the even share of tokens
        flops += (flops - gpt_flops(*shape, top_k=0)) * (model.capacity_factor - 1)
    tokens = lo.microbatch * s  # the rows of every matmul on this GPU
    compute = (
        flops / (lo.tp * lo.pp * lo.cp) / (cl.peak_flops * matmul_efficiency(tokens, cl.efficiency, cl.half_tokens))
    )
    activation = lo.microbatch * s * model.hidden * ACTIVATION_BYTES  # one (b, s/cp, h) tensor
    tp_link = cl.link(lo.tp)
    passes = 3 if lo.recompute else 2
    tp = layers * passes * 2 * collective_time("all_reduce", activation, lo.tp, *tp_link)
    kv = 2 * activation / lo.tp  # this rank's K and V heads
    cp_link = cl.link(lo.tp * lo.cp)
    cp_send = collective_time("send", kv, lo.cp, *cp_link) if lo.cp > 1 else 0.0
    # fwd cp-1 hops, bwd 2cp-1, each hidden behind one attention block: attention is s/(6h) of a layer's FLOPs
    attention = compute * attention_share(model.seq, model.layers, model.hidden, model.vocab)
    cp = max(0.0, layers * (3 * lo.cp - 2) * cp_send - attention)
    ep_link = cl.link(lo.tp * lo.cp * lo.ep)
    routed = activation / lo.tp * model.top_k * model.capacity_factor  # padded to the capacity
    ep = layers * passes * 2 * collective_time("all_to_all", routed, lo.ep, *ep_link) if lo.ep > 1 else 0.0
    pp_link = cl.link(lo.tp * lo.cp * lo.ep * lo.pp)
    boundary = activation / (lo.tp if lo.sp else 1)
    pp = 2 * collective_time("send", boundary, 2, *pp_link) if lo.pp > 1 else 0.0
    slot = compute + tp + cp + ep + pp
    pipeline = (m + lo.pp - 1) * slot
    bubble = bubble_formula(lo.pp, m)

    # --- data parallel: gradients of this GPU's parameters over the data group ----------------------
    dp_link = cl.link(world)
    dp_time = _gradient_sync(dense_gpu * ACTIVATION_BYTES, data_group, lo.zero, m, dp_link)
    if expert_gpu:
        dp_time += _gradient_sync(expert_gpu * ACTIVATION_BYTES, lo.dp * lo.cp, lo.zero, m, dp_link)
    backward = compute * (passes - 1) / passes  # backward (and the recomputed forward) of the last micro-batch
    dp_exposed = dp_time if lo.pp > 1 else max(0.0, dp_time - backward)
    step = pipeline + dp_exposed
    sent = {  # bytes each GPU sends per step
        "tensor_parallel": m * layers * tensor_parallel_volume(activation, lo.tp, passes),
        "context_parallel": m * layers * (3 * lo.cp - 2) * kv if lo.cp > 1 else 0.0,
        "pipeline": 2 * m * boundary if lo.pp > 1 else 0.0,
        "expert_parallel": m
        * layers
        * passes
        * expert_parallel_volume(activation / lo.tp, lo.ep, model.top_k, model.capacity_factor),
        "data_parallel": (
            data_parallel_volume(dense_gpu, data_group, lo.zero)
            + data_parallel_volume(expert_gpu, lo.dp * lo.cp, lo.zero)
        )
        * ACTIVATION_BYTES,
    }
    whole = (model.batch, model.seq, model.layers, model.hidden, model.vocab)
    k = model.top_k if model.experts else 1
    model_flops, hardware_flops = gpt_flops(*whole, top_k=k), gpt_flops(*whole, lo.recompute, top_k=k)
    return {
        "layout": asdict(lo),
        "flags": lo.flags(),
        "gpus": world,
        "microbatches": m,
        "fits": memory["total"] <= cl.memory,
        "memory": memory,
        "time": {
            "compute": m * compute,
            "tensor_parallel": m * tp,
            "context_parallel": m * cp,
            "expert_parallel": m * ep,
            "pipeline_messages": m * pp,
            "bubble": (lo.pp - 1) * slot,
            "bubble_share": bubble,
            "data_parallel": dp_time,
            "data_parallel_exposed": dp_exposed,
            "step": step,
        },
        "bytes_sent": sent,
        "links": {
            "tp": _name(cl, lo.tp),
            "ep": _name(cl, lo.tp * lo.cp * lo.ep),
            "pp": _name(cl, lo.tp * lo.cp * lo.ep * lo.pp),
            "dp": _name(cl, world),
        },
        "mfu": model_flops / (world * cl.peak_flops * step),
        "hfu": hardware_flops / (world * cl.peak_flops * step),
    }


def _gradient_sync(nbytes: float, n: int, zero: int, microbatches: int, link) -> float:
    """Seconds to sync ``nbytes`` of gradients over ``n`` ranks: one all-reduce (DDP), a
    reduce-scatter + an all-gather (ZeRO-1/2), or ZeRO-3's reduce-scatter and two all-gathers of
    the parameters per micro-batch."""
    if zero == 3:
        gather = collective_time("all_gather", nbytes, n, *link)
        return collective_time("reduce_scatter", nbytes, n, *link) + 2 * microbatches * gather
    if zero:
        return 2 * collective_time("reduce_scatter", nbytes, n, *link)
    return collective_time("all_reduce", nbytes, n, *link)


def _name(cluster: Cluster, span: int) -> str:
    return "intra-node" if span <= cluster.gpus_per_node else "inter-node"


def _powers_of_two(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length()) if (1 << k) <= limit]


OPTIONAL = ("cp", "ep", "sp", "zero", "recompute")  # strategies `--without` can leave out


def layouts(model: ModelSpec, gpus: int, microbatches=(1, 2, 4, 8), without=()):
    """Every layout of ``gpus`` GPUs the planner considers: tp a power of two dividing the heads, pp
    dividing the layers, cp cutting the sequence into 2·cp zigzag chunks, ep dividing the experts
    (a mixture of experts only), ZeRO 2 and 3 only without a pipeline (they would sync once per
    micro-batch), SP only with TP; ``without`` leaves out any of ``OPTIONAL`` (e.g. a paper's
    search space: ``("cp", "sp", "zero")``)."""
    cps = [1] if "cp" in without else _powers_of_two(16)
    eps = [e for e in _powers_of_two(model.experts) if model.experts % e == 0] if "ep" not in without else [1]
    zeros = [0] if "zero" in without else range(4)
    sps = [False] if "sp" in without else (False, True)
    recomputes = [False] if "recompute" in without else (False, True)
    for tp, cp, ep in itertools.product(_powers_of_two(model.heads), cps, eps or [1]):
        if model.heads % tp or model.seq % (2 * cp) or gpus % (tp * cp * ep):
            continue
        for pp in range(1, model.layers + 1):
            if model.layers % pp or gpus % (tp * cp * ep * pp):
                continue
            dp = gpus // (tp * cp * ep * pp)
            for zero, sp, b, recompute in itertools.product(zeros, sps, microbatches, recomputes):
                if (zero > 1 and pp > 1) or (sp and tp == 1) or model.batch % (dp * ep * b):
                    continue
                yield Layout(dp, tp, pp, cp, sp, zero, b, recompute, ep)


def plan(model: ModelSpec, cluster: Cluster, without=()) -> list[dict]:
    """Every layout's estimate, the fitting ones first, fastest first."""
    rows = [estimate(model, cluster, lo) for lo in layouts(model, cluster.gpus, without=without)]
    # among equally fast layouts, the simplest first (lower ZeRO stage, no SP, no recomputation)
    return sorted(
        rows,
        key=lambda r: (
            not r["fits"],
            r["time"]["step"],
            r["layout"]["zero"],
            r["layout"]["sp"],
            r["layout"]["recompute"],
        ),
    )


def best(rows: list[dict], **where) -> dict | None:
    """The fastest fitting row whose layout has every ``where`` value (e.g. ``tp=8``), or None."""
    for r in rows:
        if r["fits"] and all(r["layout"][k] == v for k, v in where.items()):
            return r
    return None


# --- the command ----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt3-175b", help=f"a preset: {', '.join(PRESETS)}")
    for name, what in (
        ("experts", "experts per MoE layer (0: dense)"),
        ("top_k", "experts each token runs"),
        ("layers", "transformer blocks"),
        ("hidden", "width"),
        ("heads", "attention heads"),
        ("vocab", "vocabulary size"),
        ("seq", "sequence length"),
        ("batch", "global batch in sequences"),
    ):
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=None, help=f"{what} (overrides the preset)"
        )
    parser.add_argument(
        "--capacity-factor", type=float, default=None, help="the busiest EP rank's tokens over the even share"
    )
    c = Cluster()
    parser.add_argument("--nodes", type=int, default=c.nodes)
    parser.add_argument("--gpus-per-node", type=int, default=c.gpus_per_node)
    parser.add_argument("--memory-gb", type=float, default=c.memory / GB, help="memory per GPU")
    parser.add_argument("--peak-tflops", type=float, default=c.peak_flops / 1e12, help="peak per GPU")
    parser.add_argument("--efficiency", type=float, default=c.efficiency, help="share of peak large matmuls reach")
    parser.add_argument(
        "--half-tokens",
        type=int,
        default=c.half_tokens,
        help="tokens per GPU and micro-batch at which matmuls reach half",
    )
    parser.add_argument("--intra-gbps", type=float, default=c.intra_bw / GB, help="intra-node GB/s per GPU")
    parser.add_argument("--inter-gbps", type=float, default=c.inter_bw / GB, help="inter-node GB/s per GPU")
    parser.add_argument("--intra-latency-us", type=float, default=c.intra_alpha * 1e6)
    parser.add_argument("--inter-latency-us", type=float, default=c.inter_alpha * 1e6)
    parser.add_argument(
        "--without", nargs="+", default=[], choices=OPTIONAL, help="leave strategies out (e.g. a paper's search space)"
    )
    parser.add_argument("--top", type=int, default=5, help="how many layouts to print")
    parser.add_argument("--json", action="store_true", help="print every layout's estimate as JSON")


def from_args(args) -> tuple[ModelSpec, Cluster]:
    if args.model not in PRESETS:
        raise ValueError(f"--model {args.model} is not a preset; choose one of {', '.join(PRESETS)}")
    overrides = {
        k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab", "seq", "batch", "experts", "top_k")
    }
    overrides["capacity_factor"] = args.capacity_factor
    model = replace(PRESETS[args.model], **{k: v for k, v in overrides.items() if v is not None})
    for k, v in asdict(model).items():
        if isinstance(v, int) and not isinstance(v, bool) and v < (0 if k == "experts" else 1):
            raise ValueError(f"--{k.replace('_', '-')} must be at least {0 if k == 'experts' else 1}, got {v}")
    if model.experts and model.top_k > model.experts:
        raise ValueError(f"--top-k {model.top_k} is more than --experts {model.experts}")
    if not model.capacity_factor >= 1:
        raise ValueError(f"--capacity-factor must be at least 1, got {model.capacity_factor}")
    if model.hidden % model.heads:
        raise ValueError(f"--hidden {model.hidden} does not split into --heads {model.heads}")
    positive = ("nodes", "gpus_per_node", "memory_gb", "peak_tflops", "efficiency", "intra_gbps", "inter_gbps")
    for k in ("half_tokens", "intra_latency_us", "inter_latency_us"):
        if not getattr(args, k) >= 0:
            raise ValueError(f"--{k.replace('_', '-')} must be at least 0, got {getattr(args, k)}")
    for k in positive:
        if not getattr(args, k) > 0:  # nan too
            raise ValueError(f"--{k.replace('_', '-')} must be positive, got {getattr(args, k)}")
    if not args.efficiency <= 1:
        raise ValueError(f"--efficiency is a share of peak: at most 1, got {args.efficiency}")
    cluster = Cluster(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        memory=args.memory_gb * GB,
        peak_flops=args.peak_tflops * 1e12,
        efficiency=args.efficiency,
        half_tokens=args.half_tokens,
        intra_bw=args.intra_gbps * GB,
        inter_bw=args.inter_gbps * GB,
        intra_alpha=args.intra_latency_us * 1e-6,
        inter_alpha=args.inter_latency_us * 1e-6,
    )
    return model, cluster


def _row(r: dict) -> str:
    mem, t = r["memory"], r["time"]
    return (
        f"{r['flags']:<52} {mem['total'] / GB:6.1f} GB  step {t['step']:8.3f} s  {r['mfu']:5.1%} MFU  "
        f"(compute {t['compute']:.2f}, TP {t['tensor_parallel']:.2f} {r['links']['tp']}, "
        f"bubble {t['bubble_share']:.0%}, PP {t['pipeline_messages']:.2f}, DP {t['data_parallel_exposed']:.2f}"
        + (f", EP {t['expert_parallel']:.2f} {r['links']['ep']}" if r["layout"]["ep"] > 1 else "")
        + ")"
    )


def run(args) -> int:
    model, cluster = from_args(args)
    rows = plan(model, cluster, without=args.without)
    if args.json:
        json.dump({"model": asdict(model), "cluster": asdict(cluster), "layouts": rows}, sys.stdout)
        print()
        return 0
    fitting = [r for r in rows if r["fits"]]
    print(
        f"{args.model}: {model.parameters / 1e9:.1f}B parameters, batch {model.batch} x {model.seq} tokens, "
        f"on {cluster.nodes} x {cluster.gpus_per_node} GPUs of {cluster.memory / GB:.0f} GB"
    )
    if not fitting:
        smallest = min(rows, key=lambda r: r["memory"]["total"]) if rows else None
        need = f" (the smallest needs {smallest['memory']['total'] / GB:.1f} GB per GPU)" if smallest else ""
        print(f"no layout fits{need}: add GPUs or memory")
        return 1
    print(f"{len(fitting)} of {len(rows)} layouts fit; the fastest:")
    for r in fitting[: args.top]:
        print("  " + _row(r))
    inside = next((r for r in fitting if r["links"]["tp"] == "intra-node"), None)
    across = next((r for r in fitting if r["links"]["tp"] == "inter-node"), None)
    if inside and across:
        print(
            f"TP inside a node: best {inside['time']['step']:.3f} s/step; TP across nodes: best "
            f"{across['time']['step']:.3f} s/step ({across['flags']}), its TP all-reduces cost "
            f"{across['time']['tensor_parallel']:.2f} s on the {cluster.inter_bw / GB:g} GB/s link"
        )
    return 0


# --- tinytrain's own runs: the bytes a step sends, exactly -----------------------------------------


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
