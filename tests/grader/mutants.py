"""The mutation suite: realistic bugs planted one at a time into the reference solutions.

Each mutant is a bug a student could write, planted into the solved assignment (the reference's
solution regions): the four bugs the grader's tests always planted, the ones issue 14 found
passing, and at least two more per task, written from the handouts and the reference code (not
from the graded tests). Every mutant must make the grader fail *its* task, with a message that
names the cause (``cause``: words the task's output must contain) and a seed that replays it.

    python -m grader mutants            # every mutant; prints the catch rate per assignment
    python -m grader mutants --ci       # the representative subset that CI runs

To keep it quick, mutants of different tasks share one grader run (a "round": one mutant per task);
a mutant whose task then fails for another reason (a bug in a task it builds on) is graded again
on its own before it counts as missed. This file contains solution code: a student release leaves
it out (``tests/grader/`` is excluded in the rubric).
"""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from grader.config import ROOT, load_rubric
from grader.run import mpi_environment
from grader.stubs import assignment_texts

A1 = "tinytrain/distributed/algorithms.py"
A2 = "tinytrain/parallel/data_parallel.py"
A3 = "tinytrain/parallel/zero.py"
A4 = "tinytrain/parallel/tensor_parallel/"
A5 = "tinytrain/parallel/pipeline/"
A6 = "tinytrain/parallel/expert_parallel/"
A7 = "tinytrain/parallel/context_parallel/"
A8_CHECKPOINT = "tinytrain/autograd/checkpoint.py"
A8_OPTIM = "tinytrain/optim.py"
A9 = "tinytrain/parallel/federated.py"
A10 = "tinytrain/elastic.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    task: str  # the task that must fail
    file: str  # the reference file the bug is planted in
    edits: tuple[tuple[str, str], ...]  # (text of the solution, what replaces it); each occurs once
    cause: str  # words (a regular expression, case-insensitive) the task's failure must contain
    ci: bool = False  # in the subset CI runs (CI_MUTANTS)


def M(name, task, file, old, new, cause, ci=False, more=()):
    return Mutant(name, task, file, ((old, new), *more), cause, ci)


# --- assignment 1: collectives ------------------------------------------------------------------------

_RS_LOOP = """    for s in range(n - 1):
        send_i, recv_i = (r - s + shift) % n, (r - s - 1 + shift) % n
        (sa, sb), (ra, rb) = bounds[send_i], bounds[recv_i]
        if s == 0:
            outgoing = flat[sa:sb]  # the first step sends this rank's own chunk as it is
        incoming = sums[s % 2][: rb - ra]
        yield c.exchange(
            f"ring reduce-scatter step {s + 1}/{n - 1} (chunk {send_i} to rank {right}, "
            f"chunk {recv_i} from rank {left})",
            sends=[(outgoing, right)],
            recvs=[(incoming, left)],
        )
        last = s == n - 2
        combine(incoming, flat[ra:rb], op, out=out if last else incoming)
        outgoing = incoming
"""
_RS_DIRECT = """    ma, mb = bounds[(r + 1 + shift) % n]
    out[...] = flat[ma:mb]
    for s in range(1, n):  # straight to each chunk's owner: right values and bytes, but no ring
        dst, src = (r + s) % n, (r - s) % n
        sa, sb = bounds[(dst + 1 + shift) % n]
        incoming = sums[0][: mb - ma]
        yield c.exchange(f"direct step {s}", sends=[(flat[sa:sb], dst)], recvs=[(incoming, src)])
        combine(out, incoming, op)
"""
_A2A_LOOP = """    for s in range(1, n):
        dst, src = (r + s) % n, (r - s) % n
        (sa, sb), (ra, rb) = send_bounds[dst], recv_bounds[src]
        yield c.exchange(
            f"pairwise step {s}/{n - 1} (to rank {dst}, from rank {src})",
            sends=[(flat[sa:sb], dst)],
            recvs=[(out[ra:rb], src)],
        )
"""
_A2A_AT_ONCE = """    sends, recvs = [], []
    for s in range(1, n):
        dst, src = (r + s) % n, (r - s) % n
        (sa, sb), (ra, rb) = send_bounds[dst], recv_bounds[src]
        sends.append((flat[sa:sb], dst))
        recvs.append((out[ra:rb], src))
    yield c.exchange("everything at once", sends=sends, recvs=recvs)
"""
_BCAST_SEND = "            sends=[(flat, absolute(k)) for k in reversed(kids)],\n        )\n"

MUTANTS = [
    # 1.1 ring reduce-scatter
    M(
        "off_by_one_chunk_in_reduce_scatter",
        "1.1",
        A1,
        "send_i, recv_i = (r - s + shift) % n, (r - s - 1 + shift) % n",
        "send_i, recv_i = (r - s + 1 + shift) % n, (r - s - 1 + shift) % n",
        "of the reduce-scatter differs at index",
    ),
    M(
        "reduction_forgets_one_rank",
        "1.1",
        A1,
        "    for s in range(n - 1):\n        send_i, recv_i = (r - s + shift)",
        "    for s in range(n - 2):\n        send_i, recv_i = (r - s + shift)",
        "differs at index",
    ),
    M(
        "send_send_deadlock_at_large_sizes",
        "1.1",
        A1,
        "            sends=[(outgoing, right)],\n            recvs=[(incoming, left)],\n        )",
        "            sends=[(outgoing, right)],\n        )\n"
        "        yield c.exchange('receive', recvs=[(incoming, left)])",
        "CommTimeout.*timed out|a ring takes n-1",
    ),
    M(
        "overwrites_instead_of_adding",
        "1.1",
        A1,
        "        combine(incoming, flat[ra:rb], op, out=out if last else incoming)\n",
        "        if last:\n            out[...] = incoming\n",
        "differs at index",
    ),
    M(
        "direct_exchange_with_owners",
        "1.1",
        A1,
        _RS_LOOP,
        _RS_DIRECT,
        "in a ring every step sends one chunk to the right neighbour",
    ),
    # 1.2 ring all-gather
    M(
        "all_gather_one_step_short",
        "1.2",
        A1,
        "    for s in range(n - 1):\n        send_i, recv_i = (r + 1 + shift - s) % n",
        "    for s in range(n - 2):\n        send_i, recv_i = (r + 1 + shift - s) % n",
        "of the all-gather differs at index",
    ),
    M(
        "all_gather_receives_into_the_chunk_it_sends",
        "1.2",
        A1,
        "send_i, recv_i = (r + 1 + shift - s) % n, (r + shift - s) % n",
        "send_i, recv_i = (r + 1 + shift - s) % n, (r + 1 + shift - s) % n",
        "of the all-gather differs at index",
    ),
    # 1.3 all-reduce
    M(
        "all_reduce_drops_the_remainder",
        "1.3",
        A1,
        "bounds = chunk_bounds(split_counts(flat.size, c.size))",
        "bounds = chunk_bounds([flat.size // c.size] * c.size)",
        "all-reduce differs at index",
    ),
    M(
        "all_reduce_gathers_with_another_layout",
        "1.3",
        A1,
        "yield from _ring_all_gather(c, flat, bounds, shift=0)",
        "yield from _ring_all_gather(c, flat, bounds, shift=-1)",
        "all-reduce differs at index",
    ),
    M(
        "all_reduce_wrong_on_one_rank_only",
        "1.3",
        A1,
        "    yield from _ring_all_gather(c, flat, bounds, shift=0)\n",
        "    yield from _ring_all_gather(c, flat, bounds, shift=0)\n"
        "    if c.rank == 1 and flat.size:\n        flat[0] += 1\n",
        "rank \\d: chunk 0 of the all-reduce differs at index 0",
    ),
    # 1.4 all-to-all
    M(
        "all_to_all_swaps_two_blocks",
        "1.4",
        A1,
        "(sa, sb), (ra, rb) = send_bounds[dst], recv_bounds[src]",
        "(sa, sb), (ra, rb) = send_bounds[src], recv_bounds[src]",
        "the block received from group rank",
    ),
    M(
        "all_to_all_in_one_step",
        "1.4",
        A1,
        _A2A_LOOP,
        _A2A_AT_ONCE,
        "a pairwise exchange takes n-1 = \\d steps",
    ),
    M(
        "all_to_all_forgets_its_own_block",
        "1.4",
        A1,
        "    out[ra:rb] = flat[sa:sb]  # my piece for myself never leaves\n",
        "",
        "the block received from group rank",
    ),
    # 1.5 broadcast
    M(
        "tree_of_log2_rounds_misses_ranks_when_n_is_not_a_power_of_two",
        "1.5",
        A1,
        "    kids = [v + d for d in (1 << j for j in range(n.bit_length())) if d < low and v + d < n]\n",
        "    kids = [v + (1 << k) for k in range(int(__import__('math').log2(n)))"
        " if v < (1 << k) and v + (1 << k) < n]\n",
        "timed out|group of world ranks \\[\\d, \\d, \\d\\]|which receives from",
    ),
    M(
        "root_sends_to_everyone",
        "1.5",
        A1,
        "        parent = v - low\n",
        "        parent = 0\n",
        "binomial-tree broadcast sends ceil\\(log2 n\\)",
        more=(
            (
                "    kids = [v + d for d in (1 << j for j in range(n.bit_length())) if d < low and v + d < n]\n",
                "    kids = list(range(1, n)) if v == 0 else []\n",
            ),
        ),
    ),
    M(
        "binary_heap_tree_as_in_the_tree_reduce",
        "1.5",
        A1,
        "        parent = v - low\n",
        "        parent = (v - 1) // 2\n",
        "binomial-tree broadcast sends ceil\\(log2 n\\)|needs \\d+ rounds",
        more=(
            (
                "    kids = [v + d for d in (1 << j for j in range(n.bit_length())) if d < low and v + d < n]\n",
                "    kids = [k for k in (2 * v + 1, 2 * v + 2) if k < n]\n",
            ),
        ),
    ),
    M(
        "broadcast_wrong_on_one_rank_only",
        "1.5",
        A1,
        _BCAST_SEND,
        _BCAST_SEND + "    if v == 1 and flat.size:\n        flat[-1] += 1\n",
        "broadcast copy differs at index",
    ),
]

