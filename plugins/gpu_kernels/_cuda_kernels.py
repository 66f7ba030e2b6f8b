"""The numba.cuda kernels themselves (see ``tiled.py`` for what each one is for).

A module of its own because numba's CUDA simulator swaps the ``cuda`` name in a kernel's
*module globals*: ``cuda`` must be a global here, and this module is imported only when a
kernel is needed (importing it imports ``numba.cuda``, which fixes NUMBA_ENABLE_CUDASIM).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numba import cuda, float32

TILE = 16
CONST_BYTES = 64 * 1024  # constant memory per kernel


@functools.cache
def tiled_kernel(tile: int = TILE) -> Any:
    """Shared-memory tiled matmul; launch with blocks of (tile, tile) threads."""
    T = tile

    @cuda.jit
    def kernel(a, b, c, bias, has_bias):  # pragma: no cover - runs on the device/simulator
        sa = cuda.shared.array((T, T), float32)
        sb = cuda.shared.array((T, T), float32)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        row = cuda.blockIdx.y * T + ty
        col = cuda.blockIdx.x * T + tx
        m = a.shape[0]
        k_total = a.shape[1]
        n = b.shape[1]
        acc = float32(0.0)
        for t in range((k_total + T - 1) // T):
            ka = t * T + tx
            if row < m and ka < k_total:
                sa[ty, tx] = a[row, ka]
            else:
                sa[ty, tx] = float32(0.0)
            kb = t * T + ty
            if kb < k_total and col < n:
                sb[ty, tx] = b[kb, col]
            else:
                sb[ty, tx] = float32(0.0)
            cuda.syncthreads()
            for kk in range(T):
                acc += sa[ty, kk] * sb[kk, tx]
            cuda.syncthreads()
        if row < m and col < n:
            if has_bias:
                acc += bias[col]
            c[row, col] = acc

    return kernel


@functools.cache
def register_blocked_kernel(bm: int = 64, bn: int = 64, bk: int = 8, tm: int = 4,
                            tn: int = 4) -> Any:
    """Register-blocked matmul; launch with blocks of (bn // tn, bm // tm) threads.

    Thread (ty, tx) owns rows ``ty + i*(bm//tm)`` and columns ``tx + j*(bn//tn)`` of the block
    tile (interleaved, so neighbouring threads read neighbouring shared addresses and write
    coalesced)."""
    BM, BN, BK, TM, TN = bm, bn, bk, tm, tn
    RY, RX = bm // tm, bn // tn
    NT = RY * RX

    @cuda.jit
    def kernel(a, b, c, bias, has_bias):  # pragma: no cover - runs on the device/simulator
        sa = cuda.shared.array((BM, BK), float32)
        sb = cuda.shared.array((BK, BN), float32)
        acc = cuda.local.array((TM, TN), float32)
        ra = cuda.local.array(TM, float32)
        rb = cuda.local.array(TN, float32)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * RX + tx
        row0 = cuda.blockIdx.y * BM
        col0 = cuda.blockIdx.x * BN
        m = a.shape[0]
        k_total = a.shape[1]
        n = b.shape[1]
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = float32(0.0)
        for k0 in range(0, k_total, BK):
            for e in range(tid, BM * BK, NT):
                r = e // BK
                q = e % BK
                if row0 + r < m and k0 + q < k_total:
                    sa[r, q] = a[row0 + r, k0 + q]
                else:
                    sa[r, q] = float32(0.0)
            for e in range(tid, BK * BN, NT):
                r = e // BN
                q = e % BN
                if k0 + r < k_total and col0 + q < n:
                    sb[r, q] = b[k0 + r, col0 + q]
                else:
                    sb[r, q] = float32(0.0)
            cuda.syncthreads()
            for kk in range(BK):
                for i in range(TM):
                    ra[i] = sa[ty + i * RY, kk]
                for j in range(TN):
                    rb[j] = sb[kk, tx + j * RX]
                for i in range(TM):
                    for j in range(TN):
                        acc[i, j] += ra[i] * rb[j]
            cuda.syncthreads()
        for i in range(TM):
            r = row0 + ty + i * RY
            for j in range(TN):
                q = col0 + tx + j * RX
                if r < m and q < n:
                    v = acc[i, j]
                    if has_bias:
                        v += bias[q]
                    c[r, q] = v

    return kernel


def const_input_kernel(x: Any, tile: int = TILE) -> Any:
    """A kernel computing ``C = X @ B`` with ``X`` (a host float32 array, <= 64 KiB) baked
    into constant memory; B is staged through shared memory in (tile x tile) tiles and each
    thread keeps its partial sum in a register. Launch with blocks of (tile, tile) threads.
    threadIdx.x walks columns, so a warp reads one X element at a time: a constant-cache
    broadcast."""
    xc_host = np.ascontiguousarray(x, dtype=np.float32)
    if xc_host.nbytes > CONST_BYTES:
        raise ValueError(f"input of {xc_host.nbytes} bytes does not fit 64 KiB of constant memory")
    T = tile
    M, K = xc_host.shape

    @cuda.jit
    def kernel(b, c):  # pragma: no cover - runs on the device/simulator
        xc = cuda.const.array_like(xc_host)
        sb = cuda.shared.array((T, T), float32)
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        row = cuda.blockIdx.y * T + ty
        col = cuda.blockIdx.x * T + tx
        n = b.shape[1]
        acc = float32(0.0)
        for t in range((K + T - 1) // T):
            kb = t * T + ty
            if kb < K and col < n:
                sb[ty, tx] = b[kb, col]
            else:
                sb[ty, tx] = float32(0.0)
            cuda.syncthreads()
            if row < M:
                for kk in range(T):
                    if t * T + kk < K:
                        acc += xc[row, t * T + kk] * sb[kk, tx]
            cuda.syncthreads()
        if row < M and col < n:
            c[row, col] = acc

    return kernel
