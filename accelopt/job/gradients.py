"""The gradients of one iteration as ``accelopt_before_optimizer_step`` hands them to plugins.

Why a view and not the tensors: in every mode the hook sees the gradients *the optimizer is
about to apply*: after local backward, after the all-reduce, or, in PS mode, on the server
after the workers' gradients were averaged. A parameter server holds only its shard, so
whole-model quantities (the global norm a clipping plugin needs) cannot be computed from the
local tensors alone: :meth:`Gradients.norm` combines the partial sums of every process that
holds a part of the job's parameters. Changing a gradient (in place, or by assigning a new
tensor) changes what the optimizer applies; :meth:`Gradients.skip` skips the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from accelopt.errors import UserError
from accelopt.types import JobInfo

Reduce = Callable[[float, str], float]
"""Combine a float (``"sum"`` or ``"max"``) over every process that holds a part of the job's
parameters (the PS servers); the identity where one process holds them all."""


def _local(value: float, op: str) -> float:
    return value


class Gradients(Mapping[str, torch.Tensor]):
    """The job's gradients of this iteration by parameter name (only parameters that have
    one). ``grads[name]`` is the tensor the optimizer will read; modify it in place or assign
    a tensor of the same shape, dtype and device."""

    def __init__(self, job: JobInfo, params: Mapping[str, nn.Parameter],
                 reduce: Reduce | None = None, *, whole: bool = True) -> None:
        self.job = job
        self.parameters = params
        """Every parameter the view covers, by name (with a gradient or not)."""
        self._with_grad: dict[str, nn.Parameter] | None = None
        self._reduce = reduce or _local
        self.whole = whole
        """Whether this process holds every parameter of the job (``False`` on a parameter
        server that holds a shard: iterate over its part, use :meth:`norm` for the whole)."""
        self.skipped: str | None = None
        """The reason given to :meth:`skip`, or ``None`` when the step runs."""

    def renew(self) -> None:
        """Make the view the next iteration's (the job keeps one view per parameter table:
        building one is a measurable part of an iteration's overhead)."""
        self._with_grad = None
        self.skipped = None

    @property
    def _params(self) -> dict[str, nn.Parameter]:
        """The parameters that have a gradient (found on first use: a plugin that only skips
        or never looks costs nothing here)."""
        if self._with_grad is None:
            self._with_grad = {n: p for n, p in self.parameters.items() if p.grad is not None}
        return self._with_grad

    # -- mapping ----------------------------------------------------------------------------

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            grad = self._params[name].grad
        except KeyError:
            raise KeyError(self._unknown(name)) from None
        assert grad is not None
        return grad

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        if name not in self._params:
            raise KeyError(self._unknown(name))
        param = self._params[name]
        if not isinstance(value, torch.Tensor):
            raise UserError(f"job '{self.job.name}': gradients[{name!r}] must be a tensor, got "
                            f"{type(value).__name__}")
        if value.shape != param.shape or value.dtype != param.dtype or value.device != param.device:
            raise UserError(
                f"job '{self.job.name}': gradients[{name!r}] must keep the parameter's shape "
                f"{tuple(param.shape)}, dtype {param.dtype} and device {param.device}; got "
                f"{tuple(value.shape)}, {value.dtype}, {value.device}")
        param.grad = value

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)

    def _unknown(self, name: str) -> str:
        where = "this process's shard" if not self.whole else f"job '{self.job.name}'"
        return f"{name!r} has no gradient in {where}; names: {', '.join(self._params) or 'none'}"

    # -- whole-job operations ---------------------------------------------------------------

    def norm(self, p: float = 2.0) -> float:
        """The ``p``-norm of the job's whole gradient (every parameter, whichever process
        holds it), computed in float64. On a parameter server every server must call it the
        same number of times per iteration: the partial norms are summed across them."""
        if p <= 0:
            raise UserError(f"Gradients.norm: p must be > 0 (or inf), got {p}")
        grads = [g.detach() for g in self.values()]
        if math.isinf(p):
            local = max((float(g.abs().max()) for g in grads if g.numel()), default=0.0)
            return self._reduce(local, "max")
        local = sum(float(g.double().abs().pow(p).sum()) for g in grads)
        return self._reduce(local, "sum") ** (1.0 / p)

    def scale_(self, factor: float) -> None:
        """Multiply every gradient by ``factor``, in place."""
        for grad in self.values():
            grad.mul_(factor)

    def clip_norm_(self, max_norm: float, p: float = 2.0) -> float:
        """Scale the gradients so that their ``p``-norm is at most ``max_norm`` (like
        ``torch.nn.utils.clip_grad_norm_``, over the whole job); return the norm before
        clipping. Nothing is touched when the norm is within the bound, so a huge
        ``max_norm`` leaves every gradient bit for bit as it was."""
        if max_norm <= 0:
            raise UserError(f"Gradients.clip_norm_: max_norm must be > 0, got {max_norm}")
        total = self.norm(p)
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            self.scale_(coef)
        return total

    def skip(self, reason: str) -> None:
        """Skip this iteration's optimizer step (e.g. a non-finite gradient); ``reason`` is
        what ``accelopt_after_step`` and the run's log see."""
        self.skipped = reason or "skipped by a plugin"