# --- assignment 2: data parallel ----------------------------------------------------------------------

_AR = 'dist.all_reduce(grad_or_zeros(p), op="avg", group=self.group, algo=self.algo)'
MUTANTS += [
    M("ddp_sums_instead_of_averaging", "2.1", A2, _AR, _AR.replace('"avg"', '"sum"'), "x4 .*summed"),
    M(
        "ddp_divides_by_n_minus_1",
        "2.1",
        A2,
        _AR,
        _AR.replace('"avg"', '"sum"') + "\n            p.grad /= dist.get_world_size(self.group) - 1",
        "x4/3",
    ),
    M(
        "ddp_skips_missing_gradients",
        "2.1",
        A2,
        "        for p in self.params:\n            dist.all_reduce",
        "        for p in [q for q in self.params if q.grad is not None]:\n            dist.all_reduce",
        "no gradient on rank 3|all_reduce",
    ),
    M(
        "bucketed_ignores_poll",
        "2.2",
        A2,
        "        if self.poll:\n            dist.progress_all()\n",
        "",
        "progress_all",
    ),
    M(
        "bucketed_no_duplicate_ready_check",
        "2.2",
        A2,
        "        if id(p) in bucket.ready:\n            raise RuntimeError(",
        "        if False:\n            raise RuntimeError(",
        "must raise",
    ),
    M(
        "bucketed_waits_for_each_all_reduce_in_the_hook",
        "2.2",
        A2,
        "        bucket.ready.add(id(p))\n        self._launch_full_buckets()\n",
        "        bucket.ready.add(id(p))\n        self._launch_full_buckets()\n"
        "        for b in self.buckets[: self.next_to_launch]:\n            b.work.wait()\n",
        "waited for while backward",
    ),
    M(
        "bucketed_launches_only_at_the_end",
        "2.2",
        A2,
        "        bucket.ready.add(id(p))\n        self._launch_full_buckets()\n",
        "        bucket.ready.add(id(p))\n",
        "launched during backward",
    ),
    M(
        "no_sync_resets_to_true",
        "2.3",
        A2,
        "            self.require_sync = previous",
        "            self.require_sync = True",
        "nested",
    ),
    M(
        "no_sync_without_finally",
        "2.3",
        A2,
        "        try:\n            yield\n        finally:\n            self.require_sync = previous",
        "        yield\n        self.require_sync = previous",
        "exception",
    ),
    M(
        "server_forgets_its_own_gradient",
        "2.4",
        A2,
        "        for work in incoming:  # rank order",
        "        grads[...] = 0\n        for work in incoming:  # rank order",
        "server.*off from the serial run",
    ),
    M(
        "server_pulls_its_gradients_instead_of_its_parameters",
        "2.4",
        A2,
        "        flat = flatten([p.data for p in self.params])\n        handles",
        "        flat = flatten([p.grad for p in self.params])\n        handles",
        "'NoneType' object has no attribute|\\[rank [123]\\] after step 1, parameter .* differs from rank 0's",
    ),
    M(
        "server_averages_over_the_workers_only",
        "2.4",
        A2,
        "        grads /= self.world_size\n",
        "        grads /= self.world_size - 1\n",
        "x4/3",
    ),
    M(
        "async_ignores_the_staleness_bound",
        "2.5",
        A2,
        "        if k is not None and any(self.version + 1 - self.pulled[w] > k for w in others):",
        "        if False:",
        "bound 0|max-staleness",
    ),
    M(
        "async_counts_staleness_after_the_update",
        "2.5",
        A2,
        "        self.staleness += [self.version - self.pulled[r] for r in ranks]\n        self.version += 1\n",
        "        self.version += 1\n        self.staleness += [self.version - self.pulled[r] for r in ranks]\n",
        "staleness",
    ),
    M(
        "async_sums_without_averaging",
        "2.5",
        A2,
        "        total /= len(ranks)\n",
        "",
        "bound 0: the synchronized gradient .*x4",
    ),
    M(
        "async_reapplies_old_gradients",
        "2.5",
        A2,
        "        arrived.clear()\n",
        "",
        "applied again|replies",
    ),
    M(
        "outer_step_sums_the_deltas",
        "2.6",
        A2,
        'dist.all_reduce(delta, op="avg"',
        'dist.all_reduce(delta, op="sum"',
        "first outer step's change .*x4",
    ),
    M(
        "outer_step_with_the_delta_reversed",
        "2.6",
        A2,
        "        delta = self.start.data - flatten([p.data for p in self.params])\n",
        "        delta = flatten([p.data for p in self.params]) - self.start.data\n",
        "opposite sign",
    ),
    M(  # a replica averages only what it trained: rank 3's aux is left out of its buffer
        "local_sgd_averages_only_the_parameters_with_a_gradient",
        "2.6",
        A2,
        "        delta = self.start.data - flatten([p.data for p in self.params])\n",
        "        delta = self.start.data[: sum(p.size for p in self.params if p.grad is not None)] - flatten(\n"
        "            [p.data for p in self.params if p.grad is not None]\n        )\n",
        "rank 3|no gradient|mismatch|shape|size|off from the serial",
    ),
    M(
        "outer_step_leaves_the_replicas_where_they_are",
        "2.6",
        A2,
        "        unflatten_into(self.start.data, [p.data for p in self.params])\n",
        "",
        "H = 1|outer step",
    ),
]

# --- assignment 3: ZeRO -------------------------------------------------------------------------------

