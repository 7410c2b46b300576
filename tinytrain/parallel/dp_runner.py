"""``tinytrain train --dp N [--zero 1|2|3]``: the training loop's runner for data parallel and ZeRO.

``tinytrain/train.py`` owns the loop (batch, forward/backward, clip, step, evaluate, save); a
runner says how one step runs on this rank. This one takes this rank's rows of the global batch,
runs bucketed DDP or ZeRO from ``data_parallel.py`` / ``zero.py``, reports the *global* mean loss
(so the curve lies on the serial one), and on rank 0 prints each rank's memory.
"""

from __future__ import annotations

import sys

# Only argparse setup runs at import: `tinytrain --help` must not start MPI. The runner's imports
# (distributed, the strategies) happen when a runner is built.


def add_arguments(group) -> None:
    group.add_argument("--dp", type=int, default=1, help="data-parallel ranks (= mpirun -n)")
    group.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                       help="with --dp: ZeRO stage (1 optimizer state, 2 + gradients, 3 + parameters sharded)")
    group.add_argument("--bucket-mb", type=float, default=1.0, help="DDP gradient bucket size in MB")
    group.add_argument("--progress", choices=("poll", "thread"), default="poll",
                       help="how async all-reduces advance during backward: polled from hooks, or a helper thread")


def sum_over_replicas(params, loss_share, group, dist) -> None:
    """Replicas of the same shard (a pipeline stage, a tensor-parallel piece) each computed the
    gradient of their share of the global loss; summing them over the DP group gives the serial
    gradient. ``loss_share`` (a 1-element array) is summed the same way, in place."""
    from tinytrain.backend import xp

    for p in params:
        if p.grad is None:
            p.grad = xp.zeros_like(p.data)
        dist.all_reduce(p.grad, group=group)
    dist.all_reduce(loss_share, group=group)


def wanted(args) -> bool:
    return args.dp > 1 or args.zero > 0


class DataParallelRunner:
    """Each rank: its rows of the batch, full forward/backward, gradients averaged (or sharded)."""

    def __init__(self, model, args):
        from tinytrain import distributed as dist

        dist.init()
        n = dist.get_world_size()
        if args.dp != n:
            raise ValueError(f"--dp {args.dp} must equal the number of ranks: run `mpirun -n {args.dp} tinytrain "
                             f"train --dp {args.dp} ...` (this run has {n})")
        if args.batch_size % n:
            raise ValueError(f"--batch-size {args.batch_size} (the global batch) does not split over {n} ranks; "
                             f"use a multiple of {n}, e.g. {n * max(1, args.batch_size // n)}")
        if args.bucket_mb <= 0:
            raise ValueError(f"--bucket-mb must be positive, got {args.bucket_mb}")
        if args.zero == 3 and args.dropout > 0:
            raise ValueError("--zero 3 recomputes each layer's forward in backward, so it needs --dropout 0")
        if args.zero and args.resume:
            raise ValueError("--resume with --zero is not supported: ZeRO checkpoints hold no optimizer state yet")
        self.model, self.rank, self.world_size = model, dist.get_rank(), n
        self.is_main = self.rank == 0
        self.saves_optimizer = not args.zero  # ZeRO's optimizer state is in pieces on every rank
        self.psi = sum(p.size for p in model.parameters() if p.requires_grad)
        self.args, self.wrapper, self.last_memory = args, None, None
        if args.progress == "thread":
            dist.start_progress_thread()

    def _wrap(self):
        """Built at the first step, after the loop may have loaded a checkpoint into the model."""
        from tinytrain.parallel.data_parallel import BucketedDDP
        from tinytrain.parallel.zero import Zero

        if self.args.zero:
            return Zero(self.model, None, stage=self.args.zero)
        return BucketedDDP(self.model, bucket_mb=self.args.bucket_mb, poll=self.args.progress == "poll")

    @property
    def sharded(self) -> bool:
        return self.args.zero > 0

    def parameters(self):
        return self.model.parameters()

    def forward_backward(self, x, y) -> float:
        from tinytrain import distributed as dist
        from tinytrain.backend import xp
        from tinytrain.data import shard_rows
        from tinytrain.train import loss_of

        self.wrapper = self.wrapper or self._wrap()
        x, y = shard_rows(x, self.rank, self.world_size), shard_rows(y, self.rank, self.world_size)
        loss = loss_of(self.wrapper, x, y)
        self.wrapper.backward(loss)
        # The mean of the ranks' mean losses is the global batch's mean loss (equal rows per rank).
        value = xp.asarray([loss.item()], dtype=xp.float64)
        return float(dist.all_reduce(value, op="avg")[0])

    def clip_gradients(self, max_norm: float) -> float:
        from tinytrain.optim import clip_grad_norm_

        if self.sharded:
            return self.wrapper.clip_grad_norm_(max_norm)
        return clip_grad_norm_(self.parameters(), max_norm)  # gradients are already averaged

    def step(self, optimizer) -> None:
        if self.sharded:
            self.last_memory = self.wrapper.memory()  # gradients exist now: the peak of the step
            self.wrapper.step(optimizer)
        else:
            optimizer.step()

    def share_model(self) -> None:
        """ZeRO-3 keeps pieces only: put the full parameters back into the model for rank 0's
        evaluation and checkpoint (the next forward frees them again)."""
        if self.sharded and self.wrapper is not None and self.wrapper.stage == 3:
            self.wrapper.materialize()

    def finish(self, args, out) -> None:
        from tinytrain import distributed as dist
        from tinytrain import trace

        dist.stop_progress_thread()
        if args.trace:
            spans = trace.merge()
            if self.is_main:
                trace.write_chrome(args.trace, spans)
                print(f"wrote the Chrome trace {args.trace} (open it in https://ui.perfetto.dev)", file=sys.stderr)
        if self.sharded and self.last_memory is not None:
            self.print_memory()

    def print_memory(self) -> None:
        from tinytrain import distributed as dist
        from tinytrain.backend import xp

        keys = ("params", "grads", "optimizer")
        mine = xp.asarray([[self.last_memory[k] for k in keys] + [self.last_memory["gathered_peak"]]], dtype=xp.int64)
        rows = dist.all_gather(mine)
        if not self.is_main:
            return
        per_element = self.wrapper.optimizer_bytes_per_element()
        full = [4 * self.psi, 4 * self.psi, per_element * self.psi]
        mb = lambda b: f"{b / 2**20:9.3f}"  # noqa: E731
        lines = [f"ZeRO-{self.wrapper.stage} memory per rank (MiB), Ψ = {self.psi:,} trainable parameters:",
                 f"{'':10}{'params':>10}{'grads':>10}{'optimizer':>10}{'total':>10}{'gathered':>10}"]
        for r, row in enumerate(rows.tolist()):
            lines.append(f"rank {r:<5}{mb(row[0])} {mb(row[1])} {mb(row[2])} {mb(sum(row[:3]))} {mb(row[3])}")
        lines.append(f"{'unsharded':10}{mb(full[0])} {mb(full[1])} {mb(full[2])} {mb(sum(full))}")
        print("\n".join(lines), file=sys.stderr)
