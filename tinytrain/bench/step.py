"""``tinytrain bench step``: one GPT training step in tinytrain vs the same model in PyTorch.

Each framework runs in its own process (``python -m tinytrain.bench.step --worker NAME``), float32,
with the same number of threads (``OMP_NUM_THREADS``/``OPENBLAS_NUM_THREADS`` set before NumPy or
PyTorch start their thread pools), from the same initial weights and the same batch. Why not one
process: NumPy's OpenBLAS threads and PyTorch's OpenMP threads keep spinning for a while after
their work, so timed in one process each framework runs while the other's pool takes the cores.

The parent alternates runs of ``--block`` steps (tinytrain's block, PyTorch's block, ...) so that
load from elsewhere hits both alike; between blocks it waits ``--settle`` seconds, longer than
either pool spins, and the worker not being timed waits asleep on its pipe. Each run starts with
``--warmup`` untimed steps (default 1): in a training loop a step follows a step, and the first
one after a pause pays for waking both frameworks' thread pools (and, on a virtual machine, its
idle cores), which no step of a loop pays. The ratio of the medians is reported.

The reference is pinned: ``pip install -e ".[bench]"`` installs PyTorch ``PINNED_TORCH``, and the
table's head names the CPU, each framework's threads, NumPy's BLAS (and the CPU kernels it runs)
and PyTorch's version and BLAS. Where ``OPENBLAS_CORETYPE`` makes NumPy's BLAS run other kernels
than the CPU's own (Haswell's on an AVX-512 CPU, set on some machines for old OpenBLAS builds), a
note says so: the products then run at about half speed, and the ratios measure that setting.
Against another PyTorch the ratios are marked ``*`` and a line says that they are not against the
pinned reference (the same bench gave ratios 40 % apart between PyTorch 2.13 and 2.14).

The first step's losses are compared too: if they differ, the two models are not the same model
and the timing would mean nothing.

The printed check: while one worker's block runs, the parent reads from ``/proc`` how much CPU the
other worker used. That is the distortion this design removes; above ``IDLE_LIMIT`` of one core the
row says ``DISTURBED`` (``idle_cpu`` in ``--json``), so the distortion cannot come back unseen.

``--precision bf16|fp16`` adds two workers, each framework in 16 bits, alternating with the float32
two: tinytrain as ``tinytrain train --precision`` steps (a 16-bit model, float32 master weights,
fp16's loss scaler), PyTorch under ``torch.autocast`` (float32 weights, 16-bit products; fp16 with
its GradScaler). Each 16-bit step is reported over its own framework's float32 step: what mixed
precision costs or saves on this CPU (PyTorch's bf16 products run on the CPU's bf16 instructions
where it has them; NumPy has none, so tinytrain converts to float32 and back around each op).

A step is: forward, cross-entropy, backward, AdamW update. PyTorch uses its fused
``scaled_dot_product_attention``; tinytrain uses its own fused attention Function.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import select
import statistics
import subprocess
import sys
import time

import numpy

from tinytrain import functional as F
from tinytrain.autograd import loss_scaling
from tinytrain.backend import device, precision_dtype, to_host, xp
from tinytrain.nn import GPT, GPTConfig
from tinytrain.optim import AdamW, LossScaler, grads_finite

CONFIGS = {
    # the default `tinytrain train` model on the addition task
    "default": dict(model=dict(vocab_size=12, block_size=8, n_layer=2, n_head=4, n_embd=128), batch=64),
    # wider and deeper, longer context: matmuls dominate
    "wide": dict(model=dict(vocab_size=96, block_size=64, n_layer=4, n_head=8, n_embd=512), batch=16),
    # long context, narrow model: T = 256 >> n_embd, so attention (its T x T scores and softmax) dominates
    "long": dict(model=dict(vocab_size=96, block_size=256, n_layer=2, n_head=4, n_embd=64), batch=8),
}
# name -> "module:function" building (step function, ...) in a worker; see tinytrain_step
FRAMEWORKS = {"tinytrain": f"{__name__}:tinytrain_step", "torch": f"{__name__}:torch_step"}
# name -> "module:function" timing steps per op (see tinytrain_profile); any other reference is a
# tinytrain step (the tests' stand-ins), profiled as tinytrain
PROFILERS = {"torch": f"{__name__}:torch_profile"}
# The PyTorch the ratios are measured against (pyproject's `bench` extra pins the same; a test checks):
# 2.13.0's CPU build is the one this machine class has on disk for Python 3.11, so `pip install`
# takes it in seconds and offline, where an unpinned `torch` pulls a CUDA build of several GB.
PINNED_TORCH = "2.13.0"
# |first loss in 16 bits - in float32| / the float32 loss above which a 16-bit step is not the same model
# (a GPT's initial loss, log(vocab), moves by about 1e-3 in bf16 rounding; 5e-2 is a different model)
LOW_PRECISION_LOSS = 5e-2
IDLE_LIMIT = 0.10  # of one core: more CPU than this from the idle worker while the other is timed
_WAIT_S = 600.0  # the longest one block (or a worker's start) may take


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--steps", type=int, default=20, help="timed steps per framework and config")
    p.add_argument("--threads", type=int, default=None, help="threads for both (default: CPU count)")
    # One step per run: on a machine with bursts of other load, a burst then hits both frameworks
    # alike (with runs of 5 steps, one burst could land on one side only and swing the ratio).
    p.add_argument("--block", type=int, default=1, help="steps per alternating run of one framework")
    p.add_argument(
        "--warmup", type=int, default=1, help="untimed steps starting each run (in a loop, steps follow steps)"
    )
    p.add_argument("--settle", type=float, default=0.3, help="seconds between runs (idle thread pools stop spinning)")
    p.add_argument(
        "--precision",
        choices=["bf16", "fp16"],
        default=None,
        help="also time both frameworks in this precision (tinytrain: --precision's 16-bit model with float32 "
        "master weights; PyTorch: autocast) beside their float32 step, each side's ratio to its own float32",
    )
    p.add_argument("--json", default=None, help="write the rows to this file")
    p.add_argument(
        "--profile",
        type=int,
        nargs="?",
        const=5,
        default=0,
        metavar="STEPS",
        help="after timing, profile STEPS more steps (default 5) per framework and print where the time goes, per op",
    )


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


def _batch(name: str):
    """(config, x, y) of ``name``: the same batch in every worker."""
    spec = CONFIGS[name]
    config = GPTConfig(**spec["model"])
    ids = numpy.random.default_rng(0).integers(0, config.vocab_size, size=(spec["batch"], config.block_size + 1))
    return config, ids[:, :-1], ids[:, 1:]


def tinytrain_step(name: str, threads: int, precision: str = "fp32"):
    """tinytrain's training step of config ``name``: a function running one step, returning its loss.
    ``precision`` bf16 or fp16: as ``tinytrain train --precision`` steps, a 16-bit model whose
    optimizer keeps float32 masters; fp16 with the loss scaler's backward, overflow check and update."""
    config, x, y = _batch(name)
    model = GPT(config, seed=0)
    model.to(precision_dtype(precision))
    opt = AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    scaler = LossScaler() if precision == "fp16" else None
    x, y = xp.asarray(x), xp.asarray(y)

    def step():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        if scaler is None:
            loss.backward()
            opt.step()
            return loss.item()
        with loss_scaling(scaler.scale), numpy.errstate(over="ignore", invalid="ignore"):
            loss.backward()
        opt.loss_scale = scaler.scale
        if scaler.update(found_inf=not grads_finite(p.grad for p in model.parameters())):
            opt.step()
        return loss.item()

    return step