MUTANTS += [
    M(
        "zero_reduce_scatter_sums",
        "3.1",
        A3,
        'return dist.reduce_scatter(flat, op="avg"',
        'return dist.reduce_scatter(flat, op="sum"',
        "x4",
    ),
    M(
        "zero_assumes_every_parameter_has_a_gradient",
        "3.1",
        A3,
        "            if s.p.grad is None:\n                s.p.grad = xp.zeros_like(s.p.data)\n"
        "            s.grad = self._reduce_scatter",
        "            s.grad = self._reduce_scatter",
        "no gradient on rank 3|NoneType|reduce_scatter",
    ),
    M(
        "zero_forgets_the_all_gather",
        "3.1",
        A3,
        "            dist.all_gather(s.my_piece(s.p.data), group=self.group, sizes=s.sizes, out=s.p.data.reshape(-1))",
        "            pass",
        "off from the serial run",
    ),
    M(
        "zero_recreates_optimizer_state_every_step",
        "3.1",
        A3,
        "            if s.state is None:\n                s.state = self.optimizer.init_state(piece)",
        "            s.state = self.optimizer.init_state(piece)",
        "off from the serial run",
    ),
    M(
        "zero2_keeps_the_full_gradient",
        "3.2",
        A3,
        "            s.p.grad = None  # the collective copied it: the full gradient is not kept\n",
        "",
        "full gradient",
    ),
    M(
        "zero2_waits_for_each_reduce_scatter",
        "3.2",
        A3,
        "            self.pending.append((s, self._reduce_scatter(s, async_op=True)))\n            s.p.grad = None",
        "            self.pending.append((s, self._reduce_scatter(s, async_op=True)))\n"
        "            self.pending[-1][1].wait()\n            s.p.grad = None",
        "overlap|async|during backward",
    ),
    M(  # the order each rank's own backward completes them in: a parameter one rank never used shifts
        # every later reduce-scatter there (issue 38: no ZeRO test had a parameter without a gradient)
        "zero2_starts_each_reduce_scatter_in_its_own_backwards_order",
        "3.2",
        A3,
        "        while self.next_to_launch < len(order) and id(order[self.next_to_launch].p) in self.ready:\n"
        "            s = order[self.next_to_launch]\n",
        "        for s in [self.shard_of[id(p)]]:\n",
        "rank 3|no gradient|off from the serial|mismatch|called",
    ),
    M(  # a pipeline stage's second micro-batch completes every gradient again before the sync
        "zero2_a_second_backward_starts_no_turns",
        "3.2",
        A3,
        "        if id(p) in self.ready:\n            self._close_turns()\n",
        "",
        "micro-batch|off from the serial",
    ),
    M(  # the sync waits only for what backward started: a parameter unused on one rank is never reduced there
        "zero2_sync_forgets_the_parameters_backward_never_completed",
        "3.2",
        A3,
        "            if id(s.p) not in self.ready:\n                self._complete(s.p)\n",
        "            pass\n",
        "rank 3|no gradient|off from the serial|mismatch|called|timed out",
    ),
    M(
        "zero3_never_uncounts_gathered_bytes",
        "3.3",
        A3,
        "                self.gathered_bytes -= s.p.data.nbytes\n",
        "",
        "gathered|one layer",
    ),
    M(
        "zero3_keeps_gathered_parameters",
        "3.3",
        A3,
        "                s.p.data = _EMPTY",
        "                pass",
        "full parameters|\\(params, grads, optimizer\\)",
    ),
]

# --- assignment 4: tensor and sequence parallel --------------------------------------------------------

_TP = A4 + "mappings.py"
_TPL = A4 + "layers.py"
MUTANTS += [
    M(
        "copy_to_region_backward_does_not_sum",
        "4.1",
        _TP,
        "        return all_reduce_copy(grad, ctx.group), None\n",
        "        return grad, None\n",
        "CopyToRegion",
    ),
    M(
        "gather_from_region_backward_keeps_everything",
        "4.1",
        _TP,
        "        return my_piece(grad, -1, ctx.group), None\n",
        "        return grad, None\n",
        "GatherFromRegion",
    ),
    M(
        "gather_from_region_backward_reduce_scatters",  # "the transpose of all-gather", /t to fix the values
        "4.1",
        _TP,
        "        return my_piece(grad, -1, ctx.group), None\n",
        "        return reduce_scatter_along(grad, -1, ctx.group) / dist.get_world_size(ctx.group), None\n",
        "GatherFromRegion backward sent \\d+ bytes",
    ),
    M(
        "row_parallel_adds_the_bias_on_every_rank",
        "4.2",
        _TPL,
        "        y = self.leave(F.linear(x, self.weight))\n        return y if self.bias is None else y + self.bias",
        "        return self.leave(F.linear(x, self.weight, self.bias))",
        "row|bias",
    ),
    M(
        "column_parallel_skips_enter",
        "4.2",
        _TPL,
        "y = F.linear(self.enter(x), self.weight, self.bias)",
        "y = F.linear(x, self.weight, self.bias)",
        "column|input gradient",
    ),
    M(
        "parallel_attention_forgets_dropout",
        "4.3",
        _TPL,
        "        return self.dropout(self.proj(y), self.p, self.training)\n",
        "        return self.proj(y)\n",
        "attention|dropout|output",
        ci=True,
    ),
    M(
        "attention_enters_once_per_projection",
        "4.3",
        _TPL,
        "self.split_heads(F.linear(x, lin.weight, lin.bias))",
        "self.split_heads(lin(x))",
        "input gradient, .*\\d+ heads",
    ),
    # The bugs below show only in a fixed case of the graded tests, not in every draw.
    M(
        "copy_to_region_copies_in_the_gradients_layout",  # np.copy keeps a transposed gradient's strides
        "4.1",
        _TP,
        "        return all_reduce_copy(grad, ctx.group), None\n",
        '        return dist.all_reduce(xp.copy(grad), group=ctx.group, algo="ring"), None\n',
        "contiguous",
    ),
    M(
        "attention_merges_heads_without_transposing",  # (B, h, T, D) -> (B, T, C) is a plain reshape for h = 1
        "4.3",
        _TPL,
        "        y = y.transpose(1, 2).reshape(B, T, H * D)",
        "        y = y.reshape(B, T, H * D)",
        "output, .*2 heads per rank",
    ),
    M(
        "attention_splits_heads_without_transposing",  # (B, T, C) -> (B, h, T, D) is a plain reshape for h = 1
        "4.3",
        _TPL,
        "self.split_heads(F.linear(x, lin.weight, lin.bias))",
        "F.linear(x, lin.weight, lin.bias).reshape(x.shape[0], self.n_head, x.shape[1], -1)",
        "output, .*2 heads per rank",
    ),
    M(
        "cross_entropy_target_logit_summed_over_the_world",  # right when the TP group is the world
        "4.4",
        A4 + "cross_entropy.py",
        'target_logit = dist.all_reduce(picked, group=group, algo="ring")',
        'target_logit = dist.all_reduce(picked, algo="ring")',
        "loss, mesh-2x2",
    ),
    M(
        "cross_entropy_backward_onehot_where_not_owned",  # the serial gradient, on every rank's columns
        "4.4",
        A4 + "cross_entropy.py",
        "ops.nll_grad(probs, local, mine, valid * (grad / ctx.denom))",
        "ops.nll_grad(probs, local, valid, valid * (grad / ctx.denom))",
        "grad|logits|loss",
    ),
    M(
        "vocab_embedding_does_not_mask",
        "4.4",
        _TPL,
        "        local = local * Tensor(mine[..., None].astype(local.dtype))\n",
        "",
        "embedding|lookup",
    ),
    M(
        "cross_entropy_without_the_global_max",
        "4.4",
        A4 + "cross_entropy.py",
        '        dist.all_reduce(row_max, op="max", group=group, algo="ring")\n',
        "",
        "cross|loss|logits",
    ),
    M(
        "cross_entropy_without_the_max_shift",  # log Σ exp(z) - z_target: right on small logits
        "4.4",
        A4 + "cross_entropy.py",
        "        probs = xp.exp(flat - row_max[:, None])\n",
        "        probs = xp.exp(flat)\n",
        "not finite on large logits",
        more=(("(xp.log(total) + row_max - target_logit)", "(xp.log(total) - target_logit)"),),
    ),
    M(
        "sequence_parallel_dropout_not_sharded",
        "4.5",
        _TPL,
        "seq_shard = (dist.get_rank(self.group), dist.get_world_size(self.group))\n",
        "seq_shard = None\n",
        "dropout|sequence",
    ),
    M(
        "dropout_by_hand_without_the_replicas_rows",  # the site's mask and SP's positions, but of my rows only
        "4.5",
        _TPL,
        "        return F.dropout(x, p, training, site=self.dropout_site, seq_shard=seq_shard)\n",
        "        if not training or p == 0.0:\n"
        "            return x\n"
        "        from tinytrain import random as _random\n"
        "        from tinytrain.autograd import ops\n"
        "        full, index = list(x.shape), [slice(None)] * x.ndim\n"
        "        if seq_shard is not None:  # the whole sequence's mask, my positions of it\n"
        "            r, n = seq_shard\n"
        "            full[1], index[1] = x.shape[1] * n, slice(r * x.shape[1], (r + 1) * x.shape[1])\n"
        "        generator = _random.dropout_generator(self.dropout_site)\n"
        "        return ops.Dropout.apply(x, p, generator, full_shape=tuple(full), index=tuple(index))\n",
        "DP replica 1 of 2 .*dropout masks must be those rows",
    ),
    M(
        "sequence_gather_backward_does_not_sum",
        "4.5",
        _TP,
        "        return reduce_scatter_along(grad, 1, ctx.group), None\n",
        "        return my_piece(grad, 1, ctx.group), None\n",
        "gradient of|reduce_scatter",
    ),
]

