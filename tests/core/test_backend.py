"""backend: the device choice from TINYTRAIN_DEVICE (in subprocesses), to_host, index_add."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy
import pytest

from tinytrain import backend
from tinytrain.backend import index_add, to_host, xp


def import_backend(device):
    env = dict(os.environ, TINYTRAIN_DEVICE=device)
    code = "import tinytrain.backend as b; print('DEVICE', b.device, b.xp.__name__); print('WHY', b.device_reason)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_bogus_device_is_a_clear_error():
    r = import_backend("bogus")
    assert r.returncode != 0
    assert "BackendError" in r.stderr
    assert "TINYTRAIN_DEVICE='bogus' is not one of cpu, gpu, auto, strict" in r.stderr


def test_cpu_device_uses_numpy():
    r = import_backend(" CPU ")  # case and spaces do not matter
    assert r.returncode == 0, r.stderr
    assert "DEVICE cpu numpy" in r.stdout and "WHY TINYTRAIN_DEVICE=cpu" in r.stdout


def test_strict_device_is_the_cupy_stand_in():
    r = import_backend("strict")
    assert r.returncode == 0, r.stderr
    assert "DEVICE strict tinytrain.backend.strict.xp" in r.stdout and "the strict stand-in for CuPy" in r.stdout


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_gpu_without_cupy_names_the_fix():
    r = import_backend("gpu")
    assert r.returncode != 0
    assert "BackendError" in r.stderr and "CuPy cannot be imported" in r.stderr
    assert 'pip install -e ".[gpu]"' in r.stderr and "TINYTRAIN_DEVICE=cpu" in r.stderr


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_auto_without_cupy_falls_back_to_the_cpu():
    r = import_backend("auto")
    assert r.returncode == 0, r.stderr
    assert "DEVICE cpu numpy" in r.stdout
    assert "WHY TINYTRAIN_DEVICE=auto (the default) and no usable GPU (ModuleNotFoundError" in r.stdout


def test_to_host_gives_numpy_with_the_same_values():
    a = xp.asarray(numpy.random.default_rng().standard_normal((3, 4)).astype(numpy.float32))
    h = to_host(a)
    assert isinstance(h, numpy.ndarray) and h.dtype == numpy.float32
    numpy.testing.assert_array_equal(h, numpy.asarray(a.get() if hasattr(a, "get") else a))
    assert isinstance(to_host([1, 2]), numpy.ndarray)
    assert backend.is_array(a) and not backend.is_array([1, 2])
    if backend.device == "cpu":
        assert backend.select_device_for_rank(3) is None
        backend.synchronize()  # a no-op on the CPU


def test_index_add_sums_repeated_indices():
    rng = numpy.random.default_rng()
    target = rng.standard_normal((5, 3)).astype(numpy.float32)
    index = numpy.array([0, 2, 2, 4, 2, 0])
    values = rng.standard_normal((6, 3)).astype(numpy.float32)
    expected = target.astype(numpy.float64)
    for i, v in zip(index, values):
        expected[i] += v
    t = xp.asarray(target.copy())
    index_add(t, xp.asarray(index), xp.asarray(values))
    numpy.testing.assert_allclose(to_host(t), expected, rtol=1e-6, atol=1e-6)
    # a plain fancy-index += would keep only one of the repeats
    naive = target.copy()
    naive[index] += values
    assert not numpy.allclose(naive, expected)


def test_default_rng_is_seeded():
    a = to_host(backend.default_rng((3, 7)).random(5))
    b = to_host(backend.default_rng((3, 7)).random(5))
    c = to_host(backend.default_rng((3, 8)).random(5))
    numpy.testing.assert_array_equal(a, b)
    assert not numpy.array_equal(a, c)


_REFILL = """
import resource, sys
import numpy as np
import tinytrain.backend as b
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
a = np.ones(1 << 21, np.float32)  # 8 MiB, then freed
del a
before = faults()
a = np.ones(1 << 21, np.float32)  # the next step's array of the same size
print(b.host_memory_kept, faults() - before)
"""


@pytest.mark.parametrize("keep", ["1", "0"])
def test_freed_host_memory_is_reused_without_page_faults(keep):
    """A step's big arrays come back every step: with tinytrain's malloc settings the second 8 MiB
    array reuses the first one's pages (no page faults); with TINYTRAIN_KEEP_FREED_MEMORY=0 (glibc's
    defaults) it is mapped afresh: hundreds of faults (the kernel maps a few pages per fault)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc settings: Linux only")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["TINYTRAIN_KEEP_FREED_MEMORY"] = keep
    r = subprocess.run([sys.executable, "-c", _REFILL], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    kept, faults = r.stdout.split()
    if keep == "1":
        assert kept == "True" and int(faults) < 50, r.stdout
    else:
        assert kept == "False" and int(faults) > 100, r.stdout