def torch_step(name: str, threads: int, precision: str = "fp32"):
    """The same step in PyTorch: the same GPT (tinytrain's initial weights copied in), batch, AdamW.
    ``precision`` bf16 or fp16: forward and loss under ``torch.autocast`` (float32 weights, 16-bit
    products: PyTorch's mixed precision), fp16 with its GradScaler."""
    import contextlib

    import torch

    torch.set_num_threads(threads)
    config, x, y = _batch(name)
    tm = torch_gpt(GPT(config, seed=0), torch)
    opt = torch.optim.AdamW(tm.parameters(), lr=1e-4, weight_decay=0.0)
    where = torch_device(torch)
    tx, ty = (torch.from_numpy(a).to(where) for a in (x, y))
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    autocast = (lambda: torch.autocast(where, dtype=low)) if low is not None else contextlib.nullcontext
    scaler = torch.amp.GradScaler(where) if precision == "fp16" else None

    def step():
        with autocast():
            loss = torch.nn.functional.cross_entropy(tm(tx).flatten(0, 1), ty.flatten())
        opt.zero_grad()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        if tx.is_cuda:
            torch.cuda.synchronize()
        return loss.item()

    return step


# --- profiles: where a step's time goes, per op, in each framework's own words mapped to one list ----

# tinytrain Function (or timed block) -> the op's row in the profile table
TINYTRAIN_OPS = {
    "Linear": "linear",
    "MatMul": "linear",
    "ScaledDotProductAttention": "attention",
    "LayerNorm": "layer_norm",
    "GELU": "gelu",
    "CrossEntropy": "cross_entropy",
    "Embedding": "embedding",
    "Add": "add (residual)",
    "Reshape": "reshape/transpose",
    "Permute": "reshape/transpose",
    "AdamW": "AdamW",
}
# PyTorch's top-level profiler events (forward ops, autograd's backward nodes, the optimizer) -> row
TORCH_OPS = {
    "aten::linear": "linear",
    "aten::matmul": "linear",
    "AddmmBackward0": "linear",
    "MmBackward0": "linear",
    "aten::scaled_dot_product_attention": "attention",
    "ScaledDotProductFlashAttentionForCpuBackward0": "attention",
    "ScaledDotProductEfficientAttentionBackward0": "attention",
    "ScaledDotProductFlashAttentionBackward0": "attention",
    "aten::layer_norm": "layer_norm",
    "NativeLayerNormBackward0": "layer_norm",
    "aten::gelu": "gelu",
    "GeluBackward0": "gelu",
    "aten::cross_entropy_loss": "cross_entropy",
    "NllLossBackward0": "cross_entropy",
    "LogSoftmaxBackward0": "cross_entropy",
    "aten::embedding": "embedding",
    "EmbeddingBackward0": "embedding",
    "aten::add": "add (residual)",
    "AddBackward0": "add (residual)",
    **{f"aten::{op}": "reshape/transpose" for op in ("view", "reshape", "transpose", "t", "numpy_T", "flatten")},
    **{f"{op}Backward0": "reshape/transpose" for op in ("View", "UnsafeView", "Transpose", "T", "Permute", "Reshape")},
    "Optimizer.step#AdamW.step": "AdamW",
}
_BACKWARD_EVENT = "autograd::engine::evaluate_function: "


