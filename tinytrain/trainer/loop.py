"""``tinytrain train``: train a GPT and leave metrics, a loss curve and a checkpoint behind.

    tinytrain train                          # the built-in addition task, about a minute on 2 cores
    tinytrain train --data book.txt          # characters of any text file
    tinytrain train --out runs/a --resume    # continue exactly where runs/a stopped
    mpirun -n 4 tinytrain train --dp 2 --tp 2 --resume   # ... under another layout
    mpirun -n 4 tinytrain train              # no layout flag: data parallel over the 4 ranks

The loop is the textbook one: draw a batch, forward, loss, backward, clip, optimizer step, LR
schedule. It knows no parallel strategy: a runner (``runners.py``) runs each step on this rank.
Batches and dropout masks are functions of (seed, step), so a resumed run reproduces the
uninterrupted one, whatever layout wrote the checkpoint.

Nothing is lost: every output is checked writable before the first step (``--out``, ``--trace``,
the figures inside ``--out``) and written atomically; SIGINT or SIGTERM (Ctrl-C, a scheduler's
preemption) lets every rank finish the step it is in, the ranks agree on that step, a checkpoint is
written and the run exits with 128 + the signal number, saying how to resume. A second Ctrl-C stops
at once (the last checkpoint stays).

``--resume`` continues the same curve or refuses, in one sentence that names the flag: the model's
flags, the data (its characters: a checkpoint keeps them), --optimizer, --seed, --batch-size,
--weight-decay, --grad-clip, --dropout and the MoE loss flags must be the checkpoint's; --steps,
--lr, --min-lr and --warmup may change only where no step still to come gets another learning rate
(so a constant rate, --warmup 0 and --min-lr equal to --lr, can be extended). The layout flags,
--precision (a checkpoint holds float32 master weights), --out, --eval-* and --ckpt-every may change.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy

from tinytrain import checkpoint, launcher
from tinytrain import random as _random
from tinytrain.autograd import loss_scaling, no_grad
from tinytrain.backend import device
from tinytrain.data import AdditionDataset, dataset_change, load_dataset
from tinytrain.nn.moe import load_routing_biases, routing_biases
from tinytrain.optim import SGD, AdamW, LossScaler, WarmupCosine
from tinytrain.trainer.args import (
    NO_RESUME,
    add_arguments,
    build_model,
    check_args,
    model_mismatch,
    plan_of,
    use_implementation,
)
from tinytrain.trainer.runners import launched_world, make_runner

__all__ = ["add_arguments", "run"]


def build_optimizer(args, params):
    if args.optimizer == "adamw":
        optimizer = AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay)
    else:
        optimizer = SGD(params, lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    return optimizer, WarmupCosine(optimizer, args.warmup, args.steps, min_lr=args.min_lr)


def evaluate(model, dataset, args, step: int) -> dict:
    model.eval()
    result = {}
    with no_grad():
        for split in ("train", "val"):
            losses = [
                model.loss(*dataset.batch(split, args.batch_size, seed=args.seed + 1, step=i)).item()
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
        line = (
            f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] loss {loss:.4f} "
            f"| {tokens_per_s / 1000:.1f}k tok/s | eta {eta:4.0f}s {extra}"
        )
        if self.tty:
            print("\r" + line, end="\n" if step == self.total else "", file=sys.stderr, flush=True)
        elif step % self.every == 0 or step == self.total or extra:
            print(line, file=sys.stderr, flush=True)


def run(args) -> int:
    """``tinytrain train``: tracing (``--trace``, ``--plot``) is on for this run only."""
    from tinytrain import trace

    tracing = bool(args.trace or args.plot)
    if tracing:
        trace.clear()  # this run's spans only (an in-process caller may have traced before)
        trace.enable()
    try:
        code = train(args)
    finally:
        if tracing:
            trace.enable(False)
    _stop_heartbeat()  # not after an error: the CLI ends the job, and the cause is its message
    return code


def _stop_heartbeat() -> None:
    """This rank is done: tell the others it will not answer any more (a wait for it is a failure)."""
    dist = sys.modules.get("tinytrain.distributed")
    if dist is not None and dist.is_initialized():
        from tinytrain.distributed import watchdog

        watchdog.stop_heartbeat(finished=True)


def train(args) -> int:
    check_args(args)
    out = prepare_outputs(args)
    with checkpoint.folder_lock(out, "--out", hold=_writes_outputs()):  # one live run per --out
        refuse_to_overwrite(out, args)
        return _train(args, out)


def _train(args, out: Path) -> int:
    default_layout(args)
    dataset = load_dataset(args.data, args.block_size, args.digits)
    use_implementation(args.impl)  # before the model and the schedules are built
    model = build_model(args, dataset)
    parameters = model.num_parameters()  # the whole model's: a layout keeps only this rank's part
    runner = make_runner(model, plan_of(args), args.batch_size, dataset)
    optimizer, schedule = build_optimizer(args, runner.parameters())
    scaler = LossScaler() if args.precision == "fp16" else None  # bf16 has fp32's range: no scaling
    quiet = args.quiet or not runner.is_main
    ckpt = out / "ckpt"
    metrics = {
        "config": {
            "args": _plain_args(args),
            "model": model.config.to_dict(),
            "device": device,
            "parameters": parameters,
        },
        "steps": [],
    }
    start_step = 0
    if args.resume:
        start_step, metrics["steps"] = resume(ckpt, runner, model, optimizer, schedule, args, scaler)
        if start_step >= args.steps and not quiet:
            print(f"checkpoint is at step {start_step}; nothing to do for --steps {args.steps}", file=sys.stderr)

    ranks = runner.ranks()  # on every rank: it gathers
    if not quiet and start_step < args.steps:
        steps = f"steps {start_step + 1}..{args.steps}" if start_step else f"{args.steps} steps"
        print(
            f"tinytrain: GPT with {parameters:,} parameters on {device}, data={dataset.name}, "
            f"batch {args.batch_size} x {dataset.block_size} tokens, {steps}" + (f"; {ranks}" if ranks else ""),
            file=sys.stderr,
        )
    progress = Progress(args.steps, quiet)
    tokens_per_step = args.batch_size * dataset.block_size
    world, layout = launched_world()[1], plan_of(args).flags()
    saved_step = start_step
    with Interrupts(announce=runner.is_main) as interrupts:
        for step in range(start_step + 1, args.steps + 1):
            t0 = time.perf_counter()
            scale = scaler.scale if scaler is not None else None
            loss_value, grad_norm, lr = train_step(runner, optimizer, schedule, dataset, args, step, scaler)
            check_diverged(loss_value, step, model.config.vocab_size, args.lr)
            dt = time.perf_counter() - t0
            record = {"step": step, "loss": loss_value, "lr": lr, "tokens_per_s": tokens_per_step / dt}
            record.update(world=world, layout=layout, time=round(time.time(), 3))  # (an elastic run's layout changes)
            if grad_norm is not None:
                record["grad_norm"] = grad_norm
            if scaler is not None:  # fp16: the loss scale this step used; an overflow skipped the update
                record["loss_scale"] = scale
                if scaler.skipped:
                    record["skipped"] = True
            moe = runner.step_stats()  # with experts: load per expert, dropped share, aux loss
            if moe:
                record["moe"] = moe
            extra = moe_line(moe) if moe else ""
            extra += f" skipped: inf/NaN gradients at loss scale {scale:g}" if record.get("skipped") else ""
            if step % args.eval_every == 0 or step == args.steps:
                runner.share_model()
                if runner.is_main:
                    ev = evaluate(model, dataset, args, step)
                    record.update(val_loss=ev["val_loss"], eval_train_loss=ev["train_loss"])
                    if "val_accuracy" in ev:
                        record["val_accuracy"] = ev["val_accuracy"]
                    extra += f" val {ev['val_loss']:.4f}" + (
                        f" acc {ev['val_accuracy']:.2f}" if "val_accuracy" in ev else ""
                    )
            metrics["steps"].append(record)
            progress.update(step, loss_value, record["tokens_per_s"], extra)
            # every rank stops after the same step, with the signal one of them got (0: none)
            stop = runner.vote(interrupts.signal or 0)
            last = step == args.steps or stop  # the run ends: its checkpoint is on disk before it does
            try:
                runner.settle_save()  # --ckpt-async: the manifest, once every rank's pieces are on disk
                if step % args.ckpt_every == 0 or last:
                    save(
                        runner,
                        ckpt,
                        step,
                        optimizer,
                        metrics,
                        args,
                        model,
                        scaler,
                        background=args.ckpt_async and not last,
                    )
            except BaseException:
                if runner.is_main:  # the steps done are not lost with the checkpoint
                    keep_metrics(out, metrics)
                raise
            if last:
                saved_step = step
            if stop:
                return interrupted(runner, out, metrics, stop, saved_step, quiet)

    runner.share_model()
    runner.finish(args, out)
    if not runner.is_main:
        return 0
    final = evaluate(model, dataset, args, args.steps)
    metrics["final"] = final
    write_metrics(out, metrics, args, dataset)
    if not quiet:
        summary = ", ".join(f"{k} {v:.4f}" for k, v in final.items())
        wrote = "metrics.json, ckpt/" if args.no_plot else "metrics.json, loss.png, ckpt/"
        print(f"done: {summary}; wrote {wrote} in {out}", file=sys.stderr)
    return 0


def train_step(runner, optimizer, schedule, dataset, args, step: int, scaler=None) -> tuple[float, float | None, float]:
    """One step of the loop on this rank: the batch and dropout masks of (seed, step), forward and
    backward, gradient clipping, the optimizer's update, the LR schedule. Returns (the batch's mean
    loss, the gradient norm before clipping or None without --grad-clip, the rate this step used).
    ``tinytrain bench scaling`` times exactly this.

    ``scaler`` (fp16, ``optim.LossScaler``): backward starts from the loss scale S, so gradients are
    S times the loss's; an inf or NaN in any rank's gradients skips the update (the scale halves, the
    batch and its learning rate are used up); else clipping compares the scaled norm with S times
    --grad-clip, and the optimizer divides the gradients by S in float32."""
    _random.manual_seed((args.seed, step))  # dropout masks depend on (seed, step, site) only
    x, y = dataset.batch("train", args.batch_size, seed=args.seed, step=step)
    optimizer.zero_grad()
    scale = scaler.scale if scaler is not None else 1.0
    # fp16: a gradient overflowing is what the scaler handles (below), not worth NumPy's warning
    quiet = numpy.errstate(over="ignore", invalid="ignore") if scaler is not None else contextlib.nullcontext()
    with _trace_step(step), loss_scaling(scale), quiet:
        loss_value = runner.forward_backward(x, y)
    lr = optimizer.lr
    if scaler is not None and not scaler.update(found_inf=runner.found_inf()):
        runner.skip_step()
        schedule.step()
        return loss_value, None, lr
    grad_norm = runner.clip_gradients(args.grad_clip * scale) / scale if args.grad_clip else None
    optimizer.loss_scale = scale
    runner.step(optimizer)
    schedule.step()
    return loss_value, grad_norm, lr


def save(runner, ckpt: Path, step: int, optimizer, metrics: dict, args, model, scaler=None, background=False) -> None:
    """The checkpoint of ``step`` (``background``: its pieces written while training goes on)."""
    meta = {
        "step": step,
        "seed": args.seed,
        "optimizer": args.optimizer,
        "args": _plain_args(args),
        "model_config": model.config.to_dict(),
        "metrics_steps": list(metrics["steps"]),  # (a background save's: the steps up to its own)
        "routing_bias": routing_biases(model),  # --balance bias: state the next steps' routing needs
    }
    if getattr(model, "dataset_meta", None):  # its vocabulary: `tinytrain sample` needs no text
        meta["dataset"] = model.dataset_meta
    if scaler is not None:
        meta["loss_scaler"] = scaler.state_dict()
    runner.save(ckpt, step, optimizer, meta, background=background)


def write_metrics(out: Path, metrics: dict, args, dataset) -> None:
    """metrics.json and the figures, each written atomically (rank 0)."""
    checkpoint.remove_temporaries(out)  # what a killed run left half-written
    checkpoint.atomic_write(out / "metrics.json", lambda f: f.write(json.dumps(metrics, indent=1).encode()))
    if args.no_plot or not metrics["steps"]:
        return
    from tinytrain.viz import plot_expert_load, plot_loss_curve

    title = f"GPT on {dataset.name}"
    checkpoint.atomic_write(out / "loss.png", lambda f: plot_loss_curve(metrics, f, title=title))
    if any("moe" in s for s in metrics["steps"]):
        per_rank = args.experts // args.ep if args.ep > 1 else None
        checkpoint.atomic_write(
            out / "expert_load.png", lambda f: plot_expert_load(metrics, f, experts_per_rank=per_rank)
        )


DIVERGED = 10  # a loss this many times that of guessing uniformly has diverged (training starts near 1x)


def check_diverged(loss: float, step: int, vocab_size: int, lr: float) -> None:
    """Stop a run whose loss is no longer a number, or far above that of a uniform guess (ln V): an
    fp32 run at --lr 10 reached 1432 and went on to exit 0."""
    uniform = math.log(vocab_size)
    if not math.isfinite(loss):
        raise FloatingPointError(f"loss became {loss} at step {step}; lower --lr or enable --grad-clip")
    if loss > DIVERGED * uniform:
        raise FloatingPointError(
            f"training diverged at step {step}: loss {loss:.4g} is over {DIVERGED}x that of guessing uniformly "
            f"(ln {vocab_size} = {uniform:.3g}); lower --lr (it is {lr:g}) or enable --grad-clip"
        )


def keep_metrics(out: Path, metrics: dict) -> None:
    """metrics.json after a save failed (a full disk): small, so it may still fit; never a second error."""
    try:
        checkpoint.atomic_write(out / "metrics.json", lambda f: f.write(json.dumps(metrics, indent=1).encode()))
    except OSError:
        pass  # the save's own error says what is wrong with the disk


def interrupted(runner, out: Path, metrics: dict, signum: int, step: int, quiet: bool) -> int:
    """After SIGINT/SIGTERM: the checkpoint of ``step`` is written; keep the metrics, say how to go on."""
    if runner.is_main:
        checkpoint.remove_temporaries(out)
        checkpoint.atomic_write(out / "metrics.json", lambda f: f.write(json.dumps(metrics, indent=1).encode()))
        algo = metrics["config"]["args"].get("dp_algo")
        if algo in NO_RESUME:  # check_args refuses --resume for these: name the continuation that works
            how = (
                f"--dp-algo {algo} cannot resume ({NO_RESUME[algo]}): to continue from step {step + 1} on this "
                f"checkpoint, run the same command with --resume and --dp-algo allreduce in place of --dp-algo {algo} "
                f"and its own flags (and --out {out}), or start afresh."
            )
        else:
            how = f"Run the same command with --resume (and --out {out}) to continue from step {step + 1}."
        print(
            f"\ntinytrain: {signal.Signals(signum).name} received: stopped after step {step}, checkpoint written to "
            f"{out / 'ckpt'}. {how}",
            file=sys.stderr,
        )
    return 128 + signum


class Interrupts:
    """SIGINT, SIGTERM and SIGUSR1 during training: the first one asks the loop to stop after the
    current step (``signal`` holds its number); a second SIGINT raises ``KeyboardInterrupt`` at once.

    SIGUSR1 because Open MPI's ``mpirun`` turns a SIGTERM it receives into the end of the job (it
    passes SIGTERM on, closes the ranks' output and kills them a second later) but passes SIGUSR1 on
    and waits; Slurm's ``--signal=USR1@SECONDS`` is the usual notice before a preemption. A rank
    whose launcher has gone is sent SIGTERM by ``launcher.watch`` and stops the same way.

    Installed only in the main thread (Python allows handlers nowhere else); restored on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, announce: bool = True):
        self.announce = announce  # one rank says what happens
        self.signal: int | None = None
        self.previous: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self.previous[signum] = signal.signal(signum, self.handle)
        return self

    def handle(self, signum, frame) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt("interrupted twice: stopped at once; the last checkpoint stays")
        if self.signal is None:
            self.signal = signum
            _say_who_died()
        if self.announce and signum == self.signal:
            why = f" ({launcher.lost} has exited)" if launcher.lost else ""
            print(
                f"\ntinytrain: {signal.Signals(signum).name}{why}: finishing this step, then saving a checkpoint "
                "(Ctrl-C again to stop at once)",
                file=sys.stderr,
                flush=True,
            )

    def __exit__(self, *exc) -> bool:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        return False


