# Assignment 2: Data parallel (handout: assignments/a2_data_parallel.md).
# Generated from tinytrain/parallel/data_parallel.py by `python -m grader stubs`. Replace each
# `raise NotImplementedError("TODO ...")` with your code; grade it with `python -m grader`.

"""Data parallel: every rank holds the whole model and trains on its own rows of the batch.

    global batch of N·B rows ── shard_rows(batch, rank, N) ──► rank r gets rows r·B .. (r+1)·B - 1

             rank 0              rank 1                     rank N-1
         ┌───────────┐       ┌───────────┐              ┌───────────┐
         │ params W  │       │ params W  │     ...      │ params W  │  identical copies: rank 0's
         │ optimizer │       │ optimizer │              │ optimizer │  are broadcast at the start
         └───────────┘       └───────────┘              └───────────┘
  forward   x_0 ─► loss_0      x_1 ─► loss_1               x_N-1 ─► loss_N-1      (no communication)
  backward  g_0                g_1                         g_N-1
            └─────────── all_reduce(avg): g = (g_0 + g_1 + ... + g_N-1) / N ──────────┘
  step      W -= lr·g          W -= lr·g                   W -= lr·g    (same g: copies stay equal)

Averaging the gradients of N equal shards gives the gradient of the mean loss over the whole
batch, so N ranks with B rows each train exactly like one process with N·B rows.

This chapter builds six versions, in the order a framework grew them:

1. ``NaiveDDP`` (task 2.1): wait for backward to end, then all-reduce every gradient.
2. ``BucketedDDP`` (task 2.2): gradients become complete one by one *during* backward (the
   autograd engine calls a parameter's post-accumulate hook at that moment). Group them, in the
   reverse of registration order (roughly the order backward produces them), into buckets of
   ``bucket_mb`` megabytes and start an asynchronous all-reduce as soon as a bucket is full, so
   communication runs while backward still computes the earlier layers::

       backward:  [ layer L ][ layer L-1 ][ layer L-2 ] ... [ embeddings ]   wait   step
       comm:              [ all_reduce bucket 0 ][ bucket 1 ]  ...  [ last bucket ]

3. ``no_sync()`` (task 2.3): gradient accumulation. Micro-batches inside ``no_sync()`` only add
   into ``.grad``; the next backward outside it communicates the sum once.
4. ``ParameterServer`` (task 2.4): the design the ring replaced. One rank holds the parameters and
   the optimizer; the others push their gradients to it and pull the new parameters back. Every
   byte goes through the server: its traffic grows as 2(N-1)·|W| while a ring all-reduce sends
   2(N-1)/N·|W| per rank, which stays below 2|W| however many ranks join. ``SparsePushServer``
   pushes an embedding's gradient as the rows the batch touched: the server's case for sparse models.
5. ``AsyncParameterServer`` (task 2.5): no lock-step. The server applies each gradient as it
   arrives and sends that worker the new parameters at once; a gradient computed on parameters
   some updates old is *stale* (Dean et al. 2012, Downpour SGD). A bound on staleness (stale
   synchronous parallel, Ho et al. 2013) trades it back; bound 0 is the synchronous server.
6. ``LocalSGD`` (task 2.6): communicate less often. Each replica takes H steps alone, then the
   replicas average how far they moved and an outer optimizer takes that as its gradient
   (``LocalSGD.diloco``: Nesterov momentum, Douillard et al. 2023). One all-reduce per H steps.

Frozen parameters (``requires_grad=False``) are never communicated. A tied weight (GPT's token
embedding, also its output head) is one parameter: the engine fires its hook once, after both
uses have added their gradient, so it is reduced once.

The all-reduce uses the ring algorithm by default (``algo="ring"``), whose volume per rank is the
textbook 2(N-1)/N of the buffer; ``algo=None`` lets tinytrain choose by message size.

What all of them share with ZeRO (``zero.py``) is in ``wrapper.py``: the ``Wrapper`` around the model
(``ddp(x)`` runs it, ``ddp.backward(loss)`` runs backward, then the strategy's communication) and
helpers on parameter lists (``trainable``, ``grad_or_zeros``, ``flatten``, ``unflatten_into``).
"""

