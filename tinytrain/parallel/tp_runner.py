"""``tinytrain train --tp T [--sp] [--dp D]``: the training loop's runner for tensor parallel.

(With ``--pp P`` as well, ``train.PipelineRunner`` runs tensor-parallel stages instead.)

Every rank builds the serial GPT from the seed and keeps its shards (``tensor_parallel.py``). With
``--dp D`` the ranks form a mesh ``{"dp": D, "tp": T}`` (TP innermost: a TP group is neighbouring
ranks, one node in a real cluster): replica d takes its rows of the global batch, each loss is
divided by the number of targets in the *global* batch, and after backward every shard sums its
gradient with the same shard of the other replicas, so the sum is exactly the serial gradient.
The serial model is refreshed from the shards (an all-gather) only when the loop evaluates or saves.
"""

from __future__ import annotations

import math


def add_arguments(group) -> None:
    group.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (heads, width and vocabulary split)")
    group.add_argument("--sp", action="store_true", help="with --tp: sequence parallel (LayerNorm/dropout on sequence shards)")


def wanted(args) -> bool:
    return args.tp > 1 or args.sp


class TensorParallelRunner:
    saves_optimizer = False  # each rank holds the optimizer state of its shards only

    def __init__(self, model, args):
        from tinytrain import distributed as dist
        from tinytrain.parallel.tensor_parallel import tensor_parallel_gpt

        dist.init()
        tp, dp, n = args.tp, args.dp, dist.get_world_size()
        if args.sp and tp < 2:
            raise ValueError("--sp splits the sequence over the tensor-parallel group: add --tp 2 or more")
        if args.zero:
            raise ValueError("--zero with --tp is not supported; use plain --dp with --tp")
        if args.resume:
            raise ValueError("--resume with --tp is not supported: TP checkpoints hold no optimizer state yet")
        if dp * tp != n:
            raise ValueError(f"--dp {dp} --tp {tp} needs exactly {dp * tp} ranks: run `mpirun -n {dp * tp} tinytrain "
                             f"train --tp {tp}{f' --dp {dp}' if dp > 1 else ''} ...` (this run has {n})")
        if args.batch_size % dp:
            raise ValueError(f"--batch-size {args.batch_size} does not split over {dp} replicas; use a multiple of {dp}")
        self.dist, self.model, self.dp = dist, model, dp
        if dp > 1:
            mesh = dist.DeviceMesh({"dp": dp, "tp": tp})
            self.dp_rank, self.dp_group, tp_group = mesh.coordinate("dp"), mesh.get_group("dp"), mesh.get_group("tp")
        else:
            self.dp_rank, self.dp_group, tp_group = 0, None, dist.world()
        rows = (self.dp_rank * args.batch_size // dp, args.batch_size) if dp > 1 else None
        self.parallel = tensor_parallel_gpt(model, tp_group, sequence_parallel=args.sp, rows=rows)
        self.is_main = dist.get_rank() == 0

    def parameters(self):
        return self.parallel.parameters()

    def forward_backward(self, x, y) -> float:
        from tinytrain.backend import xp
        from tinytrain.data import replica_batch

        x, y, targets = replica_batch(x, y, self.dp_rank, self.dp)
        loss = self.parallel.loss(x, y, denominator=targets)
        loss.backward()
        self.parallel.sync_sequence_parallel_grads()
        value = xp.asarray([loss.item()], dtype=xp.float64)
        if self.dp > 1:
            from tinytrain.parallel.dp_runner import sum_over_replicas

            sum_over_replicas(self.parameters(), value, self.dp_group, self.dist)
        return float(value[0])

    def clip_gradients(self, max_norm: float) -> float:
        """Global norm: shards' squares summed over the TP group, replicated weights counted once."""
        from tinytrain.backend import xp
        from tinytrain.optim import clip_grad_norm_

        sharded, replicated = 0.0, 0.0
        for p, _, axis, _, _, _ in self.parallel.shards():
            if p.grad is not None:
                square = float((p.grad.astype(xp.float64) ** 2).sum())
                sharded, replicated = (sharded + square, replicated) if axis is not None else (sharded, replicated + square)
        total = xp.asarray([sharded])
        self.dist.all_reduce(total, group=self.parallel.group)
        return clip_grad_norm_(self.parameters(), max_norm, total_norm=math.sqrt(float(total[0]) + replicated))

    def step(self, optimizer) -> None:
        optimizer.step()

    def share_model(self) -> None:
        self.parallel.write_into(self.model)

    def finish(self, args, out) -> None:
        """Write the Chrome trace of every rank (``--trace``): the TP all-reduces between matmuls."""
        if not args.trace:
            return
        import sys

        from tinytrain import trace

        spans = trace.merge()
        if self.is_main:
            trace.write_chrome(args.trace, spans)
            print(f"wrote the Chrome trace {args.trace} (open it in https://ui.perfetto.dev)", file=sys.stderr)
