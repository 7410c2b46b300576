"""Runners: how one training step runs on this rank. The loop (``loop.py``) calls only these.

``SerialRunner`` holds the whole model in one process (no MPI). ``MeshRunner`` runs any layout a
``Plan`` describes (``--dp/--tp/--pp/--sp/--zero``) through ``tinytrain.parallel.hybrid``; it
knows no strategy either: the composition lives there.
"""

from __future__ import annotations

import os
import socket
import sys
import zlib
from pathlib import Path
from typing import Protocol, runtime_checkable

from tinytrain import checkpoint
from tinytrain.backend import precision_dtype
from tinytrain.checkpoint import Placement
from tinytrain.nn.moe import moe_step_stats
from tinytrain.nn.recompute import apply_recompute
from tinytrain.optim import clip_grad_norm_, grads_finite
from tinytrain.parallel.expert_parallel import balance_experts


@runtime_checkable
class Runner(Protocol):
    """What the training loop needs from a layout."""

    is_main: bool  # this rank prints, evaluates and writes metrics

    def parameters(self) -> list: ...  # what this rank's optimizer updates

    def forward_backward(self, x, y) -> float: ...  # gradients of the global batch; its mean loss

    def clip_gradients(self, max_norm: float) -> float: ...  # by the global norm; returns it

    def step(self, optimizer) -> None: ...

    def found_inf(self) -> bool: ...  # an inf or NaN in any rank's gradients (the same answer on every rank)

    def skip_step(self) -> None: ...  # drop the gradients without an update (fp16: the loss scale overflowed)

    def share_model(self) -> None: ...  # the full current model in the serial GPT on every rank

    def shapes(self) -> dict: ...  # each parameter's serial shape (what a checkpoint records)

    def save(self, folder, step: int, optimizer, meta: dict) -> None: ...  # every rank its pieces

    def load(self, reader: checkpoint.Reader, optimizer) -> None: ...  # from a checkpoint of any layout

    def step_stats(self) -> dict: ...  # the last step's mixture-of-experts numbers ({} without experts)

    def vote(self, value: int) -> int: ...  # the largest ``value`` any rank gave, on every rank

    def ranks(self) -> str: ...  # the ranks and their process ids, for the start line ("" serially)

    def finish(self, args, out: Path) -> None: ...  # traces, plots, memory tables


class SerialRunner:
    """One process holds the whole model: forward, backward, done."""

    is_main = True

    def __init__(self, model):
        self.model = model
        self.named = [(Placement(name), p) for name, p in model.named_parameters()]

    def parameters(self):
        return self.model.parameters()

    def forward_backward(self, x, y) -> float:
        loss = self.model.loss(x, y)
        loss.backward()
        return loss.item()

    def clip_gradients(self, max_norm: float) -> float:
        return clip_grad_norm_(self.parameters(), max_norm)

    def step(self, optimizer) -> None:
        optimizer.step()
        balance_experts(self.model)  # --balance bias: each expert's routing bias against its load

    def found_inf(self) -> bool:
        return not grads_finite(p.grad for p in self.parameters())

    def skip_step(self) -> None:
        """Nothing to drop: the next step's zero_grad clears the gradients."""

    def share_model(self) -> None:
        """The model is whole already."""

    def save(self, folder, step: int, optimizer, meta: dict) -> None:
        pieces, scalars = checkpoint.collect(self.named, optimizer)
        checkpoint.write_pieces(folder, step, 0, pieces, scalars)
        checkpoint.commit(folder, step, 1, self.shapes(), dict(meta, layout="(serial)"))

    def shapes(self) -> dict:
        return _shapes(self.model)

    def load(self, reader, optimizer) -> None:
        checkpoint.restore(reader, self.named, optimizer)

    def step_stats(self) -> dict:
        return moe_step_stats(self.model)

    def vote(self, value: int) -> int:
        return value

    def ranks(self) -> str:
        return ""

    def finish(self, args, out: Path) -> None:
        """``--trace``: this process's spans as a Chrome trace (one rank: forward, backward, optimizer)."""
        if args.trace:
            from tinytrain import trace

            write_trace(args.trace, trace.spans())