def _row_key(op: str, phase: str) -> str:
    """The profile's row: ``"linear forward"``, ``"AdamW step"``, ``"other backward"``, ..."""
    return f"{op} {'step' if op == 'AdamW' else phase}"


def tinytrain_profile(step, steps: int) -> dict:
    """Seconds per step of each op (see ``TINYTRAIN_OPS``) over ``steps`` steps, from the autograd
    engine's per-Function timer; ``"step"`` is the whole step's."""
    from tinytrain.autograd import op_timer

    start = time.perf_counter()
    with op_timer() as seconds:
        for _ in range(steps):
            step()
    rows = {"step": time.perf_counter() - start}
    for key, s in seconds.items():
        function, phase = key.rsplit(" ", 1)
        row = _row_key(TINYTRAIN_OPS.get(function, "other"), phase)
        rows[row] = rows.get(row, 0.0) + s
    return {k: v / steps for k, v in rows.items()}


def torch_profile(step, steps: int) -> dict:
    """The same from ``torch.profiler`` (CPU): each top-level event's time, children included
    (``aten::linear`` holds its ``aten::addmm``), so nothing counts twice."""
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    rows = {"step": time.perf_counter() - start}
    for event in prof.events():
        if event.cpu_parent is not None:
            continue
        backward = event.name.startswith(_BACKWARD_EVENT)
        name = event.name.removeprefix(_BACKWARD_EVENT)
        if name.startswith("Optimizer.zero_grad") or name == "aten::item":
            continue  # tinytrain's zero_grad and loss.item() are outside its ops too
        row = _row_key(TORCH_OPS.get(name, "other"), "backward" if backward else "forward")
        rows[row] = rows.get(row, 0.0) + event.cpu_time_total / 1e6
    return {k: v / steps for k, v in rows.items()}


