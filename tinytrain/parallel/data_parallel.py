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

This chapter builds four versions, in the order a framework grew them:

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
   2(N-1)/N·|W| per rank, which stays below 2|W| however many ranks join.

Frozen parameters (``requires_grad=False``) are never communicated. A tied weight (GPT's token
embedding, also its output head) is one parameter: the engine fires its hook once, after both
uses have added their gradient, so it is reduced once.

The all-reduce uses the ring algorithm by default (``algo="ring"``), whose volume per rank is the
textbook 2(N-1)/N of the buffer; ``algo=None`` lets tinytrain choose by message size.

What all four share with ZeRO (``zero.py``) is in ``wrapper.py``: the ``Wrapper`` around the model
(``ddp(x)`` runs it, ``ddp.backward(loss)`` runs backward, then the strategy's communication) and
helpers on parameter lists (``trainable``, ``grad_or_zeros``, ``flatten``, ``unflatten_into``).
"""

from __future__ import annotations

import contextlib

from tinytrain import distributed as dist
from tinytrain import trace
from tinytrain.backend import xp
from tinytrain.parallel.wrapper import (
    Wrapper,
    average_op,
    broadcast_parameters,
    flatten,
    grad_or_zeros,
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
        # BEGIN SOLUTION 2.3 "Inside the with-block backward passes only accumulate, without talking; on leaving it, even by an exception, the wrapper goes back to what it did before." full="Set self.require_sync to False for the with-block and restore the previous value afterwards (even on an exception)."
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous
        # END SOLUTION

    def after_backward(self) -> None:
        if self.require_sync:  # inside no_sync() gradients only accumulate
            self.finish_gradient_sync()


# ================================================================================================
# 1. Naive DDP: all-reduce every gradient after backward
# ================================================================================================


class NaiveDDP(_Replicated):
    """One blocking all-reduce per parameter once backward has finished: simple, no overlap."""

    def finish_gradient_sync(self) -> None:
        # BEGIN SOLUTION 2.1 "After backward, every trainable parameter's gradient becomes its average over the data-parallel ranks, a missing one counting as zeros." full="For every parameter in self.params, all_reduce its gradient in place with op='avg' (use grad_or_zeros, group=self.group, algo=self.algo)."
        for p in self.params:
            dist.all_reduce(grad_or_zeros(p), op="avg", group=self.group, algo=self.algo)
        # END SOLUTION


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
        # BEGIN SOLUTION 2.2 "Record that this parameter's gradient is complete (a second time before a sync is an error), then start every one of the buckets that is now complete, strictly in launch order, and help the async work along when asked to." full="Add id(p) to its bucket's ready set (error if it is already there), then launch every full bucket in bucket order; poll with dist.progress_all() if self.poll."
        bucket = self.bucket_of[id(p)]
        if id(p) in bucket.ready:
            raise RuntimeError(
                "a parameter's gradient became ready twice before the gradients were synchronized: "
                "call backward once per step, or wrap the extra backward passes in no_sync()"
            )
        bucket.ready.add(id(p))
        self._launch_full_buckets()
        if self.poll:
            dist.progress_all()
        # END SOLUTION

    def _launch_full_buckets(self) -> None:
        # Strictly in bucket order: every rank must start its collectives in the same order, even
        # if (say) bucket 2 filled up before bucket 1 on one rank.
        while self.next_to_launch < len(self.buckets) and self.buckets[self.next_to_launch].is_full():
            self.buckets[self.next_to_launch].launch(self.group, self.algo)
            self.next_to_launch += 1

    def finish_gradient_sync(self) -> None:
        """Launch what backward did not fill (unused parameters), then wait for every bucket."""
        # BEGIN SOLUTION 2.2 "Start whatever backward left unfilled (parameters that got no gradient), wait until all the averaging is done and the results are back in place, and be set to begin the next backward from the first one again." full="Mark every parameter of not-yet-launched buckets ready and launch them; then finish() every bucket and reset next_to_launch."
        for bucket in self.buckets[self.next_to_launch :]:
            bucket.ready.update(id(p) for p in bucket.params)
        self._launch_full_buckets()
        with trace.span("wait_gradients", cat="idle"):
            for bucket in self.buckets:
                bucket.finish()
        self.next_to_launch = 0
        # END SOLUTION

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()


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

    The server also trains on its own rows, so the result equals the serial run. Only the server
    ever creates optimizer state. Its link carries (N-1) gradients in and (N-1) copies of the
    parameters out per step: the bottleneck that all-reduce removes.
    """

    def __init__(self, module, optimizer, server: int = 0, group=None):
        super().__init__(module)
        self.optimizer, self.server, self.group = optimizer, server, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.params = trainable(module)
        self._pull()  # everyone starts from the server's parameters

    @property
    def workers(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.server]

    def step(self) -> None:
        """Push gradients, update on the server, pull parameters (replaces ``optimizer.step()``)."""
        self._push_and_update()
        self._pull()

    def _push_and_update(self) -> None:
        # BEGIN SOLUTION 2.4 "Gradients from all the others are pushed to the central process, which adds them to its own in a fixed order (not arrival order), averages, and alone updates the parameters." full="Workers send their flattened gradients to the server (tag _PUSH); the server receives one buffer per worker, adds them to its own in rank order, divides by the world size, writes them into .grad and calls optimizer.step()."
        grads = flatten([grad_or_zeros(p) for p in self.params])
        if self.rank != self.server:
            dist.send(grads, self.server, group=self.group, tag=_PUSH)
            return
        incoming = {w: xp.empty_like(grads) for w in self.workers}
        handles = [dist.irecv(buf, w, group=self.group, tag=_PUSH) for w, buf in incoming.items()]
        for h in handles:
            h.wait()
        for w in self.workers:  # rank order: the sum does not depend on arrival order
            grads += incoming[w]
        grads /= self.world_size
        unflatten_into(grads, [p.grad for p in self.params])
        self.optimizer.step()
        # END SOLUTION

    def _pull(self) -> None:
        # BEGIN SOLUTION 2.4 "The central process hands its current parameters to all the others, which overwrite theirs with them, so every copy starts the next iteration equal." full="The server sends its flattened parameters to every worker (tag _PULL); each worker receives them and copies them into its parameters."
        if self.rank == self.server:
            flat = flatten([p.data for p in self.params])
            handles = [dist.isend(flat, w, group=self.group, tag=_PULL) for w in self.workers]
            for h in handles:
                h.wait()
        else:
            flat = xp.empty(sum(p.size for p in self.params), dtype=self.params[0].dtype)
            dist.recv(flat, self.server, group=self.group, tag=_PULL)
            unflatten_into(flat, [p.data for p in self.params])
        # END SOLUTION
