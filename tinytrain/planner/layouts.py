"""The planner's estimates: models, clusters, layouts, and what each layout costs.

For every layout (dp × pp × ep × cp × tp ranks, SP on or off, ZeRO stage, micro-batch size,
activation recomputation) it computes, with the formulas of ``tinytrain/parallel/costs.py`` (the handouts'):

* memory per GPU: parameters, gradients and optimizer state (``zero_memory`` over the data group,
  of this GPU's 1/(tp·pp) of the model) + activations (``activation_bytes_per_layer`` × layers of a
  stage × micro-batches a 1F1B stage holds, min(p, m));
* step time: compute (``gpt_flops`` / (peak × ``matmul_efficiency``: lower for the few tokens of a
  small micro-batch or a short context shard)) per micro-batch, plus per micro-batch
  each TP all-reduce (the blocks'; the vocab-parallel embedding, head and loss,
  ``vocab_parallel_volume``, spread over the stages as the logits' FLOPs are), CP ring transfer
  beyond what attention hides, PP boundary message, on the link it crosses (α-β:
  ``collective_time``), times (m + p - 1) micro-batch slots (the bubble, ``bubble_formula``),
  plus the data-parallel gradient sync that backward does not hide.

The mesh is tinytrain's: TP innermost (neighbouring GPUs), then CP, EP, PP, DP outermost; a group whose
ranks lie within ``gpus_per_node`` consecutive GPUs talks over the intra-node link, otherwise over
the inter-node one. A mixture of experts (``--experts``) adds EP: each EP rank holds 1/ep of the
experts and takes its own rows; per MoE layer and pass two all-to-alls (dispatch, combine) of its
tokens × top-k, padded to the capacity factor, which also scales the busiest rank's expert compute
(the imbalance). What is not modelled: the optimizer step's time, the logits' memory, a MoE layer's
extra activations, overlap of TP, EP or PP messages with compute, interleaved schedules.

Activations are Megatron's layer (the paper's formula, ``activation_bytes_per_layer``), and a
layout recomputes fully or not at all (``Layout.recompute``; the formula also prices "selective").
tinytrain's own layer keeps other arrays: ``costs.tinytrain_activation_bytes`` gives its exact bytes,
14sbh + 8sb + 4abP - 10abs² more than the formula at itemsize 4 without recompute (its docstring
says term by term why), 14sbh + 8sb more with selective, the same 4sbh with full.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import asdict, dataclass

from tinytrain.parallel.costs import (
    activation_bytes_per_layer,
    attention_share,
    bubble_formula,
    collective_time,
    context_parallel_volume,
    data_parallel_volume,
    expert_parallel_volume,
    gpt_flops,
    gpt_parameters,
    matmul_efficiency,
    mlp_parameters,
    tensor_parallel_volume,
    vocab_parallel_volume,
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
    200 Gb/s InfiniBand HDR port per GPU (25 GB/s), 312 TFLOP/s bf16 peak.

    ``placement``: consecutive ranks share a node ("block", launchers' default) or ranks go round
    the nodes ("cyclic", ``mpirun --map-by node``, as ``tinytrain plan --measure`` runs TP across nodes)."""

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
    placement: str = "block"

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def spread(self, span: int, stride: int = 1) -> tuple[int, int]:
        """(nodes, ranks on each) of a mesh group: ranks ``stride`` apart within ``span``
        consecutive ranks (TP: span tp, stride 1; DP: span the world, stride world/dp)."""
        size = span // stride
        if self.placement == "cyclic":
            nodes = min(size, self.nodes // math.gcd(stride, self.nodes))
        else:
            nodes = 1 if span <= self.gpus_per_node else min(size, span // self.gpus_per_node)
        return nodes, size // nodes

    def link(self, span: int, stride: int = 1) -> tuple[float, float]:
        """(α, bandwidth) of a mesh group (see :meth:`spread`): the intra-node link when it lies
        on one node."""
        if self.spread(span, stride)[0] == 1:
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


def memory_per_gpu(
    model: ModelSpec,
    lo: Layout,
    state_bytes=(2, 2, 12),
    itemsize: int = ACTIVATION_BYTES,
    layer_bytes=None,
    held: float | None = None,
) -> dict:
    """Bytes one GPU holds: model state (``zero_memory``; the dense weights sharded over the data
    group dp·ep·cp, the experts over dp·cp), ZeRO-3's gathered weights (one layer's at a time; under
    PP the stage's, gathered for the step) and the activations of stage 0, which under 1F1B holds
    min(p, m) micro-batches of its layers (and, recomputing, one layer's full set at a time).
    ``state_bytes``: bytes per parameter of (weights, gradients, optimizer state), mixed-precision
    Adam by default; ``itemsize``: of an activation (tinytrain's fp32 AdamW: (4, 4, 8) and 4).
    ``layer_bytes(s, b, recompute)``: one layer's bytes kept for backward, Megatron's formula
    (``activation_bytes_per_layer``) by default; ``held``: layer activations (layers x micro-batches)
    stage 0 holds at its peak, 1F1B's by default (``tinytrain_memory`` passes tinytrain's own)."""
    dense, expert = shards(model, lo)
    state = zero_memory(dense, lo.dp * lo.ep * lo.cp, lo.zero, *state_bytes)
    experts = zero_memory(expert, lo.dp * lo.cp, lo.zero, *state_bytes)
    s, m = model.seq // lo.cp, model.batch // (lo.dp * lo.ep * lo.microbatch)
    h, a = model.hidden, model.heads
    if layer_bytes is None:

        def layer_bytes(s, b, recompute):
            return activation_bytes_per_layer(s, b, h, a, lo.tp, lo.sp, recompute, itemsize)

    if held is None:
        held = model.layers / lo.pp * (min(lo.pp, m) if lo.pp > 1 else 1)
    activations = layer_bytes(s, lo.microbatch, lo.recompute) * held
    if lo.recompute:
        activations += layer_bytes(s, lo.microbatch, False)
    memory = {k: state[k] + experts[k] for k in ("params", "grads", "optimizer")}
    memory["gathered"] = gathered_weights(model, lo, state_bytes[0]) if lo.zero == 3 else 0.0
    memory["activations"] = activations
    memory["total"] = sum(memory.values())
    return memory


def gathered_weights(model: ModelSpec, lo: Layout, weight_bytes: float) -> float:
    """ZeRO-3's full weights held besides the pieces: the largest layer's (a block, this GPU's TP
    shard of it) while it runs, or under PP the whole stage's, gathered for the step's micro-batches
    (zero.py's docstring); the pieces of them are counted in ``params`` too, as a run holds both."""
    dense, expert = shards(model, lo)
    if lo.pp > 1:
        return (dense + expert) * weight_bytes
    block = model.parameters - gpt_parameters(0, model.hidden, model.vocab, model.seq, model.bias, model.tied)
    return block / model.layers / lo.tp * weight_bytes


def estimate(model: ModelSpec, cluster: Cluster, layout: Layout, itemsize: int = ACTIVATION_BYTES) -> dict:
    """Memory per GPU (bytes) and step time (seconds), each with its parts; see the module docstring.
    ``itemsize``: bytes of an activation and a gradient on the wire (4: tinytrain's fp32 runs)."""
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
    activation = lo.microbatch * s * model.hidden * itemsize  # one (b, s/cp, h) tensor
    passes = 3 if lo.recompute else 2
    tp_link = cl.link(lo.tp)
    tp = layers * passes * 2 * collective_time("all_reduce", activation, lo.tp, *tp_link)
    # the vocab-parallel embedding, head and loss: 2 all-reduces of an activation, 3 of a number per
    # token (SP: about the same), on the first and last stage: spread over the stages, as the logits' FLOPs are
    tokens_bytes = lo.microbatch * s * itemsize
    edges = sum(vocab_parallel_volume(activation, tokens_bytes, lo.tp, lo.sp).values())
    edge_ars = ((activation, 2), (tokens_bytes, 3))
    tp += sum(k * collective_time("all_reduce", x, lo.tp, *tp_link) for x, k in edge_ars) / lo.pp
    kv = 2 * activation / lo.tp  # this rank's K and V heads
    cp_link = cl.link(lo.tp * lo.cp, lo.tp)
    cp_send = collective_time("send", kv, lo.cp, *cp_link) if lo.cp > 1 else 0.0
    # fwd cp-1 hops, bwd 2cp-1, each hidden behind one attention block: attention is s/(6h) of a layer's FLOPs
    attention = compute * attention_share(model.seq, model.layers, model.hidden, model.vocab)
    cp = max(0.0, layers * (3 * lo.cp - 2) * cp_send - attention)
    ep_link = cl.link(lo.tp * lo.cp * lo.ep, lo.tp * lo.cp)
    routed = activation / lo.tp * model.top_k * model.capacity_factor  # padded to the capacity
    ep = layers * passes * 2 * collective_time("all_to_all", routed, lo.ep, *ep_link) if lo.ep > 1 else 0.0
    pp_link = cl.link(lo.tp * lo.cp * lo.ep * lo.pp, lo.tp * lo.cp * lo.ep)
    boundary = activation / (lo.tp if lo.sp else 1)
    pp = 2 * collective_time("send", boundary, 2, *pp_link) if lo.pp > 1 else 0.0
    slot = compute + tp + cp + ep + pp
    pipeline = (m + lo.pp - 1) * slot
    bubble = bubble_formula(lo.pp, m)

    # --- data parallel: gradients of this GPU's parameters over the data group ----------------------
    dp_stride = world // lo.dp
    dp_link = cl.link(world, dp_stride)
    sync = _gradient_sync(dense_gpu * itemsize, data_group, lo.zero, m, dp_link)
    if expert_gpu:
        more = _gradient_sync(expert_gpu * itemsize, lo.dp * lo.cp, lo.zero, m, dp_link)
        sync = {when: sync[when] + more[when] for when in sync}
    dp_time = sum(sync.values())
    backward = compute * (passes - 1) / passes  # backward (and the recomputed forward) of the last micro-batch
    if lo.pp > 1:
        dp_exposed = dp_time  # a pipeline syncs after its last backward, with the stages idle
    else:  # the last backward hides what it can; the parameters gathered after the optimizer step wait
        dp_exposed = max(0.0, sync["backward"] - backward) + sync["after_step"]
    step = pipeline + dp_exposed
    sent = {  # bytes each GPU sends per step
        "tensor_parallel": m * (layers * tensor_parallel_volume(activation, lo.tp, passes) + edges / lo.pp),
        "context_parallel": m * layers * context_parallel_volume(activation / lo.tp, lo.cp),
        "pipeline": 2 * m * boundary if lo.pp > 1 else 0.0,
        "expert_parallel": m
        * layers
        * passes
        * expert_parallel_volume(activation / lo.tp, lo.ep, model.top_k, model.capacity_factor),
        "data_parallel": (
            data_parallel_volume(dense_gpu, data_group, lo.zero)
            + data_parallel_volume(expert_gpu, lo.dp * lo.cp, lo.zero)
        )
        * itemsize,
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
            "tp": _name(cl, lo.tp, 1),
            "ep": _name(cl, lo.tp * lo.cp * lo.ep, lo.tp * lo.cp),
            "pp": _name(cl, lo.tp * lo.cp * lo.ep * lo.pp, lo.tp * lo.cp * lo.ep),
            "dp": _name(cl, world, dp_stride),
        },
        "mfu": model_flops / (world * cl.peak_flops * step),
        "hfu": hardware_flops / (world * cl.peak_flops * step),
    }


def _gradient_sync(nbytes: float, n: int, zero: int, microbatches: int, link) -> dict:
    """Seconds to sync ``nbytes`` of gradients over ``n`` ranks, by what they can hide behind: the
    last backward, or nothing (after the optimizer step). DDP: one all-reduce during the last
    backward. ZeRO-1/2: the gradients' reduce-scatter during the last backward; the updated
    parameters' all-gather after the step, when nothing is left to compute. ZeRO-3: its
    reduce-scatter and the two all-gathers of the parameters per micro-batch, counted against the
    last backward as before (prefetching under the forwards is not modelled)."""
    gather = collective_time("all_gather", nbytes, n, *link)
    scatter = collective_time("reduce_scatter", nbytes, n, *link)
    if zero == 3:
        return {"backward": scatter + 2 * microbatches * gather, "after_step": 0.0}
    if zero:
        return {"backward": scatter, "after_step": gather}
    return {"backward": collective_time("all_reduce", nbytes, n, *link), "after_step": 0.0}


def _name(cluster: Cluster, span: int, stride: int) -> str:
    return "intra-node" if cluster.spread(span, stride)[0] == 1 else "inter-node"


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
    stages = _divisors(math.gcd(model.layers, gpus))  # pp divides both (not range(layers): --layers 10**8)
    for tp, cp, ep in itertools.product(_powers_of_two(model.heads), cps, eps or [1]):
        if model.heads % tp or model.seq % (2 * cp) or gpus % (tp * cp * ep):
            continue
        for pp in stages:
            if gpus % (tp * cp * ep * pp):
                continue
            dp = gpus // (tp * cp * ep * pp)
            for zero, sp, b, recompute in itertools.product(zeros, sps, microbatches, recomputes):
                if (zero > 1 and pp > 1) or (sp and tp == 1) or model.batch % (dp * ep * b):
                    continue
                yield Layout(dp, tp, pp, cp, sp, zero, b, recompute, ep)


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` >= 1, ascending (trial division up to its square root)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _tp_cp_sizes(model: ModelSpec, without=()) -> tuple[list[int], list[int]]:
    """The TP and CP sizes :func:`layouts` tries for ``model``, ascending."""
    tps = [t for t in _powers_of_two(model.heads) if model.heads % t == 0]
    cps = [c for c in ([1] if "cp" in without else _powers_of_two(16)) if model.seq % (2 * c) == 0] or [1]
    return tps, cps


def most_gpus(model: ModelSpec, without=()) -> int:
    """The most GPUs any layout of ``model`` spans: every factor at its largest (dp·ep: one
    sequence of the batch each, tp, cp, and pp: one stage per layer)."""
    tps, cps = _tp_cp_sizes(model, without)
    return model.batch * tps[-1] * cps[-1] * model.layers


def no_layout(model: ModelSpec, gpus: int, without=()) -> str:
    """Why :func:`layouts` has none for ``gpus`` GPUs, in one sentence with the flags to change: the
    cluster is larger than the model can use (every factor at its largest), or no product of the
    factors its rules allow is exactly ``gpus`` (then the nearest counts that have one)."""
    tps, cps = _tp_cp_sizes(model, without)
    most = most_gpus(model, without)
    if gpus > most:
        return (
            f"{gpus:,} GPUs are more than this model can use: at most {most:,} (--batch {model.batch} replicas "
            f"of one sequence x tp {tps[-1]}, the largest power of two dividing --heads {model.heads}, x cp "
            f"{cps[-1]} x pp {model.layers}, one stage per layer of --layers); use fewer --nodes or "
            "--gpus-per-node, or a larger --batch"
        )
    rules = (
        f"a layout's dp x ep x pp x cp x tp must be exactly {gpus:,}, with dp x ep dividing --batch "
        f"{model.batch}, pp dividing --layers {model.layers}, tp a power of two dividing --heads {model.heads}"
        + (f" and cp a power of two up to 16 dividing half of --seq {model.seq}" if "cp" not in without else "")
    )
    if max(model.batch, model.layers) > 10**12:  # too many divisors to look for the nearest counts
        return f"no layout splits this model over {gpus:,} GPUs: {rules}"
    batch_divisors = _divisors(model.batch)
    below, above = 0, None
    for tp, cp, pp in itertools.product(tps, cps, _divisors(model.layers)):
        rest = tp * cp * pp
        i = bisect.bisect_right(batch_divisors, gpus // rest)
        if i:
            below = max(below, batch_divisors[i - 1] * rest)
        if i < len(batch_divisors):
            above = min(above or math.inf, batch_divisors[i] * rest)
    nearest = " or ".join(f"{n:,}" for n in (below, above) if n)
    return f"no layout splits this model over {gpus:,} GPUs: {rules}; the nearest GPU counts that have one: {nearest}"


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
