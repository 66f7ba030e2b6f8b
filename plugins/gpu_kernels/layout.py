"""channels_last (NHWC) memory layout, decided by measurement per model.

Tensor-core GPUs run NHWC convolutions natively (1.5-2x per convolution reported); on a CPU
the gain is small (~1.05x measured here) and can be negative, so ``auto`` times the model's
forward (+backward when training) both ways on the real input at its first forward and
keeps channels_last only if it passes the same noise rule as the conv autotuner.

Only 4-D tensors are converted: ``Module.to(memory_format=channels_last)`` converts 4-D and
5-D ones and raises on a 5-D one (a Conv3d's weight), which failed the whole job of a model
holding a Conv3d. For a 2-D conv model torch converts exactly its 4-D tensors, so the layout
there is the one ``Module.to`` gives; 5-D parameters keep the default layout, and the
decision's reason names their layers.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
from accelopt_plugins.gpu_kernels.autotune import model_step, pick, time_callables
from torch import nn

from accelopt import UserError, isolated_rng


@dataclass
class LayoutDecision:
    channels_last: bool
    median_ms: dict[str, float] = field(default_factory=dict)
    reason: str = ""


def image_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The forward's image: its first 4-D tensor input, positional or keyword (an HF image
    model takes ``pixel_values=``)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() == 4:
            return value
    return None


def with_image(args: tuple[Any, ...], kwargs: dict[str, Any], image: torch.Tensor,
               new: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The forward's inputs with ``image`` (the very tensor) replaced by ``new``."""
    return (tuple(new if a is image else a for a in args),
            {k: new if v is image else v for k, v in kwargs.items()})


def _left_default(model: nn.Module) -> list[str]:
    """The layers holding tensors channels_last cannot take (5-D: Conv3d), in model order."""
    owners: list[str] = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        owner = name.rpartition(".")[0] or "the model itself"
        if t.dim() == 5 and owner not in owners:
            owners.append(owner)
    return owners