class MeshRunner:
    """Any layout of ``plan`` on the device mesh: ``hybrid.parallelize`` builds this rank's part."""

    def __init__(self, model, plan, batch_size: int, dataset=None):
        from tinytrain import distributed as dist
        from tinytrain.distributed import watchdog
        from tinytrain.parallel.hybrid import parallelize

        dist.init()
        watchdog.start_heartbeat()  # an honest long wait (a slow stage, a big save) is not a failure
        self.dist, self.model, self.plan = dist, model, plan
        plan.check(dist.get_world_size(), model.config, batch_size)
        self.rank, self.is_main = dist.get_rank(), dist.get_rank() == 0
        if plan.progress == "thread":
            dist.start_progress_thread()
        self.parallel = parallelize(model, plan, dataset, batch_size)
        self.last_memory = None

    def parameters(self):
        return self.parallel.parameters()

    def forward_backward(self, x, y) -> float:
        return self.parallel.forward_backward(x, y)

    def clip_gradients(self, max_norm: float) -> float:
        return self.parallel.clip_grad_norm_(max_norm)

    def step(self, optimizer) -> None:
        self.last_memory = self.parallel.memory()  # gradients exist now: the peak of the step
        self.parallel.step(optimizer)

    def found_inf(self) -> bool:
        return self.parallel.found_inf()

    def skip_step(self) -> None:
        self.parallel.skip_step()

    def share_model(self) -> None:
        self.parallel.gather_model()

    def step_stats(self) -> dict:
        return self.parallel.step_stats()

    def ranks(self) -> str:
        """ "4 ranks (process ids 0=3823 1=3824 ...)": a rank killed outright cannot say who it was, so
        the others learn here where each runs, to name it (``watchdog.learn_places``)."""
        import numpy

        from tinytrain.distributed import watchdog

        here = zlib.crc32(socket.gethostname().encode())  # one id per machine
        places = self.dist.all_gather(numpy.array([[os.getpid(), here]], dtype=numpy.int64))
        pids, hosts = places[:, 0].tolist(), places[:, 1].tolist()
        watchdog.learn_places(pids, hosts)
        return f"{len(pids)} ranks (process ids {' '.join(f'{r}={p}' for r, p in enumerate(pids))})"

    def vote(self, value: int) -> int:
        """One 4-byte all-reduce (max): a signal may reach one rank only, or the ranks during
        different steps, and every rank must stop after the same step, knowing which signal."""
        import numpy

        votes = numpy.array([value], dtype=numpy.int32)
        self.dist.all_reduce(votes, op="max")
        return int(votes[0])

    def save(self, folder, step: int, optimizer, meta: dict) -> None:
        pieces, scalars = self.parallel.checkpoint_pieces(optimizer)
        checkpoint.write_pieces(folder, step, self.rank, pieces, scalars)
        self.dist.barrier()  # every rank's pieces are on disk before the manifest names them
        if self.is_main:
            checkpoint.commit(
                folder, step, self.dist.get_world_size(), self.shapes(), dict(meta, layout=self.plan.flags())
            )
        self.dist.barrier()

    def shapes(self) -> dict:
        return self.parallel.shapes  # the serial shapes, kept before ZeRO-3 freed the parameters

    def load(self, reader, optimizer) -> None:
        self.parallel.load_checkpoint(reader, optimizer)

    def finish(self, args, out: Path) -> None:
        from tinytrain import trace

        self.dist.stop_progress_thread()
        if args.trace or args.plot:
            spans = trace.merge()
            if self.is_main and args.trace:
                write_trace(args.trace, spans)
            if self.is_main and args.plot and self.plan.pp > 1:
                from tinytrain.trainer.plots import plot_last_pipeline_step

                plot_last_pipeline_step(spans, self.plan, args, out)
            if self.is_main and self.plan.cp > 1:
                from tinytrain.trainer.plots import print_context_parallel_overlap

                print_context_parallel_overlap(spans, self.plan)
        if self.last_memory is not None:
            self.print_memory()
        report = self.parallel.comm_report()  # --dp-algo: bytes per step and the formula (every rank calls)
        if report and self.is_main:
            print(report, file=sys.stderr)

    def print_memory(self) -> None:
        """ZeRO: each rank's bytes of parameters, gradients and optimizer state (rank 0 prints)."""
        from tinytrain.backend import xp

        keys = ("params", "grads", "optimizer")
        mine = xp.asarray([[self.last_memory[k] for k in keys] + [self.last_memory["gathered_peak"]]], dtype=xp.int64)
        rows = self.dist.all_gather(mine)
        if not self.is_main:
            return
        zero = self.parallel.zero
        psi = sum(p.size for p in self.model.parameters() if p.requires_grad)
        size = precision_dtype(self.plan.precision).itemsize  # bytes per parameter: 4, or 2 (bf16, fp16)
        full = [size * psi, size * psi, zero.optimizer_bytes_per_element() * psi]

        def mb(b):
            return f"{b / 2**20:9.3f}"

        lines = [
            f"ZeRO-{zero.stage} memory per rank (MiB), Ψ = {psi:,} trainable parameters:",
            f"{'':10}{'params':>10}{'grads':>10}{'optimizer':>10}{'total':>10}{'gathered':>10}",
        ]
        for r, row in enumerate(rows.tolist()):
            lines.append(f"rank {r:<5}{mb(row[0])} {mb(row[1])} {mb(row[2])} {mb(sum(row[:3]))} {mb(row[3])}")
        lines.append(f"{'unsharded':10}{mb(full[0])} {mb(full[1])} {mb(full[2])} {mb(sum(full))}")
        print("\n".join(lines), file=sys.stderr)


def write_trace(path, spans: list[dict]) -> None:
    """The spans as a Chrome trace at ``path``, written atomically like every output."""
    import json

    from tinytrain import trace

    checkpoint.atomic_write(path, lambda f: f.write(json.dumps(trace.to_chrome(spans)).encode()))
    print(f"wrote the Chrome trace {path} (open it in https://ui.perfetto.dev)", file=sys.stderr)


def _shapes(model) -> dict:
    return {name: p.shape for name, p in model.named_parameters()}


def launched_world() -> tuple[int, int]:
    """(rank, ranks) of this process's MPI job: tinytrain.distributed's world once it started (the
    test harness gives a single-process test a world of one), else what the launcher put in the
    environment (MPICH, Open MPI), without starting MPI."""
    dist = sys.modules.get("tinytrain.distributed")
    if dist is not None and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    from tinytrain import launcher

    return launcher.rank_and_size()


def make_runner(model, plan, batch_size: int, dataset=None):
    """The serial runner for one rank without parallel flags, else the mesh runner. ``dataset``:
    what a layout that splits the data itself (--dp-algo fedavg's clients) splits."""
    if plan.is_serial:
        plan.check(1, model.config, batch_size)
        model.to(precision_dtype(plan.precision))  # (a mesh casts, and applies --recompute, in hybrid.parallelize)
        apply_recompute(model, plan.recompute)
        return SerialRunner(model)
    return MeshRunner(model, plan, batch_size, dataset)
