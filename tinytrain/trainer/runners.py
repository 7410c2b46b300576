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

    def save(
        self, folder, step: int, optimizer, meta: dict, background: bool = False
    ) -> None: ...  # every rank its pieces

    def settle_save(self, wait: bool = False) -> int | None: ...  # a background save's manifest, once all wrote

    def load(self, reader: checkpoint.Reader, optimizer) -> None: ...  # from a checkpoint of any layout

    def step_stats(self) -> dict: ...  # the last step's mixture-of-experts numbers ({} without experts)

    def vote(self, value: int) -> int: ...  # the largest ``value`` any rank gave, on every rank

    def ranks(self) -> str: ...  # the ranks and their process ids, for the start line ("" serially)

    def finish(self, args, out: Path) -> None: ...  # traces, plots, memory tables


class Saves:
    """Checkpoint saving, the same for both runners: every rank writes its pieces, then rank 0 names
    them in the manifest once every rank's are on disk. With ``background`` (``--ckpt-async``) the
    pieces are only copied to host memory here, a thread writes them, and ``settle_save`` (called
    at every step's end) commits the manifest at the first step's end when every rank's write is done."""

    pending = None  # (folder, step, meta, its BackgroundWrite or None)

    def save(self, folder, step: int, optimizer, meta: dict, background: bool = False) -> None:
        self.settle_save(wait=True)  # one write at a time: the last one's manifest first
        pieces, scalars = self.checkpoint_pieces(optimizer)  # host copies: the snapshot
        if background:
            self.pending = (folder, step, meta, checkpoint.BackgroundWrite(folder, step, self.rank, pieces, scalars))
            return
        checkpoint.write_pieces(folder, step, self.rank, pieces, scalars)
        self.pending = (folder, step, meta, None)
        self.settle_save(wait=True)
        self.barrier()  # a synchronous save has returned on no rank before the manifest names it

    def settle_save(self, wait: bool = False) -> int | None:
        """Commit the pending save if every rank's pieces are on disk (``wait``: wait for this rank's
        write first); returns the step committed, else None. Every rank calls it at the same steps."""
        if self.pending is None:
            return None
        folder, step, meta, write = self.pending
        if write is not None and wait:
            write.wait()
        mine = write.error if write is not None and write.finished else None
        still_writing, failed = self.agree(int(write is not None and not write.finished), int(mine is not None))
        if failed:
            self.pending = None
            if mine is not None:
                raise mine
            raise checkpoint.CheckpointError(
                f"the checkpoint of step {step} was not saved: another rank could not write its pieces "
                "(its error says why); the previous checkpoint stays"
            )
        if still_writing:
            return None
        self.pending = None
        if self.is_main:
            checkpoint.commit(folder, step, self.world_size(), self.shapes(), dict(meta, layout=self.layout()))
        return step


class SerialRunner(Saves):
    """One process holds the whole model: forward, backward, done."""

    is_main = True
    rank = 0

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

    def checkpoint_pieces(self, optimizer):
        return checkpoint.collect(self.named, optimizer)

    def agree(self, *flags: int) -> tuple[int, ...]:
        return flags

    def barrier(self) -> None:
        """One process: nothing to wait for."""

    def world_size(self) -> int:
        return 1

    def layout(self) -> str:
        return "(serial)"

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


class MeshRunner(Saves):
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
        return self.agree(value)[0]

    def checkpoint_pieces(self, optimizer):
        return self.parallel.checkpoint_pieces(optimizer)

    def agree(self, *flags: int) -> tuple[int, ...]:
        """The largest of each flag over the ranks (one small all-reduce): did any rank ...?"""
        import numpy

        most = numpy.array(flags, dtype=numpy.int32)
        self.dist.all_reduce(most, op="max")
        return tuple(int(f) for f in most)

    def barrier(self) -> None:
        self.dist.barrier()

    def world_size(self) -> int:
        return self.dist.get_world_size()

    def layout(self) -> str:
        return self.plan.flags()

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
