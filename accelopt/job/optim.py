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

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from accelopt.config import JobConfig
from accelopt.errors import AccelOptError
from accelopt.host import PluginHost
from accelopt.types import JobInfo

HOOK = "accelopt_optimizer_build"


def make_optimizer(spec: JobConfig, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer the job's settings name (``optimizer``, ``lr``, ``momentum``)."""
    params = list(params)
    if spec.optimizer == "adam":
        return torch.optim.Adam(params, lr=spec.lr)
    return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum)


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
    out = host.chain(HOOK, optimizer, lambda o: {
        "job": job, "optimizer": o, "parameters": named, "previous": previous})
    if not isinstance(out, torch.optim.Optimizer):
        raise AccelOptError(f"{HOOK} returned {type(out).__name__} for job '{job.name}', not a "
                            "torch.optim.Optimizer; return an optimizer or None")
    return out