# --- assignment 5: pipeline ---------------------------------------------------------------------------

_PM = A5 + "messages.py"
_PS = A5 + "schedules.py"
_PE = A5 + "executor.py"
MUTANTS += [
    M(
        "received_activation_without_grad",
        "5.1",
        _PM,
        "    return Tensor(buffer, requires_grad=True)",
        "    return Tensor(buffer)",
        "grad",
    ),
    M(
        "received_buffer_reused_across_microbatches",
        "5.1",
        _PM,
        "    buffer = xp.empty(shape, dtype=dtype)\n",
        "    buffer = globals().setdefault('_reused', {})"
        ".setdefault((tuple(shape), str(dtype)), xp.empty(shape, dtype=dtype))\n",
        "micro-batch|buffer|off|differ",
    ),
    M(
        "gpipe_runs_one_microbatch_at_a_time",
        "5.2",
        _PS,
        '[Action("F", i) for i in range(microbatches)] + [Action("B", i) for i in range(microbatches)]',
        '[a for i in range(microbatches) for a in (Action("F", i), Action("B", i))]',
        "GPipe|schedule",
    ),
    M(
        "gpipe_forgets_the_last_backward",
        "5.2",
        _PS,
        '[Action("B", i) for i in range(microbatches)]',
        '[Action("B", i) for i in range(microbatches - 1)]',
        "GPipe|schedule|backward",
    ),
    M(
        "one_f_one_b_warmup_off_by_one",
        "5.3",
        _PS,
        "        warmup = min(stages - 1 - s, microbatches)",
        "        warmup = min(stages - s, microbatches)",
        "1F1B|warm",
    ),
    M(
        "one_f_one_b_backward_before_forward",
        "5.3",
        _PS,
        '            actions += [Action("F", warmup + i), Action("B", i)]',
        '            actions += [Action("B", i), Action("F", warmup + i)]',
        "1F1B|schedule|before",
    ),
    M(
        "interleaved_warmup_too_short",
        "5.4",
        _PS,
        "(stages - 1 - s) * 2 + (chunks - 1) * stages",
        "(stages - 1 - s) + (chunks - 1) * stages",
        "interleaved|warm|peak",
    ),
    M(
        "interleaved_backward_keeps_the_chunk_order",
        "5.4",
        _PS,
        'chunk if kind == "F" else chunks - 1 - chunk',
        "chunk",
        "interleaved|chunk",
    ),
    M(
        "interleaved_group_in_reverse_microbatch_order",
        "5.4",
        _PS,
        "microbatch = (k // group) * stages + k % stages",
        "microbatch = (k // group) * stages + (stages - 1 - k % stages)",
        "interleaved|micro-batch|order",
    ),
    M(
        "interleaved_backward_pairs_with_the_wrong_pass",
        "5.4",
        _PS,
        '            actions += [nth(warmup + k, "F"), nth(k, "B")]',
        '            actions += [nth(warmup + k, "F"), nth(k + (k % 2 if k + 1 < total - warmup else 0), "B")]',
        "interleaved|micro-batch|order|deadlock",
    ),
    M(
        "zb_h1_final_weight_passes_reversed",
        "5.6",
        _PS,
        'split += [Action("W", j) for j in range(max(0, microbatches - s), microbatches)]',
        'split += [Action("W", j) for j in reversed(range(max(0, microbatches - s), microbatches))]',
        "zb_h1|micro-batch|order",
    ),
    M(
        "split_b_runs_the_whole_backward",
        "5.5",
        _PE,
        "self.weight_work[(mb, chunk)] = backward_inputs(out, [leaf] if leaf is not None else [], grad)",
        "out.backward(grad)\n                self.weight_work[(mb, chunk)] = lambda: None",
        "first W|weight gradients to W",
    ),
    M(
        "split_w_never_runs_its_work",
        "5.5",
        _PE,
        "            self.weight_work.pop((mb, chunk))()",
        "            self.weight_work.pop((mb, chunk))",
        "no gradient|every W",
    ),
    M(
        "split_work_keyed_by_microbatch_only",
        "5.5",
        _PE,
        "self.weight_work[(mb, chunk)] = backward_inputs(",
        "self.weight_work[mb] = backward_inputs(",
        "found no work|chunk|gradient of",
        more=(("            self.weight_work.pop((mb, chunk))()", "            self.weight_work.pop(mb)()"),),
    ),
    M(
        "split_first_stage_b_runs_the_whole_backward",
        "5.5",
        _PE,
        "backward_inputs(out, [leaf] if leaf is not None else [], grad)",
        "(backward_inputs(out, [leaf], grad) if leaf is not None else (out.backward(grad) or (lambda: None)))",
        "first W|weight gradients to W",
    ),
    M(
        "zb_h1_runs_w_right_after_b",
        "5.6",
        _PS,
        'if a.kind == "B" and a.microbatch >= s:\n                split.append(Action("W", a.microbatch - s))',
        'if a.kind == "B":\n                split.append(Action("W", a.microbatch))',
        "bubble|hold|zero-bubble",
        more=(("range(max(0, microbatches - s), microbatches)", "range(0)"),),
    ),
    M(
        "zb_h1_forgets_the_last_weight_pass",
        "5.6",
        _PS,
        "range(max(0, microbatches - s), microbatches)",
        "range(max(0, microbatches - s), microbatches - 1)",
        "split|W",
    ),
]

# --- assignment 6: expert parallel --------------------------------------------------------------------

