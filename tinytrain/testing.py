"""Test helpers: a numerical gradient check and an array comparison that explains a mismatch.

``gradcheck`` compares the gradient that ``backward()`` computes with one measured by finite
differences. It checks one random direction of the output at a time: with random weights ``w`` of
the output's shape it differentiates the scalar ``sum(out * w)``, which exercises every output
element (a plain ``sum`` would hide, e.g., a transposed gradient whose entries add up right).

Why **central** differences: ``(f(x+eps) - f(x-eps)) / 2eps`` has error O(eps²), where the one-sided
``(f(x+eps) - f(x)) / eps`` has error O(eps). Why **float64**: the numeric derivative divides a
difference of two nearly equal numbers by eps, so rounding error grows like
machine-epsilon / eps. In float64 (epsilon ~1e-16) with eps = 1e-6 that is ~1e-10 and the
O(eps²) term ~1e-12: far below the tolerance. In float32 (epsilon ~1e-7) it would be ~0.1, useless.
So every floating-point input is copied to float64 before checking.
"""

from __future__ import annotations

import numpy

from tinytrain.autograd import Tensor, no_grad
from tinytrain.backend import to_host, xp


def _host(a) -> numpy.ndarray:
    return to_host(a.data if isinstance(a, Tensor) else a)


def assert_same_kind(actual, expected, what: str, dtype=None) -> None:
    """Assert ``actual`` has ``expected``'s shape and dtype (or ``dtype``, when the expected values
    were computed in another precision), naming both: a float64 leak, a transposed or flattened
    result, a missing axis fail here with what to look at, before any value is compared."""
    a = actual.data if isinstance(actual, Tensor) else actual
    e = expected.data if isinstance(expected, Tensor) else expected
    got_dtype, want_dtype = (
        numpy.dtype(getattr(a, "dtype", type(a))),
        numpy.dtype(dtype or getattr(e, "dtype", type(e))),
    )
    got_shape, want_shape = tuple(getattr(a, "shape", ())), tuple(getattr(e, "shape", ()))
    if got_shape != want_shape or got_dtype != want_dtype:
        raise AssertionError(
            f"{what}: got dtype {got_dtype} and shape {got_shape}, expected dtype {want_dtype} and shape {want_shape}"
            + (
                " (keep the input's dtype: an operation with a float64 array or scalar promotes)"
                if got_dtype != want_dtype
                else ""
            )
        )


def gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-4, seed=0, what="") -> bool:
    """Check ``backward()`` of ``fn(*inputs)`` against float64 central differences.

    ``inputs`` may mix Tensors and other arguments (integer ids, shapes, ...); only Tensors with
    ``requires_grad`` are checked, each as a float64 copy (the caller's tensors are not touched).
    ``fn`` may return one Tensor or a list/tuple of them. It must be deterministic: a function that
    draws random numbers (dropout) should create its generator from a fixed seed on every call.
    ``seed`` picks the random projection weights. It is fixed by default: tests draw fresh random
    inputs, so a failure is reproduced from the inputs alone. ``what`` is quoted in the error.
    Raises AssertionError naming the input, the worst element, and both gradients; returns True.
    """
    inputs = [
        Tensor(xp.array(a.data, dtype=xp.float64), requires_grad=a.requires_grad)
        if isinstance(a, Tensor) and a.dtype.kind == "f"
        else a
        for a in inputs
    ]
    checked = [i for i, a in enumerate(inputs) if isinstance(a, Tensor) and a.requires_grad]
    if not checked:
        raise ValueError("gradcheck: no input requires grad, so there is nothing to check")

    def outputs():
        out = fn(*inputs)
        return list(out) if isinstance(out, (list, tuple)) else [out]

    rng = numpy.random.default_rng(seed)
    outs = outputs()
    weights = [rng.standard_normal(o.shape) for o in outs]

    def projection() -> float:  # sum(out * w), in float64 on the host
        with no_grad():
            return sum(float((_host(o).astype(numpy.float64) * w).sum()) for o, w in zip(outputs(), weights))

    # Analytic: backward of sum(out * w) is backward of each output with grad w.
    for k, (o, w) in enumerate(zip(outs, weights)):
        if o.requires_grad:
            o.backward(xp.asarray(w, dtype=o.dtype), retain_graph=k < len(outs) - 1)

    where = f" ({what})" if what else ""
    for i in checked:
        x = inputs[i]
        analytic = numpy.zeros(x.shape) if x.grad is None else _host(x.grad)
        if analytic.shape != x.shape:
            raise AssertionError(f"gradcheck{where}: input {i} has shape {x.shape} but its gradient {analytic.shape}")
        numeric = numpy.zeros(x.shape)
        flat = x.data.reshape(-1)  # a view: writing it perturbs the input in place
        for j in range(flat.size):
            orig = flat[j].item()
            flat[j] = orig + eps
            plus = projection()
            flat[j] = orig - eps
            minus = projection()
            flat[j] = orig
            numeric.flat[j] = (plus - minus) / (2 * eps)
        err = numpy.abs(analytic - numeric) - (atol + rtol * numpy.abs(numeric))
        if not (err <= 0).all():  # also catches NaN
            worst = numpy.unravel_index(int(numpy.argmax(numpy.nan_to_num(err, nan=numpy.inf))), x.shape)
            worst = tuple(int(k) for k in worst)
            raise AssertionError(
                f"gradcheck{where}: wrong gradient for input {i} (shape {x.shape}) at index {worst}: "
                f"analytic {analytic[worst]:.8g} vs numeric {numeric[worst]:.8g} "
                f"(atol={atol}, rtol={rtol}, eps={eps}; {int((~(err <= 0)).sum())} of {err.size} "
                f"elements off; projection seed {seed})"
            )
    return True


