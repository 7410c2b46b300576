# Assignment 7: Context parallel (handout: assignments/a7_context_parallel.md).
# Generated from tinytrain/parallel/context_parallel/merge.py by `python -m grader stubs`. Replace each
# `raise NotImplementedError("TODO ...")` with your code; grade it with `python -m grader`.

"""One block of attention, and merging partial results with the online softmax (log-sum-exp).

Ring attention never holds a query's whole row of scores: it sees the keys one block at a time.
For one block of keys K_b, V_b a query block q gets a *partial* result::

    s = q·K_bᵀ·scale          (causal mask on the diagonal block)
    lse_b = log Σ_j exp(s_j)  (one number per query: the block's log-sum-exp)
    out_b = softmax(s)·V_b    (normalised within the block)

Two partial results over disjoint key sets merge exactly into the result over their union (each
weighted by its share of the softmax mass), so after every block has been merged, ``out`` is
softmax over all keys times V, and ``lse`` is the row's log-normaliser: all a backward pass needs
to rebuild any block's probabilities without storing them. The derivations: assignment 7's
handout, sections 2 and 4.

``WORK`` counts the q·k products computed (query rows × key columns, per batch row and head):
the load-balance measurement of ``split.py`` reads it.
"""

from __future__ import annotations

from tinytrain.backend import xp


class Work:
    """q·k products computed by ``block_attention`` (query rows × key columns of each block)."""

    def __init__(self):
        self.products = 0

    def add(self, n: int) -> None:
        self.products += int(n)

    def reset(self) -> int:
        """Return the count so far and start again from 0."""
        n, self.products = self.products, 0
        return n


WORK = Work()


def causal_bias(T: int, dtype):
    """(T, T): 0 on and below the diagonal, -inf above (a query sees no later key)."""
    return xp.triu(xp.full((T, T), -xp.inf, dtype=dtype), k=1)


def block_attention(q, k, v, scale, causal: bool):
    """Attention of queries ``q`` (..., Tq, D) over one block of keys/values (..., Tk, D).

    ``causal``: the diagonal block (the same positions for queries and keys): the causal mask.
    Returns ``(out, lse)``: the block's softmax-normalised output (..., Tq, D) and its log-sum-exp
    of the scores (..., Tq).
    """
    WORK.add(q.shape[-2] * k.shape[-2])
    raise NotImplementedError("TODO 7.1: One block's attention output and each query's log-sum-exp over these keys, without overflow; causal on the diagonal block.")


def merge_partials(out_a, lse_a, out_b, lse_b):
    """The attention result over the keys of both partial results (disjoint key sets).

    ``out_*``: (..., T, D) each normalised over its own keys; ``lse_*``: (..., T) their
    log-sum-exps. Returns ``(out, lse)`` over the union. ``lse_a`` may be -inf (no keys yet) as
    long as ``lse_b`` is finite.
    """
    raise NotImplementedError("TODO 7.1: The exact attention over the union of two disjoint key sets from their two partial results; stable when one side has seen no keys yet.")


def block_gradients(q, k, v, lse, grad, delta, scale, causal: bool):
    """Backward of one block: ``(dq, dk, dv)`` of the block's share of the merged output.

    ``lse``: the merged log-sum-exp (..., Tq); ``grad``: d loss / d out (..., Tq, D);
    ``delta``: rowsum(grad ⊙ out) (..., Tq). See the module docstring.
    """
    WORK.add(q.shape[-2] * k.shape[-2])
    raise NotImplementedError("TODO 7.3: One block's gradients for queries, keys and values, rebuilding its probabilities from the merged LSE instead of storing them.")
