"""Models for the cluster's fault tests: a small MLP that fails on one rank (its RANK
environment variable) at one call of its forward, as a user's model can; and the
watchdog's verdict on ranks that ended (:func:`watchdog_verdict`)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from accelopt.errors import RankFailed


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


class EndedRank:
    """A rank process as the watchdog sees it: its pid and exit code (None: still running)."""

    def __init__(self, pid: int, exitcode: int | None) -> None:
        self.pid, self.exitcode = pid, exitcode


def watchdog_verdict(workdir: Path, codes: list[int | None],
                     raised: dict[int, BaseException] | None = None,
                     iteration: int | None = 19, job: tuple[str, str] = ("", "")) -> RankFailed:
    """The watchdog's verdict on a PS run whose rank r ended with ``codes[r]``, ranks in
    ``raised`` having reported that exception, every rank having reached ``iteration`` of
    ``job`` (its id and name)."""
    from accelopt.drivers.cluster import faults

    children = [faults.Child(r, "server" if r == 0 else "worker", EndedRank(100 + r, code))
                for r, code in enumerate(codes)]
    for c in children:
        progress = faults.Progress(workdir, c.rank)
        if iteration is not None:
            progress.set(iteration, *job)
    for rank, exc in (raised or {}).items():
        faults.write_failure(workdir, rank, children[rank].role,
                             faults.At(iteration, *job), exc)
    return faults.Watchdog(children, workdir)._diagnose()
