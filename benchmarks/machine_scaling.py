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
scaling figure they say how much of a shortfall from 2x is the machine's. A probe whose
result is not finite, or whose call took less time than its stated work needs at a rate no
thread reaches (the compiler dropped the work), has its figure refused, with the reason.

    python benchmarks/machine_scaling.py
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import _cli
import numba
import numpy as np
from numba import njit, prange
from slide_common import machine


@njit(parallel=True, cache=True, fastmath=True)
def _compute(chains: int, iters: int, out: np.ndarray) -> None:
    """``iters`` steps of x <- 0.9999 x + 1e-4 on four independent chains per prange
    iteration, chain ``c`` starting at c, c + 1, c + 2, c + 3; their sum is written to
    ``out[c]``. Why a contracting map (fixed point 1): every value stays finite however many
    steps are taken, and the end value is a function of the start and of the number of
    steps that the compiler cannot know without taking them all. The growing map it
    replaced (x * 1.0001) overflowed float32 to inf within 1e6 steps; under fastmath (no
    infinities assumed) LLVM then dropped the loop, and the probe timed nothing but starting
    the threads."""
    a, b = np.float32(0.9999), np.float32(1e-4)
    for c in prange(chains):
        x0, x1, x2, x3 = np.float32(c), np.float32(c + 1), np.float32(c + 2), np.float32(c + 3)
        for _ in range(iters):
            x0 = x0 * a + b
            x1 = x1 * a + b
            x2 = x2 * a + b
            x3 = x3 * a + b
        out[c] = x0 + x1 + x2 + x3


def compute_flops(chains: int, iters: int) -> float:
    """The floating-point operations of one ``_compute`` call: a multiply and an add per
    chain step."""
    return 2.0 * 4 * chains * iters


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


N, UPDATED, STREAM, ITERS, CHAINS = 670_000, 60_000, 1 << 25, 1_000_000, 64
"""The probes' sizes (module doc): rows of the random-rows arrays and rows updated, floats
per stream array, steps and prange iterations of the compute probe."""

PEAK_PER_THREAD = {"FLOP": 1e12, "B": 1e12}
"""Work per second no thread does, by unit: 1e12 float32 FLOP/s is three times a core's
peak (two 16-lane FMA units at 5 GHz), 1e12 B/s more than a core's cache bandwidth. A probe
faster than this did not do its stated work (the compiler dropped it): its figure is
refused, not printed."""


@dataclass(frozen=True)
class Probe:
    """One kind of work: ``run`` does it once, ``work`` is how much (in ``unit``: ``FLOP``
    or ``B``, bytes moved) and ``result`` what it wrote, which must stay finite."""

    run: Callable[[], None]
    work: float
    unit: str
    result: Callable[[], np.ndarray]


@dataclass(frozen=True)
class Refused:
    """A probe's figure that is not printed, and why."""

    reason: str

    def __str__(self) -> str:
        return self.reason


def _pair_times(run: Callable[[], None], pairs: int) -> list[tuple[float, float]]:
    """(1-thread time, 2-thread time) of ``run()``, measured in interleaved pairs."""
    before = numba.get_num_threads()
    times = []
    try:
        for threads in (1, 2):  # compile and touch every page first
            numba.set_num_threads(threads)
            run()
        for _ in range(pairs):
            pair = []
            for threads in (1, 2):
                numba.set_num_threads(threads)
                start = time.perf_counter()
                run()
                pair.append(time.perf_counter() - start)
            times.append((pair[0], pair[1]))
    finally:
        numba.set_num_threads(before)
    return times


def speedup(probe: Probe, times: list[tuple[float, float]]) -> float | Refused:
    """The median of the pairs' 1-thread / 2-thread time ratios, or why it is refused: the
    probe's result is not finite (its arithmetic overflowed, and under fastmath the compiler
    may then skip it), or a call took less time than its stated work needs at
    :data:`PEAK_PER_THREAD` (the work was not done, so the ratio times thread start-up)."""
    if not np.isfinite(probe.result()).all():
        return Refused("its result is not finite: the work overflowed and may have been "
                       "skipped")
    for threads, column in ((1, [t[0] for t in times]), (2, [t[1] for t in times])):
        fastest = min(column)
        peak = PEAK_PER_THREAD[probe.unit] * threads
        if fastest * peak < probe.work:
            return Refused(
                f"{threads} thread{'s' if threads > 1 else ''} took {fastest * 1e6:.3g} us per "
                f"call for {probe.work:.3g} {probe.unit}, faster than {peak:.0e} "
                f"{probe.unit}/s, more than the machine can do: the work was not done")
    return float(np.median([t1 / t2 for t1, t2 in times]))


def probes(seed: int = 0, n: int = N, updated: int = UPDATED, stream: int = STREAM,
           iters: int = ITERS, chains: int = CHAINS) -> dict[str, Probe]:
    """The three probes of the module doc at these sizes (the defaults there, smaller only
    for tests)."""
    rng = np.random.default_rng(seed)
    out = np.zeros(chains, np.float32)
    w, m, v = (rng.random((n, 128), dtype=np.float32) for _ in range(3))
    rows = np.sort(rng.choice(n, updated, replace=False)).astype(np.int32)
    a, b, c = (np.full(stream, x, np.float32) for x in (0.0, 1.0, 1.0))
    return {
        "compute": Probe(lambda: _compute(chains, iters, out), compute_flops(chains, iters),
                         "FLOP", lambda: out),
        # each updated row: w, m and v read and written, 128 float32 each
        "random rows": Probe(lambda: _random_rows(rows, w, m, v), updated * 128 * 4 * 6, "B",
                             lambda: w[rows]),
        "stream": Probe(lambda: _stream(a, b, c), stream * 4 * 3, "B", lambda: a),
    }


def machine_scaling(pairs: int = 15, seed: int = 0, n: int = N, updated: int = UPDATED,
                    stream: int = STREAM, iters: int = ITERS) -> dict[str, float | Refused]:
    """Median 1 -> 2 thread speed-up of each probe (see the module doc; the sizes are the
    defaults there, smaller only for tests), or why it is refused (:func:`speedup`); needs
    2 numba threads."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        raise SystemExit("machine_scaling: numba has one thread here; nothing to compare")
    return {name: speedup(probe, _pair_times(probe.run, pairs))
            for name, probe in probes(seed, n, updated, stream, iters).items()}


def describe(speedups: dict[str, float | Refused]) -> str:
    return "this machine's 1 -> 2 thread speed-up by kind of work (median of interleaved " \
        "pairs): " + ", ".join(f"{name} {r:.2f}x" if not isinstance(r, Refused) else
                               f"{name} not shown ({r})" for name, r in speedups.items()) + \
        " (bound: 2.00x for two threads on two cores)"


def main() -> None:
    ap = argparse.ArgumentParser(description=_cli.summary(__doc__))
    ap.add_argument("--pairs", type=_cli.positive_int, default=15,
                    help="interleaved 1/2-thread pairs per probe (median of their ratios)")
    args = ap.parse_args()
    print(f"machine: {machine()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"settings: --pairs {args.pairs} (interleaved 1/2-thread pairs per probe); compute "
          f"{CHAINS} x 4 chains of {ITERS:,} steps, random rows {UPDATED:,} of {N:,} rows, "
          f"stream {STREAM:,} floats per array", flush=True)
    print(describe(machine_scaling(pairs=args.pairs)))


if __name__ == "__main__":
    _cli.run(main)