from __future__ import annotations

import contextlib

import numpy

from tinytrain import distributed as dist
from tinytrain import trace
from tinytrain.autograd import Parameter
from tinytrain.backend import xp
from tinytrain.distributed import watchdog
from tinytrain.nn import Embedding
from tinytrain.optim import SGD, clip_grad_norm_
from tinytrain.parallel.wrapper import (
    Wrapper,
    average_op,
    broadcast_parameters,
    flat_grads,
    flatten,
    grad_or_zeros,
    recv_into,
    trainable,
    unflatten_into,
)


class _Replicated(Wrapper):
    """What every all-reduce variant shares: the group, identical start, ``no_sync()``."""

    def __init__(self, module, group=None, algo: str | None = "ring"):
        super().__init__(module)
        self.group, self.algo = group, algo
        self.require_sync = True  # False inside no_sync(): gradients only accumulate locally
        broadcast_parameters(module, group=group)
        self.params = trainable(module)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate into ``.grad``; the first one after communicates."""
        raise NotImplementedError("TODO 2.3: Inside the with-block backward passes only accumulate, without talking; on leaving it, even by an exception, the wrapper goes back to what it did before.")

    def after_backward(self) -> None:
        if self.require_sync:  # inside no_sync() gradients only accumulate
            self.finish_gradient_sync()


# ================================================================================================
# 1. Naive DDP: all-reduce every gradient after backward
# ================================================================================================


class NaiveDDP(_Replicated):
    """One blocking all-reduce per parameter once backward has finished: simple, no overlap."""

    def finish_gradient_sync(self) -> None:
        raise NotImplementedError("TODO 2.1: After backward, every trainable parameter's gradient becomes its average over the data-parallel ranks, a missing one counting as zeros.")


# ================================================================================================
# 2. Bucketed DDP: all-reduce buckets of gradients during backward
# ================================================================================================


class Bucket:
    """A few parameters whose gradients travel together in one flat buffer."""

    def __init__(self, params):
        self.params = params
        self.buffer = xp.zeros(sum(p.size for p in params), dtype=params[0].dtype)
        self.ready: set[int] = set()  # ids of parameters whose gradient is complete
        self.work = None  # the in-flight all_reduce

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def is_full(self) -> bool:
        return len(self.ready) == len(self.params)

    def launch(self, group, algo) -> None:
        """Copy the gradients into the buffer and start averaging it; returns at once."""
        offset = 0
        for p in self.params:
            self.buffer[offset : offset + p.size] = grad_or_zeros(p).reshape(-1)
            offset += p.size
        op = average_op(self.buffer, group)  # "avg" (16-bit: "sum" of buffer / N, see average_op)
        self.work = dist.all_reduce(self.buffer, op=op, group=group, async_op=True, algo=algo)

    def finish(self) -> None:
        """Wait for the all-reduce and copy the averaged gradients back into ``.grad``."""
        self.work.wait()
        offset = 0
        for p in self.params:
            p.grad[...] = self.buffer[offset : offset + p.size].reshape(p.shape)
            offset += p.size
        self.ready.clear()
        self.work = None


def make_buckets(params, bucket_bytes: int) -> list[Bucket]:
    """Consecutive groups of ``params`` of at most ``bucket_bytes`` each (a bigger parameter
    gets a bucket of its own). Every rank builds the same buckets from the same model."""
    buckets, current, size = [], [], 0
    for p in params:
        if current and size + p.nbytes > bucket_bytes:
            buckets.append(Bucket(current))
            current, size = [], 0
        current.append(p)
        size += p.nbytes
    if current:
        buckets.append(Bucket(current))
    return buckets


class BucketedDDP(_Replicated):
    """All-reduce gradients in buckets, each as soon as it is full, while backward continues.

    The async all-reduces move only when polled: pass ``poll=True`` (each hook calls
    ``dist.progress_all()``) or start ``dist.start_progress_thread()``. Without either, a bucket's
    first step is posted at launch and the rest runs in the final wait (no overlap).
    """

    def __init__(self, module, bucket_mb: float = 25.0, group=None, algo: str | None = "ring", poll: bool = False):
        super().__init__(module, group, algo)
        if bucket_mb <= 0:
            raise ValueError(f"bucket size must be positive, got {bucket_mb} MB")
        self.poll = poll
        # Reverse registration order: the last layers' gradients are ready first in backward.
        self.buckets = make_buckets(self.params[::-1], int(bucket_mb * 2**20))
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.next_to_launch = 0
        self.hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params]

    def _grad_ready(self, p) -> None:
        """Called by the autograd engine the moment ``p.grad`` is complete for this backward."""
        if not self.require_sync:
            return  # no_sync(): let the gradient accumulate; the last micro-batch communicates
        raise NotImplementedError("TODO 2.2: Each bucket's averaging is under way as soon as all its gradients are complete, in the same bucket order on every rank; a gradient completed twice before a sync is an error.")

    def _launch_full_buckets(self) -> None:
        # Strictly in bucket order: every rank must start its collectives in the same order, even
        # if (say) bucket 2 filled up before bucket 1 on one rank.
        while self.next_to_launch < len(self.buckets) and self.buckets[self.next_to_launch].is_full():
            self.buckets[self.next_to_launch].launch(self.group, self.algo)
            self.next_to_launch += 1

    def finish_gradient_sync(self) -> None:
        """Launch what backward did not fill (unused parameters), then wait for every bucket."""
        raise NotImplementedError("TODO 2.2: On return every gradient holds its average, those of buckets no gradient reached included, and the next backward starts afresh.")

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()


def count_bytes(wrapper, communicate, *ops) -> None:
    """Run ``communicate()`` and add the bytes this rank sent and received in ``ops`` to ``wrapper.moved``
    (what ``tinytrain train --dp-algo`` reports per step, against the formula)."""
    with dist.comm_stats() as stats:
        communicate()
    wrapper.moved += sum(stats.sent(op) + stats.recv(op) for op in ops)


# ================================================================================================
# 3. Parameter server: push gradients to one rank, pull parameters back
# ================================================================================================

_PUSH, _PULL = 21, 22  # message tags


class ParameterServer(Wrapper):
    """Rank ``server`` owns the parameters and the optimizer; every rank computes gradients.

        worker 1 ──push g_1──►┐                   ┌──pull W──► worker 1
        worker 2 ──push g_2──►│  server: g = mean │──pull W──► worker 2
        ...                   │  of all g_i, then │   ...
        worker N-1 ─push ────►┘  optimizer.step() └──pull W──► worker N-1

    ``step`` pushes, updates on the server and pulls (``clip_grad_norm_`` pushes first, to clip
    the whole batch's gradient where it is: on the server). The server also trains on its own
    rows, so the result equals the serial run. Only the server ever creates optimizer state. Its
    link carries (N-1) gradients in and (N-1) copies of the parameters out per step, 2(N-1)·Ψ: the
    bottleneck that all-reduce removes.
    """

    def __init__(self, module, optimizer, server: int = 0, group=None):
        super().__init__(module)
        self.optimizer, self.server, self.group = optimizer, server, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.params = trainable(module)
        self._pull()  # everyone starts from the server's parameters
        self.moved, self.steps = 0, 0  # bytes this rank sent and received for it since, and its steps
        self.pushed = False  # clip_grad_norm_ pushed this step's gradients already

    @property
    def workers(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.server]

    def step(self) -> None:
        """Push gradients, update on the server, pull parameters (replaces ``optimizer.step()``).
        Gradients accumulate locally until then: several backward passes push once."""
        if not self.pushed:
            count_bytes(self, self._push_and_average, "send", "recv")
        if self.rank == self.server:
            self.optimizer.step()
        count_bytes(self, self._pull, "send", "recv")
        self.pushed, self.steps = False, self.steps + 1

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the whole batch's gradient, which only the server has: push now (``step`` then does
        not push again). Returns its norm before clipping on the server, a worker's own elsewhere."""
        count_bytes(self, self._push_and_average, "send", "recv")
        self.pushed = True
        if self.rank == self.server:
            return clip_grad_norm_(self.params, max_norm)
        return clip_grad_norm_(self.params, 0.0)  # (max_norm 0: measures, clips nothing)

    def _push_and_average(self) -> None:
        raise NotImplementedError("TODO 2.4: On return the central process's gradients are the whole batch's average, bit for bit the same whatever order the pushes arrive in.")

    def _pull(self) -> None:
        if self.rank != self.server:  # a worker overwrites its parameters with what the server sends
            recv_into([p.data for p in self.params], self.server, group=self.group, tag=_PULL)
            return
        raise NotImplementedError("TODO 2.4: On return every worker holds the central process's current parameters.")


_ROWS = 25  # tag of a sparse push (its row count, indices and rows)


class SparsePushServer(ParameterServer):
    """A parameter server whose workers push an embedding's gradient as the rows their batch
    touched (Li et al. 2014: the parameter server's case for sparse models)::

        dense push     every row of the V x D table            V·D·4 bytes
        sparse push    k = rows touched, then their indices and rows     8 + k·(8 + D·4) bytes

    An untied token embedding gets gradient only in the rows of the tokens its batch holds; the
    server adds the rows into its own (dense) gradient, in rank order, so the numbers are the
    dense server's exactly. A table whose gradient is dense (tied to the output head: every row)
    is pushed dense (its sparse push would be larger).
    """

    def __init__(self, module, optimizer, server: int = 0, group=None):
        super().__init__(module, optimizer, server, group)
        tables = {id(m.weight) for m in module.modules() if isinstance(m, Embedding)}
        self.sparse = [p for p in self.params if id(p) in tables]
        self.dense = [p for p in self.params if id(p) not in tables]
        self.table_bytes = 0  # bytes this rank pushed for its embedding tables

    def _push_and_average(self) -> None:
        params, self.params = self.params, self.dense  # the dense gradients: the synchronous server's push
        try:
            super()._push_and_average()
        finally:
            self.params = params
        if self.rank != self.server:
            for p in self.sparse:
                self._push_rows(grad_or_zeros(p))
            return
        for p in self.sparse:
            total = grad_or_zeros(p)
            for w in self.workers:
                self._add_rows(total, w)
            total /= self.world_size

    def _push_rows(self, grad) -> None:
        """A worker: the touched rows (nonzero gradient) with their indices, or the whole table."""
        rows = xp.flatnonzero(xp.any(grad != 0, axis=1))
        sparse = 8 + rows.size * (8 + grad[0].nbytes) < grad.nbytes
        header = xp.asarray([rows.size if sparse else -1], dtype=xp.int64)
        parts = [header, rows.astype(xp.int64), xp.ascontiguousarray(grad[rows])] if sparse else [header, grad]
        for part in parts:
            dist.send(part, self.server, group=self.group, tag=_ROWS)
            self.table_bytes += part.nbytes

    def _add_rows(self, total, worker: int) -> None:
        """The server: add a worker's pushed rows (or whole table) into ``total``."""
        header = dist.recv(xp.zeros(1, dtype=xp.int64), worker, group=self.group, tag=_ROWS)
        count = int(header[0])
        if count < 0:
            total += dist.recv(xp.empty_like(total), worker, group=self.group, tag=_ROWS)
            return
        rows = dist.recv(xp.empty(count, dtype=xp.int64), worker, group=self.group, tag=_ROWS)
        values = dist.recv(xp.empty((count, total.shape[1]), dtype=total.dtype), worker, group=self.group, tag=_ROWS)
        total[rows] += values  # rows are distinct: no two values land in one row


# ================================================================================================
# 4. Asynchronous parameter server: apply each gradient as it arrives
# ================================================================================================

_ASYNC_PUSH, _ASYNC_PULL = 23, 24  # message tags


class AsyncParameterServer(ParameterServer):
    """The server applies each gradient the moment it arrives and sends that worker the new
    parameters at once; the workers never wait for each other's gradients::

        version  v        v+1           v+2           v+3
        server   ●─own g──●──g_2 (from v-1)──●──g_1 (from v-2)──●──g_3 ...   one update per push
        worker 2      push g_2 ──► ◄── pull W_(v+2)
        worker 1               push g_1 ──► ◄── pull W_(v+3)

    A worker's gradient was computed on the parameters it last pulled; the updates the server applied
    since are its **staleness** (versions behind), recorded for every gradient (``staleness``).
    ``max_staleness=k`` bounds it (stale synchronous parallel: the rule is task 2.5's, in its
    handout). k = 0 waits for every gradient: synchronous PS exactly.

    ``order="arrival"`` serves gradients as MPI delivers them (not reproducible); ``"seeded"`` serves
    the workers in an order drawn from (seed, step): the asynchrony a test can replay. The server
    trains on its own rows too (its gradient is never stale) and clips every update by
    ``max_norm``. Per step each worker pushes Ψ and pulls Ψ: the server's link carries 2(N-1)·Ψ,
    as the synchronous server's does. A worker that died ends the server's wait with the
    watchdog's error naming it, within the deadline.
    """

    def __init__(self, module, optimizer=None, server=0, group=None, max_staleness=None, order="arrival", seed=0):
        if order not in ("arrival", "seeded"):
            raise ValueError(f"order must be 'arrival' or 'seeded', got {order!r}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be 0 or more (or None: unbounded), got {max_staleness}")
        Wrapper.__init__(self, module)  # (not the synchronous server's: it needs no task 2.4 to start)
        self.optimizer, self.server, self.group = optimizer, server, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.params = trainable(module)
        broadcast_parameters(module, src=server, group=group)  # everyone starts from the server's parameters
        self.moved = 0  # bytes this rank sent and received for it
        self.max_staleness, self.order, self.seed = max_staleness, order, seed
        self.max_norm = None  # clip every update's gradient to this norm (set by the runner)
        self.version = 0  # updates the server has applied
        self.pulled = [0] * self.world_size  # the version each rank's parameters have (server's view)
        self.staleness: list[int] = []  # versions behind, of every gradient applied, in order
        self.steps = 0

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Remember ``max_norm`` for the server's updates; returns this rank's own gradient norm."""
        self.max_norm = max_norm
        return float(xp.sqrt(sum(float((grad_or_zeros(p).astype(xp.float64) ** 2).sum()) for p in self.params)))

    def step(self) -> None:
        self.steps += 1
        count_bytes(self, self._push_and_pull if self.rank != self.server else self._serve, "send", "recv")

    def _push_and_pull(self) -> None:
        """A worker: push my gradient, wait for the parameters the server sends back (mine applied)."""
        dist.send(flat_grads(self.params), self.server, group=self.group, tag=_ASYNC_PUSH)
        recv_into([p.data for p in self.params], self.server, group=self.group, tag=_ASYNC_PULL)

    def _serve(self) -> None:
        """The server: one gradient from every rank this step, each applied as soon as allowed."""
        own = flat_grads(self.params)
        self.pulled[self.server] = self.version  # my gradient is of the current parameters
        incoming = {w: xp.empty_like(own) for w in self.workers}
        handles = {w: dist.irecv(buf, w, group=self.group, tag=_ASYNC_PUSH) for w, buf in incoming.items()}
        arrived, replies = {self.server: own}, []
        self._apply_checked(arrived, replies)
        for w in self._arrivals(handles):
            arrived[w] = incoming[w]
            self._apply_checked(arrived, replies)
        if arrived:
            raise RuntimeError(
                f"asynchronous server: the step ended with the gradients of ranks {sorted(arrived)} never applied "
                f"(max_staleness={self.max_staleness}): once every gradient has arrived, no bound holds one back"
            )
        with trace.span("wait_replies", cat="idle"):
            for h in replies:
                h.wait()

    def _apply_checked(self, arrived: dict, replies: list) -> None:
        """``_apply_if_allowed``, then a check of what it did, so that a wrong count of replies fails
        here and now, naming it, instead of as a worker's (or the next step's) receive that times out."""
        waiting, applied, sent = sorted(arrived), len(self.staleness), len(replies)
        self._apply_if_allowed(arrived, replies)
        applied, sent = len(self.staleness) - applied, len(replies) - sent
        if applied == 0 and sent == 0 and sorted(arrived) == waiting:
            return  # held back
        workers = [r for r in waiting if r != self.server]
        problems = []
        if applied != len(waiting):
            problems.append(f"recorded the staleness of {applied} gradients for the {len(waiting)} it had")
        if sent != len(workers):
            problems.append(f"sent {sent} replies for the {len(workers)} workers {workers} whose gradients it had")
        if arrived:
            problems.append(f"left ranks {sorted(arrived)} in `arrived`, to be applied again by the next update")
        if problems:
            raise RuntimeError(
                f"asynchronous server, version {self.version}: an update of the gradients of ranks {waiting} "
                + "; ".join(problems)
                + " (each gradient is applied once, and each worker whose gradient an update applied gets one reply)"
            )

    def _arrivals(self, handles):
        """The workers, each once, in the order their gradients are served."""
        if self.order == "seeded":
            rng = numpy.random.default_rng([self.seed, self.steps])
            for w in rng.permutation(self.workers).tolist():
                handles[w].wait()
                yield w
            return
        left = dict(handles)
        while left:
            group = self.group if self.group is not None else dist.world()
            watchdog.wait_until(  # the deadline, and a dead worker named, as every wait in tinytrain
                lambda: any(h.test() for h in left.values()),
                lambda: f"recv of gradients (asynchronous parameter server) on {group.describe()}",
                lambda: [("recv from", group.world_rank(w)) for w in left],
            )
            for w in [w for w, h in left.items() if h.test()]:  # rank order among those arrived together
                del left[w]
                yield w

    def _apply_if_allowed(self, arrived: dict, replies: list) -> None:
        raise NotImplementedError("TODO 2.5: Updates come as early as the staleness bound allows and never later than it requires, each the average of what arrived; every worker whose gradient an update applied gets the new parameters.")


# ================================================================================================
# 5. Local SGD and DiLoCo: H steps alone, then average how far the replicas moved
# ================================================================================================


class LocalSGD(Wrapper):
    """Every replica takes ``local_steps`` (H) optimizer steps on its own rows without talking, then
    an outer optimizer moves the shared start by how far the replicas moved, averaged (DiLoCo's
    outer gradient: task 2.6, whose handout states the rule and asks for its sign)::

        θ (the same on every rank) ─► rank r: H inner steps ─► θ_r
        one all-reduce of Ψ per H steps, not per step ─► the outer step on θ, every rank from the new θ

    Outer SGD with lr 1 and no momentum is θ ← mean of θ_r: plain local SGD (parameter averaging);
    with H = 1 and an inner SGD it is synchronous data parallel (the update is linear in the
    gradient). DiLoCo (Douillard et al. 2023) takes an inner AdamW and an outer Nesterov momentum,
    lr 0.7, momentum 0.9: its published settings, the defaults of ``diloco()``. The inner
    optimizer's state stays each replica's own across rounds; the outer one's is the same on all.
    """

    def __init__(self, module, local_steps: int, outer_lr=1.0, outer_momentum=0.0, nesterov=False, group=None):
        if local_steps < 1:
            raise ValueError(f"local_steps must be at least 1, got {local_steps}")
        super().__init__(module)
        self.local_steps, self.group, self.optimizer = local_steps, group, None
        broadcast_parameters(module, group=group)
        self.params = trainable(module)
        self.start = Parameter(flatten([p.data for p in self.params]))  # θ of the last round, flat
        self.outer = SGD([self.start], lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
        self.inner_steps = self.moved = 0  # steps taken, bytes sent and received for the averages

    @property
    def steps(self) -> int:
        return self.inner_steps

    @classmethod
    def diloco(cls, module, local_steps: int, group=None) -> LocalSGD:
        return cls(module, local_steps, outer_lr=0.7, outer_momentum=0.9, nesterov=True, group=group)

    def step(self) -> None:
        """The inner step (the training loop's optimizer); every H-th, also the outer step."""
        self.optimizer.step()
        self.inner_steps += 1
        if self.inner_steps % self.local_steps == 0:
            count_bytes(self, self.outer_step, "all_reduce")

    def outer_step(self) -> None:
        raise NotImplementedError("TODO 2.6: The outer optimizer takes one step on the shared start from the replicas' averaged movement (DiLoCo's outer gradient), and every replica continues from the new start.")