def torch_available() -> bool:
    """PyTorch importable, checked without importing it here (its thread pool stays out of this process)."""
    import importlib.util

    return importlib.util.find_spec("torch") is not None


# --- the worker: one framework in its own process ----------------------------------------------------


def _worker(framework: str, name: str, threads: int, precision: str = "fp32") -> int:
    """Build the step, run the warm-up step (reported: its loss, and what the framework runs on),
    then on each ``run K W`` line run W untimed and K timed steps and reply with the K seconds, on
    each ``profile K`` line profile K steps and reply with seconds per step per op; quit on EOF.
    One JSON line per reply."""
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(threads)
    except ImportError:
        pass  # OPENBLAS_NUM_THREADS, set by the parent before NumPy started, does it
    module, function = FRAMEWORKS.get(framework, framework).split(":")
    build = getattr(importlib.import_module(module), function)
    step = build(name, threads) if precision == "fp32" else build(name, threads, precision)
    first = {"first_loss": step()}  # also the warm-up step
    first["versions"] = torch_versions() if framework == "torch" else tinytrain_versions()
    print(json.dumps(first), flush=True)
    for line in sys.stdin:
        if line.startswith("profile"):
            module, function = PROFILERS.get(framework, f"{__name__}:tinytrain_profile").split(":")
            profiler = getattr(importlib.import_module(module), function)
            print(json.dumps({"ops": profiler(step, int(line.split()[1]))}), flush=True)
            continue
        steps, warmup = (int(word) for word in line.split()[1:3])
        for _ in range(warmup):
            step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        print(json.dumps({"seconds": times}), flush=True)
    return 0


def tinytrain_versions() -> dict:
    """What a tinytrain step runs on: NumPy, its BLAS (name and version, as NumPy was built with it),
    the threads of tinytrain's pool and of that BLAS (one: the pool cuts the products itself)."""
    from tinytrain import backend
    from tinytrain.autograd import threads

    blas = getattr(numpy, "__config__", None)
    blas = getattr(blas, "CONFIG", {}).get("Build Dependencies", {}).get("blas", {})
    return {
        "framework": "tinytrain",
        "numpy": numpy.__version__,
        "blas": f"{blas.get('name', '?')} {blas.get('version', '?')}",
        "blas_kernel": backend.blas_kernel(),
        "threads": threads.THREADS,
        "blas_threads": backend.blas_threads(),
    }


