"""The fused ops' kernels cut into pieces of rows, one per thread (tinytrain.autograd.threads):
the same numbers and gradients as in one piece, every row done once, errors not lost."""

import threading
import warnings

import numpy as np
import pytest

import tinytrain.functional as F
from tinytrain.autograd import Tensor, ops, threads
from tinytrain.backend import on_device, to_host, xp
from tinytrain.testing import assert_close, gradcheck


@pytest.fixture
def three_threads(monkeypatch):
    """Three threads, and pieces however small: the threaded path even on tiny test arrays."""
    monkeypatch.setattr(threads, "THREADS", 3)
    monkeypatch.setattr(threads, "MIN_PIECE", 1)
    monkeypatch.setattr(ops, "LAYER_NORM_PIECE", 1)
    monkeypatch.setattr(threads, "MIN_CAST_PIECE", 1)
    monkeypatch.setattr(threads, "_pool", [None])
    yield
    if threads._pool[0] is not None:
        threads._pool[0].shutdown()


def test_each_row_is_done_once_and_the_pieces_run_in_threads(three_threads):
    data = np.arange(7.0)[:, None] * np.ones(2)  # row i holds i
    seen = {}  # first row of a piece -> (thread, rows)

    def kernel(piece):
        seen[int(piece[0, 0])] = (threading.get_ident(), len(piece))
        piece += 100

    threads.in_pieces(kernel, data)
    assert (data[:, 0] == np.arange(7.0) + 100).all(), "every row exactly once"
    if not on_device:  # on a GPU the kernel runs once, on the whole array
        assert {first: rows for first, (_, rows) in seen.items()} == {0: 2, 2: 2, 4: 3}
        assert seen[0][0] == threading.get_ident(), "the first piece runs on the calling thread"
        assert seen[2][0] != threading.get_ident() and seen[4][0] != threading.get_ident()


@pytest.mark.skipif(on_device, reason="on a GPU the kernel runs once, on the calling thread")
def test_the_callers_floating_point_settings_hold_in_every_piece(three_threads):
    """numpy.errstate is the caller's: a piece on another thread raises what the caller raises and
    keeps quiet about what it ignores (only the last of three pieces overflows here)."""
    a = np.ones((9, 4), dtype=np.float32)
    a[-1] = 1e30

    def scale(piece, out):
        np.multiply(piece, np.float32(1e30), out=out)

    out = np.empty_like(a)
    with np.errstate(over="raise"), pytest.raises(FloatingPointError):
        threads.in_pieces(scale, a, out)
    with np.errstate(over="ignore"), warnings.catch_warnings():
        warnings.simplefilter("error")
        threads.in_pieces(scale, a, out)
    assert np.isinf(out[-1]).all() and (out[:-1] == np.float32(1e30)).all()


def test_an_error_in_a_worker_thread_reaches_the_caller(three_threads):
    def kernel(piece):
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("bad piece")

    with pytest.raises(ValueError, match="bad piece"):
        threads.in_pieces(kernel, np.arange(12.0).reshape(6, 2))


def fused_ops(x, w, b, qkv, approximate="tanh"):
    """GELU, LayerNorm and (causal) attention, the ops whose kernels run in pieces."""
    h = F.layer_norm(F.gelu(x, approximate=approximate), w, b)
    q = k = v = h.reshape(*qkv)
    return F.scaled_dot_product_attention(q, k, v, causal=True)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pieces_give_the_numbers_of_one_piece(rng, three_threads, monkeypatch, dtype, approximate):
    x, w, b = rng.standard_normal((4, 6, 8)), rng.standard_normal(8), rng.standard_normal(8)
    grad = rng.standard_normal((4, 2, 6, 4))
    results = []
    for n_threads in (3, 1):
        monkeypatch.setattr(threads, "THREADS", n_threads)
        leaves = [Tensor(a.astype(dtype), requires_grad=True) for a in (x, w, b)]
        out = fused_ops(*leaves, (4, 6, 2, 4), approximate)
        out = out.transpose(1, 2)  # (4, 2, 6, 4): heads first, as grad is laid out
        out.backward(Tensor(grad.astype(dtype)))
        results.append([out.numpy()] + [t.grad for t in leaves])
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for name, threaded, single in zip(["output", "dx", "dw", "db"], *results):
        assert_close(threaded, single, atol=tol, rtol=tol, what=f"{name} in 3 pieces vs 1")


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gradients_in_pieces_pass_gradcheck(rng, three_threads, approximate):
    x, w, b = (Tensor(rng.standard_normal(s), requires_grad=True) for s in ((3, 4, 6), (6,), (6,)))
    gradcheck(
        lambda a, c, d: fused_ops(a, c, d, (3, 4, 2, 3), approximate),
        [x, w, b],
        what=f"gelu ({approximate}), layer_norm, attention",
    )