def to_channels_last(model: nn.Module) -> str:
    """Convert ``model``'s 4-D parameters (and their gradients) and buffers to channels_last
    in place: the same Parameter objects, as ``Module.to`` keeps them, so an optimizer built
    over them is unaffected. Returns a note naming the layers left in the default layout
    (5-D tensors; module docstring), or ``""``."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 4:
                p.data = p.data.contiguous(memory_format=torch.channels_last)
                if p.grad is not None:
                    p.grad = p.grad.contiguous(memory_format=torch.channels_last)
        for name, b in list(model.named_buffers()):
            if b.dim() == 4:
                parent, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(parent), leaf,
                        b.contiguous(memory_format=torch.channels_last))
    left = _left_default(model)
    if not left:
        return ""
    return (f"5-D parameters of {', '.join(left)} left in the default layout: channels_last "
            "is 4-D")


def measure_channels_last(model: nn.Module, x: torch.Tensor | tuple[Any, ...], *,
                          training: bool, reps: int = 7, min_gain: float = 0.05,
                          kwargs: dict[str, Any] | None = None) -> LayoutDecision:
    """Time deep copies of ``model`` in both layouts on its inputs (``x``: the input tensor
    or the positional inputs; ``kwargs``: the keyword inputs); never touches ``model``."""
    args, kwargs = (x if isinstance(x, tuple) else (x,)), dict(kwargs or {})
    image = image_input(args, kwargs)
    if image is None:
        return LayoutDecision(False, reason="no 4-D (NCHW) input, channels_last needs one")
    dense = copy.deepcopy(model)
    nhwc = copy.deepcopy(model)
    to_channels_last(nhwc)
    plain = with_image(args, kwargs, image, image.detach())
    converted = with_image(args, kwargs, image,
                           image.detach().contiguous(memory_format=torch.channels_last))
    samples = time_callables(
        {"contiguous": model_step(dense, *plain, training),
         "channels_last": model_step(nhwc, *converted, training)},
        image.device, reps,
    )
    choice = pick(samples, min_gain, baseline="contiguous")
    med = {k: round(statistics.median(v) * 1e3, 4) for k, v in samples.items()}
    return LayoutDecision(choice == "channels_last", med, "measured")


def layout_failure(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                   image: torch.Tensor, training: bool) -> str | None:
    """Why ``model`` cannot run in channels_last: the error of one step of an NHWC deep copy
    when the same step of a contiguous copy runs (``None`` when the NHWC one runs, or when
    both fail: the model's own forward then fails as it would without this plugin). A
    forward calling ``view`` on a conv output (``h.view(h.size(0), -1)``) fails only in NHWC,
    whose tensors are not contiguous in the default sense; it failed the job, the line
    blaming the inputs."""
    nhwc = copy.deepcopy(model)
    to_channels_last(nhwc)
    converted = with_image(args, kwargs, image,
                           image.detach().contiguous(memory_format=torch.channels_last))
    try:
        model_step(nhwc, *converted, training)()
        return None
    except Exception as exc:  # noqa: BLE001 - the answer is the error itself
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:240] if str(exc) else ''}"
    finally:
        del nhwc
    try:
        model_step(copy.deepcopy(model), *with_image(args, kwargs, image, image.detach()),
                   training)()
    except Exception:  # noqa: BLE001 - the model fails either way: not the layout's doing
        return None
    hint = (" (a .view() of a tensor channels_last made non-contiguous: use .reshape() "
            "there)" if "view" in error else "")
    return error + hint


class ChannelsLast:
    """Installed on a model: at its first 4-D forward decides (``mode='auto'``) or simply
    applies (``mode='on'``) channels_last, converting parameters in place (same Parameter
    objects, so the optimizer is unaffected) and every later input."""

    def __init__(self, model: nn.Module, mode: str, reps: int = 7, min_gain: float = 0.05) -> None:
        self.mode, self.reps, self.min_gain = mode, reps, min_gain
        self.decision: LayoutDecision | None = None
        self._measuring = False  # deep copies made while measuring carry a disarmed hook
        self._handle = model.register_forward_pre_hook(self._pre, with_kwargs=True)

    def _pre(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if self._measuring:
            return None
        image = image_input(args, kwargs)
        if self.decision is None:
            self.decision = self._decide(model, args, kwargs, image)
            if not self.decision.channels_last:
                self._handle.remove()
                return None
            note = to_channels_last(model)
            if note:
                self.decision.reason += f"; {note}"
        if image is None:
            return None
        return with_image(args, kwargs, image,
                          image.contiguous(memory_format=torch.channels_last))

    def release(self) -> None:
        """Take the hook off the model (the run ended): a model already converted stays in
        channels_last, which takes inputs in either layout; its later inputs are no longer
        converted."""
        self._handle.remove()

    def reapply(self, model: nn.Module) -> None:
        """Convert ``model`` again after its parameters were replaced (pruning after N
        iterations slices a layer into new, default-layout tensors): the decision already
        taken holds for the whole job, and without this the sliced layers ran NCHW for the
        rest of it while the row said "channels_last on". No-op before the decision (the
        first forward converts whatever the model then holds) or when it was "off"."""
        if self.decision is not None and self.decision.channels_last:
            to_channels_last(model)

    def _decide(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                image: torch.Tensor | None) -> LayoutDecision:
        """Whether to convert: never without an image input, always for ``on``, by timing
        both layouts on deep copies for ``auto``."""
        if image is None:
            return LayoutDecision(False, reason="no 4-D (NCHW) input")
        training = model.training and torch.is_grad_enabled()
        self._measuring = True
        try:  # the trial and measuring steps must not draw from the job's random stream
            with isolated_rng():
                if self.mode != "on":  # the measurement runs both layouts: a failure there
                    try:  # is diagnosed after it, not by a trial step before every one
                        return measure_channels_last(model, args, kwargs=kwargs,
                                                     training=training, reps=self.reps,
                                                     min_gain=self.min_gain)
                    except Exception:
                        failure = layout_failure(model, args, kwargs, image, training)
                        if failure is None:
                            raise  # it fails in the default layout too: its own error
                        return LayoutDecision(False, reason="kept contiguous: the model fails "
                                              f"in channels_last, {failure}")
                failure = layout_failure(model, args, kwargs, image, training)
                if failure is not None:
                    raise UserError(
                        f"plugins.gpu_kernels.channels_last=on: the model fails in the "
                        f"channels_last layout and runs in the default one: {failure}; "
                        "change the forward, or set channels_last=auto (falls back) or off")
                return LayoutDecision(True, reason="forced on")
        finally:
            self._measuring = False
