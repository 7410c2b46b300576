"""``tinytrain bench step``: one GPT training step in tinytrain vs the same model in PyTorch.

Both run on the CPU in the same process (on a GPU machine, both on the GPU: tinytrain with CuPy,
PyTorch with CUDA), float32, with the same number of threads, from the
same initial weights and the same batch; their step times are measured interleaved (tinytrain,
PyTorch, tinytrain, ...) so that load from elsewhere hits both alike, and the ratio of the
medians is reported. The first step's losses are compared too: if they differ, the two models
are not the same model and the timing would mean nothing.

A step is: forward, cross-entropy, backward, AdamW update. PyTorch uses its fused
``scaled_dot_product_attention``; tinytrain uses its own fused attention Function.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy

from tinytrain import functional as F
from tinytrain.backend import device, to_host, xp
from tinytrain.nn import GPT, GPTConfig
from tinytrain.optim import AdamW

CONFIGS = {
    # the default `tinytrain train` model on the addition task
    "default": dict(model=dict(vocab_size=12, block_size=8, n_layer=2, n_head=4, n_embd=128), batch=64),
    # wider and deeper, longer context: matmuls dominate
    "wide": dict(model=dict(vocab_size=96, block_size=64, n_layer=4, n_head=8, n_embd=512), batch=16),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--steps", type=int, default=20, help="timed steps per framework and config")
    p.add_argument("--threads", type=int, default=None, help="threads for both (default: CPU count)")
    p.add_argument("--json", default=None, help="write the rows to this file")


def torch_device(torch) -> str:
    """Where PyTorch runs: on the GPU when tinytrain does and PyTorch can, else on the CPU."""
    return "cuda" if device == "gpu" and torch.cuda.is_available() else "cpu"


def torch_gpt(model: GPT, torch):
    """The same GPT in PyTorch, with tinytrain's weights copied in, on :func:`torch_device`."""
    nn, tF = torch.nn, torch.nn.functional
    cfg = model.config

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            C = cfg.n_embd
            self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.attn = nn.ModuleDict({n: nn.Linear(C, C) for n in ("q", "k", "v", "proj")})
            self.mlp = nn.ModuleDict({"fc_1": nn.Linear(C, 4 * C), "fc_2": nn.Linear(4 * C, C)})

        def forward(self, x):
            B, T, C = x.shape
            a, m, h = self.attn, self.mlp, self.ln_1(x)
            heads = lambda t: t.view(B, T, cfg.n_head, C // cfg.n_head).transpose(1, 2)  # noqa: E731
            y = tF.scaled_dot_product_attention(heads(a.q(h)), heads(a.k(h)), heads(a.v(h)), is_causal=True)
            x = x + a.proj(y.transpose(1, 2).reshape(B, T, C))
            return x + m.fc_2(tF.gelu(m.fc_1(self.ln_2(x)), approximate="tanh"))

    class TorchGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.n_embd)

        def forward(self, ids):
            x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
            for b in self.blocks:
                x = b(x)
            return self.ln_f(x) @ self.wte.weight.T  # tied head

    tm = TorchGPT()
    ours = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in tm.named_parameters():
            src = to_host(ours[name].data)
            if isinstance(tm.get_submodule(name.rsplit(".", 1)[0]), nn.Linear) and name.endswith("weight"):
                src = src.T  # tinytrain's Linear weight is (in, out); PyTorch's is (out, in)
            p.copy_(torch.from_numpy(src.copy()))
    return tm.to(torch_device(torch))


def _time_steps(step_fns, steps):
    """Run the step functions interleaved ``steps`` times; return each one's list of seconds."""
    times = [[] for _ in step_fns]
    for _ in range(steps):
        for i, fn in enumerate(step_fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return times


def bench_config(name, steps, torch):
    spec = CONFIGS[name]
    config = GPTConfig(**spec["model"])
    model = GPT(config, seed=0)
    rng = numpy.random.default_rng(0)
    ids = rng.integers(0, config.vocab_size, size=(spec["batch"], config.block_size + 1))
    x, y = ids[:, :-1], ids[:, 1:]
    opt = AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)

    def ours():
        loss = F.cross_entropy(model(xp.asarray(x)), xp.asarray(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    row = {
        "config": name,
        "params": model.num_parameters(),
        "batch": spec["batch"],
        "tokens": spec["batch"] * config.block_size,
        **spec["model"],
    }
    if torch is None:
        ours()
        (t_ours,) = _time_steps([ours], steps)
        row.update(tinytrain_ms=1e3 * statistics.median(t_ours))
        return row

    tm = torch_gpt(model, torch)
    topt = torch.optim.AdamW(tm.parameters(), lr=1e-4, weight_decay=0.0)
    tx, ty = (torch.from_numpy(a).to(torch_device(torch)) for a in (x, y))

    def theirs():
        loss = torch.nn.functional.cross_entropy(tm(tx).flatten(0, 1), ty.flatten())
        topt.zero_grad()
        loss.backward()
        topt.step()
        return loss.item()

    first_ours, first_theirs = ours(), theirs()  # also the warm-up step
    if abs(first_ours - first_theirs) > 1e-3 * max(1.0, abs(first_theirs)):
        raise RuntimeError(f"models differ: first loss {first_ours} (tinytrain) vs {first_theirs} (PyTorch)")
    t_ours, t_theirs = _time_steps([ours, theirs], steps)
    row.update(
        tinytrain_ms=1e3 * statistics.median(t_ours),
        torch_ms=1e3 * statistics.median(t_theirs),
        first_loss_diff=abs(first_ours - first_theirs),
    )
    row["ratio"] = row["tinytrain_ms"] / row["torch_ms"]
    return row


def run(args) -> int:
    if args.steps <= 0:
        raise ValueError(f"--steps must be positive, got {args.steps}")
    if args.threads is not None and args.threads <= 0:
        raise ValueError(f"--threads must be positive, got {args.threads}")
    threads = args.threads or os.cpu_count()
    try:
        import torch

        torch.set_num_threads(threads)
    except ImportError:
        torch = None
        print(
            "PyTorch is not importable: timing tinytrain alone (no ratio). "
            '`pip install -e ".[bench]"` (or `pip install torch`) to compare.'
        )
    if device != "cpu":
        where = torch_device(torch) if torch is not None else "-"
        print(f"note: tinytrain runs on its {device} device here; PyTorch on {where}", flush=True)
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(threads)
    except ImportError:
        pass  # NumPy's BLAS then uses its default, which is the CPU count
    print(f"one training step (forward + backward + AdamW), float32, {threads} threads, median of {args.steps}")
    print(f"{'config':<8} {'params':>10} {'tokens':>7} {'tinytrain ms':>13} {'torch ms':>9} {'ratio':>6}")
    rows = []
    for name in args.configs:
        row = bench_config(name, args.steps, torch)
        rows.append(row)
        torch_ms = f"{row['torch_ms']:9.2f}" if "torch_ms" in row else f"{'-':>9}"
        ratio = f"{row['ratio']:5.2f}x" if "ratio" in row else f"{'-':>6}"
        print(f"{name:<8} {row['params']:>10,} {row['tokens']:>7} {row['tinytrain_ms']:13.2f} {torch_ms} {ratio}")
    print("ratio = tinytrain step time / PyTorch step time (lower is better; 1.0 = as fast)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
