"""How a job's gradients and parameters move: the one thing a mode changes.

``Job.step`` is the same in every mode; it asks its exchange to move data at three points
(``begin`` the iteration, make the ``gradients`` final after backward, ``end`` it) and asks
it a few facts (does this process run forward? take the optimizer step? which rows of the
batch are its own? which parameters does it update?). The local exchange below moves
nothing: the gradients backward left in ``.grad`` are final. The cluster's exchanges
(``drivers/cluster``) push and pull through the transport (parameter server) or sum buckets
(all-reduce) behind the same methods.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from torch import nn

from accelopt.types import Role

if TYPE_CHECKING:
    from accelopt.job.job import Job
    from accelopt.job.timeline import PhaseTimer


class Exchange:
    """The local (one-process) exchange, and the interface every exchange implements."""

    role: Role = "single"
    moves: bool = False
    """Whether ``begin``/``gradients``/``end`` move anything (the local exchange does not, so
    the step does not call them)."""
    computes: bool = True
    """This process runs forward and backward (``False`` on a parameter server)."""
    steps: bool = True
    """This process takes the optimizer step over :meth:`stepped_parameters`."""
    whole: bool = True
    """This process holds every parameter of the job (``False`` on a server with a shard)."""
    stream: int = 0
    """Which of the job's random streams this process draws from (a worker's index)."""

    def rows(self, batch_size: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` of each global batch this process trains on."""
        return 0, batch_size

    def attach(self, job: Job, timer: PhaseTimer) -> None:
        """Once, after the job's model is built and on its device: install what moving the
        job's data needs (forward pre-hooks, gradient hooks)."""

    def stepped_parameters(self, model: nn.Module) -> dict[str, nn.Parameter]:
        """The parameters this process's optimizer updates, by name."""
        return dict(model.named_parameters())

    def begin(self, iteration: int) -> None:
        """The iteration starts (before the batch is read)."""

    def weigh(self, share: float | None) -> None:
        """Before backward: this process's share of the iteration's loss (its labelled
        positions over the batch's, where the model's loss is a mean over them; ``None``: its
        share of the rows). An exchange that combines several processes' gradients scales
        this process's by it; one process's gradient is the batch's already."""

    def gradients(self, iteration: int,
                  update: Callable[[Sequence[str]], None] | None = None) -> bool:
        """After backward: move the gradients so that, on a process that steps, ``.grad`` of
        every stepped parameter holds the final gradient.

        ``update(names)`` (offered only where the job's step is one independent update per
        tensor: no clipping, no plugin on the gradients, no scaler) applies the optimizer
        to those tensors, whose ``.grad`` is final. An exchange that uses it (a PS server
        updating each tensor as its gradients arrive) returns ``True``: the step then takes
        no optimizer step of its own."""
        return False

    def end(self, iteration: int) -> None:
        """The iteration's data movement is over (after the optimizer step)."""

    def reduce(self, value: float, op: str) -> float:
        """Combine ``value`` (``"sum"``/``"max"``) over the processes that hold parts of the
        parameters; here one process holds them all."""
        return value

    def close(self) -> None:
        """The job is over: stop background threads, release buffers."""


LOCAL = Exchange()


class BuildOnly(Exchange):
    """A job built to be looked at, not trained: the same model (plugins offered the same
    layers as for training) but no optimizer. Scoring a cluster run's gathered weights in
    the launcher uses it."""

    computes = False
    steps = False


BUILD_ONLY = BuildOnly()
