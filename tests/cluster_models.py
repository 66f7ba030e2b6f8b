"""Models for the cluster's fault tests: a small MLP that fails on one rank (its RANK
environment variable) at one call of its forward, as a user's model can."""

from __future__ import annotations

import math
import os

import torch
from torch import nn


class RaisesOnRank(nn.Module):
    """Raises ``RuntimeError('boom on rank R')`` in the ``when``-th forward on rank ``rank``."""

    def __init__(self, input_shape, num_classes: int, rank: int, when: int) -> None:
        super().__init__()
        self.l1 = nn.Linear(math.prod(input_shape), 16)
        self.l2 = nn.Linear(16, num_classes)
        self.rank, self.when, self.calls = rank, when, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.when and os.environ.get("RANK") == str(self.rank):
            raise RuntimeError(f"boom on rank {self.rank}")
        return self.l2(torch.relu(self.l1(x.flatten(1))))


def raises_on_rank(*, input_shape, num_classes, rank: int = 1, when: int = 3) -> nn.Module:
    return RaisesOnRank(input_shape, num_classes, rank, when)
