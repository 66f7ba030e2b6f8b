"""numba.cuda kernels of gpu_kernels on numba's CUDA simulator (correctness only).

Runs only with NUMBA_ENABLE_CUDASIM=1 in the environment *before* numba is imported:
``tests/test_gpu_kernels.py`` launches this file in a subprocess with it set, so the
simulator never leaks into other tests. Sizes are tiny (the simulator runs every CUDA
thread as a Python thread) and ragged, so every edge guard is exercised.
"""

from __future__ import annotations

import math
import os
import sys
import threading

import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 (run by test_gpu_kernels.py in a subprocess)",
                allow_module_level=True)

import numpy as np  # noqa: E402
from accelopt_plugins.gpu_kernels.tiled import (  # noqa: E402
    KERNELS,
    TILE,
    const_input_kernel,
    launch_matmul,
)

SHAPES = [(1, 1, 1), (5, 7, 9), (17, 3, 18)]


@pytest.fixture(autouse=True)
def _shared_arrays_made_once_per_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """numba's simulator gives a block's threads one shared array by a check-then-set on a
    dict with no lock (``FakeCUDAShared.array``), and the stack walk in between lets another
    thread in: two threads can each make one, and the kernel then reads memory its
    neighbours never wrote (uninitialised values like 1e36 in one column, seen on a loaded
    2-core CI VM). A real GPU has no such race; the lock makes the simulator keep the
    contract the kernels are written for."""
    from numba.core import types
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    from numba.np import numpy_support

    made_once = threading.Lock()
    dynamic = FakeCUDAShared.array

    def locked(self: FakeCUDAShared, shape: object, dtype: object) -> np.ndarray:
        if shape == 0:  # dynamic shared memory: one buffer made up front, no race
            return dynamic(self, shape, dtype)
        caller = sys._getframe(1)  # one array per kernel source line, as the simulator keys
        key = (caller.f_code.co_filename, caller.f_lineno)
        with made_once:
            found = self._allocations.get(key)
            if found is None:
                if isinstance(dtype, types.Type):
                    dtype = numpy_support.as_dtype(dtype)
                found = self._allocations[key] = np.empty(shape, dtype)
        return found

    monkeypatch.setattr(FakeCUDAShared, "array", locked)


def _case(m: int, k: int, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((m, k)).astype(np.float32),
            rng.standard_normal((k, n)).astype(np.float32),
            rng.standard_normal(n).astype(np.float32))


@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("shape", SHAPES)
def test_matmul_kernels_match_numpy(kind: str, shape: tuple[int, int, int]) -> None:
    a, b, bias = _case(*shape)
    c = np.full(shape[::2], np.nan, dtype=np.float32)
    launch_matmul(kind, a, b, c, bias)
    np.testing.assert_allclose(c, a @ b + bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KERNELS)
def test_strided_views_serve_the_backward_pass(kind: str) -> None:
    """Linear backward calls the kernel on transposed views (grad @ W, grad^T @ x)."""
    a, b, _ = _case(6, 19, 4, seed=1)
    bt = np.ascontiguousarray(b.T)
    c = np.full((6, 4), np.nan, dtype=np.float32)
    launch_matmul(kind, a, bt.T, c)  # and without bias
    np.testing.assert_allclose(c, a @ b, rtol=1e-5, atol=1e-5)


def test_const_input_kernel() -> None:
    a, b, _ = _case(3, 21, 18, seed=2)
    c = np.zeros((3, 18), dtype=np.float32)
    const_input_kernel(a)[(math.ceil(18 / TILE), math.ceil(3 / TILE)), (TILE, TILE)](b, c)
    np.testing.assert_allclose(c, a @ b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="64 KiB"):
        const_input_kernel(np.zeros((200, 100), dtype=np.float32))
