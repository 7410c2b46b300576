"""Optimizers (SGD with momentum, AdamW), gradient-norm clipping and a warmup + cosine schedule;
for mixed precision, float32 master weights and dynamic loss scaling (``LossScaler``).

Each optimizer keeps its per-parameter state in ``optimizer.state[param]`` (a dict of arrays),
so it can be inspected, counted (``state_bytes()``) and, in ZeRO, sharded. The update rule itself
is a plain function on arrays (``Optimizer.update``), so ZeRO can apply it to a shard of a
parameter with a shard of its gradient and a shard of its state.

Mixed precision (``--precision bf16|fp16``): the model's parameters and gradients are 16-bit, the
optimizer's state float32. For a 16-bit parameter the state holds ``master``, a float32 copy of it
(Micikevicius et al., 2018): an update smaller than half the parameter's spacing (bf16: 2^-8 of its
size) adds up there instead of being lost. So AdamW holds 12 bytes per element (master, m, v)
beside the parameter's 2 and the gradient's 2: 2Ψ + 2Ψ + 12Ψ, and ZeRO shards the master with the
moments, since it is part of the state (assignment 8, task 8.3).
"""

from __future__ import annotations

import functools
import math

from tinytrain.autograd import timed
from tinytrain.autograd.threads import in_pieces
from tinytrain.backend import is_low_precision, to_host, xp


class Optimizer:
    # The gradients are this many times the loss's (fp16 loss scaling: ``LossScaler``): a step must
    # take them as the loss's own (task 8.3).
    loss_scale = 1.0

    def __init__(self, params, lr: float):
        self.params = list(params)
        if not self.params:
            raise ValueError("the optimizer got no parameters")
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("a parameter appears twice in the optimizer's list")
        if lr < 0:
            raise ValueError(f"learning rate must be >= 0, got {lr}")
        self.lr = lr
        self.state: dict = {}

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        """Update every parameter that has a gradient, in place."""
        with timed(f"{type(self).__name__} step"):
            for p in self.params:
                if p.grad is None:
                    continue
                state = self.state.get(p)
                if state is None:
                    state = self.state[p] = self.init_state(p.data)
                self.update(p.data, p.grad, state)

    def init_state(self, param) -> dict:
        """The state of a new parameter array (or ZeRO's piece of one): the rule's (``new_state``);
        for a 16-bit ``param`` also ``master``, its float32 copy, and the rule's state is float32."""
        if not is_low_precision(param.dtype):
            return self.new_state(param)
        # BEGIN SOLUTION 8.3 "A 16-bit parameter's state: what the rule keeps, made for a full-precision copy of the parameter, and that copy." full="master = param.astype(xp.float32) (a copy); return the dict of self.new_state(master) plus master."
        master = param.astype(xp.float32)
        return {**self.new_state(master), "master": master}
        # END SOLUTION

    def update(self, param, grad, state) -> None:
        """One step of the rule for the array ``param`` (in place), from ``grad`` (``loss_scale``
        times the loss's gradient; the caller's array stays unchanged) and ``state``. With a float32
        ``master`` in the state, afterwards the master holds the float32 result and ``param`` (the
        same array as before) that value in its own dtype."""
        master = state.get("master")
        if master is None:
            self.rule(param, grad / self.loss_scale if self.loss_scale != 1 else grad, state)
            return
        # BEGIN SOLUTION 8.3 "After the call the full-precision copy holds the rule's step taken in full precision from the true (unscaled) gradient, the 16-bit parameter holds that copy rounded, and the caller's gradient is unchanged." full="g32 = grad.astype(xp.float32) (a copy); if self.loss_scale != 1, multiply it by 1 / self.loss_scale; self.rule(master, g32, state); param[...] = master."
        g32 = grad.astype(xp.float32)  # a copy: the rule may change it
        if self.loss_scale != 1:
            g32 *= 1 / self.loss_scale
        self.rule(master, g32, state)
        param[...] = master  # round to nearest in param's dtype
        # END SOLUTION

    def new_state(self, param) -> dict:
        """The rule's state for ``param`` (its moments: arrays like it)."""
        raise NotImplementedError

    def rule(self, param, grad, state) -> None:
        """The update rule on arrays of one dtype, in place."""
        raise NotImplementedError

    def state_bytes(self) -> int:
        return sum(a.nbytes for s in self.state.values() for a in s.values() if hasattr(a, "nbytes"))

    # --- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """``{"lr": ..., "state": {param index: {name: host array or number}}}``."""
        index = {id(p): i for i, p in enumerate(self.params)}
        return {
            "lr": self.lr,
            "state": {
                index[id(p)]: {k: (to_host(v).copy() if hasattr(v, "shape") else v) for k, v in s.items()}
                for p, s in self.state.items()
            },
        }

    def load_state_dict(self, state: dict) -> None:
        self.lr = state["lr"]
        self.state = {}
        for i, s in state["state"].items():
            p = self.params[int(i)]
            self.state[p] = {k: (xp.array(v) if hasattr(v, "shape") and v.shape else v) for k, v in s.items()}