_ER = A6 + "routing.py"
_ED = A6 + "dispatch.py"
MUTANTS += [
    M(
        "aux_loss_from_local_counts",
        "6.1",
        _ER,
        "*batch_totals(moe, gathered),",
        "batch_totals(moe, gathered)[0], tokens.shape[0],",
        "aux|load",
    ),
    M(
        "aux_loss_unscaled",
        "6.1",
        _ER,
        "scale=float(gathered.shape[0])",
        "scale=1.0",
        "aux|load|router",
    ),
    M(
        "gate_ignores_the_routing_bias",
        "6.1",
        _ER,
        "experts = top_k(moe.selection_scores(to_host(probs.data)), k)",
        "experts = top_k(to_host(probs.data), k)",
        "routing bias",
    ),
    M(
        "bias_moves_with_the_load",
        "6.5",
        _ER,
        "numpy.sign(load.mean() - load)",
        "numpy.sign(load - load.mean())",
        "route_bias|mean",
    ),
    M(
        "bias_steps_by_the_load_gap",  # proportional, not DeepSeek-V3's fixed-size sign step
        "6.5",
        _ER,
        "numpy.sign(load.mean() - load)",
        "(load.mean() - load)",
        "route_bias|rate",
    ),
    M("capacity_admits_one_too_many", "6.2", _ER, "< capacity", "<= capacity", "drop|capacity|kept"),
    M(
        "capacity_ignores_lower_ranks",
        "6.2",
        _ER,
        " + counts[:me].sum(axis=0)",
        "",
        "drop|capacity|kept",
    ),
    M(
        "all_to_all_backward_sizes_not_swapped",
        "6.3",
        _ED,
        "dist.all_to_all(xp.ascontiguousarray(grad), recv_sizes, send_sizes, group=ctx.group)",
        "dist.all_to_all(xp.ascontiguousarray(grad), send_sizes, recv_sizes, group=ctx.group)",
        "size",
    ),
    M(
        "dispatch_without_regrouping_by_expert",
        "6.3",
        _ED,
        "    out = moe.run_experts(got[xp.asarray(perm)], arriving.sum(axis=0), owned(r, moe.n_experts, P))\n"
        "    back = out[xp.asarray(inverse(perm))]",
        "    out = moe.run_experts(got, arriving.sum(axis=0), owned(r, moe.n_experts, P))\n    back = out",
        "expert",
    ),
    # The bugs below show only in a fixed case of the graded tests, not in every draw (issue: "tests
    # catch what a careless student gets wrong").
    M(
        "aux_counts_only_first_choices",  # Switch's f_e (top-1) under top-2: right for k = 1 only
        "6.1",
        _ER,
        "*batch_totals(moe, gathered),",
        "gathered[:, 0, :E].sum(axis=0), batch_totals(moe, gathered)[1],  # the tokens sent to each expert\n",
        "aux loss",
    ),
    M(
        "gate_gathers_counts_over_ep_only",  # right when the EP group is the whole data group
        "6.1",
        _ER,
        "gathered = gather_over(mine, ep_group, dp_group)",
        "gathered = gather_over(mine, ep_group)",
        "gathered has shape .*dp 2 × ep 2 mesh",
    ),
    M(
        "all_to_all_of_a_strided_view",  # right for the contiguous rows dropless builds
        "6.3",
        _ED,
        "return dist.all_to_all(xp.ascontiguousarray(x), send_sizes, recv_sizes, group=group)",
        "return dist.all_to_all(x, send_sizes, recv_sizes, group=group)",
        "contiguous",
    ),
    M(
        "dropless_skips_a_rank_with_nothing_to_send",  # but its experts may still receive rows
        "6.3",
        _ED,
        "    mine = numpy.ascontiguousarray(counts.reshape(P, per).astype(numpy.int64))\n",
        "    if rows.shape[0] == 0:  # all my assignments dropped: nothing to dispatch\n"
        "        return rows, [0] * P, [0] * P\n"
        "    mine = numpy.ascontiguousarray(counts.reshape(P, per).astype(numpy.int64))\n",
        "(split sizes|bytes by all-to-all).*empty-pieces",  # rank 2's split sizes, or the bytes where they match
    ),
    M(
        "dropless_counts_exchange_over_the_world",  # right when the EP group is the world
        "6.3",
        _ED,
        "arriving = dist.all_to_all(mine, group=group)",
        "arriving = dist.all_to_all(mine)",
        "all_to_all: \\d+ rows do not split evenly",
    ),
    M(
        "missing_expert_gradient_becomes_zeros",  # an expert no token reached gets a zero gradient
        "6.4",
        A6 + "model.py",
        "        if experts:\n            flat = flatten(experts)\n",
        "        if experts:\n"
        "            for p in experts:  # no token reached it here: its gradient is zero\n"
        "                if p.grad is None:\n"
        "                    p.grad = xp.zeros_like(p.data)\n"
        "            flat = flatten(experts)\n",
        "must stay None",
    ),
    M(
        "expert_gradients_not_divided_by_ep",
        "6.4",
        A6 + "model.py",
        "unflatten(flat, experts, scale=1.0 / self.size)",
        "unflatten(flat, experts)",
        "expert",
    ),
    M(
        "dense_gradients_not_averaged_over_dp",
        "6.4",
        A6 + "model.py",
        "            if self.dp_group is not None:\n"
        '                dist.all_reduce(flat, op="avg", group=self.dp_group)\n'
        "            unflatten(flat, dense_params)",
        "            unflatten(flat, dense_params)",
        "dense|wte",
    ),
]

# --- assignment 7: context parallel -------------------------------------------------------------------

