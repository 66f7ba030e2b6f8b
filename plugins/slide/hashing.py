"""LSH hash families for SLIDE, in numba: SimHash, WTA and densified WTA (DWTA).

Why one flat representation: the training kernels hash inside ``prange`` loops, where numba
cannot dispatch on Python objects. Every family is therefore described by the same arrays
(``idx``: the coordinates each elementary hash reads; ``sgn``: SimHash's +-1 signs) plus an
integer ``kind``, and :func:`table_keys_one` turns one vector into its L table keys.

* SimHash (signed random projection): bit = sign(sum_k sgn_k x[idx_k]) with sparse +-1
  projections (``density`` of the coordinates each); two vectors at angle theta collide with
  probability 1 - theta/pi per bit.
* WTA: value = position of the largest of ``bin_size`` coordinates (log2(bin_size) bits).
* DWTA: WTA whose bins tile random permutations of the coordinates; a bin with no non-zero
  entry (common for sparse inputs) borrows the value of another bin chosen by a fixed probe
  sequence (Chen & Shrivastava's densification), so sparse inputs still get K*L values.

Sparse (CSR) inputs are scattered into a per-thread dense scratch row and hashed by the dense
code, so both paths give identical codes by construction (tested).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
from numba import njit, prange

FAMILIES: dict[str, int] = {"simhash": 0, "wta": 1, "dwta": 2}
_MAX_PROBES = 100
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass
class HashFamily:
    """K*L elementary hashes; table t's key concatenates hashes t*K ... t*K+K-1.

    ``range_pow``: tables have 2**range_pow buckets. When the concatenated code has more
    bits (K * bits), it is folded by multiplicative (Fibonacci) hashing.
    """

    kind: int
    dim: int
    k: int
    l: int  # noqa: E741 - the paper's name
    bits: int
    range_pow: int
    idx: np.ndarray  # int32 [K*L, m]
    sgn: np.ndarray  # float32 [K*L, m]

    @property
    def n_buckets(self) -> int:
        return 1 << self.range_pow

    def keys_dense(self, x: np.ndarray) -> np.ndarray:
        """Table keys (int32 [n, L]) of the rows of a dense float32 matrix."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"expected a [n, {self.dim}] matrix, got shape {x.shape}")
        out = np.empty((x.shape[0], self.l), dtype=np.int32)
        _keys_dense_par(x, *self.args(), out)
        return out

    def keys_csr(self, indptr: np.ndarray, indices: np.ndarray, data: np.ndarray) -> np.ndarray:
        """Table keys (int32 [n, L]) of the rows of a CSR matrix with ``dim`` columns."""
        n = len(indptr) - 1
        out = np.empty((n, self.l), dtype=np.int32)
        if len(indices) and (indices.min() < 0 or indices.max() >= self.dim):
            raise ValueError(f"CSR column index outside [0, {self.dim})")
        _keys_csr_par(
            np.asarray(indptr, np.int64), np.asarray(indices, np.int64),
            np.asarray(data, np.float32), *self.args(), out, numba.get_num_threads(),
        )
        return out

    def values_dense(self, x: np.ndarray) -> np.ndarray:
        """The K*L elementary hash values (int32 [n, K*L]); for collision tests."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], self.k * self.l), dtype=np.int32)
        _values_dense(x, self.kind, self.idx, self.sgn, out)
        return out

    def args(self) -> tuple:
        return (self.kind, self.idx, self.sgn, self.k, self.l, self.bits, self.range_pow)


def make_family(
    kind: str,
    dim: int,
    k: int,
    l: int,  # noqa: E741
    *,
    seed: int,
    bin_size: int = 8,
    density: float = 1.0 / 3.0,
    range_pow: int | None = None,
) -> HashFamily:
    """Draw a hash family. ``range_pow=None``: as many bits as the code has, at most 20."""
    if kind not in FAMILIES:
        raise ValueError(f"hash family must be one of {', '.join(FAMILIES)}, got {kind!r}")
    if dim < 1 or k < 1 or l < 1:
        raise ValueError(f"dim, K and L must be >= 1 (got {dim}, {k}, {l})")
    rng = np.random.default_rng(seed)
    n_hash = k * l
    if kind == "simhash":
        bits = 1
        m = max(1, min(dim, int(math.ceil(dim * density))))
        idx = np.stack([rng.choice(dim, size=m, replace=False) for _ in range(n_hash)])
        sgn = rng.choice(np.array([-1.0, 1.0], dtype=np.float32), size=(n_hash, m))
    else:
        if bin_size < 2 or bin_size & (bin_size - 1):
            raise ValueError(f"bin_size must be a power of two >= 2, got {bin_size}")
        bits = bin_size.bit_length() - 1
        m = min(bin_size, dim)
        if kind == "wta":
            idx = np.stack([rng.permutation(dim)[:m] for _ in range(n_hash)])
        else:  # DWTA: bins tile concatenated permutations, so every coordinate is read
            need = n_hash * m
            perms = [rng.permutation(dim) for _ in range((need + dim - 1) // dim)]
            idx = np.concatenate(perms)[:need].reshape(n_hash, m)
        sgn = np.ones((n_hash, m), dtype=np.float32)
    code_bits = k * bits
    rp = min(code_bits, 20) if range_pow is None else int(range_pow)
    if not 1 <= rp <= 30:
        raise ValueError(f"range_pow must be in [1, 30], got {rp}")
    return HashFamily(
        kind=FAMILIES[kind], dim=dim, k=k, l=l, bits=bits, range_pow=rp,
        idx=np.ascontiguousarray(idx, dtype=np.int32), sgn=np.ascontiguousarray(sgn, np.float32),
    )


# ------------------------------------------------------------------------------- kernels


@njit(cache=True, inline="always")
def _bin_argmax(x, idx, h, nonzero_only):
    """Position of the largest entry of bin h; -1 if ``nonzero_only`` and all are zero."""
    best = -1
    best_v = -np.inf
    for p in range(idx.shape[1]):
        v = x[idx[h, p]]
        if nonzero_only and v == 0.0:
            continue
        if v > best_v:
            best_v = v
            best = p
    return best


@njit(cache=True)
def hash_value(x, kind, idx, sgn, h):
    """Elementary hash h of the dense vector x."""
    if kind == 0:
        acc = 0.0
        for p in range(idx.shape[1]):
            acc += sgn[h, p] * x[idx[h, p]]
        return 1 if acc >= 0.0 else 0
    if kind == 1:
        return max(_bin_argmax(x, idx, h, False), 0)
    v = _bin_argmax(x, idx, h, True)
    n_hash = idx.shape[0]
    attempt = 1
    while v < 0 and attempt <= _MAX_PROBES:
        probe = (h * 2654435761 + attempt * 40503 + attempt * attempt) % n_hash
        v = _bin_argmax(x, idx, probe, True)
        attempt += 1
    return max(v, 0)


@njit(cache=True)
def table_keys_one(x, kind, idx, sgn, k, l, bits, range_pow, out):  # noqa: E741
    """The L table keys of one dense vector, written to out[0:L]."""
    code_bits = k * bits
    m = idx.shape[1]
    for t in range(l):
        key = np.uint64(0)
        for j in range(k):
            h = t * k + j
            if kind == 0:
                v = hash_value(x, kind, idx, sgn, h)
            else:  # inlined WTA argmax (5x faster); DWTA falls back when a bin holds a zero
                v = 0
                best = x[idx[h, 0]]
                zero = best == 0.0
                for p in range(1, m):
                    val = x[idx[h, p]]
                    if val == 0.0:
                        zero = True
                    if val > best:
                        best = val
                        v = p
                if zero and kind == 2:
                    v = hash_value(x, kind, idx, sgn, h)
            key = (key << np.uint64(bits)) | np.uint64(v)
        if code_bits > range_pow:
            key = (key * _GOLDEN) >> np.uint64(64 - range_pow)
        out[t] = np.int32(key)


@njit(parallel=True, cache=True)
def _keys_dense_par(x, kind, idx, sgn, k, l, bits, range_pow, out):  # noqa: E741
    for i in prange(x.shape[0]):
        table_keys_one(x[i], kind, idx, sgn, k, l, bits, range_pow, out[i])


@njit(parallel=True, cache=True)
def _keys_csr_par(indptr, indices, data, kind, idx, sgn, k, l, bits, range_pow, out, threads):  # noqa: E501, E741
    n = len(indptr) - 1
    n_chunks = min(threads, max(n, 1))
    dim = 1 + (idx.max() if idx.size else 0)
    dim = max(dim, (indices.max() + 1) if len(indices) else 0)
    scratch = np.zeros((n_chunks, dim), dtype=np.float32)
    for c in prange(n_chunks):
        row = scratch[c]
        for i in range(c, n, n_chunks):
            for p in range(indptr[i], indptr[i + 1]):
                row[indices[p]] += data[p]
            table_keys_one(row, kind, idx, sgn, k, l, bits, range_pow, out[i])
            for p in range(indptr[i], indptr[i + 1]):
                row[indices[p]] = 0.0


@njit(cache=True)
def _values_dense(x, kind, idx, sgn, out):
    for i in range(x.shape[0]):
        for h in range(idx.shape[0]):
            out[i, h] = hash_value(x[i], kind, idx, sgn, h)


@njit(parallel=True, cache=True)
def pack_sign_keys(p, k, l, range_pow, out, dest, lo):  # noqa: E741
    """SimHash table keys from precomputed projections (float32 [m, K*L], p[i, t*K + j] =
    the j-th projection of table t) into row ``dest[lo + i]`` of ``out`` for row i of p, or
    row ``lo + i`` when ``dest`` is empty. Bit j of a key is ``p >= 0`` with the first hash
    as most significant bit, folded like :func:`table_keys_one`, so the keys equal the query
    path's up to the sign of a projection within rounding of 0. Parallel over rows; ``out``
    may be in any layout (the layer keeps it column-major so that each table's column is
    contiguous when the tables are filled), and writing through ``dest`` saves a serial
    scatter of the new keys into it."""
    for i in prange(p.shape[0]):
        row = dest[lo + i] if dest.shape[0] > 0 else lo + i
        for t in range(l):
            key = np.uint64(0)
            for j in range(k):
                key = (key << np.uint64(1)) | np.uint64(1 if p[i, t * k + j] >= 0.0 else 0)
            if k > range_pow:
                key = (key * _GOLDEN) >> np.uint64(64 - range_pow)
            out[row, t] = np.int32(key)
