"""Hand-written CUDA matmul kernels (numba.cuda) that follow the seed's memory-hierarchy
recipe, and a Linear replacement that uses them on CUDA devices.

* ``tiled``: classic shared-memory tiling: each block stages a TxT tile of A and of B in
  shared memory, every thread accumulates one output in a register (public SGEMM worklog:
  ~13% of cuBLAS).
* ``register_blocked``: each thread computes a TMxTN micro-tile held in registers
  (``cuda.local.array``) from BMxBK / BKxBN shared tiles: more reuse per shared load
  (worklog: ~69% of cuBLAS).
* ``const_input``: the *input* lives in constant memory (broadcast to a warp that reads the
  same address), the weights in shared-memory tiles, partial sums in registers: the seed's
  exact recipe. numba bakes constant arrays into the kernel at compile time, so this kernel
  is compiled per input: useful for a fixed input served many times (and to measure the
  idea), not as a training layer.

Every kernel computes ``C = A @ B (+ bias)`` on arbitrary strided 2-D float32 arrays, so the
backward pass reuses them through transposed views. Edges are guarded (any M, N, K).

numba is imported lazily: importing this module does not import ``numba.cuda``, whose
``NUMBA_ENABLE_CUDASIM`` setting is fixed at numba's import (tests run the simulator in a
subprocess for that reason). numba >= 0.61 deprecates its built-in CUDA target in favour of
NVIDIA's ``numba-cuda`` package; ``from numba import cuda`` resolves to whichever is
installed, and the kernels use only APIs both provide.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

if not hasattr(np, "row_stack"):
    # numpy 2.5 removed this alias of vstack, but numba-cuda's typing registry still names it
    # when it compiles a kernel (seen on an H200 image: numpy 2.5.2, every kernel launch
    # failed with "module 'numpy' has no attribute 'row_stack'"). Restoring the alias is
    # exact: it was defined as vstack.
    np.row_stack = np.vstack

KERNELS = ("tiled", "register_blocked")
TILE = 16


def const_input_kernel(x: Any, tile: int = TILE) -> Any:
    """The constant-memory-input kernel for host array ``x`` (see the module docstring)."""
    from accelopt_plugins.gpu_kernels import _cuda_kernels as kernels

    return kernels.const_input_kernel(x, tile)


def launch_matmul(kind: str, a: Any, b: Any, c: Any, bias: Any = None, stream: Any = 0) -> None:
    """``c[:] = a @ b (+ bias)`` with kernel ``kind`` on numba device arrays (or, in the
    simulator, numpy arrays). Shapes: a (M, K), b (K, N), c (M, N), bias (N,)."""
    import numpy as np

    m, n = c.shape
    has_bias = bias is not None
    if bias is None:
        bias = np.zeros(1, dtype=np.float32) if not hasattr(c, "__cuda_array_interface__") else c[0]
    from accelopt_plugins.gpu_kernels import _cuda_kernels as kernels

    if kind == "tiled":
        grid = (math.ceil(n / TILE), math.ceil(m / TILE))
        kernels.tiled_kernel()[grid, (TILE, TILE), stream](a, b, c, bias, has_bias)
    elif kind == "register_blocked":
        grid = (math.ceil(n / 64), math.ceil(m / 64))
        kernels.register_blocked_kernel()[grid, (16, 16), stream](a, b, c, bias, has_bias)
    else:
        raise ValueError(f"unknown kernel {kind!r}; use one of {KERNELS}")


def numba_cuda_usable() -> bool:
    """True when numba can launch on a real CUDA device (not the simulator)."""
    if not torch.cuda.is_available():
        return False
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        return False
    try:
        from numba import cuda

        return bool(cuda.is_available())
    except Exception:  # numba without a usable driver: the torch path is used instead
        return False


def _matmul_cuda(kind: str, a: torch.Tensor, b: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` on CUDA tensors through a numba kernel on torch's current stream."""
    from numba import cuda

    out = torch.empty(a.shape[0], b.shape[1], device=a.device, dtype=torch.float32)
    stream = cuda.external_stream(torch.cuda.current_stream(a.device).cuda_stream)
    launch_matmul(
        kind,
        cuda.as_cuda_array(a.detach()),
        cuda.as_cuda_array(b.detach()),
        cuda.as_cuda_array(out),
        None if bias is None else cuda.as_cuda_array(bias.detach()),
        stream,
    )
    return out


class _TiledLinearFn(torch.autograd.Function):
    """Forward and backward through the same kernel, on transposed (strided) views."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                kind: str) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.kind = kind
        ctx.has_bias = bias is not None
        return _matmul_cuda(kind, x, weight.t(), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        gx = _matmul_cuda(ctx.kind, grad, weight) if ctx.needs_input_grad[0] else None
        gw = _matmul_cuda(ctx.kind, grad.t(), x) if ctx.needs_input_grad[1] else None
        gb = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


class TiledLinear(nn.Linear):
    """``nn.Linear`` computed by a numba.cuda kernel on CUDA float32 inputs; anywhere else
    (CPU, other dtypes) it is exactly ``F.linear`` and says so in ``last_path``."""

    kernel: str
    last_path: str

    @classmethod
    def from_linear(cls, layer: nn.Linear, kernel: str = "register_blocked") -> TiledLinear:
        if kernel not in KERNELS:
            raise ValueError(f"unknown kernel {kernel!r}; use one of {KERNELS}")
        new = cls.__new__(cls)
        state = dict(vars(layer))
        for key in ("_parameters", "_buffers", "_modules"):
            state[key] = dict(state[key])
        new.__dict__.update(state)
        new.kernel = kernel
        new.last_path = "none"
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            self.last_path = self.kernel
            flat = x.reshape(-1, self.in_features).contiguous()
            y = _TiledLinearFn.apply(flat, self.weight, self.bias, self.kernel)
            return y.reshape(*x.shape[:-1], self.out_features)
        self.last_path = "torch"
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kernel={self.kernel}"