def _say_who_died() -> None:
    """A signal that follows a rank's death is its launcher ending the job (Open MPI's sends SIGTERM,
    then SIGKILL): name the rank that died, which a rank killed outright cannot do itself."""
    dist = sys.modules.get("tinytrain.distributed")
    if dist is None or not dist.is_initialized():
        return
    from tinytrain.distributed import watchdog

    said = watchdog.who_died_here()
    if said:
        print(f"\ntinytrain: {said}; its launcher is stopping the job", file=sys.stderr, flush=True)


def prepare_outputs(args) -> Path:
    """Check, before any step, that every output can be written: ``--out`` (created), the figures
    in it, and ``--trace`` (a relative path is taken inside ``--out``). Returns ``--out``."""
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder (it will hold metrics.json, loss.png, ckpt/)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {out} cannot be created ({exc.strerror}); choose another folder") from None
    _check_writable(out, "--out")
    if args.trace:
        trace_path = Path(args.trace) if Path(args.trace).is_absolute() else out / args.trace
        if trace_path.is_dir():
            raise ValueError(f"--trace {args.trace} is a folder; give a file name such as run.json")
        if not trace_path.parent.is_dir():
            raise ValueError(f"--trace {args.trace}: the folder {trace_path.parent} does not exist; create it first")
        _check_writable(trace_path.parent, "--trace")
        args.trace = str(trace_path)
    return out


