"""``tinytrain train``: train a GPT and leave metrics, a loss curve and a checkpoint behind.

    tinytrain train                          # the built-in addition task, about a minute on 2 cores
    tinytrain train --data book.txt          # characters of any text file
    tinytrain train --out runs/a --resume    # continue exactly where runs/a stopped

The loop is the textbook one: draw a batch, forward, loss, backward, clip, optimizer step, LR
schedule. Batches and dropout masks are functions of (seed, step), so a resumed run reproduces
the uninterrupted one exactly.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from tinytrain import checkpoint
from tinytrain import functional as F
from tinytrain import random as _random
from tinytrain.autograd import no_grad
from tinytrain.backend import device, xp
from tinytrain.data import AdditionDataset, load_dataset
from tinytrain.nn import GPT, GPTConfig
from tinytrain.optim import SGD, AdamW, WarmupCosine, clip_grad_norm_


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
    opt = p.add_argument_group("optimization")
    opt.add_argument("--steps", type=int, default=600)
    opt.add_argument("--batch-size", type=int, default=64, help="global batch (sequences per step)")
    opt.add_argument("--lr", type=float, default=1e-3)
    opt.add_argument("--min-lr", type=float, default=1e-4)
    opt.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 5%% of --steps, at most 30)")
    opt.add_argument("--weight-decay", type=float, default=0.01)
    opt.add_argument("--grad-clip", type=float, default=1.0, help="0 disables clipping")
    opt.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    run = p.add_argument_group("run")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--out", default="runs/latest", help="folder for metrics.json, loss.png, ckpt.npz")
    run.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.npz")
    run.add_argument("--eval-every", type=int, default=100)
    run.add_argument("--eval-batches", type=int, default=4)
    run.add_argument("--ckpt-every", type=int, default=200)
    run.add_argument("--no-plot", action="store_true", help="skip the loss-curve PNG")
    run.add_argument("--trace", default=None, metavar="OUT.json", help="write a Chrome trace of every rank (Perfetto)")
    run.add_argument("--plot", action="store_true", help="also draw what each rank did in the last step (pipeline)")
    par = p.add_argument_group("parallelism (run under mpirun -n N)")
    par.add_argument("--pp", type=int, default=1, help="pipeline stages")
    par.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved"), default="1f1b")
    par.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (default: 2 x --pp)")
    par.add_argument("--chunks", type=int, default=1, help="model chunks per stage (interleaved schedule)")
    from tinytrain.parallel import dp_runner, tp_runner

    dp_runner.add_arguments(par)  # --dp, --zero, --bucket-mb, --progress
    tp_runner.add_arguments(par)  # --tp, --sp
    run.add_argument("--quiet", action="store_true", help="no progress output")


def check_args(args) -> None:
    """Reject impossible settings with a message that says what to change."""
    for name in ("steps", "batch_size", "layers", "heads", "width", "eval_every", "eval_batches", "ckpt_every"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.lr <= 0:
        raise ValueError(f"--lr must be positive, got {args.lr}")
    if args.warmup is None:
        args.warmup = min(30, args.steps // 20)
    if args.warmup > args.steps:
        raise ValueError(f"--warmup {args.warmup} is longer than --steps {args.steps}")


def build_model(args, dataset) -> GPT:
    config = GPTConfig(
        vocab_size=dataset.vocab_size, block_size=dataset.block_size, n_layer=args.layers,
        n_head=args.heads, n_embd=args.width, dropout=args.dropout, n_experts=args.experts,
        moe_top_k=min(2, args.experts) if args.experts else 2,
    )
    return GPT(config, seed=args.seed)


def build_optimizer(args, params):
    if args.optimizer == "adamw":
        optimizer = AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay)
    else:
        optimizer = SGD(params, lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    return optimizer, WarmupCosine(optimizer, args.warmup, args.steps, min_lr=args.min_lr)


def loss_of(model, x, y):
    loss = F.cross_entropy(model(xp.asarray(x)), xp.asarray(y))
    if model.config.n_experts:
        loss = loss + 0.01 * model.moe_aux_loss()
    return loss


def evaluate(model, dataset, args, step: int) -> dict:
    model.eval()
    result = {}
    with no_grad():
        for split in ("train", "val"):
            losses = [
                loss_of(model, *dataset.batch(split, args.batch_size, seed=args.seed + 1, step=i)).item()
                for i in range(args.eval_batches)
            ]
            result[f"{split}_loss"] = sum(losses) / len(losses)
    if isinstance(dataset, AdditionDataset):
        from tinytrain.sample import generate

        result["val_accuracy"] = dataset.accuracy(lambda p, n: generate(model, p, n), count=200, seed=args.seed)
    model.train()
    return result


class Progress:
    """One self-rewriting line on a terminal; a plain line every so often elsewhere (CI logs)."""

    def __init__(self, total: int, quiet: bool):
        self.total, self.quiet = total, quiet
        self.tty = sys.stderr.isatty()
        self.every = max(1, total // 20)
        self.start = time.perf_counter()

    def update(self, step: int, loss: float, tokens_per_s: float, extra: str = "") -> None:
        if self.quiet:
            return
        done = step / self.total
        bar = "#" * int(24 * done) + "-" * (24 - int(24 * done))
        elapsed = time.perf_counter() - self.start
        eta = elapsed / max(done, 1e-9) - elapsed
        line = (f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] loss {loss:.4f} "
                f"| {tokens_per_s / 1000:.1f}k tok/s | eta {eta:4.0f}s {extra}")
        if self.tty:
            print("\r" + line, end="\n" if step == self.total else "", file=sys.stderr, flush=True)
        elif step % self.every == 0 or step == self.total or extra:
            print(line, file=sys.stderr, flush=True)


class SerialRunner:
    """One process holds the whole model: forward, backward, done."""

    is_main = True
    saves_optimizer = True

    def __init__(self, model):
        self.model = model

    def parameters(self):
        return self.model.parameters()

    def forward_backward(self, x, y) -> float:
        loss = loss_of(self.model, x, y)
        loss.backward()
        return loss.item()

    def clip_gradients(self, max_norm: float) -> float:
        return clip_grad_norm_(self.parameters(), max_norm)

    def step(self, optimizer) -> None:
        optimizer.step()

    def share_model(self) -> None:
        """Make the full, current model available on this rank (nothing to do here)."""

    def finish(self, args, out: Path) -> None:
        """Write what this strategy has to show (nothing for a serial run)."""


class PipelineRunner(SerialRunner):
    """``--pp P [--dp D] [--tp T]``: each rank is one stage (or a TP shard of one) of D replicas.

    With D > 1 or T > 1 the ranks form a mesh ``{"dp": D, "pp": P, "tp": T}`` (TP innermost: the
    shards of a stage are neighbours; then the stages of a replica). Replica d trains on its rows
    of the global batch, and after backward each stage sums its gradients with the same stage of
    the other replicas (an all-reduce over the DP group). Each micro-batch's loss is divided by
    the number of targets in the *global* batch, so that sum is exactly the serial gradient. With
    T > 1 each stage runs its blocks of a ``TensorParallelGPT`` over its TP group; activations
    travel the pp axis between the same TP ranks of neighbouring stages.
    """

    saves_optimizer = False  # each stage holds its own optimizer state

    def __init__(self, model, args):
        from tinytrain import distributed as dist
        from tinytrain.parallel.pipeline import PipelineStage, make_schedule

        dist.init()
        dp, pp, tp = getattr(args, "dp", 1), args.pp, getattr(args, "tp", 1)
        if getattr(args, "zero", 0):
            raise ValueError("--zero with --pp is not supported; use plain --dp with --pp")
        if getattr(args, "sp", False):
            raise ValueError("--sp with --pp is not supported; use --tp without --sp inside pipeline stages")
        if dist.get_world_size() != dp * pp * tp:
            flags = f"--pp {pp}" + (f" --dp {dp}" if dp > 1 else "") + (f" --tp {tp}" if tp > 1 else "")
            raise ValueError(f"{flags} needs exactly {dp * pp * tp} ranks: run `mpirun -n {dp * pp * tp} tinytrain "
                             f"train {flags} ...` (this run has {dist.get_world_size()})")
        self.model, self.dist, self.dp, self.tp = model, dist, dp, tp
        self.microbatches = args.microbatches or 2 * pp
        if args.batch_size % (dp * self.microbatches):
            per = f"{dp} replicas x {self.microbatches}" if dp > 1 else f"{self.microbatches}"
            raise ValueError(f"--batch-size {args.batch_size} does not split into {per} micro-batches; "
                             f"use a multiple of {dp * self.microbatches}")
        self.parallel = None  # the TensorParallelGPT under --tp
        self.loss_src = pp - 1  # the world rank of replica 0's last stage (TP rank 0)
        if dp > 1 or tp > 1:
            mesh = dist.DeviceMesh({"dp": dp, "pp": pp, "tp": tp})
            self.dp_rank, self.dp_group, pp_group = mesh.coordinate("dp"), mesh.get_group("dp"), mesh.get_group("pp")
            self.loss_src = mesh.rank_at(dp=0, pp=pp - 1, tp=0)
            if tp > 1:
                from tinytrain.parallel.tensor_parallel import tensor_parallel_gpt

                self.parallel = tensor_parallel_gpt(model, mesh.get_group("tp"))
        else:
            self.dp_rank, self.dp_group, pp_group = 0, None, None
        self.net = self.parallel or model  # what the stages run: the serial GPT or this rank's shards
        self.schedule = make_schedule(args.schedule, pp, self.microbatches, args.chunks)
        self.stage = PipelineStage(self.net, pp, args.chunks, group=pp_group)
        self.actions = self.schedule[self.stage.rank]
        self.is_main = dist.get_rank() == 0

    def parameters(self):
        return self.stage.parameters()

    def forward_backward(self, x, y) -> float:
        from tinytrain.data import replica_batch
        from tinytrain.parallel.pipeline import train_step

        x, y, targets = replica_batch(x, y, self.dp_rank, self.dp)
        loss, _ = train_step(self.stage, self.actions, x, y, self.microbatches, n_targets=targets)
        buf = xp.asarray([loss if loss is not None else 0.0], dtype=xp.float64)
        if self.dp > 1:
            from tinytrain.parallel.dp_runner import sum_over_replicas

            sum_over_replicas(self.parameters(), buf, self.dp_group, self.dist)
        # the loss lives on the last stage (of replica 0); rank 0 reports it
        self.dist.broadcast(buf, src=self.loss_src)
        return float(buf[0])

    def clip_gradients(self, max_norm: float) -> float:
        # The global norm adds every stage's squares; the tied embedding, held twice, counts once.
        # Replicas hold the same (summed) gradients, so the pipeline group alone gives the norm;
        # under TP, shards' squares are also summed over the TP group, replicated weights counted once.
        params = self.parameters()
        tied = self.net.wte.weight if self.stage.is_last and not self.stage.is_first else None
        sharded = {id(p) for p, _, axis, _, _, _ in self.parallel.shards() if axis is not None} if self.parallel else set()
        sq = xp.zeros(2)  # [sharded, replicated]
        for p in params:
            if p.grad is not None and p is not tied:
                sq[0 if id(p) in sharded else 1] += float((p.grad.astype(xp.float64) ** 2).sum())
        self.dist.all_reduce(sq, group=self.stage.group)
        shards = sq[:1].copy()
        if self.parallel is not None:
            self.dist.all_reduce(shards, group=self.parallel.group)
        return clip_grad_norm_(params, max_norm, total_norm=math.sqrt(float(shards[0] + sq[1])))

    def share_model(self) -> None:
        from tinytrain.parallel.pipeline import share_parameters

        share_parameters(self.stage)  # every rank: all stages' parameters (of its TP shard)
        if self.parallel is not None:
            self.parallel.write_into(self.model)  # gather the TP shards into the serial model

    def finish(self, args, out: Path) -> None:
        if not (args.plot or args.trace):
            return
        from tinytrain import trace

        spans = trace.merge()
        if not self.is_main:
            return
        if args.trace:
            trace.write_chrome(args.trace, spans)
            print(f"wrote the Chrome trace {args.trace} (open it in https://ui.perfetto.dev)", file=sys.stderr)
        if args.plot:
            plot_last_pipeline_step(spans, self, args, out)


def plot_last_pipeline_step(spans, runner, args, out: Path) -> None:
    """The measured last step next to the simulated schedule, and activation memory per stage."""
    from tinytrain.parallel.simulator import bubble_formula, simulate
    from tinytrain.viz import bubble_share, compare_pipelines, pipeline_events, plot_activation_memory

    last = {s["rank"]: s for s in spans if s["cat"] == "step" and s["args"]["step"] == args.steps}
    in_last = [s for s in spans if s["rank"] in last and last[s["rank"]]["start"] <= s["start"] <= last[s["rank"]]["end"]]
    measured = pipeline_events(in_last)
    p, m, v = args.pp, runner.microbatches, args.chunks
    simulated = simulate(runner.schedule, chunks=v).rows()
    formula = bubble_formula(p, m, v)
    compare_pipelines([(f"simulated {args.schedule}", simulated), (f"measured {args.schedule}, step {args.steps}", measured)],
                      out / "pipeline.png", formulas=[formula, formula], sharex=False,
                      units_ms=[False, True])
    memory = {}
    for s in in_last:
        if s["cat"] == "memory":
            memory.setdefault(f"stage {s['rank']}", []).append((s["start"], s["args"]["bytes"]))
    plot_activation_memory(dict(sorted(memory.items())), out / "activation_memory.png",
                           title=f"bytes saved for backward during step {args.steps} ({args.schedule})")
    print(f"pipeline: measured bubble share {bubble_share(measured):.1%}, formula (p-1)/(v·m+p-1) = {formula:.1%}; "
          f"wrote {out}/pipeline.png and activation_memory.png", file=sys.stderr)


def make_runner(args, model):
    if args.pp < 1 or args.chunks < 1 or (args.microbatches is not None and args.microbatches < 1):
        raise ValueError("--pp, --chunks and --microbatches must be positive")
    from tinytrain.parallel import dp_runner, tp_runner

    if tp_runner.wanted(args) and args.pp == 1:
        return tp_runner.TensorParallelRunner(model, args)
    if args.pp > 1:
        return PipelineRunner(model, args)
    if dp_runner.wanted(args):
        return dp_runner.DataParallelRunner(model, args)
    if args.chunks != 1 or args.microbatches:
        raise ValueError("--chunks and --microbatches need --pp > 1")
    return SerialRunner(model)


def run(args) -> int:
    check_args(args)
    dataset = load_dataset(args.data, args.block_size, args.digits)
    model = build_model(args, dataset)
    runner = make_runner(args, model)
    optimizer, schedule = build_optimizer(args, runner.parameters())
    quiet = args.quiet or not runner.is_main
    if args.trace or args.plot:
        from tinytrain import trace

        trace.enable()
    out = Path(args.out)
    ckpt_path = out / "ckpt.npz"
    metrics = {"config": {"args": vars(args).copy(), "model": model.config.to_dict(), "device": device,
                          "parameters": model.num_parameters()},
               "steps": []}
    metrics["config"]["args"].pop("_module", None)
    start_step = 0
    if args.resume:
        model_state, optim_state, meta = checkpoint.load(ckpt_path)
        if not runner.saves_optimizer or not meta.get("optimizer_saved", True):
            raise ValueError("--resume needs a checkpoint with the optimizer state, which pipeline runs do not "
                             "write yet; resume without --pp from a run without --pp")
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)
        start_step = meta["step"]
        metrics["steps"] = meta["metrics_steps"]
        schedule.last_step = start_step
        optimizer.lr = schedule.lr_at(start_step + 1)
        if start_step >= args.steps and not quiet:
            print(f"checkpoint is at step {start_step}; nothing to do for --steps {args.steps}", file=sys.stderr)

    if not quiet:
        print(f"tinytrain: GPT with {model.num_parameters():,} parameters on {device}, data={dataset.name}, "
              f"batch {args.batch_size} x {dataset.block_size} tokens, steps {start_step + 1}..{args.steps}",
              file=sys.stderr)
    progress = Progress(args.steps, quiet)
    tokens_per_step = args.batch_size * dataset.block_size
    for step in range(start_step + 1, args.steps + 1):
        t0 = time.perf_counter()
        _random.manual_seed((args.seed, step))  # dropout masks depend on (seed, step) only
        x, y = dataset.batch("train", args.batch_size, seed=args.seed, step=step)
        optimizer.zero_grad()
        with _trace_step(step):
            loss_value = runner.forward_backward(x, y)
        grad_norm = runner.clip_gradients(args.grad_clip) if args.grad_clip else None
        lr = optimizer.lr
        runner.step(optimizer)
        schedule.step()
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"loss became {loss_value} at step {step}; lower --lr or enable --grad-clip")
        dt = time.perf_counter() - t0
        record = {"step": step, "loss": loss_value, "lr": lr, "tokens_per_s": tokens_per_step / dt}
        if grad_norm is not None:
            record["grad_norm"] = grad_norm
        extra = ""
        evaluate_now = step % args.eval_every == 0 or step == args.steps
        save_now = step % args.ckpt_every == 0 or step == args.steps
        if evaluate_now or save_now:
            runner.share_model()
        if evaluate_now and runner.is_main:
            ev = evaluate(model, dataset, args, step)
            record.update(val_loss=ev["val_loss"], eval_train_loss=ev["train_loss"])
            if "val_accuracy" in ev:
                record["val_accuracy"] = ev["val_accuracy"]
            extra = f"val {ev['val_loss']:.4f}" + (f" acc {ev['val_accuracy']:.2f}" if "val_accuracy" in ev else "")
        metrics["steps"].append(record)
        progress.update(step, loss_value, record["tokens_per_s"], extra)
        if save_now and runner.is_main:
            save_checkpoint(ckpt_path, model, optimizer if runner.saves_optimizer else None, args, step, metrics)

    runner.share_model()
    runner.finish(args, out)
    if not runner.is_main:
        return 0
    final = evaluate(model, dataset, args, args.steps)
    metrics["final"] = final
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    if not args.no_plot and metrics["steps"]:
        from tinytrain.viz import plot_loss_curve

        plot_loss_curve(metrics, out / "loss.png", title=f"GPT on {dataset.name}")
    if not quiet:
        summary = ", ".join(f"{k} {v:.4f}" for k, v in final.items())
        print(f"done: {summary}; wrote {out}/metrics.json, loss.png, ckpt.npz", file=sys.stderr)
    return 0


def _trace_step(step: int):
    from tinytrain import trace

    return trace.span("step", cat="step", step=step)


def save_checkpoint(path, model, optimizer, args, step, metrics) -> None:
    """Save the model (and the optimizer, when this rank holds all of its state)."""
    meta = {"step": step, "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
            "model_config": model.config.to_dict(), "metrics_steps": metrics["steps"],
            "optimizer_saved": optimizer is not None}
    optim_state = optimizer.state_dict() if optimizer is not None else {"lr": 0.0, "state": {}}
    checkpoint.save(path, model.state_dict(), optim_state, meta)
