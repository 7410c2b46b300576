"""The cost formulas of the handouts, in one place: bytes each collective sends, the α-β time of a
message, ZeRO's memory per rank, activation memory per layer, FLOPs per step, the pipeline bubble.

Everything here is arithmetic on sizes; nothing talks between ranks. ``tinytrain plan`` computes
layouts with these functions, the tests check them against measured bytes and published figures,
and ``docs/choosing_a_layout.md`` walks through them. Symbols:

    N   bytes of a buffer            n   ranks in the group          Ψ   parameters
    α   seconds to start a message   bw  bytes per second of a link  K   optimizer bytes per parameter
    s   sequence length              b   micro-batch (sequences)     h   hidden width
    a   attention heads              l   layers                      V   vocabulary
    t   tensor-parallel ranks        p   pipeline stages             m   micro-batches per replica

Collective volumes (bytes *each rank sends*, ring algorithms, ``distributed/algorithms.py``; with
n not dividing the buffer a rank sends within one chunk of these, and the sum over ranks is exact)::

    all-reduce (ring)              2(n-1)/n · N      in 2(n-1) steps
    all-reduce (halving-doubling)  2(n-1)/n · N      in 2·log2 n steps
    all-reduce (recursive doubl.)  log2 n · N        in log2 n steps
    all-gather, reduce-scatter     (n-1)/n · N       in n-1 steps (N: the whole, gathered buffer)
    all-to-all (pairwise)          (n-1)/n · N       in n-1 steps (N: the send buffer)
    send (one message)             N                 in 1 step
"""

from __future__ import annotations

import math

import numpy

from tinytrain.autograd.ops import ATTENTION_BLOCK
from tinytrain.parallel.simulator import bubble_formula

__all__ = [
    "bubble_formula",
    "collective_bytes",
    "collective_steps",
    "collective_time",
    "hierarchical_all_reduce_time",
    "series_link",
    "zero_memory",
    "data_parallel_volume",
    "parameter_server_volume",
    "local_sgd_volume",
    "sparse_push_volume",
    "tensor_parallel_volume",
    "vocab_parallel_volume",
    "pipeline_volume",
    "context_parallel_volume",
    "activation_bytes_per_layer",
    "attention_scores_kept",
    "tinytrain_activation_bytes",
    "gpt_parameters",
    "gpt_flops",
    "mlp_parameters",
    "expert_parallel_volume",
    "routed_volume",
    "attention_share",
    "matmul_efficiency",
    "fit_alpha_beta",
    "crossover",
]

# --- collectives: volume and α-β time ------------------------------------------------------------


def collective_bytes(op: str, nbytes: float, n: int, algo: str = "ring") -> float:
    """Bytes each of ``n`` ranks sends in ``op`` on a buffer of ``nbytes`` (see the module table)."""
    if n == 1:
        return 0.0
    if op == "all_reduce":
        return math.log2(n) * nbytes if algo == "recursive_doubling" else 2 * (n - 1) / n * nbytes
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n * nbytes
    if op == "send":
        return float(nbytes)
    raise ValueError(f"no volume formula for {op!r}: use all_reduce, all_gather, reduce_scatter, all_to_all or send")


def collective_steps(op: str, n: int, algo: str = "ring") -> int:
    """Messages each rank sends one after the other in ``op`` (each pays one start-up α)."""
    if n == 1:
        return 0
    if op == "send":
        return 1
    if op == "all_reduce":
        return {
            "ring": 2 * (n - 1),
            "halving_doubling": 2 * math.ceil(math.log2(n)),
            "recursive_doubling": math.ceil(math.log2(n)),
        }[algo]
    return n - 1


def collective_time(op: str, nbytes: float, n: int, alpha: float, bandwidth: float, algo: str = "ring") -> float:
    """The α-β model: every step pays α, every byte a rank sends costs 1/bandwidth seconds."""
    return collective_steps(op, n, algo) * alpha + collective_bytes(op, nbytes, n, algo) / bandwidth


