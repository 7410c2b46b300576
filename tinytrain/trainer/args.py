"""The arguments of ``tinytrain train``, their checks, and the parallel ``Plan`` they describe.

Only argparse runs at import: ``tinytrain --help`` must not start MPI.
"""

from __future__ import annotations

import argparse
import importlib
import math

from tinytrain.backend import PRECISIONS
from tinytrain.nn import GPT, GPTConfig
from tinytrain.nn.recompute import MODES as RECOMPUTE_MODES
from tinytrain.parallel.plan import DP_ALGOS

# The --dp-algo runs a checkpoint cannot resume exactly, and why (said by check_args and after SIGTERM).
_OWN_REPLICAS = (
    "each replica's inner optimizer state and its parameters between two averages are its own, and a checkpoint "
    "holds one copy"
)
NO_RESUME = {
    "local-sgd": _OWN_REPLICAS,
    "diloco": _OWN_REPLICAS,
    "async-ps": "the versions each worker's parameters have are not in a checkpoint",
}
BIAS_RATE = 1e-3  # --balance bias: DeepSeek-V3's bias update speed
MAX_LR = 10.0  # above this every model here diverges in its first steps

# What decides the model's parameters: the data flags (a checkpoint records every flag), then each
# GPTConfig field and the flag that sets it. A resumed run must ask for the same.
DATA_FLAGS = ("data", "digits")
CONFIG_FLAGS = {
    "n_layer": "layers",
    "n_head": "heads",
    "n_embd": "width",
    "block_size": "block_size",
    "vocab_size": "data",
    "n_experts": "experts",
    "moe_top_k": "topk",
}


def model_mismatch(saved_args: dict, saved_config: dict, args, config) -> str | None:
    """The first model flag in which a checkpoint and this run differ, said as
    "checkpoint has --layers 2, this run asks for 3"; None if they agree."""
    for name in DATA_FLAGS:
        if name in saved_args and saved_args[name] != getattr(args, name):
            return _differs(name, saved_args[name], getattr(args, name))
    for field, name in CONFIG_FLAGS.items():
        if field in saved_config and saved_config[field] != getattr(config, field):
            if field == "vocab_size":  # same --data (checked above): the text changed
                return (
                    f"the text in --data {args.data} has {config.vocab_size} different characters, the "
                    f"checkpoint's {saved_config[field]}; resume with the text it was trained on"
                )
            return _differs(name, saved_config[field], getattr(config, field))
    return None


