"""A batch's model inputs, whatever their structure: one tensor, a tuple of tensors or a
mapping of tensors.

A model written for one tensor is called ``model(x)``; a model with several inputs gets them
as the dataset gives them: a tuple or list as positional arguments (``model(*x)``), a mapping
as keyword arguments (``model(**x)``: HF transformers' ``input_ids``, ``attention_mask``).
Every tensor of a batch is row-aligned with its labels, so slicing a process's rows, moving a
batch to a device and stacking samples into a batch apply to each tensor alike. One module
for all of it, so the step, the probes, the scorer and the adapters agree on what an input
is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

Inputs = Any
"""``torch.Tensor | tuple[torch.Tensor, ...] | Mapping[str, torch.Tensor]``."""
Structure = Literal["tensor", "positional", "keyword"]


def structure(x: Inputs) -> Structure:
    """How the model takes ``x``: one argument, positional arguments or keyword arguments."""
    if isinstance(x, Mapping):
        return "keyword"
    if isinstance(x, (tuple, list)):
        return "positional"
    return "tensor"


def tensors(x: Inputs) -> list[torch.Tensor]:
    """The tensors of ``x``, in order (a mapping's in key order)."""
    if isinstance(x, Mapping):
        return [v for v in x.values() if isinstance(v, torch.Tensor)]
    if isinstance(x, (tuple, list)):
        return [v for v in x if isinstance(v, torch.Tensor)]
    return [x] if isinstance(x, torch.Tensor) else []


def _apply(x: Inputs, fn: Any) -> Inputs:
    if isinstance(x, Mapping):
        return {k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(fn(v) if isinstance(v, torch.Tensor) else v for v in x)
    return fn(x)


def rows(x: Inputs) -> int:
    """The batch's row count (the first dimension its tensors share)."""
    found = tensors(x)
    if not found:
        raise TypeError(f"inputs of type {type(x).__name__} hold no tensor")
    return len(found[0])


def slice_rows(x: Inputs, start: int, stop: int) -> Inputs:
    """Rows ``start:stop`` of every tensor of ``x``."""
    if isinstance(x, torch.Tensor):
        return x[start:stop]
    return _apply(x, lambda t: t[start:stop])


def to_device(x: Inputs, device: torch.device, *, non_blocking: bool = False) -> Inputs:
    """``x`` with every tensor on ``device`` (itself when they all are already there)."""
    if all(t.device == device for t in tensors(x)):
        return x
    return _apply(x, lambda t: t.to(device, non_blocking=non_blocking))


def detached(x: Inputs) -> Inputs:
    """``x`` with every tensor detached and on the CPU (a copy a plugin may keep)."""
    return _apply(x, lambda t: t.detach().cpu())


def call(module: Any, x: Inputs, **extra: Any) -> Any:
    """``module(x)``, ``module(*x)`` or ``module(**x)`` as :func:`structure` says, with
    ``extra`` keyword arguments (``labels=y`` when the model computes its loss)."""
    if isinstance(x, torch.Tensor):
        return module(x, **extra)
    if isinstance(x, Mapping):
        return module(**x, **extra)
    if isinstance(x, (tuple, list)):
        return module(*x, **extra)
    return module(x, **extra)


def stack(samples: Sequence[Inputs]) -> Inputs:
    """One batch from per-sample inputs of one structure (each tensor stacked on a new first
    dimension); a mismatch in shape or keys raises ``ValueError`` naming it."""
    first = samples[0]
    if isinstance(first, Mapping):
        keys = list(first)
        for s in samples:
            if not isinstance(s, Mapping) or list(s) != keys:
                raise ValueError(f"samples with different keys in one batch ({keys} and "
                                 f"{list(s) if isinstance(s, Mapping) else type(s).__name__})")
        return {k: _stack_one([s[k] for s in samples], k) for k in keys}
    if isinstance(first, (tuple, list)):
        n = len(first)
        if any(not isinstance(s, (tuple, list)) or len(s) != n for s in samples):
            raise ValueError(f"samples with different numbers of inputs in one batch ({n} "
                             "and others)")
        return tuple(_stack_one([s[i] for s in samples], f"input {i}") for i in range(n))
    return _stack_one(list(samples), "inputs")


def _stack_one(values: list[Any], what: str) -> torch.Tensor:
    ts = [v if isinstance(v, torch.Tensor) else torch.as_tensor(v) for v in values]
    shapes = {tuple(t.shape) for t in ts}
    if len(shapes) > 1:
        raise ValueError(f"{what}: samples of different shapes in one batch "
                         f"({', '.join(map(str, sorted(shapes)[:3]))}); pad or resize them "
                         "to one shape")
    return torch.stack(ts)


def concat(batches: Sequence[Inputs]) -> Inputs:
    """Batches of one structure joined along their rows."""
    first = batches[0]
    if isinstance(first, Mapping):
        return {k: torch.cat([b[k] for b in batches]) for k in first}
    if isinstance(first, (tuple, list)):
        return tuple(torch.cat([b[i] for b in batches]) for i in range(len(first)))
    return torch.cat(list(batches))


def describe(x: Inputs) -> str:
    """Shapes for an error line: ``(32, 16)``, ``((32, 16), (32,))``, ``{input_ids: (32, 16)}``."""
    if isinstance(x, Mapping):
        return "{" + ", ".join(f"{k}: {_shape(v)}" for k, v in x.items()) + "}"
    if isinstance(x, (tuple, list)):
        return "(" + ", ".join(_shape(v) for v in x) + ")"
    return _shape(x)


def _shape(v: Any) -> str:
    return str(tuple(v.shape)) if hasattr(v, "shape") else type(v).__name__


def input_kind(x: Inputs) -> str:
    """What the job's workload check calls the inputs: ``sequence`` (integer tokens, the first
    tensor of a structure), ``image`` (float ``[B, C, H, W]``) or ``vector``."""
    first = tensors(x)[0]
    if not first.is_floating_point():
        return "sequence"
    return "image" if first.dim() == 4 else "vector"


def call_mismatch(module: Any, x: Inputs, extra: tuple[str, ...] = ()) -> str | None:
    """Why ``module`` cannot be called with ``x`` (as :func:`call` would), by its
    ``forward``'s signature; ``None`` when it can, or when the signature cannot tell."""
    import inspect

    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError, AttributeError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params) and isinstance(x, Mapping):
        return None
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    taken = f"{type(module).__name__}.forward({', '.join(p.name for p in params)})"
    if isinstance(x, Mapping):
        unknown = [k for k in [*x, *extra] if k not in names]
        if unknown:
            return (f"the batches give the inputs by name ({', '.join(x)}) but {taken} takes "
                    f"no {', '.join(unknown)}; return the tensor alone, or match the names")
        return None
    if isinstance(x, (tuple, list)) and not any(p.kind is p.VAR_POSITIONAL for p in params):
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY,
                                                      p.POSITIONAL_OR_KEYWORD)]
        required = [p for p in positional if p.default is p.empty]
        if not len(required) <= len(x) <= len(positional):
            return (f"the batches give {len(x)} positional inputs but {taken} takes "
                    f"{len(required)}" + (f" to {len(positional)}" if len(positional) >
                                          len(required) else "")
                    + "; return as many tensors as it takes")
    return None