def refuse_to_overwrite(out: Path, args) -> None:
    """A run without --resume into an --out that holds a checkpoint would replace it: refused,
    unless asked for (--overwrite)."""
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the checkpoint in --out and --overwrite replaces it: give one of them")
    if args.resume or args.overwrite or not (out / "ckpt" / "manifest.json").is_file():
        return
    try:
        held = f"a checkpoint of step {checkpoint.Reader(out / 'ckpt').meta['step']}"
    except (ValueError, OSError):
        held = "a checkpoint"
    raise ValueError(
        f"--out {out} holds {held}; add --resume to continue it, --overwrite to train afresh over it, "
        "or choose another --out"
    )


def _writes_outputs() -> bool:
    """Is this the rank that writes --out's files (and so holds its lock)? Rank 0 of the job."""
    dist = sys.modules.get("tinytrain.distributed")
    if dist is not None and dist.is_initialized():
        return dist.get_rank() == 0
    return launched_world()[0] == 0


def _check_writable(folder: Path, flag: str) -> None:
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ValueError(f"{flag}: cannot write in {folder} ({exc.strerror}); choose a writable folder") from None


def default_layout(args) -> None:
    """``mpirun -n N tinytrain train`` with no layout flag: data parallel over all N ranks (as torchrun
    users expect), never N separate runs racing on one --out.

    Only for a program that mpirun started: where MPI is running already (the test harness, a
    notebook), a caller that runs a serial training on one rank means it."""
    dist = sys.modules.get("tinytrain.distributed")
    if dist is not None and dist.is_initialized():
        return
    rank, world = launched_world()
    if world > 1 and plan_of(args).is_serial:
        args.dp = world
        if rank == 0 and not args.quiet:
            print(
                f"tinytrain: {world} ranks, no layout flag: data parallel over all {world} (--dp {world})",
                file=sys.stderr,
            )