def _differs(name: str, saved, asked) -> str:
    flag = "--" + name.replace("_", "-")
    return f"checkpoint has {flag} {saved}, this run asks for {asked}; resume with {flag} {saved}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    data = p.add_argument_group("data")
    data.add_argument("--data", default="addition", help="'addition' (built in) or a path to a text file")
    data.add_argument("--digits", type=int, default=2, help="operand digits of the addition task")
    data.add_argument("--block-size", type=int, default=None, help="context length for text data (default 64)")
    model = p.add_argument_group("model")
    model.add_argument("--layers", type=int, default=2)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--width", type=int, default=128, help="embedding width (n_embd)")
    model.add_argument("--dropout", type=float, default=0.0)
    model.add_argument("--experts", type=int, default=0, help="> 0: mixture-of-experts MLPs with this many experts")
    model.add_argument("--topk", type=int, default=None, help="experts per token (default: 2, or 1 with one expert)")
    model.add_argument(
        "--capacity-factor",
        type=float,
        default=0.0,
        help="> 0: an expert takes at most capacity-factor x (its fair share) of assignments; the rest are dropped",
    )
    model.add_argument("--aux-loss-weight", type=float, default=0.01, help="weight of the load-balancing loss")
    model.add_argument(
        "--balance",
        choices=("aux", "bias", "none"),
        default="aux",
        help="balancing experts: the aux loss, DeepSeek-V3's loss-free routing bias, or neither",
    )
    model.add_argument(
        "--bias-rate", type=float, default=BIAS_RATE, help="--balance bias: how far one step moves an expert's bias"
    )
    opt = p.add_argument_group("optimization")
    opt.add_argument("--steps", type=int, default=600)
    opt.add_argument("--batch-size", type=int, default=64, help="global batch (sequences per step)")
    opt.add_argument("--lr", type=float, default=1e-3)
    opt.add_argument("--min-lr", type=float, default=None, help="where the cosine schedule ends (default: --lr / 10)")
    opt.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 5%% of --steps, at most 30)")
    opt.add_argument("--weight-decay", type=float, default=0.01)
    opt.add_argument("--grad-clip", type=float, default=1.0, help="0 disables clipping")
    opt.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    run = p.add_argument_group("run")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--out", default="runs/latest", help="folder for metrics.json, loss.png and the checkpoint ckpt/")
    run.add_argument(
        "--resume",
        action="store_true",
        help="continue from OUT/ckpt (written by any layout: the run may change --dp/--tp/--pp/--zero)",
    )
    run.add_argument(
        "--overwrite",
        action="store_true",
        help="train afresh into an --out that holds a checkpoint (without it such an --out is refused)",
    )
    run.add_argument("--eval-every", type=int, default=100)
    run.add_argument("--eval-batches", type=int, default=4)
    run.add_argument("--ckpt-every", type=int, default=200)
    run.add_argument(
        "--ckpt-async",
        action="store_true",
        help="write checkpoints on a background thread while training goes on (the step waits only for a copy)",
    )
    run.add_argument("--no-plot", action="store_true", help="skip the loss-curve PNG")
    run.add_argument("--trace", default=None, metavar="OUT.json", help="write a Chrome trace of every rank (Perfetto)")
    run.add_argument("--plot", action="store_true", help="also draw what each rank did in the last step (pipeline)")
    par = p.add_argument_group("parallelism (run under mpirun -n N)")
    par.add_argument("--pp", type=int, default=1, help="pipeline stages")
    par.add_argument(
        "--schedule",
        choices=("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"),
        default="1f1b",
        help="pipeline schedule; zb-h1: 1F1B with each backward split into B (input) and W (weights); "
        "zb-v: the same split over two chunks per stage placed in a V",
    )
    par.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (default: 2 x --pp)")
    par.add_argument("--chunks", type=int, default=1, help="model chunks per stage (interleaved schedule)")
    par.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    par.add_argument(
        "--zero",
        type=int,
        choices=(0, 1, 2, 3),
        default=0,
        help="ZeRO stage over the data-parallel ranks (1 optimizer state, 2 + gradients, 3 + parameters)",
    )
    par.add_argument(
        "--dp-algo",
        choices=tuple(DP_ALGOS),
        default="allreduce",
        help="how the --dp replicas combine their gradients: "
        + "; ".join(f"{name}: {what}" for name, what in DP_ALGOS.items()),
    )
    par.add_argument(
        "--local-steps", type=int, default=1, help="local-sgd, diloco, fedavg: steps alone between averages (H)"
    )
    fed = p.add_argument_group("federated averaging (--dp-algo fedavg: one step is one round)")
    fed.add_argument(
        "--clients", type=int, default=None, help="fedavg: clients C, each with its own data (default: one per rank)"
    )
    fed.add_argument(
        "--participation", type=float, default=1.0, help="fedavg: the share F of clients drawn for a round (seeded)"
    )
    fed.add_argument(
        "--partition",
        default="iid",
        help="fedavg: how the training data splits over the clients: iid, or skew:ALPHA (each label class "
        "split by Dirichlet(ALPHA) proportions: 0.1 very skewed, 100 nearly iid)",
    )
    fed.add_argument(
        "--secure-agg", action="store_true", help="fedavg: pairwise masks hide each update; the sum stays exact"
    )
    fed.add_argument("--clip", type=float, default=None, help="fedavg: clip each client's update to this L2 norm S")
    fed.add_argument(
        "--dp-noise",
        type=float,
        default=0.0,
        help="fedavg with --clip: Gaussian noise of std σ·S on the sum (DP-FedAvg); ε is reported",
    )
    fed.add_argument("--dp-delta", type=float, default=1e-5, help="fedavg with --dp-noise: the δ of the ε reported")
    par.add_argument(
        "--max-staleness",
        type=int,
        default=None,
        help="async-ps: no gradient more than this many updates behind (stale synchronous parallel; 0: synchronous)",
    )
    par.add_argument(
        "--ps-order",
        choices=("arrival", "seeded"),
        default="arrival",
        help="async-ps: serve gradients as they arrive, or in an order drawn from --seed (reproducible)",
    )
    par.add_argument("--bucket-mb", type=float, default=1.0, help="DDP gradient bucket size in MB")
    par.add_argument(
        "--progress",
        choices=("poll", "thread"),
        default="poll",
        help="how async all-reduces advance during backward: polled from hooks, or a helper thread",
    )
    par.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (heads, width and vocabulary split)")
    par.add_argument(
        "--sp", action="store_true", help="with --tp: sequence parallel (LayerNorm/dropout on sequence shards)"
    )
    par.add_argument(
        "--ep", type=int, default=1, help="expert-parallel ranks (with --experts: experts split across them)"
    )
    par.add_argument("--cp", type=int, default=1, help="context-parallel ranks (every sequence split across them)")
    par.add_argument(
        "--cp-algo",
        choices=("ring", "alltoall"),
        default="ring",
        help="context-parallel attention: K/V around a ring, or all-to-all to head shards (Ulysses)",
    )
    par.add_argument(
        "--cp-split",
        choices=("zigzag", "contiguous"),
        default="zigzag",
        help="which positions a context rank holds: chunks r and 2N-1-r (balanced under the causal mask), or chunk r",
    )
    par.add_argument(
        "--recompute",
        choices=RECOMPUTE_MODES,
        default="none",
        help="activation recomputation in backward: none, selective (each attention core: drops the "
        "T x T probabilities), full (each block: keeps only its input); any layout, the same numbers",
    )
    opt.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="parameters, activations and gradients in float32, bfloat16 or float16 (fp32 master weights and "
        "optimizer state; fp16 with dynamic loss scaling); a run may resume in another precision",
    )
    run.add_argument("--quiet", action="store_true", help="no progress output")
    run.add_argument(
        "--impl",
        choices=("reference", "assignments"),
        default="reference",
        help="run tinytrain's chapters (reference) or your code in assignments/ (a student copy's chapters are stubs)",
    )