class SGD(Optimizer):
    """p -= lr · (g + wd·p), with heavy-ball momentum: v = μ·v + (g + wd·p); p -= lr·v.
    ``nesterov=True`` looks one step ahead (Sutskever et al. 2013, as torch.optim.SGD): p -= lr·(g + μ·v)."""

    def __init__(
        self, params, lr: float = 0.01, momentum: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False
    ):
        super().__init__(params, lr)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if nesterov and not momentum:
            raise ValueError("nesterov=True needs a momentum above 0")
        self.momentum, self.weight_decay, self.nesterov = momentum, weight_decay, nesterov

    def new_state(self, param):
        return {"momentum": xp.zeros_like(param)} if self.momentum else {}

    def rule(self, param, grad, state) -> None:
        if self.weight_decay:
            grad = grad + self.weight_decay * param
        if self.momentum:
            buf = state["momentum"]
            buf *= self.momentum
            buf += grad
            grad = grad + self.momentum * buf if self.nesterov else buf
        param -= self.lr * grad


class AdamW(Optimizer):
    """Adam with bias correction and decoupled weight decay (Loshchilov & Hutter):

    m = β1·m + (1-β1)·g          v = β2·v + (1-β2)·g²
    p -= lr · ( m/(1-β1^t) / (sqrt(v/(1-β2^t)) + eps)  +  wd·p )
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01):
        super().__init__(params, lr)
        b1, b2 = betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        self.betas, self.eps, self.weight_decay = (b1, b2), eps, weight_decay

    def new_state(self, param):
        return {"step": 0, "exp_avg": xp.zeros_like(param), "exp_avg_sq": xp.zeros_like(param)}

    def rule(self, param, grad, state) -> None:
        state["step"] += 1
        t = state["step"]
        b1, b2 = self.betas
        kernel = functools.partial(
            _adamw_kernel,
            b1=b1,
            b2=b2,
            step_size=self.lr / (1 - b1**t),
            v_correction=1 / (1 - b2**t),
            eps=self.eps,
            decay=1 - self.lr * self.weight_decay,
        )
        arrays = (param, grad, state["exp_avg"], state["exp_avg_sq"], xp.empty_like(param))
        if all(a.flags.c_contiguous for a in arrays):  # flat views: the pieces can be cut anywhere
            in_pieces(kernel, *(a.reshape(-1) for a in arrays))
        else:
            kernel(*arrays)


def _adamw_kernel(param, grad, m, v, scratch, *, b1, b2, step_size, v_correction, eps, decay):
    """AdamW's rule on one piece, in place: every line one pass into an existing array (``scratch``
    holds each intermediate), so a step makes no temporary of a parameter's size. The moments'
    updates are written m += (1-β1)·g after m *= β1: the same two roundings as β1·m + (1-β1)·g."""
    m *= b1
    xp.multiply(grad, 1 - b1, out=scratch)
    m += scratch
    v *= b2
    xp.multiply(grad, grad, out=scratch)
    scratch *= 1 - b2
    v += scratch
    if decay != 1:
        param *= decay  # decoupled: not part of the gradient
    xp.multiply(v, v_correction, out=scratch)
    xp.sqrt(scratch, out=scratch)
    scratch += eps
    xp.divide(m, scratch, out=scratch)
    scratch *= step_size
    param -= scratch


def clip_grad_norm_(params, max_norm: float, total_norm: float | None = None) -> float:
    """Scale all gradients so their global L2 norm is at most ``max_norm``; return the norm
    before clipping. Sharded strategies compute the global norm themselves and pass it in."""
    grads = [p.grad for p in params if p.grad is not None]
    if total_norm is None:
        total_norm = math.sqrt(sum(float((g.astype(xp.float64) ** 2).sum()) for g in grads))
    if max_norm > 0 and total_norm > max_norm:
        scale = max_norm / (total_norm + 1e-6)
        for g in grads:
            g *= scale
    return total_norm


def grads_finite(grads) -> bool:
    """Whether every entry of every array in ``grads`` (None skipped) is finite: one bool to the host."""
    # BEGIN SOLUTION 8.2 "True when no array holds an inf or a NaN (None and empty arrays hold neither), with one answer brought to the host at the end, not one per array." full="ok = True; for each g not None and of size > 0, ok = ok & xp.isfinite(g).all(); return bool(ok)."
    ok = True
    for g in grads:
        if g is not None and g.size:
            ok = ok & xp.isfinite(g).all()
    return bool(ok)
    # END SOLUTION


class LossScaler:
    """Dynamic loss scaling for float16 training (Micikevicius et al., *Mixed Precision Training*, 2018).

    float16 keeps 5 exponent bits: nothing below 2^-24 (6e-8) survives, and backward's small
    gradients (a mean over many tokens, the gradient of a deep activation) round to zero. So
    backward runs on the loss times ``scale`` (``autograd.loss_scaling``: every gradient comes out
    ``scale`` times larger, into float16's range), and the optimizer divides by it again, in
    float32 (``Optimizer.loss_scale``). Too large a scale overflows float16's 65504 instead; the
    scaler then skips the step and lowers the scale, and raises it again after a run of clean
    steps (``backoff``, ``growth``, ``growth_interval``; the rule: assignment 8's handout, §4).

    PyTorch's GradScaler has the same defaults but a growth interval of 2000 steps; 200 suits runs of
    a few hundred steps. bfloat16 has float32's exponent range and needs no scaling.
    """

    def __init__(self, scale: float = 2.0**16, growth: float = 2.0, backoff: float = 0.5, growth_interval: int = 200):
        if scale <= 0 or growth <= 1 or not 0 < backoff < 1 or growth_interval < 1:
            raise ValueError("LossScaler needs scale > 0, growth > 1, 0 < backoff < 1 and growth_interval >= 1")
        self.scale, self.growth, self.backoff, self.growth_interval = float(scale), growth, backoff, growth_interval
        self.clean_steps = 0  # clean steps since the last change of scale
        self.skipped = False  # was the last step skipped?

    def update(self, found_inf: bool) -> bool:
        """After a step's backward: True to take the step; False to skip it (and halve the scale)."""
        # BEGIN SOLUTION 8.2 "Dynamic loss scaling as Micikevicius et al. state it; returns whether this step may be applied." full="self.skipped = bool(found_inf); on found_inf: scale *= backoff, clean_steps = 0, return False; else clean_steps += 1, if clean_steps == growth_interval: scale *= growth, clean_steps = 0; return True."
        self.skipped = bool(found_inf)
        if self.skipped:
            self.scale *= self.backoff
            self.clean_steps = 0
            return False
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth
            self.clean_steps = 0
        return True
        # END SOLUTION

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])


class WarmupCosine:
    """Linear warmup from 0 to ``base_lr`` over ``warmup`` steps, then a cosine decay to
    ``min_lr`` at ``total`` steps (and ``min_lr`` after). Call ``step()`` once per update."""

    def __init__(
        self, optimizer: Optimizer, warmup: int, total: int, min_lr: float = 0.0, base_lr: float | None = None
    ):
        if total <= 0 or warmup < 0 or warmup > total:
            raise ValueError(f"need 0 <= warmup <= total and total > 0, got warmup={warmup}, total={total}")
        self.optimizer, self.warmup, self.total, self.min_lr = optimizer, warmup, total, min_lr
        self.base_lr = optimizer.lr if base_lr is None else base_lr
        self.last_step = 0
        optimizer.lr = self.lr_at(1)

    def lr_at(self, step: int) -> float:
        """Learning rate used for update number ``step`` (1-based)."""
        if step <= self.warmup:
            return self.base_lr * step / max(1, self.warmup)
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_lr + 0.5 * (self.base_lr - self.min_lr) * (1 + math.cos(math.pi * progress))

    def step(self) -> None:
        self.last_step += 1
        self.optimizer.lr = self.lr_at(self.last_step + 1)
