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
from accelopt.types import IterationContext, OptimizerRebuild

if TYPE_CHECKING:
    import torch


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
    """Fires one job's iteration events on its host. Each event is a callable, or ``None``
    when no plugin listens to it, so the step pays nothing for an event nobody implements
    (``if events.iteration_start: events.iteration_start(context)``). What the events whose
    hooks answer ``None`` return means nothing (their callers make no list of answers)."""

    def __init__(self, host: PluginHost | None, lane: str = "default",
                 clock: Clock = time.perf_counter, *, origin: float = 0.0,
                 serial: bool = False) -> None:
        """The step's times are ``clock() - origin``: the driver's clock and where its zero
        lies, given apart so that the step reads the time with no Python frame of ours
        (a driver's ``now`` method was three frames an iteration). ``serial``: the driver
        calls every hook of the process from this one thread, so the events may skip the
        hook lock (:meth:`PluginHost.bound`)."""
        self.host = host
        self.lane = lane
        self.clock = clock
        self.origin = origin

        def bound(event: Event, answers: bool = False) -> Callable[..., Any] | None:
            return (host.bound(event.value, serial=serial, answers=answers)
                    if host is not None else None)

        # the host's callers themselves: no frame of ours between the step and the hook path
        self.iteration_start = bound(Event.ITERATION_START)
        self.after_forward: Callable[[IterationContext, torch.Tensor], torch.Tensor | None] | None = (
            host.bound_chain(Event.AFTER_FORWARD.value, "loss", serial=serial)
            if host is not None else None)
        """Passes the loss through every listening plugin; returns the loss for backward, or
        ``None`` when no plugin replaced it."""
        self.before_optimizer_step = bound(Event.BEFORE_OPTIMIZER_STEP)
        self.after_step: Callable[[IterationContext, bool], list[Any]] | None = bound(
            Event.AFTER_STEP, answers=True)
        """Returns the plugins' answers (:func:`rebuilds` keeps the optimizer rebuilds)."""
        self.iteration_end = bound(Event.ITERATION_END)
        self.listens = any((self.iteration_start, self.after_forward,
                            self.before_optimizer_step, self.after_step, self.iteration_end))
        """Whether any event has a listener (else the step builds no context for them)."""


def rebuilds(answers: list[Any]) -> list[OptimizerRebuild]:
    """The optimizer rebuilds among ``accelopt_after_step``'s answers."""
    return [a for a in answers if isinstance(a, OptimizerRebuild)]


SILENT = StepEvents(None)
"""Events that fire nothing (a profile's probe steps on a copy of the job)."""