def resume(ckpt: Path, runner, model, optimizer, schedule, args, scaler=None) -> tuple[int, list]:
    """Load the checkpoint (written by any layout, in any --precision: its parameters are float32)
    into this layout; return (step, metrics so far). An fp16 run continues the loss scale of an fp16
    checkpoint; from another precision it starts afresh."""
    reader = checkpoint.Reader(ckpt)
    meta = reader.meta
    saved_args = dict(meta.get("args", {}))
    current = getattr(model, "dataset_meta", None)
    refusal, note = dataset_change(meta.get("dataset"), current, args.data)
    if refusal:
        raise ValueError(f"cannot resume from {ckpt}: {refusal}")
    if meta.get("dataset", {}).get("name") == "text" and (current or {}).get("name") == "text":
        saved_args["data"] = args.data  # compared by content above: the file may have moved
    mismatch = model_mismatch(saved_args, meta.get("model_config", {}), args, model.config)
    if mismatch:
        raise ValueError(f"cannot resume from {ckpt}: {mismatch}")
    shapes = {name: tuple(shape) for name, shape in runner.shapes().items()}  # not p.shape: ZeRO-3 emptied p
    saved = {name: tuple(shape) for name, shape in meta["tensors"].items()}
    if set(saved) != set(shapes):
        raise ValueError(
            f"the checkpoint in {ckpt} holds other parameters ({sorted(set(saved) ^ set(shapes))[:3]} "
            "differ); resume with the model settings it was trained with"
        )
    for name, shape in shapes.items():
        if saved[name] != shape:
            raise ValueError(
                f"{name}: checkpoint shape {saved[name]} != model shape {shape}; resume with the "
                "--layers/--heads/--width/--data settings the checkpoint was trained with"
            )
    if meta["optimizer"] != args.optimizer:
        raise ValueError(
            f"the checkpoint in {ckpt} was trained with --optimizer {meta['optimizer']}; "
            f"resume with --optimizer {meta['optimizer']}"
        )
    if meta["seed"] != args.seed:
        raise ValueError(
            f"the checkpoint in {ckpt} was trained with --seed {meta['seed']}; resume with that seed "
            "(batches and dropout masks follow it)"
        )
    changed = changed_setting(meta.get("args", {}), args, meta["step"], schedule)
    if changed:
        raise ValueError(f"the checkpoint in {ckpt} was trained with {changed}")
    if note and runner.is_main:
        print(f"tinytrain: note: {note}", file=sys.stderr)
    runner.load(reader, optimizer)
    if scaler is not None and "loss_scaler" in meta:
        scaler.load_state_dict(meta["loss_scaler"])
    load_routing_biases(model, meta.get("routing_bias", {}))
    step = meta["step"]
    schedule.last_step = step
    optimizer.lr = schedule.lr_at(step + 1)
    return step, meta["metrics_steps"]