def assert_close(actual, expected, atol=1e-5, rtol=1e-4, what="values") -> None:
    """Assert ``|actual - expected| <= atol + rtol * |expected|`` elementwise, saying where not.

    Accepts Tensors, NumPy or CuPy arrays and scalars. The message names the worst element (the
    one furthest outside its tolerance), both values, and how many elements are off.
    """
    a = _host(actual).astype(numpy.float64)
    e = _host(expected).astype(numpy.float64)
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shape {a.shape} differs from the expected {e.shape}")
    allowed = atol + rtol * numpy.abs(e)
    with numpy.errstate(invalid="ignore", divide="ignore"):  # inf - inf, x / 0: judged below
        diff = numpy.abs(a - e)
        ratio = numpy.nan_to_num(diff / allowed, nan=numpy.inf, posinf=numpy.inf)
    same_nan = numpy.isnan(a) & numpy.isnan(e)
    bad = ~((diff <= allowed) | same_nan | (a == e))  # a == e: equal infinities
    if not bad.any():
        return
    ratio = numpy.where(bad, ratio, -1.0)
    worst = numpy.unravel_index(int(numpy.argmax(ratio)), a.shape)
    at = f" at index {tuple(int(i) for i in worst)}" if a.ndim else ""
    raise AssertionError(
        f"{what}: {int(bad.sum())} of {a.size} elements differ; worst{at}: "
        f"got {a[worst]:.8g}, expected {e[worst]:.8g} (difference {diff[worst]:.3g}, allowed "
        f"{allowed[worst]:.3g} = atol {atol} + rtol {rtol} * |expected|)"
    )


def clean_factor(actual, expected, n: int) -> str:
    """How ``actual`` relates to ``expected`` when it is a clean multiple for a group of ``n`` ranks.

    Returns e.g. ``"x4 (each rank's part summed, not averaged: use op='avg' or divide by N)"`` when
    ``actual`` is ``expected`` times N, 1/N, N/(N-1) or (N-1)/N (the usual averaging mistakes of
    data parallelism), else "". The factor is fitted by least squares and must explain every element.
    """
    a = _host(actual).astype(numpy.float64).reshape(-1)
    e = _host(expected).astype(numpy.float64).reshape(-1)
    energy = float((e * e).sum())
    if a.shape != e.shape or n < 2 or energy == 0 or not numpy.isfinite(a).all():
        return ""
    ratio = float((a * e).sum()) / energy
    if not numpy.allclose(a, ratio * e, rtol=1e-3, atol=1e-6 * float(numpy.abs(e).max())):
        return ""
    causes = [
        (n, f"x{n}", "each rank's part summed, not averaged: use op='avg' or divide the sum by N"),
        (1 / n, f"x1/{n}", "divided by N once too often (an average of averages, or op='avg' and then / N)"),
        (n / (n - 1), f"x{n}/{n - 1}", "divided by N-1 instead of N (the ranks were counted without one of them)"),
        ((n - 1) / n, f"x{n - 1}/{n}", "one rank's part is missing (often the rank's own, or the server's)"),
    ]
    for factor, name, cause in causes:
        if abs(ratio - factor) <= 1e-3 * factor:
            return f"{name} ({cause})"
    return ""


def assert_matches_serial(actual, expected, n: int, what: str, atol=1e-6, rtol=1e-5) -> None:
    """Assert ``actual`` (a parallel run's value) matches ``expected`` (the serial run's) within
    ``atol + rtol * |expected|``; otherwise say by how much, and the factor when it is a clean one.
    The shape and dtype must be the serial run's (:func:`assert_same_kind`)."""
    assert_same_kind(actual, expected, what)
    a = _host(actual).astype(numpy.float64)
    e = _host(expected).astype(numpy.float64)
    if a.shape == e.shape and numpy.allclose(a, e, rtol=rtol, atol=atol):
        return
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shape {a.shape} differs from the serial run's {e.shape}")
    factor = clean_factor(a, e, n)
    err = float(numpy.nanmax(numpy.abs(a - e)))
    hint = f": it is the serial value {factor}" if factor else ""
    raise AssertionError(f"{what} is off from the serial run by {err:.3g}{hint}")