def check_args(args, topology: bool = True) -> None:
    """Reject impossible settings with a message that says what to change (``topology``: and an
    emulated cluster this process's launch does not fit; ``tinytrain launch`` checks its own)."""
    for name in ("steps", "batch_size", "layers", "heads", "width", "eval_every", "eval_batches", "ckpt_every"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not math.isfinite(args.lr) or args.lr <= 0:
        raise ValueError(f"--lr must be positive, got {args.lr}")
    if args.lr > MAX_LR:
        raise ValueError(f"--lr {args.lr:g} is far too large (training diverges at once); use at most {MAX_LR:g}")
    if args.min_lr is None:
        args.min_lr = args.lr / 10
    if not math.isfinite(args.min_lr) or not 0 <= args.min_lr <= args.lr:
        raise ValueError(f"--min-lr must be between 0 and --lr {args.lr:g}, got {args.min_lr}")
    if not math.isfinite(args.grad_clip) or args.grad_clip < 0:
        raise ValueError(f"--grad-clip must be a positive norm (or 0 to disable clipping), got {args.grad_clip}")
    if not math.isfinite(args.weight_decay) or args.weight_decay < 0:
        raise ValueError(f"--weight-decay must be 0 or positive, got {args.weight_decay}")
    if args.block_size is not None and args.block_size <= 0:
        raise ValueError(f"--block-size must be positive, got {args.block_size}")
    if args.warmup is None:
        args.warmup = min(30, args.steps // 20)
    if args.warmup < 0:
        raise ValueError(f"--warmup must be 0 or positive, got {args.warmup}")
    if args.warmup > args.steps:
        raise ValueError(f"--warmup {args.warmup} is longer than --steps {args.steps}")
    if args.dp_algo in ("local-sgd", "diloco") and args.local_steps > args.steps:
        raise ValueError(
            f"--local-steps {args.local_steps} is above --steps {args.steps}: the replicas average after every "
            f"--local-steps steps, so they would never average; use at most --local-steps {args.steps}, or more --steps"
        )
    if args.resume and args.dp_algo in NO_RESUME:
        raise ValueError(
            f"--resume with --dp-algo {args.dp_algo} is refused: {NO_RESUME[args.dp_algo]}; resume with --dp-algo "
            "allreduce or ps, or start afresh"
        )
    check_model_flags(args)
    check_memory(args)
    if topology:
        check_topology()


def check_topology() -> None:
    """TINYTRAIN_TOPOLOGY and its link settings, read as every rank will (a serial run too: a setting
    that the run would ignore is refused, not dropped)."""
    from tinytrain.distributed import topology
    from tinytrain.trainer.runners import launched_world

    emulated = topology.from_env()
    if emulated is not None and launched_world()[1] == 1:
        emulated.check_world(1)


def check_model_flags(args) -> None:
    """GPTConfig's own checks, said in the flags' names (``--width``, not ``n_embd``), before any
    config is built (its messages name its fields, for a library user)."""
    if args.width % args.heads:
        fits = _divisors(args.width)
        among = str(fits) if len(fits) <= 16 else f"{str(fits[:16])[:-1]}, ...]"
        raise ValueError(
            f"--width {args.width} does not split into --heads {args.heads}: each head gets --width / --heads "
            f"channels; choose --heads among {among}, or a --width that {args.heads} divides"
        )
    if not 0.0 <= args.dropout < 1.0:
        raise ValueError(f"--dropout must be at least 0 and below 1, got {args.dropout}")
    if args.experts < 0:
        raise ValueError(f"--experts must be 0 (a dense MLP) or positive, got {args.experts}")
    if args.experts and args.topk is not None and not 1 <= args.topk <= args.experts:
        raise ValueError(f"--topk {args.topk} must be between 1 and --experts {args.experts}")
    if args.balance != "aux" and not args.experts:
        raise ValueError(f"--balance {args.balance} balances experts: it needs --experts N")
    if args.balance == "bias" and not (math.isfinite(args.bias_rate) and args.bias_rate > 0):
        raise ValueError(f"--bias-rate must be a positive number with --balance bias, got {args.bias_rate}")
    if args.balance != "bias" and args.bias_rate != BIAS_RATE:
        raise ValueError("--bias-rate is the step of --balance bias's routing bias: add --balance bias, or drop it")


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def check_memory(args) -> None:
    """Refuse, before anything is built, a model whose bytes cannot fit in the host memory this
    machine has for its ranks (``MemAvailable``, shared by the ranks the launcher started here).

    The bytes are the planner's (``planner.memory_per_gpu`` with tinytrain's float32 AdamW: 4 + 4 +
    8 bytes per parameter, SGD's momentum 4) for this rank's part under the flags' layout, and at
    least the whole float32 model: every rank builds the serial model before ``--tp``/``--pp``
    split it. What decides is what a run certainly holds by its first optimizer step: weights,
    gradients and optimizer state. The planner's activations (Korthikanti et al.'s 16-bit terms
    in float32) are said but not counted: they overestimate tinytrain's attention (one float32
    softmax per head kept; --block-size 1024 --width 64 --heads 8: 1.41 GB estimated, 0.58 GB peak
    measured), and a refusal must never stop a run that fits. On a GPU the model lives in device
    memory: not checked here. A text file's vocabulary is known only once it is read: counted as
    one character, which keeps the bound a lower one."""
    from tinytrain import backend
    from tinytrain.planner import Layout, ModelSpec, memory_per_gpu

    available = None if backend.device == "gpu" else backend.host_memory_available()
    if available is None:
        return
    if args.data in (None, "addition"):
        if not 1 <= args.digits <= 6:
            return  # the dataset says so when it is built
        from tinytrain.data import AdditionDataset

        task = AdditionDataset(args.digits)
        vocab, seq = task.vocab_size, task.block_size
    else:
        vocab, seq = 1, args.block_size or 64
    topk = args.topk if args.topk is not None else (min(2, args.experts) if args.experts else 2)
    spec = ModelSpec(args.layers, args.width, args.heads, vocab, seq, args.batch_size, True, True, args.experts, topk)
    microbatches = plan_of(args).n_microbatches if args.pp > 1 else 1
    per_replica = max(1, args.batch_size // max(1, args.dp * args.ep * microbatches))
    layout = Layout(args.dp, args.tp, args.pp, args.cp, args.sp, args.zero, per_replica, False, args.ep)
    optimizer = ("AdamW state", 8) if args.optimizer == "adamw" else ("SGD momentum", 4)
    part = memory_per_gpu(spec, layout, state_bytes=(4, 4, optimizer[1]), itemsize=4)
    whole, state = 4 * spec.parameters, part["params"] + part["grads"] + part["optimizer"]
    ranks = backend.launcher_ranks_here()
    if max(whole, state) * ranks <= available:
        return
    if whole >= state:
        parts = f"every rank builds the whole model, {_gb(whole)} of float32 weights, before --tp and --pp split it"
        change = "use a smaller --width or --layers"
    else:
        parts = (
            f"weights {_gb(part['params'])}, gradients {_gb(part['grads'])}, {optimizer[0]} {_gb(part['optimizer'])}"
        )
        change = "use a smaller --width or --layers, or spread the model over ranks on more machines"
        change += " (--tp, --pp, --zero)"
    need = max(whole, state)
    raise ValueError(
        f"the model of --width {args.width} --layers {args.layers} ({spec.parameters:,} parameters) needs at least "
        f"{_gb(need)} per rank ({parts}; activations come on top, about {_gb(part['activations'])} at --batch-size "
        f"{args.batch_size}){f', {_gb(need * ranks)} for the {ranks} ranks here' if ranks > 1 else ''}, and this "
        f"machine has {_gb(available)} available (MemAvailable): {change}"
    )


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g} GB"


def plan_of(args):
    """The parallel layout the flags ask for (``tinytrain.parallel.plan.Plan``): each field of the
    plan is the flag of the same name."""
    from dataclasses import fields

    from tinytrain.parallel.plan import Plan

    return Plan(**{f.name: getattr(args, f.name) for f in fields(Plan)})


def build_model(args, dataset) -> GPT:
    """The GPT the flags describe, for ``dataset``. It remembers what it was built for
    (``model.dataset_meta``, ``dataset.describe()``: its characters...) so that a checkpoint keeps
    its vocabulary and ``--resume`` can tell what changed in the data."""
    config = GPTConfig(
        vocab_size=dataset.vocab_size,
        block_size=dataset.block_size,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.width,
        dropout=args.dropout,
        n_experts=args.experts,
        moe_top_k=args.topk if args.topk is not None else (min(2, args.experts) if args.experts else 2),
        moe_capacity_factor=args.capacity_factor,
        moe_aux_weight=args.aux_loss_weight,
        moe_balance=args.balance,
        moe_bias_rate=args.bias_rate,
    )
    model = GPT(config, seed=args.seed)
    model.dataset_meta = dataset.describe()
    return model


def use_implementation(impl: str) -> None:
    """``--impl assignments``: every function and class an assignment file defines replaces the
    reference's, so the run trains on the student's code (``assignments/use.py`` says how). Loaded by
    name: assignments/ sits beside the package, in the course repository, not inside tinytrain."""
    if impl == "reference":
        return
    try:
        use = importlib.import_module("assignments.use")
    except ModuleNotFoundError as exc:
        raise ValueError(
            "--impl assignments needs the course repository's assignments/ folder: run from its root"
        ) from exc
    use.use_assignments()
