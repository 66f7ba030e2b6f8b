"""A job's optimizer: built from its settings over the parameters this process updates, then
offered to ``accelopt_optimizer_build`` (chained), at build time and again whenever a plugin
answers ``accelopt_after_step`` with :class:`~accelopt.types.OptimizerRebuild`.

Why a rebuild and not a mutation: after a plugin changed the model (pruned a layer, replaced
a parameter) the optimizer still holds the old ``Parameter`` objects and their state. The
core builds a fresh optimizer over the current parameters, carries the state of every
parameter that is still there with the same shape, and lets plugins carry the rest (they get
the previous optimizer).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from accelopt.config import JobConfig
from accelopt.host import PluginHost
from accelopt.types import JobInfo

HOOK = "accelopt_optimizer_build"


def make_optimizer(spec: JobConfig, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer the job's settings name (``optimizer``, ``lr``, ``momentum``,
    ``weight_decay``; None keeps the optimizer's own default). No parameters (a parameter
    server whose shard is empty: more servers than the model has tensors) gives an optimizer
    of one empty group, whose step does nothing: torch refuses an empty list ("optimizer got
    an empty parameter list") and that server failed the run. A training job's model with
    nothing to train is refused when the job is built (``job.refuse_untrainable``)."""
    tensors = list(params)
    params = tensors if tensors else [{"params": []}]  # type: ignore[list-item]
    decay = {} if spec.weight_decay is None else {"weight_decay": float(spec.weight_decay)}
    if spec.optimizer == "adam":
        return torch.optim.Adam(params, lr=spec.lr, **decay)
    if spec.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=spec.lr, **decay)
    return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, **decay)


PER_TENSOR_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
"""Optimizers whose step is an independent update of each tensor (state per tensor, no
norm or statistic over several), so stepping the tensors one at a time gives the same
bits as one step over all of them."""


def step_tensors(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter],
                 groups_of: Sequence[int]) -> None:
    """One optimizer step over ``params`` alone (``params[k]`` is in
    ``param_groups[groups_of[k]]``): the other tensors are hidden from the step, not zeroed,
    so their state and gradients stay."""
    groups = optimizer.param_groups
    saved = [g["params"] for g in groups]
    try:
        for g in groups:
            g["params"] = []
        for param, group in zip(params, groups_of, strict=True):
            groups[group]["params"].append(param)
        optimizer.step()
    finally:
        for g, params in zip(groups, saved, strict=True):
            g["params"] = params


def lr_factor(spec: JobConfig, step: int) -> float:
    """The learning rate of step ``step`` (0-based) over the configured ``lr``: a linear
    warm-up over ``warmup_iterations`` steps, then ``constant``, ``cosine`` or ``linear``
    decay to ``min_lr`` at the job's last iteration. A function of the step alone, so a
    resumed job, a rebuilt optimizer and every parameter server agree without state."""
    warmup = spec.warmup_iterations
    if step < warmup:
        return (step + 1) / warmup
    if spec.lr_schedule == "constant":
        return 1.0
    span = max(1, spec.iterations - 1 - warmup)
    progress = min(1.0, (step - warmup) / span)
    floor = spec.min_lr / spec.lr
    if spec.lr_schedule == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * (1.0 - progress)


def schedules(spec: JobConfig) -> bool:
    """Whether the learning rate changes over the job (so each step sets it)."""
    return spec.lr_schedule != "constant" or spec.warmup_iterations > 0


def set_lr(optimizer: torch.optim.Optimizer, factor: float) -> None:
    """Every parameter group's learning rate at ``factor`` times its own initial one (a
    plugin's optimizer may give groups different rates; ``initial_lr`` as torch's schedulers
    keep it)."""
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
        group["lr"] = group["initial_lr"] * factor


def build_optimizer(job: JobInfo, spec: JobConfig, parameters: Mapping[str, nn.Parameter],
                    host: PluginHost, previous: torch.optim.Optimizer | None = None
                    ) -> torch.optim.Optimizer:
    """Build the job's optimizer over ``parameters``; carry ``previous``'s state where the
    parameter is unchanged; offer it to the plugins."""
    optimizer = make_optimizer(spec, parameters.values())
    if previous is not None:
        for param in parameters.values():
            state = previous.state.get(param)
            if state:
                optimizer.state[param] = state
    if not host.implements(HOOK):
        return optimizer
    named = dict(parameters)
    # an answer that is not an optimizer is refused by the host, naming the plugin
    # (hookspecs.ANSWER_CHECKS)
    return host.chain(HOOK, optimizer, lambda o: {
        "job": job, "optimizer": o, "parameters": named, "previous": previous})
