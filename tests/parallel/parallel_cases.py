"""Shared pieces of the data-parallel and ZeRO tests: a tiny GPT, its global batches, a training
loop that any strategy plugs into, and the serial run every strategy must reproduce."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np

from tinytrain import distributed as dist
from tinytrain import functional as F
from tinytrain.backend import to_host, xp
from tinytrain.data import shard_rows
from tinytrain.nn import GPT, GPTConfig
from tinytrain.optim import SGD, AdamW

VOCAB, T = 16, 8


def tiny_gpt(tie: bool = True, freeze: tuple[str, ...] = (), seed: int = 0, n_layer: int = 2) -> GPT:
    """Width 32, ``n_layer`` blocks; parameters whose name starts with one of ``freeze`` are frozen."""
    model = GPT(
        GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=n_layer, n_head=2, n_embd=32, tie_weights=tie), seed=seed
    )
    for name, p in model.named_parameters():
        if name.startswith(freeze):
            p.requires_grad = False
    return model


def make_optimizer(kind: str, model):
    if kind == "adamw":
        return AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def global_batch(step: int, rows: int, seed: int = 0):
    """Random token ids and targets: every row has T targets, so shard means average exactly."""
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, VOCAB, size=(rows, T)), rng.integers(0, VOCAB, size=(rows, T))


def train(
    model, backward, step, optimizer, steps: int, rows: int, rank: int = 0, world: int = 1, accum: int = 1, no_sync=None
) -> list[float]:
    """``steps`` optimizer steps on this rank's rows of each global batch, in ``accum`` micro-batches
    (all but the last inside ``no_sync()`` when given). Returns this rank's losses."""
    losses = []
    for t in range(steps):
        x, y = global_batch(t, rows)
        x, y = shard_rows(x, rank, world), shard_rows(y, rank, world)
        optimizer.zero_grad()
        for i, (xi, yi) in enumerate(zip(np.split(x, accum), np.split(y, accum))):
            quiet = no_sync() if no_sync is not None and i < accum - 1 else contextlib.nullcontext()
            with quiet:
                loss = F.cross_entropy(model(xp.asarray(xi)), xp.asarray(yi)) * (1.0 / accum)
                backward(loss)
            losses.append(loss.item())
        step()
    return losses


def serial_params(opt_kind: str, steps: int, rows: int, **model_kw) -> dict:
    """Parameters after ``steps`` serial steps on the global batches (the reference)."""
    model = tiny_gpt(**model_kw)
    opt = make_optimizer(opt_kind, model)
    train(model, lambda loss: loss.backward(), opt.step, opt, steps, rows)
    return {n: to_host(p.data).copy() for n, p in model.named_parameters()}


def assert_params_close(got: dict, want: dict, rtol: float, atol: float, what: str) -> None:
    for name, w in want.items():
        g = to_host(got[name])
        err = np.abs(g - w).max()
        assert np.allclose(g, w, rtol=rtol, atol=atol), (
            f"{what}: parameter {name} differs from the serial run by up to {err:.3g} "
            f"(rank {dist.get_rank()}, tolerance atol={atol}, rtol={rtol})"
        )


def assert_same_on_all_ranks(params: dict, group=None) -> None:
    """Every rank must hold bitwise the same parameters (ring results are identical everywhere)."""
    for name, a in params.items():
        a = np.ascontiguousarray(to_host(a))
        first = a.copy()
        dist.broadcast(first, src=0, group=group)
        assert np.array_equal(a, first), f"rank {dist.get_rank(group)} holds a different {name} than rank 0"


def shared_dir(tmp_path) -> Path:
    """Rank 0's ``tmp_path`` on every rank: a run's ranks write one checkpoint folder together."""
    path = np.frombuffer(str(tmp_path).encode(), dtype=np.uint8).copy()
    size = np.array([path.size], dtype=np.int64)
    dist.broadcast(size, src=0)
    shared = path if dist.get_rank() == 0 else np.zeros(int(size[0]), dtype=np.uint8)
    dist.broadcast(shared, src=0)
    return Path(bytes(shared).decode())
