"""What a second thread buys on this machine, by kind of work: the yardstick for thread scaling.

A training step's 1 -> 2 thread speed-up cannot exceed what the machine gives its kernels'
kind of work. Three probes, each timed 1 thread / 2 threads in interleaved pairs (median
of the pair ratios), with numba's OpenMP threads like the SLIDE kernels:

* ``compute``: independent float chains in registers (no memory traffic): the cores alone;
* ``random rows``: an Adam-like update of 60,000 sorted random 512-byte rows of three
  [670K, 128] float32 arrays, the sparse Adam's access pattern (memory latency and
  bandwidth);
* ``stream``: a triad over three 128 MB arrays (memory bandwidth alone).

On a shared VM the memory probes move with the neighbours' load; printed beside a
scaling figure they say how much of a shortfall from 2x is the machine's.

    python benchmarks/machine_scaling.py
"""

from __future__ import annotations

import argparse
import time

import _cli
import numba
import numpy as np
from numba import njit, prange


@njit(parallel=True, cache=True, fastmath=True)
def _compute(chains: int, iters: int, out: np.ndarray) -> None:
    for c in prange(chains):
        a = np.float32(1.0001)
        x0, x1, x2, x3 = np.float32(c), np.float32(c + 1), np.float32(c + 2), np.float32(c + 3)
        for _ in range(iters):
            x0 = x0 * a + np.float32(1e-7)
            x1 = x1 * a + np.float32(1e-7)
            x2 = x2 * a + np.float32(1e-7)
            x3 = x3 * a + np.float32(1e-7)
        out[c] = x0 + x1 + x2 + x3


@njit(parallel=True, cache=True, fastmath=True)
def _random_rows(rows: np.ndarray, w: np.ndarray, m: np.ndarray, v: np.ndarray) -> None:
    for r in prange(rows.shape[0]):
        j = rows[r]
        for d in range(w.shape[1]):
            mm = np.float32(0.9) * m[j, d] + np.float32(0.1)
            vv = np.float32(0.999) * v[j, d] + np.float32(0.001)
            m[j, d] = mm
            v[j, d] = vv
            w[j, d] -= np.float32(1e-3) * mm / (np.sqrt(vv) + np.float32(1e-8))


@njit(parallel=True, cache=True, fastmath=True)
def _stream(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> None:
    for i in prange(a.shape[0]):
        a[i] = b[i] + np.float32(2.0) * c[i]


def _pair_ratios(run, pairs: int) -> list[float]:
    """1-thread time / 2-thread time of ``run()``, measured in interleaved pairs."""
    before = numba.get_num_threads()
    ratios = []
    try:
        for threads in (1, 2):  # compile and touch every page first
            numba.set_num_threads(threads)
            run()
        for _ in range(pairs):
            times = []
            for threads in (1, 2):
                numba.set_num_threads(threads)
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            ratios.append(times[0] / times[1])
    finally:
        numba.set_num_threads(before)
    return ratios


def machine_scaling(pairs: int = 15, seed: int = 0, n: int = 670_000, updated: int = 60_000,
                    stream: int = 1 << 25, iters: int = 1_000_000) -> dict[str, float]:
    """Median 1 -> 2 thread speed-up of each probe (see the module doc; the sizes are the
    defaults there, smaller only for tests); needs 2 numba threads."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        raise SystemExit("machine_scaling: numba has one thread here; nothing to compare")
    rng = np.random.default_rng(seed)
    out = np.zeros(64, np.float32)
    w, m, v = (rng.random((n, 128), dtype=np.float32) for _ in range(3))
    rows = np.sort(rng.choice(n, updated, replace=False)).astype(np.int32)
    a, b, c = (np.full(stream, x, np.float32) for x in (0.0, 1.0, 1.0))
    probes = {
        "compute": lambda: _compute(64, iters, out),
        "random rows": lambda: _random_rows(rows, w, m, v),
        "stream": lambda: _stream(a, b, c),
    }
    return {name: float(np.median(_pair_ratios(run, pairs))) for name, run in probes.items()}


def describe(speedups: dict[str, float]) -> str:
    return "this machine's 1 -> 2 thread speed-up by kind of work (median of interleaved " \
        "pairs): " + ", ".join(f"{name} {r:.2f}x" for name, r in speedups.items()) + \
        " (bound: 2.00x for two threads on two cores)"


def main() -> None:
    ap = argparse.ArgumentParser(description=_cli.summary(__doc__))
    ap.add_argument("--pairs", type=_cli.positive_int, default=15,
                    help="interleaved 1/2-thread pairs per probe (median of their ratios)")
    args = ap.parse_args()
    print(describe(machine_scaling(pairs=args.pairs)))


if __name__ == "__main__":
    _cli.run(main)