_CM = A7 + "merge.py"
_CR = A7 + "ring.py"
MUTANTS += [
    M(
        "lse_without_the_max",
        "7.1",
        _CM,
        "    lse = (m + xp.log(total))[..., 0]",
        "    lse = xp.log(total)[..., 0]",
        "lse|log-sum-exp",
    ),
    M(
        "merge_averages_instead_of_weighting",
        "7.1",
        _CM,
        "    out = xp.exp(lse_a - lse)[..., None] * out_a + xp.exp(lse_b - lse)[..., None] * out_b",
        "    out = 0.5 * (out_a + out_b)",
        "merge",
    ),
    M(
        "ring_computes_before_sending",
        "7.2",
        _CR,
        "            incoming, works = pass_on(kv, group, TAG_KV)  # posted first: it travels while I compute\n"
        '        with compute_span(step, src, "forward"):',
        '            pass\n        with compute_span(step, src, "forward"):',
        "posted the K/V sends",
        more=(
            (
                "        if step < n - 1:\n            wait_all(works)\n            kv = incoming\n    # every query",
                "        if step < n - 1:\n            incoming, works = pass_on(kv, group, TAG_KV)\n"
                "            wait_all(works)\n            kv = incoming\n    # every query",
            ),
        ),
    ),
    M(
        "ring_waits_right_after_posting",  # right values, bytes and post-before-compute, but no overlap
        "7.2",
        _CR,
        "            incoming, works = pass_on(kv, group, TAG_KV)  # posted first: it travels while I compute\n",
        "            incoming, works = pass_on(kv, group, TAG_KV)\n            wait_all(works)\n",
        "waited for the K/V",
    ),
    M(
        "ring_labels_blocks_in_the_wrong_direction",
        "7.2",
        _CR,
        "        src = (r - step) % n  # whose K/V I hold now\n",
        "        src = (r + step) % n  # whose K/V I hold now\n",
        "output|attention",
    ),
    M("dkv_accumulator_dropped", "7.3", _CR, "            part += dkv\n", "", "dk|dv"),
    M("block_gradients_without_delta", "7.3", _CM, "    ds -= delta[..., None]\n", "", "dq|dk|dv"),
    # The bugs below show only in a fixed case of the graded tests, not in every draw.
    M(
        "block_attention_without_the_max_shift",  # exact on small scores; overflows on scores of 1e4
        "7.1",
        _CM,
        "    m = xp.max(s, axis=-1, keepdims=True)\n    p = xp.exp(s - m)\n",
        "    m = 0.0  # softmax(s) = exp(s) / sum exp(s)\n    p = xp.exp(s - m)\n",
        "not finite on scores of magnitude 1e4",
    ),
    M(
        "merge_without_the_max_shift",  # log(e^a + e^b) as written: exact on small scores
        "7.1",
        _CM,
        "    lse = m + xp.log(xp.exp(lse_a - m) + xp.exp(lse_b - m))\n",
        "    lse = xp.log(xp.exp(lse_a) + xp.exp(lse_b))\n",
        "not finite on scores of magnitude 1e4",
    ),
    M(
        "ring_masks_every_block_of_the_first_step",  # the diagonal is src == r only under the contiguous split
        "7.2",
        _CR,
        "o, lse = block_attention(qs[i], ks[j], vs[j], scale, diagonal)",
        "o, lse = block_attention(qs[i], ks[j], vs[j], scale, src == r)",
        "output at my positions .*zigzag split",
    ),
    M(
        "ring_index_by_bit_mask",  # (r - step) & (n - 1) is (r - step) % n only when n is a power of two
        "7.2",
        _CR,
        "        src = (r - step) % n  # whose K/V I hold now\n",
        "        src = (r - step) & (n - 1)  # whose K/V I hold now\n",
        "output at my positions .*over 3 ranks",
    ),
    M(
        "ring_backward_adds_key_gradients_to_the_query_chunk",  # i for j: one chunk each under contiguous
        "7.3",
        _CR,
        "                dks[j] += dkj\n                dvs[j] += dvj\n",
        "                dks[i] += dkj\n                dvs[i] += dvj\n",
        "d[kv] at my positions .*zigzag split",
    ),
    M(
        "dkv_accumulator_waited_for_at_once",  # right values and bytes, but no overlap
        "7.3",
        _CR,
        "        dkv, dkv_works = pass_on(part, group, TAG_DKV)  # travels during the next step's compute\n",
        "        dkv, dkv_works = pass_on(part, group, TAG_DKV)\n        wait_all(dkv_works)  # arrived: pass it on\n",
        "waited for the dK/dV accumulator it passed on at step 0",
    ),
    M(
        "ring_backward_computes_before_sending",
        "7.3",
        _CR,
        "        if step < n - 1:\n            incoming, works = pass_on(kv, group, TAG_KV)\n        part = ",
        "        part = ",
        "backward: rank \\d+ posted the K/V sends",
        more=(
            (
                "        if step > 0:  # the accumulator of src's block",
                "        if step < n - 1:\n            incoming, works = pass_on(kv, group, TAG_KV)\n"
                "        if step > 0:  # the accumulator of src's block",
            ),
        ),
    ),
    M(
        "ulysses_interleaves_the_head_groups",  # heads j·N + p instead of p·H/N + j: one head per rank hides it
        "7.5",
        A7 + "ulysses.py",
        "    return got.reshape(n, B, h, Tl, D).swapaxes(0, 1).reshape(B, n * h, Tl, D)",
        "    return got.reshape(n, B, h, Tl, D).transpose(1, 2, 0, 3, 4).reshape(B, h * n, Tl, D)",
        "output at my positions .*2 head\\(s\\) per rank",
    ),
    M(
        "contiguous_instead_of_zigzag",
        "7.4",
        A7 + "split.py",
        "    return [rank, n_chunks(n, split) - 1 - rank]",
        "    return [2 * rank, 2 * rank + 1]",
        "zigzag|chunks",
    ),
    M(
        "zigzag_late_chunk_first",  # the right chunks, the positions not sorted
        "7.4",
        A7 + "split.py",
        "    return [rank, n_chunks(n, split) - 1 - rank]",
        "    return [n_chunks(n, split) - 1 - rank, rank]",
        "sorted",
    ),
    M(
        "zigzag_mirror_off_by_one",
        "7.4",
        A7 + "split.py",
        "    return [rank, n_chunks(n, split) - 1 - rank]",
        "    return [rank, n_chunks(n, split) - 2 - rank]",
        "zigzag|chunks",
    ),
    M(
        "ulysses_forgets_to_sort_positions",
        "7.5",
        A7 + "ulysses.py",
        "    return got[..., order, :]",
        "    return got",
        "positions",
    ),
    M(
        "ulysses_back_in_the_wrong_order",
        "7.5",
        A7 + "ulysses.py",
        "y[..., gathered_positions(T, n, split), :]",
        "y",
        "positions",
    ),
    # --- assignment 8: memory ------------------------------------------------------------------------
    M(
        "recompute_draws_new_dropout_masks",  # the recompute runs under backward's random settings
        "8.1",
        A8_CHECKPOINT,
        "            with enable_grad(), _random.restored(segment.random), _random.segment():",
        "            with enable_grad(), _random.segment():",
        "dropout inside.*differs from a plain call",
    ),
    M(
        "recompute_leaves_ask_for_no_gradient",
        "8.1",
        A8_CHECKPOINT,
        "            a if inp is None else Tensor(a, requires_grad=grad and need)",
        "            a if inp is None else Tensor(a)",
        "got no gradient",
    ),
    M(
        "only_the_first_output_is_backpropagated",
        "8.1",
        A8_CHECKPOINT,
        "            if len(roots) == 1:\n                backward(*roots[0])",
        "            if roots:\n                backward(*roots[0])",
        "3 outputs, 2 used",
    ),
    M(
        "recompute_outside_the_backward_context",  # ZeRO-3's parameters would not be gathered
        "8.1",
        A8_CHECKPOINT,
        '        with segment.enter("backward"):\n            with enable_grad()',
        "        with contextlib.nullcontext():\n            with enable_grad()",
        "context\\('backward'\\)",
    ),
    M(
        "forward_records_the_segment_graph",  # freed when forward returns: only the peak shows it
        "8.1",
        A8_CHECKPOINT,
        '        with segment.enter("forward"), no_grad(), _random.segment():',
        '        with segment.enter("forward"), _random.segment():',
        "during the checkpoint's forward",
    ),
    M(
        "scale_grows_one_step_late",
        "8.2",
        A8_OPTIM,
        "        if self.clean_steps == self.growth_interval:",
        "        if self.clean_steps > self.growth_interval:",
        "the scale is",
    ),
    M(
        "overflow_keeps_counting_clean_steps",
        "8.2",
        A8_OPTIM,
        "            self.scale *= self.backoff\n            self.clean_steps = 0\n",
        "            self.scale *= self.backoff\n",
        "the scale is",
    ),
    M(
        "grads_finite_misses_nan",
        "8.2",
        A8_OPTIM,
        "            ok = ok & xp.isfinite(g).all()",
        "            ok = ok & ~xp.isinf(g).any()",
        "nan at entry",
    ),
    M(
        "grads_finite_looks_at_the_first_array_only",
        "8.2",
        A8_OPTIM,
        "            ok = ok & xp.isfinite(g).all()",
        "            ok = ok & xp.isfinite(g).all()\n            break",
        "was not found",
    ),
    M(
        "unscaled_in_16_bit",  # a gradient only the scale kept above float16's underflow flushes to 0
        "8.3",
        A8_OPTIM,
        "        g32 = grad.astype(xp.float32)  # a copy: the rule may change it\n"
        "        if self.loss_scale != 1:\n            g32 *= 1 / self.loss_scale\n",
        "        if self.loss_scale != 1:\n            grad = grad * (1 / self.loss_scale)\n"
        "        g32 = grad.astype(xp.float32)\n",
        "2\\^-26",
    ),
    M(
        "rule_on_the_16_bit_parameter",  # updates below the parameter's spacing are lost
        "8.3",
        A8_OPTIM,
        "        self.rule(master, g32, state)\n        param[...] = master",
        "        self.rule(param, g32.astype(param.dtype), state)\n        master[...] = param",
        "master|rounds",
    ),
    M(
        "moments_in_16_bit",
        "8.3",
        A8_OPTIM,
        '        return {**self.new_state(master), "master": master}',
        '        return {**self.new_state(param), "master": master}',
        "must be float32|bytes",
    ),
    # --- assignment 9: federated learning --------------------------------------------------------------
    M(
        "fedavg_unweighted_mean",  # every client counts once, whatever its samples
        "9.1",
        A9,
        "xp.asarray(u, dtype=xp.float64).reshape(-1) * n, xp.asarray([float(n)])",
        "xp.asarray(u, dtype=xp.float64).reshape(-1), xp.asarray([1.0])",
        "unweighted mean",
    ),
    M(
        "fedavg_local_denominator",  # the numerator summed over ranks, the samples this rank's own
        "9.1",
        A9,
        "    samples = float(total[-1])",
        "    samples = float(sum(counts))",
        "denominator|samples|nan",
    ),
    M(
        "fedavg_averages_of_ranks_summed",  # each rank averages its own clients, the ranks' averages summed
        "9.1",
        A9,
        "xp.asarray(u, dtype=xp.float64).reshape(-1) * n, xp.asarray([float(n)])",
        "xp.asarray(u, dtype=xp.float64).reshape(-1) * (n / max(sum(counts), 1)), "
        "xp.asarray([n / max(sum(counts), 1)])",
        "denominator|each rank",
    ),
    M(
        "fedavg_rank_without_clients_skips_the_sum",  # the others wait in the sum: a deadline, not a hang
        "9.1",
        A9,
        "    vectors = [\n        xp.concatenate(",
        "    if not updates:\n        return xp.zeros(0, dtype=xp.float64)\n    vectors = [\n        xp.concatenate(",
        "called 0 times",
    ),
    M(
        "fedavg_zero_samples_divides_by_zero",
        "9.1",
        A9,
        "    if samples <= 0:\n        return xp.zeros(total.size - 1, dtype=xp.float64)\n",
        "",
        "nan",
    ),
    M(
        "fedavg_weights_in_the_updates_dtype",  # n·Δ of a float32 update rounded to float32
        "9.1",
        A9,
        "xp.asarray(u, dtype=xp.float64).reshape(-1) * n,",
        "(xp.asarray(u).reshape(-1) * xp.asarray(n, dtype=xp.asarray(u).dtype)).astype(xp.float64),",
        "float32",
    ),
    M(
        "mask_seeded_by_the_client",  # not the pair's: the partner's mask is another stream
        "9.2",
        A9,
        "stream = mask_stream((*key, min(client, other), max(client, other)), size)",
        "stream = mask_stream((*key, client), size)",
        "other than 0|do not cancel",
    ),
    M(
        "mask_seeded_by_the_ordered_pair",  # (i, j) and (j, i) draw different streams
        "9.2",
        A9,
        "stream = mask_stream((*key, min(client, other), max(client, other)), size)",
        "stream = mask_stream((*key, client, other), size)",
        "other than 0|do not cancel",
    ),
    M(
        "both_clients_add_the_pairs_stream",
        "9.2",
        A9,
        "        if client < other:\n            mask += stream\n        else:\n            mask -= stream\n",
        "        mask += stream\n",
        "other than 0|do not cancel",
    ),
    M(
        "mask_ignores_the_round",  # the seed alone: every round the same masks
        "9.2",
        A9,
        "stream = mask_stream((*key, min(client, other), max(client, other)), size)",
        "stream = mask_stream((key[0], min(client, other), max(client, other)), size)",
        "next round",
    ),
    M(
        "mask_sign_by_place_in_the_list",  # cancels for one order of selected, not for another
        "9.2",
        A9,
        "        if client < other:\n            mask += stream",
        "        if selected.index(client) < selected.index(other):\n            mask += stream",
        "order of selected",
    ),
    M(
        "mask_of_32_bits",  # a stream of small numbers: the update shows through
        "9.2",
        A9,
        "stream = mask_stream((*key, min(client, other), max(client, other)), size)",
        "stream = mask_stream((*key, min(client, other), max(client, other)), size) >> xp.uint64(40)",
        "correlation",
    ),
    M(
        "clip_always_scales",  # to the bound: a short update is lengthened, a zero one is nan
        "9.3",
        A9,
        "    if norm > max_norm:\n        d *= max_norm / norm\n",
        "    d *= max_norm / norm\n",
        "unchanged|nan",
    ),
    M(
        "clip_returns_a_view",
        "9.3",
        A9,
        "    d = xp.asarray(delta, dtype=xp.float64).reshape(-1).copy()",
        "    d = xp.asarray(delta, dtype=xp.float64).reshape(-1)",
        "copy, not a view",
    ),
    M(
        "clip_in_the_updates_dtype",  # a float32 update's squares overflow float32
        "9.3",
        A9,
        "    d = xp.asarray(delta, dtype=xp.float64).reshape(-1).copy()",
        "    d = xp.asarray(delta).reshape(-1).copy()",
        "float64|nan",
    ),
    M(
        "noise_per_client",  # each upload noised: the sum's noise grows with the clients
        "9.3",
        A9,
        "    total = total_of([clip_update(u, max_norm) for u in updates])\n"
        "    noise = xp.asarray(rng.normal(0.0, sigma * max_norm, size=total.size))\n"
        "    return (total + noise) / expected",
        "    total = total_of(\n"
        "        [clip_update(u, max_norm) + xp.asarray(rng.normal(0.0, sigma * max_norm, size=u.size))\n"
        "         for u in updates]\n"
        "    )\n"
        "    return total / expected",
        "std",
    ),
    M(
        "noise_from_a_generator_of_the_rank",  # each rank its own noise: the ranks' models part
        "9.3",
        A9,
        "rng.normal(0.0, sigma * max_norm, size=total.size)",
        "numpy.random.default_rng(dist.get_rank()).normal(0.0, sigma * max_norm, size=total.size)",
        "differs from rank 0",
    ),
    M(
        "noise_of_std_sigma",  # the multiplier without the bound
        "9.3",
        A9,
        "rng.normal(0.0, sigma * max_norm, size=total.size)",
        "rng.normal(0.0, sigma, size=total.size)",
        "std",
    ),
    M(
        "private_average_over_the_updates_sent",  # the count of who took part, not the round's
        "9.3",
        A9,
        "    return (total + noise) / expected",
        "    return (total + noise) / max(len(updates), 1)",
        "expected",
    ),
    M(
        "private_average_unclipped",
        "9.3",
        A9,
        "    total = total_of([clip_update(u, max_norm) for u in updates])",
        "    total = total_of([xp.asarray(u, dtype=xp.float64) for u in updates])",
        "clip each update",
    ),
    # --- assignment 10: elastic training ---------------------------------------------------------------
    M(
        "layout_fewest_replicas_first",  # dp counted up: the first that splits the batch is 1
        "10.1",
        A10,
        "    for dp in range(available // fixed, 0, -1):",
        "    for dp in range(1, available // fixed + 1):",
        "fewer replicas than fit",
    ),
    M(
        "layout_rounds_the_replicas_up",  # the remainder rank counted as a replica
        "10.1",
        A10,
        "    for dp in range(available // fixed, 0, -1):",
        "    for dp in range(-(-available // fixed), 0, -1):",
        "more than the \\d+ available",
    ),
    M(
        "layout_one_replica_short",  # off by one: never all the replicas that fit
        "10.1",
        A10,
        "    for dp in range(available // fixed, 0, -1):",
        "    for dp in range(available // fixed - 1, 0, -1):",
        "fewer replicas than fit|refused",
    ),
    M(
        "layout_never_grows",  # at most the launch's replicas: more ranks stay idle
        "10.1",
        A10,
        "    for dp in range(available // fixed, 0, -1):",
        "    for dp in range(min(available // fixed, train_args.dp), 0, -1):",
        "fewer replicas than fit",
    ),
    M(
        "layout_ignores_the_expert_ranks",  # a replica's ep ranks take rows of their own
        "10.1",
        A10,
        "        shards = dp * train_args.ep\n",
        "        shards = dp\n",
        "does not split evenly",
    ),
    M(
        "layout_keeps_the_launchs_micro_batches",  # more rows a replica: bigger micro-batches
        "10.1",
        A10,
        "        rows = train_args.batch_size // shards\n",
        "        return Layout(dp, fixed, launch_microbatches(train_args))\n",
        "more than the launch's",
    ),
    M(
        "layout_bound_of_the_new_layout",  # the micro-batch bound taken from the replicas that fit now
        "10.1",
        A10,
        "    most_rows = train_args.batch_size // (train_args.dp * train_args.ep * launch_microbatches(train_args))",
        "    most_rows = train_args.batch_size // (max(1, available // fixed_ranks(train_args)) * train_args.ep"
        " * launch_microbatches(train_args))",
        "more than the launch's",
    ),
    M(
        "layout_strictly_smaller_micro_batches",  # < for <=: a micro-batch of the launch's size is refused
        "10.1",
        A10,
        "rows // microbatches <= most_rows",
        "rows // microbatches < most_rows",
        "fewer micro-batches|refused",
    ),
    M(
        "layout_micro_batches_that_do_not_divide",  # rows // m rounds down: rows are dropped
        "10.1",
        A10,
        "            fits = rows % microbatches == 0 and rows // microbatches <= most_rows",
        "            fits = rows // microbatches <= most_rows",
        "does not split evenly",
    ),
    M(
        "layout_ignores_the_schedule",  # interleaved 1F1B plays multiples of --pp only
        "10.1",
        A10,
        "            if fits and schedule_takes(train_args, microbatches):",
        "            if fits:",
        "does not play",
    ),
    M(
        "layout_knows_the_interleaved_rule_instead_of_asking",  # right for tinytrain's schedules, not for others
        "10.1",
        A10,
        "            if fits and schedule_takes(train_args, microbatches):",
        "            if fits and (train_args.schedule != 'interleaved' or microbatches % train_args.pp == 0):",
        "does not play",
    ),
    M(
        "layout_pipeline_at_least_two_micro_batches",  # a pipeline always cut, even when its rows fit in one
        "10.1",
        A10,
        "        for microbatches in range(1, rows + 1):",
        "        for microbatches in range(2, rows + 1):",
        "fewer micro-batches",
    ),
    M(
        "layout_never_refuses",  # a batch that nothing splits still gets a layout
        "10.1",
        A10,
        "                return Layout(dp, fixed, microbatches)\n",
        "                return Layout(dp, fixed, microbatches)\n"
        "    return Layout(1, fixed, launch_microbatches(train_args))\n",
        "must refuse",
    ),
]