# What a build of OpenBLAS for many CPUs reads when it loads, instead of asking the CPU which kernels to run
FORCED_KERNEL_VARIABLES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def cpu_own_blas_kernel() -> str | None:
    """The kernels NumPy's OpenBLAS picks on this CPU by itself: asked in a Python started without
    :data:`FORCED_KERNEL_VARIABLES` (None when it cannot tell)."""
    env = {k: v for k, v in os.environ.items() if k not in FORCED_KERNEL_VARIABLES}
    ask = "from tinytrain.backend import blas_kernel; print(blas_kernel())"
    try:
        done = subprocess.run([sys.executable, "-c", ask], env=env, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    answer = done.stdout.strip()
    return answer if done.returncode == 0 and answer not in ("", "None") else None


def forced_kernel_line(versions: dict, own: str | None) -> str | None:
    """A note when the environment made NumPy's BLAS run other kernels than this CPU's own: the
    ratios then measure that setting (Haswell's on an AVX-512 CPU: about half its product speed)."""
    ran = versions.get("blas_kernel")
    if not ran or not own or ran == own:
        return None
    setting = " ".join(f"{k}={os.environ[k]}" for k in FORCED_KERNEL_VARIABLES if k in os.environ)
    unset = " ".join(f"-u {k}" for k in FORCED_KERNEL_VARIABLES)
    return (
        f"note: {setting or 'the environment'} makes NumPy's BLAS run {ran} kernels on a CPU whose own are {own}: "
        f"tinytrain's ratios measure that setting; `env {unset} tinytrain bench step` measures the CPU's own"
    )


def torch_versions() -> dict:
    """What the PyTorch step runs on: its version, its BLAS (from its build settings) and threads."""
    import torch

    settings = torch.__config__.show()
    blas = settings.split("BLAS_INFO=", 1)[1].split(",", 1)[0] if "BLAS_INFO=" in settings else "?"
    return {"framework": "torch", "torch": torch.__version__, "blas": blas, "threads": torch.get_num_threads()}


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what the platform module says."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def pinned(versions: dict) -> bool:
    """Whether a PyTorch worker's ``versions`` are the pinned reference's (a local build tag such
    as ``+cpu`` aside)."""
    return versions.get("torch", "").split("+")[0] == PINNED_TORCH


def schedstat(pid: int) -> tuple[float, float] | None:
    """(seconds on a CPU, seconds runnable but waiting for one) of process ``pid``, all its threads
    together, to the nanosecond (Linux: ``/proc/PID/task/*/schedstat``; the clock ticks of
    ``/proc/PID/stat`` are too coarse for a step of milliseconds). None where there is no such file.
    The second is what other programs on the machine took from it."""
    running = waiting = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                fields = f.read().split()
            running, waiting = running + int(fields[0]), waiting + int(fields[1])
    except (OSError, ValueError, IndexError):
        return None
    return running / 1e9, waiting / 1e9


def _cpu_seconds(pid: int) -> float | None:
    """CPU seconds process ``pid`` has used, all its threads together (see :func:`schedstat`)."""
    stat = schedstat(pid)
    return None if stat is None else stat[0]


class Worker:
    """One framework's step in its own process, with ``threads`` threads; driven over a pipe."""

    def __init__(self, framework: str, name: str, threads: int, precision: str = "fp32"):
        self.framework, self.precision = framework, precision
        self.label = framework if precision == "fp32" else f"{framework} {precision}"
        env = dict(
            os.environ, **{k: str(threads) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
        )
        command = [sys.executable, "-m", __name__, "--worker", framework, name, str(threads), precision]
        self.proc = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        first = self._reply()
        self.first_loss, self.versions = first["first_loss"], first.get("versions", {})

    def run(self, steps: int, warmup: int = 0) -> list[float]:
        """Seconds of each of ``steps`` steps, run now after ``warmup`` untimed ones."""
        self.proc.stdin.write(f"run {steps} {warmup}\n".encode())
        self.proc.stdin.flush()
        return self._reply()["seconds"]

    def profile(self, steps: int) -> dict:
        """Seconds per step of each op over ``steps`` steps, run now (``"step"``: the whole step)."""
        self.proc.stdin.write(f"profile {steps}\n".encode())
        self.proc.stdin.flush()
        return self._reply()["ops"]

    def _reply(self) -> dict:
        fd = self.proc.stdout.fileno()
        if not select.select([fd], [], [], _WAIT_S)[0]:
            self.close()
            raise RuntimeError(f"the {self.framework} worker did not answer in {_WAIT_S:g} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.framework} worker exited (code {self.proc.wait()}); its error is above")
        return json.loads(line)

    def cpu_seconds(self) -> float | None:
        return _cpu_seconds(self.proc.pid)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def alternate(workers: list, steps: int, block: int, settle: float, warmup: int = 0) -> tuple[list, list]:
    """Runs of ``block`` steps of each worker in turn until each ran ``steps``: (each one's seconds
    per step, each one's idle CPU: the most CPU, as a share of one core, that it used during another
    worker's run). A worker not being timed waits asleep on its pipe; ``settle`` seconds between runs
    let the last run's thread pool stop spinning before the next one starts; each run begins with
    ``warmup`` untimed steps."""
    times, idle = [[] for _ in workers], [0.0 for _ in workers]
    while len(times[0]) < steps:
        k = min(block, steps - len(times[0]))
        for i, worker in enumerate(workers):
            time.sleep(settle)
            others = [(j, w.cpu_seconds()) for j, w in enumerate(workers) if j != i]
            start = time.perf_counter()
            times[i] += worker.run(k, warmup)
            wall = time.perf_counter() - start
            for j, before in others:
                after = workers[j].cpu_seconds()
                if before is not None and after is not None:
                    idle[j] = max(idle[j], (after - before) / wall)
    return times, idle


def compare(
    name: str,
    steps: int,
    threads: int,
    reference: str = "torch",
    block: int = 5,
    settle: float = 0.3,
    profile: int = 0,
    warmup: int = 1,
    precision: str | None = None,
) -> dict:
    """One row: config ``name`` timed in a tinytrain worker and a ``reference`` worker, alternating;
    with ``profile`` steps, also each one's seconds per step per op (``row["ops"]``), one after the
    other after the timing (profilers slow a step down: these steps are not the timed ones).
    With ``precision`` (bf16, fp16) two more workers, each framework in that precision, alternate
    with the float32 two: ``tinytrain_low_ms``, ``low_ratio`` (over tinytrain's float32 step),
    ``torch_low_ms``, ``torch_low_ratio`` (over PyTorch's) and ``low_vs_torch``."""
    config = GPTConfig(**CONFIGS[name]["model"])
    row = {
        "config": name,
        "params": GPT(config, seed=0).num_parameters(),
        "batch": CONFIGS[name]["batch"],
        "tokens": CONFIGS[name]["batch"] * config.block_size,
        **CONFIGS[name]["model"],
        "threads": threads,
    }
    frameworks = ["tinytrain"] + ([reference] if reference else [])
    workers = []
    try:  # (inside: a worker that fails to start closes the ones started before it)
        for p in ["fp32"] + ([precision] if precision else []):
            workers += [Worker(f, name, threads, p) for f in frameworks]
        first = [w.first_loss for w in workers]
        if reference and abs(first[0] - first[1]) > 1e-3 * max(1.0, abs(first[1])):
            raise RuntimeError(f"models differ: first loss {first[0]} (tinytrain) vs {first[1]} ({reference})")
        for w, loss in zip(workers[len(frameworks) :], first[len(frameworks) :]):  # 16-bit: the same model, rounded
            if abs(loss - first[0]) > LOW_PRECISION_LOSS * max(1.0, abs(first[0])):
                raise RuntimeError(f"{w.framework} in {precision}: first loss {loss}, {first[0]} in float32")
            if loss == first[0]:  # rounding to 16 bits moves the loss: this worker stepped in float32
                raise RuntimeError(f"{w.framework} in {precision}: the first loss is float32's to the last bit")
        row["first_losses"] = {w.label: loss for w, loss in zip(workers, first)}
        times, idle = alternate(workers, steps, block, settle, warmup)
        row["versions"] = {w.framework: w.versions for w in workers}
        if profile:
            row["ops"] = {}
            for w in workers:
                time.sleep(settle)
                row["ops"][w.label] = w.profile(profile)
    finally:
        for w in workers:
            w.close()
    row["tinytrain_ms"] = 1e3 * statistics.median(times[0])
    if reference:  # alone, there is no neighbour to disturb it
        row["idle_cpu"] = {w.label: share for w, share in zip(workers, idle)}
        row["disturbed"] = max(idle) > IDLE_LIMIT
    if reference:
        row.update(torch_ms=1e3 * statistics.median(times[1]), first_loss_diff=abs(first[0] - first[1]))
        row["ratio"] = row["tinytrain_ms"] / row["torch_ms"]
        row["pinned_reference"] = reference == "torch" and pinned(workers[1].versions)
    if precision:
        row["precision"] = precision
        row["tinytrain_low_ms"] = 1e3 * statistics.median(times[len(frameworks)])
        row["low_ratio"] = row["tinytrain_low_ms"] / row["tinytrain_ms"]
        if reference:
            row["torch_low_ms"] = 1e3 * statistics.median(times[3])
            row["torch_low_ratio"] = row["torch_low_ms"] / row["torch_ms"]
            row["low_vs_torch"] = row["tinytrain_low_ms"] / row["torch_low_ms"]
    return row


def run(args) -> int:
    if args.steps <= 0:
        raise ValueError(f"--steps must be positive, got {args.steps}")
    if args.threads is not None and args.threads <= 0:
        raise ValueError(f"--threads must be positive, got {args.threads}")
    if args.block <= 0:
        raise ValueError(f"--block must be positive, got {args.block}")
    if args.profile < 0:
        raise ValueError(f"--profile must be a positive number of steps, got {args.profile}")
    if args.settle < 0:
        raise ValueError(f"--settle must be 0 or more seconds, got {args.settle}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be 0 or more steps, got {args.warmup}")
    threads = args.threads or os.cpu_count()
    reference = "torch" if torch_available() else None
    if reference is None:
        print(
            "PyTorch is not importable: timing tinytrain alone (no ratio). "
            '`pip install -e ".[bench]"` (or `pip install torch`) to compare.'
        )
    if device != "cpu":
        print(f"note: tinytrain runs on its {device} device here; PyTorch on the GPU if it can", flush=True)
    precision = f"float32 and {args.precision}" if args.precision else "float32"
    print(
        f"one training step (forward + backward + AdamW), {precision}, {threads} threads each, median of "
        f"{args.steps}; each framework in its own process, runs of {args.block} steps alternating, "
        f"each after {args.warmup} untimed"
    )
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores seen")
    rows = []
    for name in args.configs:
        row = compare(
            name, args.steps, threads, reference, args.block, args.settle, args.profile, args.warmup, args.precision
        )
        if not rows:  # the workers say what they run on: the same for every config
            for line in versions_lines(row):
                print(line)
            forced = any(k in os.environ for k in FORCED_KERNEL_VARIABLES)
            note = forced and forced_kernel_line(row["versions"].get("tinytrain", {}), cpu_own_blas_kernel())
            if note:
                print(note)
            print(
                f"{'config':<8} {'params':>10} {'tokens':>7} {'tinytrain ms':>13} {'torch ms':>9} {'ratio':>6}"
                "  idle-neighbour check"
            )
        rows.append(row)
        torch_ms = f"{row['torch_ms']:9.2f}" if "torch_ms" in row else f"{'-':>9}"
        ratio = f"{row['ratio']:5.2f}x" if "ratio" in row else f"{'-':>6}"
        if "ratio" in row and not row["pinned_reference"]:
            ratio = ratio[:-1] + "*"
        print(
            f"{name:<8} {row['params']:>10,} {row['tokens']:>7} {row['tinytrain_ms']:13.2f} {torch_ms} {ratio}"
            f"  {_check(row)}",
            flush=True,
        )
        if args.precision:
            print(low_precision_line(row), flush=True)
        if args.profile:
            print(profile_table(row, args.profile), flush=True)
    print("ratio = tinytrain step time / PyTorch step time (above 1: tinytrain slower; 1.0 = as fast)")
    if args.precision:
        print(
            f"{args.precision}/fp32 = each framework's {args.precision} step over its own float32 step (above 1: "
            f"mixed precision slower); vs torch = tinytrain's {args.precision} step over PyTorch's autocast step"
        )
    if any("ratio" in row and not row["pinned_reference"] for row in rows):
        print(
            f"* not against the pinned reference: PyTorch {PINNED_TORCH} is what these ratios are measured against "
            '(`pip install -e ".[bench]"`); another PyTorch gives other ratios, so compare these with care'
        )
    print(
        f"idle-neighbour check: CPU the worker not being timed used meanwhile, in % of one core "
        f"(DISTURBED above {100 * IDLE_LIMIT:.0f}%: the timings include the other's thread pool)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def low_precision_line(row: dict) -> str:
    """The row's 16-bit line, under its float32 one: each framework's step and its ratio to its own
    float32 step, and tinytrain's over PyTorch's."""
    p = row["precision"]
    text = f"  {p}: tinytrain {row['tinytrain_low_ms']:.2f} ms ({row['low_ratio']:.2f}x its fp32)"
    if "torch_low_ms" in row:
        mark = "" if row["pinned_reference"] else "*"
        text += (
            f", torch autocast {row['torch_low_ms']:.2f} ms ({row['torch_low_ratio']:.2f}x its fp32), "
            f"{row['low_vs_torch']:.2f}x{mark} vs torch {p}"
        )
    return text


def versions_lines(row: dict) -> list[str]:
    """What each worker of ``row`` ran on, one line each."""
    lines = []
    for name, v in row.get("versions", {}).items():
        if v.get("framework") == "torch":
            lines.append(f"{name}: PyTorch {v['torch']} (BLAS {v['blas']}), {v['threads']} threads")
        elif v:
            kernel = f", {v['blas_kernel']} kernels" if v.get("blas_kernel") else ""
            lines.append(
                f"{name}: tinytrain on NumPy {v['numpy']} (BLAS {v['blas']}{kernel}), {v['threads']} threads "
                f"(its BLAS: {v['blas_threads']} per product piece)"
            )
    return lines


def profile_table(row: dict, steps: int) -> str:
    """The per-op table of a ``compare(..., profile=...)`` row: ms per step in each framework,
    slowest tinytrain op first; the time outside any op (Python, the autograd engine) at the end."""
    frameworks = list(row["ops"])
    ops = [row["ops"][f] for f in frameworks]
    names = sorted({k for o in ops for k in o} - {"step"}, key=lambda k: -ops[0].get(k, 0.0))
    head = f"  {'op':<28}" + "".join(f" {f[:12] + ' ms':>15}" for f in frameworks)
    lines = [
        f"  {row['config']}: per op, ms per step, {steps} profiled steps each (profilers add overhead to both)",
        head + ("   ratio" if len(ops) == 2 else ""),
    ]

    def line(label, values):
        text = f"  {label:<28}" + "".join(f" {v:15.2f}" if v is not None else f" {'-':>15}" for v in values)
        if len(values) == 2 and values[0] and values[1]:
            text += f" {values[0] / values[1]:6.2f}x"
        return text

    for name in names:
        lines.append(line(name, [1e3 * o[name] if name in o else None for o in ops]))
    outside = [1e3 * (o["step"] - sum(v for k, v in o.items() if k != "step")) for o in ops]
    lines.append(line("(outside ops: Python, engine)", outside))
    lines.append(line("step", [1e3 * o["step"] for o in ops]))
    return "\n".join(lines)


def _check(row: dict) -> str:
    if "idle_cpu" not in row:
        return "- (tinytrain alone)"
    shares = ", ".join(f"{k} {100 * v:.1f}%" for k, v in row["idle_cpu"].items())
    return ("DISTURBED: " if row["disturbed"] else "ok: ") + shares


if __name__ == "__main__":  # a worker: python -m tinytrain.bench.step --worker FRAMEWORK CONFIG THREADS
    if sys.argv[1:2] != ["--worker"] or len(sys.argv) != 6:
        sys.exit("run `tinytrain bench step` (this module's own entry is its worker)")
    sys.exit(_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]))
