"""Packed gradients of the rows one batch touched: what both SLIDE layers hand to the sparse Adam.

Why packed instead of an [n, d] gradient array like a dense layer's: a batch touches a few
thousand of the n rows, so its gradients fit in cache as one [rows, d] block. Accumulating
into that block and reading it back in the update replaces two passes over scattered rows
of a 100 MB array (at 200K labels) with cache hits: the sparse Adam took ~40% less time at
6,000 rows, and the layer no longer holds a gradient array as large as its weights.

Row ``r`` of the block belongs to row ``rows[r]`` of the layer (sorted); with HOGWILD
``slot[j]`` maps back (``-1``: not touched this batch). The block is all zeros between
steps: the sparse Adam clears each row it consumes.

Two ways to fill it (``plugins.slide.backward``): ``rows`` (default) sums each row from the
batch's entries of that row, one thread per range of rows (:meth:`RowGradients.accumulate`,
no races); ``hogwild``, the paper's, lets every sample add its rows in place from its own
thread (the layers call :func:`kernels.backward_active` / :func:`kernels.sparse_input_backward`
with :attr:`RowGradients.slot`). Both give the same gradients up to float summation order.
"""

from __future__ import annotations

import numba
import numpy as np
from accelopt_plugins.slide import kernels


class RowGradients:
    """The packed gradient block of one layer (weights, and bias when ``with_bias``)."""

    def __init__(self, n_rows: int, dim: int, with_bias: bool, by_rows: bool = True) -> None:
        """``by_rows``: gradients will be summed by :meth:`accumulate` (``backward=rows``),
        which needs each row's entries indexed; the HOGWILD kernels need the slots alone."""
        self.by_rows = by_rows
        self.slot = np.full(n_rows, -1, np.int32)
        self.rows = np.zeros(n_rows, np.int32)
        self.start = np.zeros(n_rows + 1, np.int64)
        self._sort = (np.zeros(0, np.int32),) * 4  # radix sort buffers: keys, entries, twice
        self._passes, self._bits = kernels.radix_passes(n_rows)  # fixed by the layer width
        self.ent = self._sort[1]
        self.shift = self.width = 1
        self.dim, self.with_bias = dim, with_bias
        self.w = np.zeros((0, dim), np.float32)
        self.b = np.zeros(0, np.float32)
        self.count = self.indexed = 0

    def assign(self, ids: np.ndarray, counts: np.ndarray, extra: int = 0) -> int:
        """Give the distinct ids of ``ids[b, :counts[b]]`` (sorted) packed rows 0..k-1, index
        each one's entries (see :func:`kernels.index_rows`), and make room for ``extra`` more
        rows after them (the caller fills ``rows[k:k+extra]``, which must be disjoint from
        the ids, and their gradients); the slot map only when not :attr:`by_rows` (the
        HOGWILD kernels add into ``w[slot[j]]``). Returns k."""
        if 2 * ids.size >= 2**31:
            raise ValueError(f"slide: {ids.size} active entries in one batch exceed the row "
                             "index's int32 positions; use a smaller batch or active set")
        if self._sort[0].shape[0] < ids.size:
            self._sort = tuple(np.zeros(ids.size, np.int32) for _ in range(4))
        self.shift = kernels.entry_shift(ids.shape[1])
        parts = max(1, min(numba.get_num_threads(), ids.shape[0]))
        k = int(kernels.index_rows(ids, counts, parts, self.shift, self._passes, self._bits,
                                   *self._sort, self.slot, self.rows, self.start,
                                   not self.by_rows))
        self.ent = self._sort[1 if self._passes % 2 == 0 else 3]
        self.width = ids.shape[1]
        self.indexed = k
        self.count = k + extra
        self.reserve(self.count)
        return k

    def entries(self, r: int) -> np.ndarray:
        """The flat positions in ``ids`` (b * width + i) of packed row r's entries, in (b, i)
        order (for tests and debugging)."""
        e = self.ent[self.start[r]:self.start[r + 1]].astype(np.int64)
        return (e >> self.shift) * self.width + (e & ((1 << self.shift) - 1))

    def accumulate(self, coef: np.ndarray, scale: float, x: np.ndarray,
                   w: np.ndarray | None = None) -> np.ndarray | None:
        """Gradients of the indexed rows, ``sum over entries (b, i) of row r of coef[b, i] *
        scale * x[b]`` (``coef`` is shaped like the ``ids`` given to :meth:`assign`), added
        to the block; with ``w`` (the layer's weights before the update) also returns the
        input gradient ``dh[b] = sum_i coef[b, i] * scale * w[ids[b, i]]``."""
        parts = numba.get_num_threads()
        batch, dim = x.shape
        dh_parts = np.zeros((parts, batch if w is not None else 0, dim), np.float32)
        kernels.accumulate_rows(
            self.rows, self.indexed, self.start, self.ent, self.shift, coef, np.float32(scale), x,
            w if w is not None else np.zeros((0, dim), np.float32), dh_parts, self.w,
            self.b if self.with_bias else self.b[:0])
        return dh_parts.sum(0) if w is not None else None

    def reserve(self, count: int) -> None:
        """Grow the block to at least ``count`` rows (by half again, so that a slowly
        growing union of rows does not reallocate every step); new rows are zero."""
        if count > self.w.shape[0]:
            size = min(max(count, self.w.shape[0] * 3 // 2), self.rows.shape[0])
            self.w = np.zeros((size, self.dim), np.float32)
            self.b = np.zeros(size if self.with_bias else 0, np.float32)

    def adam_step(self, w: np.ndarray, m_w: np.ndarray, v_w: np.ndarray,
                  bias: tuple[np.ndarray, np.ndarray, np.ndarray] | None, steps: np.ndarray,
                  dirty: np.ndarray, lr: float, cfg, global_t: int) -> int:
        """The sparse Adam (:func:`kernels.sparse_adam`) on the rows with pending gradients,
        then :meth:`release`: the update both SLIDE layers end a step with. ``bias``: (bias,
        m_b, v_b), or None when the layer's bias is not updated here. Returns the rows
        updated."""
        n_rows = self.count
        b, m_b, v_b = bias if bias is not None else (self.b[:0],) * 3
        kernels.sparse_adam(self.rows, n_rows, w, self.w, m_w, v_w, b, self.b, m_b, v_b, steps,
                            dirty, lr, cfg.beta1, cfg.beta2, cfg.eps, global_t)
        self.release()
        return n_rows

    def release(self) -> None:
        """Forget this batch's slots (after the update consumed and cleared the block)."""
        if not self.by_rows:  # only the HOGWILD kernels use slots
            kernels.release_slots(self.rows, self.count, self.slot)
        self.count = self.indexed = 0

    def dense(self) -> tuple[np.ndarray, np.ndarray]:
        """The pending gradients as full [n, d] and [n] arrays (for tests and debugging)."""
        w = np.zeros((self.slot.shape[0], self.dim), np.float32)
        b = np.zeros(self.slot.shape[0], np.float32)
        rows = self.rows[:self.count]
        w[rows] = self.w[:self.count]
        if self.with_bias:
            b[rows] = self.b[:self.count]
        return w, b