def hierarchical_all_reduce_time(
    nbytes: float, nodes: int, local: int, intra: tuple, inter: tuple, inter_algo: str = "ring"
) -> float:
    """The α-β time of the hierarchical all-reduce (``distributed/hierarchical.py``) over ``nodes``
    nodes of ``local`` ranks: a ring reduce-scatter and all-gather inside each node on the ``intra``
    (α, bandwidth) link, between them an all-reduce of one rank's 1/local piece across the nodes
    (``inter_algo``) on the ``inter`` link. The flat ring over the same ranks pays ``inter`` on
    every step: ``collective_time("all_reduce", nbytes, nodes * local, *inter)``."""
    inside = sum(collective_time(op, nbytes, local, *intra) for op in ("reduce_scatter", "all_gather"))
    return inside + collective_time("all_reduce", nbytes / local, nodes, *inter, algo=inter_algo)


def series_link(*links: tuple) -> tuple[float, float]:
    """(α, bandwidth) of links a message crosses one after the other: the α add up, so do the
    seconds per byte (the emulated topology's inter-node link, then the shared memory under it)."""
    return sum(a for a, _ in links), 1.0 / sum(1.0 / bw for _, bw in links)


# --- data parallel and ZeRO --------------------------------------------------------------------------


def zero_memory(psi: float, n: int, stage: int, weight: int = 2, grad: int = 2, optimizer: int = 12) -> dict:
    """Bytes of model state per rank (ZeRO paper, Figure 1), for Ψ parameters over n data-parallel ranks.

    Defaults: mixed-precision Adam (2 + 2 + K with K = 12); tinytrain's fp32 Adam is 4 + 4 + 8::

        stage 0 (DDP)   (2 + 2 + K) Ψ          16Ψ     fp32: 16Ψ
        stage 1         4Ψ + KΨ/n                      fp32: 8Ψ + 8Ψ/n
        stage 2         2Ψ + (2 + K)Ψ/n                fp32: 4Ψ + 12Ψ/n
        stage 3         (2 + 2 + K)Ψ/n                 fp32: 16Ψ/n
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    shard = {"params": stage >= 3, "grads": stage >= 2, "optimizer": stage >= 1}
    per = {"params": weight, "grads": grad, "optimizer": optimizer}
    mem = {k: per[k] * psi / (n if shard[k] else 1) for k in per}
    mem["total"] = sum(mem.values())
    return mem


def data_parallel_volume(psi: float, n: int, stage: int, tied: float = 0) -> float:
    """Elements each rank sends per step to synchronize Ψ gradients over n ranks (multiply by the
    bytes of an element). DDP: one all-reduce, 2(n-1)/n Ψ. ZeRO-1/2: reduce-scatter of gradients +
    all-gather of updated parameters, the same 2(n-1)/n Ψ. ZeRO-3: parameters gathered for forward
    and again for backward + reduce-scatter, 3(n-1)/n Ψ (a weight used by two layers, ``tied``
    elements, is gathered by each: 2(n-1)/n more of it)."""
    if stage == 3:
        return (n - 1) / n * (3 * psi + 2 * tied)
    return 2 * (n - 1) / n * psi


def parameter_server_volume(psi_bytes: float, n: int) -> float:
    """Bytes through the server's link per step (in and out), n ranks of which n-1 push: each worker
    pushes its gradient and pulls the parameters, 2(n-1)·Ψ; asynchronous or not, the same."""
    return 2 * (n - 1) * psi_bytes


def local_sgd_volume(psi_bytes: float, n: int, local_steps: int) -> float:
    """Bytes all n replicas send and receive together per step under local SGD / DiLoCo: one ring
    all-reduce of the Ψ deltas every H steps, in which the ranks together send 2(n-1)·Ψ (exactly,
    whatever the chunks) and receive as much."""
    return 2 * 2 * (n - 1) * psi_bytes / local_steps


def fedavg_round_volume(psi: int, n: int, counted: bool = True) -> float:
    """Bytes all n ranks send and receive together per round of federated averaging
    (``federated.FedAvg``): one ring all-reduce of the Ψ-element update sum (and the sample count,
    unless DP-FedAvg's fixed denominator makes it needless), 8 bytes an element (float64 sums, or
    secure aggregation's uint64 fixed point), in which the ranks together send 2(n-1) times the
    buffer and receive as much."""
    return 2 * 2 * (n - 1) * (psi + (1 if counted else 0)) * 8


def sparse_push_volume(rows_touched: int, row_bytes: int, index_bytes: int = 8) -> float:
    """Bytes of one embedding gradient pushed sparse (``data_parallel.SparsePushServer``): a row
    count, then the k rows a batch touched, each with its index; dense it is ``vocabulary · row_bytes``."""
    return index_bytes + rows_touched * (row_bytes + index_bytes)


# --- tensor parallel --------------------------------------------------------------------------------


def tensor_parallel_volume(activation_bytes: float, t: int, passes: int = 2) -> float:
    """Bytes each rank sends per block for ``passes`` passes (forward + backward = 2; a recomputed
    forward adds one): two all-reduces of one (b, s, h) activation per pass, 4(t-1)/t·A, the same
    bytes under SP as all-gathers + reduce-scatters (a4 handout, section 6)."""
    return passes * 2 * collective_bytes("all_reduce", activation_bytes, t)


def vocab_parallel_volume(
    activation_bytes: float, token_bytes: float, t: int, sp: bool = False, partial_bytes: float = 0
) -> dict:
    """Bytes each rank sends per step outside the blocks under TP, by collective: the
    vocabulary-parallel embedding (an all-reduce of the t partial lookups, forward), the tied head
    (an all-reduce of its input's gradient, backward) and the vocabulary-parallel cross-entropy
    (three all-reduces of one number per token, ``token_bytes``: row max, sum of exponentials,
    target logit). Under SP tinytrain keeps the embedding's all-reduce (then scatters; backward
    all-gathers), the head all-gathers the sequence (backward reduce-scatters), and the gradients
    of the replicated weights that saw only my tokens (``partial_bytes``: LayerNorms, row biases)
    are all-reduced."""
    activation, tokens, partial = (
        collective_bytes("all_reduce", x, t) for x in (activation_bytes, token_bytes, partial_bytes)
    )
    if not sp:
        return {"all_reduce": 2 * activation + 3 * tokens}
    return {
        "all_reduce": activation + 3 * tokens + partial,
        "all_gather": 2 * collective_bytes("all_gather", activation_bytes, t),
        "reduce_scatter": collective_bytes("reduce_scatter", activation_bytes, t),
    }


# --- pipeline and context parallel --------------------------------------------------------------------


def pipeline_volume(boundary_bytes: float, p: int, m: int) -> float:
    """Bytes all p stages of one pipeline send per step: at each of the p - 1 boundaries every
    micro-batch's activation goes forward and its gradient back, 2m messages of one micro-batch's
    (b, s, h) (``boundary_bytes``; /t under SP). GPipe and 1F1B send the same messages, in another order."""
    return (p - 1) * 2 * m * collective_bytes("send", boundary_bytes, 2)


def context_parallel_volume(activation_bytes: float, cp: int, algo: str = "ring") -> float:
    """Bytes each of ``cp`` ranks sends per attention layer, forward + backward, for one local
    (b, s/cp, h) tensor of ``activation_bytes``. Ring attention passes K and V (2 tensors) cp - 1
    hops forward and K, V and their gradients 2cp - 1 hops backward: (3cp - 2)·2A. Ulysses
    (``alltoall``) turns q, k, v from sequence to head shards and the output back, 4 all-to-alls
    per pass."""
    if cp == 1:
        return 0.0
    if algo == "ring":
        return (3 * cp - 2) * 2 * activation_bytes
    if algo == "alltoall":
        return 2 * 4 * collective_bytes("all_to_all", activation_bytes, cp)
    raise ValueError(f"no context-parallel formula for {algo!r}: use ring or alltoall")


def activation_bytes_per_layer(
    s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, recompute=False, itemsize: int = 2
) -> float:
    """Bytes one transformer layer keeps for backward (Korthikanti et al. 2022, Table 2, 16-bit
    activations, 1-byte dropout masks, Megatron's layer)::

                          none                    selective (attention core)   full
        no TP             sbh (34 + 5as/h)        34 sbh                       2sbh
        TP over t         sbh (10 + 24/t + 5as/(ht))   sbh (10 + 24/t)         2sbh
        TP + SP           sbh/t (34 + 5as/h)      34 sbh/t                     2sbh/t

    ``recompute``: "none", "selective" or "full" (False and True: none and full). ``itemsize``
    scales the 2-byte figures (4: fp32 activations; the masks scale with it too). tinytrain's own
    layer keeps other arrays: :func:`tinytrain_activation_bytes` (its exact bytes), and says where."""
    mode = {False: "none", True: "full"}.get(recompute, recompute)
    sbh = s * b * h * itemsize / 2
    attention = 0 if mode == "selective" else 5 * a * s / h  # the core: softmax, its dropout, its mask
    if mode == "full":
        return 2 * sbh / (t if sp else 1)
    if mode not in ("none", "selective"):
        raise ValueError(f"recompute is none, selective or full, got {recompute!r}")
    if sp:
        return sbh / t * (34 + attention)
    return sbh * (10 + 24 / t + attention / t)


def attention_scores_kept(s: int) -> int:
    """Probabilities per head and sequence that tinytrain's causal attention keeps for backward:
    blocks of 64 query rows (``autograd/ops.py``), each against the keys up to its last row, so
    s² for s ≤ 64 and about s²/2 + 32s beyond."""
    block = ATTENTION_BLOCK
    return sum((min(s, lo + block) - lo) * min(s, lo + block) for lo in range(0, s, block))


def tinytrain_activation_bytes(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    sp: bool = False,
    recompute: str = "none",
    dropout: bool = True,
    cp: int = 1,
    cp_algo: str = "ring",
) -> int:
    """Bytes one block of tinytrain's GPT keeps for backward, exactly as the engine counts them
    (``saved_bytes()``: each buffer once, parameters not): float32 activations, bool dropout masks,
    what our ops save. s positions of b sequences, width h, a heads, over t tensor-parallel ranks::

        kept by                                   bytes            TP over t     TP + SP
        ln_1, ln_2: xhat (s·b·h), rstd (s·b)     2 (4sbh + 4sb)    not divided   /t
        ln_1, ln_2 outputs (inputs of q,k,v and   2 · 4sbh         not divided   not divided (*)
          of fc_1, kept by those linears)
        q, k, v                                   3 · 4sbh         /t            /t
        attention output (input of proj)          4sbh             /t            /t
        fc_1 output (GELU's input), GELU's σ,     3 · 16sbh        /t            /t
          GELU output (input of fc_2)
        the two dropout masks (if dropout)        2 · sbh          not divided   /t
        attention core: probabilities             4ab · P(s)       /t (heads)    /t
          (P(s) = attention_scores_kept(s), s² for s ≤ 64)

        none       all of the above: 82sbh + 8sb + 4abP            (80sbh + 8sb + 4abP without dropout)
        TP         18sbh + 8sb + 64sbh/t + 4abP/t
        TP + SP    8sbh + (74sbh + 8sb + 4abP)/t
        selective  the same without the attention core (it keeps q, k, v, counted above)
        full       4sbh: the block's input (/t under SP, where the input is a sequence shard)

    (*) Megatron's SP keeps the LayerNorm output's shard and all-gathers it again in backward; our
    column-parallel linear keeps the all-gathered input, so 8sbh stays whole under SP.

    Context parallel over ``cp`` ranks: every term above with this rank's s/cp positions, but the
    attention core is the algorithm's: ring attention keeps its output (B, H, s/cp, D) and the
    log-sum-exp of each row, 4·(s/cp)bh + 4ab·s/cp (q, k, v are counted above); all-to-all
    (Ulysses) keeps the probabilities of its a/cp whole-sequence heads, 4b·(a/cp)·P(s), and q, k, v
    gathered to those heads instead of this rank's (the same 12·(s/cp)bh). Heads /t under TP.

    Against :func:`activation_bytes_per_layer` at itemsize 4 (Korthikanti et al.'s terms in fp32),
    without TP: ours - theirs = 14sbh + 8sb + 4abP - 10abs², from 16sbh (GELU keeps σ besides its
    input), -2sbh (our masks are 1 byte, the scaled formula counts 2), 8sb (LayerNorm's rstd), and
    an attention core of 4abP (the probabilities, the causal blocks only) against 10abs² (softmax
    output, the attention-dropout mask and output: our attention has no dropout)."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute is none, selective or full, got {recompute!r}")
    if s % cp:
        raise ValueError(f"{cp} context-parallel ranks do not split {s} positions evenly")
    sbh, sb = s // cp * b * h, s // cp * b  # this rank's positions
    if recompute == "full":
        return 4 * sbh // (t if sp else 1)
    masks = 2 * sbh if dropout else 0
    norms = 8 * sbh + 8 * sb + masks  # xhat and rstd of both LayerNorms, the dropout masks
    inputs = 8 * sbh  # the two LayerNorm outputs the column-parallel linears keep
    split = 64 * sbh  # q, k, v, attention output, fc_1 output, GELU's σ and output
    if recompute == "selective":
        core = 0
    elif cp == 1:
        core = 4 * b * a * attention_scores_kept(s)  # the probabilities
    elif cp_algo == "ring":
        core = 4 * sbh + 4 * a * sb  # the ring's output and log-sum-exp
    elif cp_algo == "alltoall":
        core = 4 * b * (a // cp) * attention_scores_kept(s)  # the probabilities of my whole-sequence heads
    else:
        raise ValueError(f"cp_algo is ring or alltoall, got {cp_algo!r}")
    if t > 1 and (split % t or core % t or (sp and norms % t)):
        raise ValueError(f"{t} tensor-parallel ranks do not divide this layer's activations evenly")
    return (norms // t if sp else norms) + inputs + (split + core) // t


# --- the GPT: parameters and FLOPs ---------------------------------------------------------------


def gpt_parameters(l: int, h: int, V: int, s: int, bias: bool = True, tied: bool = True, experts: int = 0) -> int:  # noqa: E741
    """Parameters of tinytrain's GPT (``nn/transformer.py``): per block 12h² weights (q, k, v, proj:
    4h²; the MLP: 8h²), two LayerNorms (2h, 4h with biases) and the linear layers' biases (9h);
    token and position embeddings Vh + sh, the final LayerNorm (h or 2h), and an untied head Vh.
    With ``experts`` (``nn/moe.py``) every block's MLP is that many MLPs and a gate (hE)."""
    norm = 2 * h if bias else h  # one LayerNorm: weight (and bias)
    block = 4 * h * h + (4 * h if bias else 0) + 2 * norm + mlp_parameters(h, bias) * max(experts, 1)
    block += h * experts  # the gate (no bias)
    return l * block + V * h + s * h + norm + (0 if tied else V * h)


def mlp_parameters(h: int, bias: bool = True) -> int:
    """One MLP (an expert): fc_1 h → 4h and fc_2 4h → h, 8h² weights (and 5h of biases)."""
    return 8 * h * h + (5 * h if bias else 0)


def gpt_flops(B: int, s: int, l: int, h: int, V: int, recompute: bool = False, top_k: int = 1) -> float:  # noqa: E741
    """Floating-point operations of one step on B sequences (Narayanan et al. 2021, eq. 3):
    72·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) for forward + backward (the backward costs two forwards);
    a recomputed forward adds a third: 96 instead of 72. Of the 1, 4/12 are the attention
    projections and 8/12 the MLP, which a token routed to ``top_k`` experts runs top_k times."""
    layer = (4 + 8 * top_k) / 12 + s / (6 * h) + V / (16 * l * h)
    return (96 if recompute else 72) * B * s * l * h * h * layer


def expert_parallel_volume(tokens_bytes: float, ep: int, top_k: int = 1, capacity_factor: float = 1.0) -> float:
    """Bytes each rank sends per MoE layer and pass: an all-to-all to the experts (dispatch) and
    one back (combine) of its tokens, each sent to ``top_k`` experts; with a capacity factor the
    buffers are padded to ``capacity_factor`` times the even share (a6 handout, ``wire_bytes``)."""
    return 2 * collective_bytes("all_to_all", tokens_bytes * top_k * capacity_factor, ep)


def routed_volume(rows_away: float, row_bytes: float) -> float:
    """Bytes per MoE layer and pass, from the routing a step really drew: every row dispatched to
    an expert on another rank (``rows_away``) goes there and comes back (combine). Under even
    routing rows_away = (ep-1)/ep · tokens · top_k per rank, and this is ``expert_parallel_volume``
    (capacity factor 1)."""
    return 2 * rows_away * row_bytes


def matmul_efficiency(tokens: int, large: float, half_tokens: int) -> float:
    """Share of peak a layer's matmuls reach on ``tokens`` rows (micro-batch × sequence positions
    on this GPU): ``large`` for big ones, half of that at ``half_tokens``; small matmuls cannot fill
    the GPU (Narayanan et al. 2021, section 5.6: throughput grows with the micro-batch size)."""
    return large * tokens / (tokens + half_tokens)


def attention_share(s: int, l: int, h: int, V: int) -> float:  # noqa: E741
    """The share of ``gpt_flops`` spent in attention scores and their weighted sums (the s/(6h) term)."""
    return (s / (6 * h)) / (1 + s / (6 * h) + V / (16 * l * h))


# --- calibration: α and bandwidth from measured times ------------------------------------------------


def fit_alpha_beta(points) -> tuple[float, float]:
    """Least-squares (α, bandwidth) of ``time = steps·α + bytes/bandwidth`` from ``(steps, bytes each
    rank sends, seconds)`` points (e.g. ``bench collectives`` rows through ``collective_steps`` and
    ``collective_bytes``). α is kept at or above 0."""
    a = numpy.array([[s, b] for s, b, _ in points], dtype=float)
    t = numpy.array([sec for _, _, sec in points], dtype=float)
    (alpha, per_byte), *_ = numpy.linalg.lstsq(a, t, rcond=None)
    if alpha < 0:  # bandwidth alone explains the times better: fit it alone
        alpha, per_byte = 0.0, float(a[:, 1] @ t / (a[:, 1] @ a[:, 1]))
    if per_byte <= 0:
        raise ValueError("the times do not grow with message size: measure larger messages to fit a bandwidth")
    return float(alpha), 1.0 / float(per_byte)


def crossover(op: str, algo_a: str, algo_b: str, n: int, alpha: float, bandwidth: float) -> float | None:
    """The buffer size (bytes) at which ``algo_a`` and ``algo_b`` take equal α-β time, or None if
    one is always cheaper. Below it the algorithm with fewer steps wins, above it the one that sends less."""
    steps = collective_steps(op, n, algo_b) - collective_steps(op, n, algo_a)
    per_byte = (collective_bytes(op, 1.0, n, algo_a) - collective_bytes(op, 1.0, n, algo_b)) / bandwidth
    if steps == 0 or per_byte == 0 or (steps > 0) != (per_byte > 0):
        return None
    return steps * alpha / per_byte
