"""gradcomm's options (``plugins.gradcomm.<key>=...``) and their one-line validation."""

from __future__ import annotations

import math
from dataclasses import dataclass

from accelopt.errors import ConfigError

DTYPES = ("fp32", "fp16", "bf16")
SPARSIFY = ("none", "topk", "threshold")


@dataclass
class GradcommConfig:
    """The codec runs its stages in this declared order on each gradient bucket:
    error-feedback accumulate -> sparsify -> cast to ``dtype`` -> wire; decoding runs in
    reverse. ``density``: fraction of a bucket's elements top-k sends (0 < d <= 1);
    ``threshold``: send elements with |value| >= threshold (threshold mode);
    ``error_feedback``: keep what was not sent (and the cast's rounding error) and add it
    to the next gradient; ``overlap``: start each bucket's all-reduce as soon as backward
    has produced it (false: all buckets wait for the end of backward, for comparison);
    ``check_finite``: refuse to send a NaN/Inf gradient and name its layer."""

    dtype: str = "fp32"
    sparsify: str = "none"
    density: float = 0.01
    threshold: float = 0.0
    error_feedback: bool = True
    overlap: bool = True
    check_finite: bool = True


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
    if not (isinstance(c.density, (int, float)) and math.isfinite(c.density)
            and 0 < c.density <= 1):
        raise ConfigError(
            f"plugins.gradcomm.density must be in (0, 1], got {c.density}; e.g. 0.01 sends 1%"
        )
    if c.sparsify == "threshold" and not (math.isfinite(c.threshold) and c.threshold > 0):
        raise ConfigError(
            f"plugins.gradcomm.threshold must be > 0 with sparsify=threshold, got {c.threshold}"
        )