# What a resumed run may not change: the flags that shape the run's curve (the layout flags and
# --eval-*/--ckpt-every/--out may change). The LR schedule's flags only where the rate of a step
# still to come would change: a constant rate (--warmup 0, --min-lr equal to --lr) can be extended.
SCHEDULE_FLAGS = ("steps", "lr", "min_lr", "warmup")
CURVE_FLAGS = {
    "batch_size": "every step's batch follows it",
    "weight_decay": "every update follows it",
    "grad_clip": "every update follows it",
    "dropout": "the dropout masks follow it",
    "capacity_factor": "which tokens the experts drop follows it",
    "aux_loss_weight": "the loss follows it",
    "balance": "the routing follows it",
    "bias_rate": "the routing follows it",
}


def changed_setting(saved: dict, args, step: int, schedule) -> str | None:
    """The first flag a resumed run may not change but does, said as "--steps 300 (its
    learning-rate schedule follows it); resume with --steps 300"; None if none. ``saved``: the
    checkpoint's flags (an older checkpoint may lack some: those are not compared)."""
    if all(saved.get(name) is not None for name in SCHEDULE_FLAGS):
        rates = SimpleNamespace(lr=saved["lr"])  # the schedule only sets an optimizer's lr
        before = type(schedule)(rates, saved["warmup"], saved["steps"], min_lr=saved["min_lr"], base_lr=saved["lr"])
        if any(not math.isclose(before.lr_at(s), schedule.lr_at(s)) for s in range(step + 1, args.steps + 1)):
            for name in SCHEDULE_FLAGS:
                if not _same(saved[name], getattr(args, name)):
                    why = "its learning-rate schedule follows it" if name == "steps" else "the learning rate follows it"
                    return _resume_with(name, saved[name], why)
    for name, why in CURVE_FLAGS.items():
        if name in saved and not _same(saved[name], getattr(args, name)):
            return _resume_with(name, saved[name], why)
    return None


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


def _resume_with(name: str, value, why: str) -> str:
    flag = "--" + name.replace("_", "-")
    shown = f"{value:g}" if isinstance(value, float) else value
    return f"{flag} {shown} ({why}); resume with {flag} {shown}"


def moe_line(moe: dict) -> str:
    """The progress line's mixture-of-experts part: aux loss, dropped share, each expert's share."""
    total = max(sum(moe["load"]), 1)
    shares = "/".join(f"{100 * n / total:.0f}" for n in moe["load"])
    return f"aux {moe['aux']:.3f} drop {moe['dropped']:.1%} load% {shares}"


def _plain_args(args) -> dict:
    return {k: v for k, v in vars(args).items() if not k.startswith("_")}


def _trace_step(step: int):
    from tinytrain import trace

    return trace.span("step", cat="step", step=step)
