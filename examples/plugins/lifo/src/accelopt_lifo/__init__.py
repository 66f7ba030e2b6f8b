"""lifo: last in, first out, as a salus scheduling policy (an example of the plugin guide).

It imports nothing of salus: salus reads its policies from the entry-point group
``accelopt_salus.policies``, and this package declares itself there (``pyproject.toml``).
Installed, ``plugins.salus.policy=lifo`` selects it in every process of a run: the ranks of
a cluster run, the reference runs of ``run.compare``, the sets of ``accelopt bench``.

A policy is a class with ``select(lane, ready, now_s) -> job_id``; the rest is optional:
``max_lanes`` (how many lanes salus opens for it; 1 runs one iteration at a time, which is
what makes an order meaningful) and ``observe(job_id, seconds)`` (every iteration's time).
"""

from __future__ import annotations

from collections.abc import Sequence

from accelopt import JobState


class Lifo:
    """The most recently arrived ready job runs next (ties: the larger job id)."""

    max_lanes = 1

    def __init__(self) -> None:
        self.choices = 0

    def select(self, lane: str, ready: Sequence[JobState], now_s: float) -> str:
        self.choices += 1
        return max(ready, key=lambda s: (s.job.arrival_s, s.job.job_id)).job.job_id
