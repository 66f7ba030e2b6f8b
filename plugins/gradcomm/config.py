"""gradcomm's options (``plugins.gradcomm.<key>=...``) and their one-line validation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from accelopt.errors import ConfigError

DTYPES = ("fp32", "fp16", "bf16")
SPARSIFY = ("none", "topk", "threshold")
SCOPES = ("bucket", "model")

METHOD_DEFAULTS: dict[str, Any] = {"density": 0.01, "threshold": 0.0, "factor_masking": True,
                                   "topk_scope": "model"}
"""The settings of one method (top-k, threshold, momentum correction) and the value their
``null`` stands for. They default to ``null`` so that a value the user gives is seen as
given, even one equal to the method's default: the composed config holds every key, so a
comparison with the defaults let ``density=0.01`` without ``sparsify=topk`` pass while
``density=0.1`` was refused."""


@dataclass
class GradcommConfig:
    """The codec runs its stages in this declared order on each gradient bucket:
    momentum-correction velocity -> error-feedback accumulate -> sparsify (then factor
    masking) -> cast to ``dtype`` -> wire; decoding runs in reverse. ``density``: fraction of a bucket's elements top-k sends (0 < d <= 1);
    ``threshold``: send elements with |value| >= threshold (threshold mode);
    ``error_feedback``: keep what was not sent (and the cast's rounding error) and add it
    to the next gradient; ``overlap``: start each bucket's all-reduce as soon as backward
    has produced it (false: all buckets wait for the end of backward, for comparison);
    ``check_finite``: refuse to send a NaN/Inf gradient and name its layer;
    ``momentum_correction``: DGC's momentum correction for top-k/threshold (each rank
    accumulates its own velocity and sends top-k of the accumulated velocity; the decoder
    hands the job's SGD ``S_t - m*S_{t-1}``, so its own momentum buffer equals the sent sum
    ``S_t`` and the step applies exactly that). ``null`` (default):
    on when sparsifying with error feedback and the job's optimizer is SGD with momentum
    > 0, off otherwise; ``true`` where it cannot apply (Adam, no momentum, dense, no error
    feedback) is a one-line error. ``factor_masking``: with momentum correction, zero the
    velocity of the entries just sent (DGC's momentum factor masking). ``topk_scope``:
    ``bucket`` sends ``density`` of every bucket; ``model`` shares the budget ``density`` x
    (all gradient elements) between buckets by where the last step's model-wide top-k fell
    (top-k over the whole model, one step stale, overlap kept). ``density``, ``threshold``,
    ``factor_masking`` and ``topk_scope`` default to ``null``, read as their method's
    default (0.01, 0.0, true, ``model``: :data:`METHOD_DEFAULTS`); a value given for a
    method not chosen is a one-line error (:func:`validate`)."""

    dtype: str = "fp32"
    sparsify: str = "none"
    density: Optional[float] = None
    threshold: Optional[float] = None
    error_feedback: bool = True
    overlap: bool = True
    check_finite: bool = True
    momentum_correction: Optional[bool] = None  # OmegaConf 2.3 needs Optional
    factor_masking: Optional[bool] = None
    topk_scope: Optional[str] = None

    def __post_init__(self) -> None:
        """Note which method settings were given (not ``null``), then put each method's
        default in place of ``null``: the plugin and the codec read plain values, and
        :func:`validate` reads ``explicit``. Not a field, so not a config key."""
        self.explicit = frozenset(k for k in METHOD_DEFAULTS if getattr(self, k) is not None)
        for key, default in METHOD_DEFAULTS.items():
            if getattr(self, key) is None:
                setattr(self, key, default)


def validate(c: GradcommConfig) -> None:
    if c.dtype not in DTYPES:
        raise ConfigError(
            f"plugins.gradcomm.dtype: unknown dtype {c.dtype!r}; use one of {', '.join(DTYPES)}"
        )
    if c.sparsify not in SPARSIFY:
        raise ConfigError(
            f"plugins.gradcomm.sparsify: unknown method {c.sparsify!r}; use one of "
            f"{', '.join(SPARSIFY)}"
        )
    if c.topk_scope not in SCOPES:
        raise ConfigError(
            f"plugins.gradcomm.topk_scope: unknown scope {c.topk_scope!r}; use one of "
            f"{', '.join(SCOPES)}"
        )
    if not (isinstance(c.density, (int, float)) and math.isfinite(c.density)
            and 0 < c.density <= 1):
        raise ConfigError(
            f"plugins.gradcomm.density must be in (0, 1], got {c.density}; e.g. 0.01 sends 1%"
        )
    if not (isinstance(c.threshold, (int, float)) and math.isfinite(c.threshold)):
        # said before "has no effect" or "> 0": either would read wrongly for nan or inf
        raise ConfigError(
            f"plugins.gradcomm.threshold must be a finite number (> 0 with sparsify=threshold), "
            f"got {c.threshold}"
        )
    if c.sparsify == "threshold" and not c.threshold > 0:
        raise ConfigError(
            f"plugins.gradcomm.threshold must be > 0 with sparsify=threshold, got {c.threshold}"
        )
    # a setting of another method than the one chosen would be silently ignored (the row
    # said "dense all-reduce" for density=0.1 without sparsify=topk); any value given counts,
    # the method's default too (``explicit``: the settings that were not null)
    explicit = getattr(c, "explicit", frozenset())
    for key, method in (("density", "topk"), ("topk_scope", "topk"), ("threshold", "threshold")):
        if key in explicit and c.sparsify != method:
            raise ConfigError(
                f"plugins.gradcomm.{key}={getattr(c, key)} has no effect with "
                f"sparsify={c.sparsify} (it is {method}'s setting); set "
                f"plugins.gradcomm.sparsify={method}, or drop it")
    if "factor_masking" in explicit and c.sparsify == "none":
        raise ConfigError(
            f"plugins.gradcomm.factor_masking={c.factor_masking} has no effect with "
            "sparsify=none (it is momentum correction's setting, which corrects "
            "sparsification); set plugins.gradcomm.sparsify=topk or threshold, or drop it")


def momentum_factor(c: GradcommConfig, optimizer: str | None, momentum: float) -> float:
    """The momentum factor the codec corrects for (0: no correction), from the option and
    the job's optimizer (``None``: unknown, e.g. no workload). ``momentum_correction=true``
    where it cannot apply is a one-line ``ConfigError`` naming the reason."""
    wanted = c.momentum_correction
    if wanted is False:
        return 0.0
    reason = None
    if c.sparsify == "none":
        reason = "it corrects sparsification (set plugins.gradcomm.sparsify=topk or threshold)"
    elif not c.error_feedback:
        reason = "it accumulates what is not sent (set plugins.gradcomm.error_feedback=true)"
    elif optimizer is None:
        reason = "the run has no job (workload.jobs) whose optimizer it could correct"
    elif optimizer != "sgd":
        reason = (f"the job's optimizer is {optimizer}; it needs SGD with momentum (Adam keeps "
                  f"per-element statistics that a sparse sum cannot replace)")
    elif not momentum > 0:
        reason = f"the job's SGD has momentum {momentum:g}, so there is no momentum to correct"
    if reason is None:
        return float(momentum)
    if wanted:
        raise ConfigError(f"plugins.gradcomm.momentum_correction=true cannot apply: {reason}; "
                          f"or set it to false")
    return 0.0