# The representative subset CI runs (tests/grader/test_mutants.py): one mutant of each of 14 tasks,
# graded in one run (about 30 s on 2 cores); A3's tasks, the slowest to grade, only in the full set.
CI_MUTANTS = (
    "direct_exchange_with_owners",
    "all_gather_one_step_short",
    "all_reduce_drops_the_remainder",
    "all_to_all_in_one_step",
    "tree_of_log2_rounds_misses_ranks_when_n_is_not_a_power_of_two",
    "ddp_sums_instead_of_averaging",
    "parallel_attention_forgets_dropout",
    "received_buffer_reused_across_microbatches",
    "interleaved_warmup_too_short",
    "dispatch_without_regrouping_by_expert",
    "ring_computes_before_sending",
    "ulysses_forgets_to_sort_positions",
    "fedavg_unweighted_mean",
    "layout_ignores_the_expert_ranks",
)
MUTANTS = [replace(m, ci=m.name in CI_MUTANTS) for m in MUTANTS]

# --- planting and grading -----------------------------------------------------------------------------

_RUBRIC = load_rubric()


def assignment_of(m: Mutant):
    return _RUBRIC.assignments[m.task.split(".")[0]]


def plant(mutants: list[Mutant], folder: Path) -> Path:
    """Write the solved assignments of ``mutants`` into ``folder``, each mutant's edits applied."""
    for a in {assignment_of(m).id: assignment_of(m) for m in mutants}.values():
        texts = assignment_texts(a, _RUBRIC, solved=True)
        for m in (m for m in mutants if assignment_of(m).id == a.id):
            file = dict(a.pairs)[m.file] if m.file.endswith(".py") else None
            if file is None:
                raise ValueError(f"mutant {m.name}: {m.file} is not a reference file of assignment {a.id}")
            for old, new in m.edits:
                if texts[file].count(old) != 1:
                    raise ValueError(f"mutant {m.name}: {old!r} occurs {texts[file].count(old)} times in {m.file}")
                texts[file] = texts[file].replace(old, new)
        for file, text in texts.items():
            path = (
                folder / Path(a.file).name / Path(file).relative_to(a.file)
                if len(a.files) > 1
                else folder / Path(file).name
            )
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return folder