def test_thread_count_follows_omp_and_the_ranks_on_this_machine(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 8)  # 8 CPUs this process may use
    for name in ("OMP_NUM_THREADS", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert threads.thread_count() == 8
    monkeypatch.setenv("MPI_LOCALNRANKS", "4")  # 4 ranks share the 8 CPUs
    assert threads.thread_count() == 2
    monkeypatch.setenv("MPI_LOCALNRANKS", "16")
    assert threads.thread_count() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # an explicit setting wins
    assert threads.thread_count() == 3


@pytest.mark.parametrize(
    "shape",
    [(7, 5, 3), (3, 5, 7), (1, 4, 9), (9, 4, 1), (2, 3, 2), (0, 3, 4), (4, 3, 0), (4, 0, 5)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_products_in_pieces_give_the_product(rng, three_threads, monkeypatch, shape):
    """threads.matmul cuts the rows (or, for a wider b, the columns) among 3 threads: the same
    numbers as one product, with a bias, for transposed and strided operands, and for empty ones."""
    monkeypatch.setattr(threads, "MIN_GEMM", 1)
    m, k, n = shape
    a, b, bias = rng.standard_normal((m, k)), rng.standard_normal((k, n)), rng.standard_normal(n)

    def product(a, b, bias=None):  # on the backend's arrays (a device's too), back on the host
        return to_host(threads.matmul(xp.asarray(a), xp.asarray(b), None if bias is None else xp.asarray(bias)))

    assert_close(product(a, b), a @ b, atol=1e-12, what="a @ b in pieces")
    assert_close(product(a, b, bias), a @ b + bias, atol=1e-12, what="a @ b + bias in pieces")
    a_t = xp.ascontiguousarray(xp.asarray(a).T).T  # a transposed view: column-major
    b_strided = xp.repeat(xp.asarray(b), 2, axis=1)[:, ::2]  # every other column of a wider array
    assert_close(to_host(threads.matmul(a_t, b_strided)), a @ b, atol=1e-12, what="transposed and strided operands")


def _f32_hard_values():
    """float32 values at every edge of float16 and bfloat16: zeros, float16's subnormals and the
    ties between them, its smallest normal, its largest finite and the overflow past it, infinities,
    NaN, float32's own subnormals; each with both signs."""
    tiny = 2.0**-24  # float16's smallest subnormal
    values = [0.0, tiny / 2, tiny / 2 * 1.0001, tiny, tiny * 1.5, tiny * 2.5, tiny * 1023.5, 2.0**-14 * (1 - 2**-12)]
    values += [2.0**-14, 1.0, 65504.0, 65519.0, 65520.0, 1e6, np.inf, np.nan, 1e-40, 3.0e38]
    return np.array(values + [-v for v in values], dtype=np.float32)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided", "3 ranks of rows"])
def test_cast_gives_astypes_bits_in_any_layout(rng, three_threads, dtype, layout):
    # Drawn values spanning float16's subnormal range (where the cast takes its own path) and
    # beyond, with the hard values planted among them.
    drawn = rng.standard_normal(3000) * np.exp(rng.uniform(-25, 3, 3000))
    flat = np.concatenate([_f32_hard_values(), drawn.astype(np.float32)])
    a = {
        "contiguous": flat[:3000].reshape(100, 30),
        "transposed": flat[:3000].reshape(30, 100).T,
        "strided": flat[:3000].reshape(100, 30)[:, ::3],
        "3 ranks of rows": flat[:3003].reshape(3, 1001),
    }[layout]
    target = np.dtype(dtype) if dtype == "float16" else np.dtype(__import__("ml_dtypes").bfloat16)
    with np.errstate(all="ignore"):
        expected = a.astype(target)
        got = to_host(threads.cast(xp.asarray(a), target))
    assert got.dtype == target and got.shape == a.shape
    assert (got.view(np.uint16) == expected.view(np.uint16)).all(), f"{layout}: bits differ from astype's"
    back = to_host(threads.cast(xp.asarray(expected), np.float32))
    assert (np.isnan(back) == np.isnan(expected.astype(np.float32))).all()
    assert (back[~np.isnan(back)] == expected.astype(np.float32)[~np.isnan(back)]).all(), "the way back is exact"


def test_cast_into_out_writes_every_entry(rng, three_threads):
    a = rng.standard_normal((7, 5)).astype(np.float32) * 1e-6  # float16 subnormals
    out = xp.zeros((7, 5), dtype=np.float16)
    assert threads.cast(xp.asarray(a), np.float16, out=out) is out
    with np.errstate(all="ignore"):
        assert (to_host(out).view(np.uint16) == a.astype(np.float16).view(np.uint16)).all()


def test_bfloat16_casts_give_astypes_bits_for_every_pattern(rng, three_threads, monkeypatch):
    """threads.cast's own bfloat16 kernels (integer passes over the bits) against ml_dtypes' astype:
    every one of the 65,536 bfloat16s up to float32, and 200,000 float32s drawn as bit patterns
    (subnormals, infinities, NaNs of every payload and sign among them) down to bfloat16, in blocks
    that do not divide a piece."""
    monkeypatch.setattr(threads, "BF16_BLOCK", 1000)
    bf16 = np.dtype(__import__("ml_dtypes").bfloat16)
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(bf16).reshape(256, 256)
    up = to_host(threads.cast(xp.asarray(every), np.float32))
    assert up.dtype == np.float32 and (up.view(np.uint32) == every.astype(np.float32).view(np.uint32)).all()
    drawn = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32).reshape(400, 500)
    # the first piece of three has NaNs (the whole piece converted by astype); the last none, so its
    # every entry goes through the integer passes: the drawn bits with their NaNs made 0, and each
    # kept half (odd and even, both signs, the largest finite) with each dropped half at and around
    # the tie and at its ends
    drawn[:100, :3] = [np.nan, -np.nan, np.float32(np.uint32(0x7F800001).view(np.float32))]
    drawn[200:][np.isnan(drawn[200:])] = 0.0
    kept = np.array([0x3F80, 0x3F81, 0xBF80, 0xBF81, 0x7F7F, 0x0001, 0x0000], dtype=np.uint32)
    dropped = np.array([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    edges = ((kept[:, None] << 16) | dropped[None, :]).reshape(-1)
    drawn[-1, :] = np.resize(edges, 500).view(np.float32)
    with np.errstate(invalid="ignore"):  # NumPy warns of the NaNs it casts
        down = to_host(threads.cast(xp.asarray(drawn), bf16))
        expected = drawn.astype(bf16)
    assert (down.view(np.uint16) == expected.view(np.uint16)).all()


def test_float16_casts_give_astypes_bits_for_every_pattern(rng, three_threads):
    """threads.cast's float16 kernels against NumPy's astype: every one of the 65,536 float16s up to
    float32 (a lookup: NaN payloads and subnormals as NumPy makes them), and down, float32s drawn as
    bit patterns and over float16's whole range, where pieces hold no tiny entry, a few, or only them."""
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).reshape(256, 256)
    up = to_host(threads.cast(xp.asarray(every), np.float32))
    assert up.dtype == np.float32 and (up.view(np.uint32) == every.astype(np.float32).view(np.uint32)).all()
    # three pieces of 100 rows: drawn as bit patterns and over float16's whole range (a few tiny
    # entries among them), none tiny, all tiny
    patterns = rng.integers(0, 1 << 32, 25_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    ranged = (rng.standard_normal(25_000) * np.exp(rng.uniform(-25, 12, 25_000))).astype(np.float32)
    drawn = np.concatenate([patterns, ranged, np.zeros(100_000, dtype=np.float32)]).reshape(300, 500)
    drawn[100:200] = rng.standard_normal((100, 500)) + 8.0
    drawn[200:300] = rng.uniform(-(2.0**-14), 2.0**-14, (100, 500))
    drawn[99, : _f32_hard_values().size] = _f32_hard_values()
    with np.errstate(all="ignore"):  # NumPy warns of the NaNs, overflows and underflows it casts
        down = to_host(threads.cast(xp.asarray(drawn), np.float16))
        expected = drawn.astype(np.float16)
    assert down.dtype == np.float16 and (down.view(np.uint16) == expected.view(np.uint16)).all()
