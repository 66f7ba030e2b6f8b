"""The events of one iteration, in the order they fire, and the object that fires them.

Modelled on Composer's ``Event``: one list a plugin author reads top to bottom. Every mode
runs the same sequence (``Job.step``); a process only skips the events of work it does not
do (a parameter server runs no forward, a PS worker takes no optimizer step)::

    step(i):
        ITERATION_START              every process that runs the iteration
        exchange.begin(i)            PS: servers post parameters, workers start receiving
        batch(i), forward, loss      single, workers
        AFTER_FORWARD                single, workers          (may replace the loss)
        backward                     single, workers          (PS/all-reduce: sends overlap it)
        exchange.gradients(i)        PS: push to the servers, which average; all-reduce: sum
        BEFORE_OPTIMIZER_STEP        single, all-reduce workers, PS servers   (may clip/skip)
        optimizer.step()             where the parameters live
        AFTER_STEP                   single, all-reduce workers, PS servers   (may rebuild)
        ITERATION_END                every process that runs the iteration

Each event is a hook of :mod:`accelopt.hookspecs`, where its docstring says on which ranks
and threads it fires and what a plugin may change there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Any

from accelopt.host import PluginHost
from accelopt.types import IterationContext, IterationResult, OptimizerRebuild

if TYPE_CHECKING:
    import torch

    from accelopt.job.gradients import Gradients

Clock = Callable[[], float]


class Event(str, Enum):
    """The iteration events, in firing order; each value is the hook that fires."""

    ITERATION_START = "accelopt_iteration_start"
    """Before any data is read: the iteration's ephemeral memory is empty."""
    AFTER_FORWARD = "accelopt_after_forward"
    """The loss is computed; a plugin may return a replacement loss for backward."""
    BEFORE_OPTIMIZER_STEP = "accelopt_before_optimizer_step"
    """The gradients are final (after the exchange); a plugin may change or skip them."""
    AFTER_STEP = "accelopt_after_step"
    """The optimizer stepped (or was skipped); a plugin may ask for an optimizer rebuild."""
    ITERATION_END = "accelopt_iteration_end"
    """The iteration's result is known; checkpoints are safe after it."""


class StepEvents:
    """Fires one job's iteration events on its host, skipping the hooks nobody implements
    (the hot path pays nothing for an event no plugin listens to)."""

    def __init__(self, host: PluginHost | None, lane: str = "default",
                 clock: Clock = time.perf_counter) -> None:
        self.host = host
        self.lane = lane
        self.now = clock
        wants = (lambda e: host.implements(e.value)) if host is not None else (lambda e: False)
        self._start = wants(Event.ITERATION_START)
        self._forward = wants(Event.AFTER_FORWARD)
        self._gradients = wants(Event.BEFORE_OPTIMIZER_STEP)
        self._stepped = wants(Event.AFTER_STEP)
        self._end = wants(Event.ITERATION_END)

    @property
    def wants_gradients(self) -> bool:
        return self._gradients

    def iteration_start(self, context: IterationContext) -> None:
        if self._start:
            self.host.call(Event.ITERATION_START.value, context=context)  # type: ignore[union-attr]

    def after_forward(self, context: IterationContext, loss: torch.Tensor) -> torch.Tensor:
        if not self._forward:
            return loss
        return self.host.chain(Event.AFTER_FORWARD.value, loss,  # type: ignore[union-attr]
                               lambda value: {"context": context, "loss": value})

    def before_optimizer_step(self, context: IterationContext, gradients: Gradients) -> None:
        if self._gradients:
            self.host.call(Event.BEFORE_OPTIMIZER_STEP.value,  # type: ignore[union-attr]
                           context=context, gradients=gradients)

    def after_step(self, context: IterationContext, stepped: bool) -> list[OptimizerRebuild]:
        if not self._stepped:
            return []
        answers: list[Any] = self.host.call(Event.AFTER_STEP.value,  # type: ignore[union-attr]
                                            context=context, stepped=stepped)
        return [a for a in answers if isinstance(a, OptimizerRebuild)]

    def iteration_end(self, context: IterationContext, result: IterationResult) -> None:
        if self._end:
            self.host.call(Event.ITERATION_END.value, context=context, result=result)  # type: ignore[union-attr]


SILENT = StepEvents(None)
"""Events that fire nothing (a profile's probe steps on a copy of the job)."""