# Tasks whose graded tests run the code of other tasks (a bug there fails these too): mutants of
# a task and of what it builds on are never graded in the same run.
BUILDS_ON = {
    "2.3": {"2.1", "2.2"},
    "3.2": {"3.1"},
    "3.3": {"3.1", "3.2", "8.1"},
    "4.2": {"4.1"},
    "4.3": {"4.1", "4.2"},
    "4.4": {"4.1", "4.2", "4.3"},
    "4.5": {"4.1", "4.2", "4.3", "4.4"},
    "6.2": {"6.1"},
    "6.3": {"6.1", "6.2"},
    "6.4": {"6.1", "6.2", "6.3"},
    "7.2": {"7.1"},
    "7.3": {"7.1", "7.2"},
}


def _apart(a: str, b: str) -> bool:
    return a != b and a not in BUILDS_ON.get(b, ()) and b not in BUILDS_ON.get(a, ())


def rounds(mutants: list[Mutant]) -> list[list[Mutant]]:
    """Groups with at most one mutant per task and none of tasks that build on each other."""
    out: list[list[Mutant]] = []
    for m in mutants:
        home = next((r for r in out if all(_apart(x.task, m.task) for x in r)), None)
        if home is None:
            out.append(home := [])
        home.append(m)
    return out


def grade(mutants: list[Mutant], tmp: Path, timeout: float = 900) -> dict:
    """Grade the planted copy's mutated tasks; the results.json of the run."""
    folder = plant(mutants, tmp / "planted")
    tasks = sorted({m.task for m in mutants})
    cmd = [sys.executable, "-m", "grader", "--assignments", str(folder), "--out", str(tmp / "out")]
    cmd += ["--comm-timeout", "4", "--timeout", "20", "--tasks", *tasks]
    proc = subprocess.run(cmd, cwd=ROOT, env=mpi_environment(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the grader failed (status {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return json.loads((tmp / "out" / "results.json").read_text())


_SEED = re.compile(r"seed[ =:]*\d+|TINYTRAIN_GRADER_SEED=\d+", re.I)


def verdict(m: Mutant, results: dict) -> tuple[bool, str]:
    """(caught, why): its task failed, naming the cause, with a replay seed."""
    row = next(t for t in results["tests"] if t["number"] == m.task)
    out = row["output"]
    first = out.splitlines()[0] if out else ""
    if row["status"] != "failed":
        return False, "passed"
    message = re.sub(r"^FAIL: test_\w+(\[[\w-]+\])?:? ", "", first)  # what the student reads, not the test's name
    if not re.search(m.cause, message, re.I):
        return False, f"failed without naming the cause ({m.cause!r}): {first[:300]}"
    if not _SEED.search(out):
        return False, f"failed, but names no replay seed: {first[:300]}"
    return True, first[:300]


def run(mutants: list[Mutant], progress=print) -> dict[str, tuple[bool, str]]:
    """Grade every mutant (in rounds, then alone where a round was inconclusive)."""
    found: dict[str, tuple[bool, str]] = {}
    shared: set[str] = set()  # graded together with other mutants
    with tempfile.TemporaryDirectory(prefix="tinytrain-mutants-") as tmp:
        for k, group in enumerate(rounds(mutants)):
            results = grade(group, Path(tmp) / f"round{k}")
            for m in group:
                found[m.name] = verdict(m, results)
                progress(
                    f"round {k}: {m.task} {m.name}: {'caught' if found[m.name][0] else 'MISSED'}: {found[m.name][1]}"
                )
            if len(group) > 1:
                shared |= {m.name for m in group}
        for k, m in enumerate(m for m in mutants if not found[m.name][0] and m.name in shared):
            found[m.name] = verdict(m, grade([m], Path(tmp) / f"alone{k}"))
            progress(f"alone: {m.task} {m.name}: {'caught' if found[m.name][0] else 'MISSED'}: {found[m.name][1]}")
    return found


def report(mutants: list[Mutant], found: dict[str, tuple[bool, str]]) -> str:
    lines = []
    for a in sorted({m.task.split(".")[0] for m in mutants}, key=int):
        mine = [m for m in mutants if m.task.split(".")[0] == a]
        caught = sum(found[m.name][0] for m in mine)
        lines.append(f"assignment {a}: {caught}/{len(mine)} caught")
        lines += [f"  {m.task} {m.name}: {found[m.name][1]}" for m in mine if not found[m.name][0]]
    total = sum(ok for ok, _ in found.values())
    lines.append(f"total: {total}/{len(found)} caught")
    return "\n".join(lines)


def main(ci: bool = False, tasks: list[str] | None = None) -> int:
    chosen = [
        m for m in MUTANTS if (not ci or m.ci) and (not tasks or any(fnmatch.fnmatchcase(m.task, p) for p in tasks))
    ]
    found = run(chosen)
    print(report(chosen, found))
    return 0 if all(ok for ok, _ in found.values()) else 1
