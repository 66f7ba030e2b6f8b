"""Synthetic job-arrival traces for cluster experiments.

Production deep-learning clusters see jobs arrive roughly as a Poisson process, and job
lengths are heavy-tailed: most jobs are short, a few run very long (Jeon et al., "Analysis of
Large-Scale Multi-Tenant GPU Clusters", ATC 2019). Schedulers behave very differently under
such tails than under uniform lengths, so traces here draw iteration counts from a Pareto
distribution. Everything comes from one ``random.Random(seed)``: a trace is a pure function of
its arguments and can be regenerated instead of stored.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from accelopt.workloads.data import default_dataset_for
from accelopt.workloads.models import MODEL_NAMES


@dataclass(frozen=True)
class TraceJob:
    """One job in a trace: what to train, for how long, and when it is submitted."""

    name: str
    model: str
    dataset: str
    batch_size: int
    iterations: int
    arrival_s: float
    seed: int


def _validate(
    n_jobs: int,
    mean_interarrival_s: float,
    models: Sequence[str],
    batch_sizes: Sequence[int],
    min_iterations: int,
    max_iterations: int,
    pareto_alpha: float,
) -> None:
    """One-line errors for every bad argument, before any job is drawn."""
    if n_jobs < 1:
        raise ValueError(f"n_jobs must be >= 1; got {n_jobs}")
    if not (math.isfinite(mean_interarrival_s) and mean_interarrival_s >= 0):
        raise ValueError(
            f"mean_interarrival_s must be finite and >= 0 (0 = all jobs at t=0); "
            f"got {mean_interarrival_s}"
        )
    if not models:
        raise ValueError(f"models must be non-empty; choose from {', '.join(MODEL_NAMES)}")
    unknown = [m for m in models if m not in MODEL_NAMES]
    if unknown:
        raise ValueError(f"unknown models {unknown}; known models: {', '.join(MODEL_NAMES)}")
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise ValueError(f"batch_sizes must be non-empty and all >= 1; got {list(batch_sizes)}")
    if min_iterations < 1:
        raise ValueError(f"min_iterations must be >= 1; got {min_iterations}")
    if min_iterations > max_iterations:
        raise ValueError(
            f"min_iterations ({min_iterations}) must be <= max_iterations ({max_iterations})"
        )
    if not (math.isfinite(pareto_alpha) and pareto_alpha > 0):
        raise ValueError(f"pareto_alpha must be finite and > 0; got {pareto_alpha}")


def _iterations(rng: random.Random, alpha: float, lo: int, hi: int) -> int:
    """Pareto(alpha) scaled so its minimum is ``lo``, floored to an integer, clipped to ``hi``.

    Drawn in log space (a Pareto(alpha) variate is ``exp(E / alpha)`` with ``E ~ Exp(1)``)
    because ``random.paretovariate`` raises OverflowError for small alpha, exactly where the
    tail matters most.
    """
    log_x = math.log(lo) + rng.expovariate(1.0) / alpha
    if log_x >= math.log(hi):
        return hi
    return max(lo, min(hi, int(math.exp(log_x))))


def generate_trace(
    *,
    n_jobs: int,
    seed: int,
    mean_interarrival_s: float,
    models: Sequence[str],
    batch_sizes: Sequence[int],
    min_iterations: int,
    max_iterations: int,
    pareto_alpha: float = 1.5,
) -> list[TraceJob]:
    """Draw ``n_jobs`` jobs: Poisson arrivals (first at 0.0), Pareto iteration counts in
    ``[min_iterations, max_iterations]``, model and batch size uniform over the choices.

    Smaller ``pareto_alpha`` means a heavier tail (alpha <= 1 has infinite mean before clipping).
    Each job gets its own seed so its data order and weights are independent of its neighbours.
    """
    _validate(
        n_jobs,
        mean_interarrival_s,
        models,
        batch_sizes,
        min_iterations,
        max_iterations,
        pareto_alpha,
    )
    rng = random.Random(seed)
    jobs: list[TraceJob] = []
    arrival = 0.0
    for i in range(n_jobs):
        if i > 0 and mean_interarrival_s > 0:
            arrival += rng.expovariate(1.0 / mean_interarrival_s)
        model = rng.choice(list(models))
        jobs.append(
            TraceJob(
                name=f"{model}-{i:02d}",
                model=model,
                dataset=default_dataset_for(model),
                batch_size=int(rng.choice(list(batch_sizes))),
                iterations=_iterations(rng, pareto_alpha, min_iterations, max_iterations),
                arrival_s=arrival,
                seed=rng.randrange(2**31),
            )
        )
    return jobs
