"""A salus policy for tests/test_cluster_multijob.py: a seeded random choice at every
iteration boundary, so the cluster's jobs interleave in an arbitrary order. Spawned ranks
import it as ``plugins.salus.policy=multijob_policies:RandomPolicy`` (tests/ on PYTHONPATH)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from accelopt_plugins.salus.policies import Policy

from accelopt import JobState


class RandomPolicy(Policy):
    """Any ready job, at random (seed 7): the worst case for a deadlock-prone protocol."""

    def __init__(self) -> None:
        super().__init__()
        self.rng = random.Random(7)

    def select(self, lane: str, ready: Sequence[JobState], now_s: float) -> str:
        return self.rng.choice(sorted(s.job.job_id for s in ready))
