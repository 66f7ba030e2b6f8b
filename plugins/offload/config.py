"""The offload plugin's options (``plugins.offload.<key>=...``) and their validation."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from accelopt.errors import ConfigError

POLICIES = ("all", "conv", "size")


@dataclass
class OffloadConfig:
    """``policy``: which saved tensors leave the device: ``all`` (vDNN_all), ``conv`` (only
    those saved by convolutions: vDNN_conv) or ``size`` (those of at least ``min_kib`` KiB).
    ``layers``: a regular expression of module paths to offload (``""``: the whole model).
    ``prefetch_layers``: how many layers ahead of backward to prefetch (vDNN: 1; 0 fetches on
    demand, like ``save_on_cpu``). ``pin_memory``: pinned host buffers on CUDA."""

    policy: str = "all"
    min_kib: float = 64.0
    layers: str = ""
    prefetch_layers: int = 1
    pin_memory: bool = True


def validate(config: OffloadConfig) -> None:
    """One-line errors naming the key and the fix."""
    if config.policy not in POLICIES:
        raise ConfigError(
            f"plugins.offload.policy: unknown policy {config.policy!r}; use one of "
            f"{', '.join(POLICIES)}"
        )
    if not (math.isfinite(config.min_kib) and config.min_kib >= 0):
        raise ConfigError(f"plugins.offload.min_kib must be a finite number >= 0 (KiB), got "
                          f"{config.min_kib}")
    if config.min_kib != OffloadConfig().min_kib and config.policy != "size":
        # ignored in silence: only the size policy reads it
        raise ConfigError(f"plugins.offload.min_kib={config.min_kib} has no effect with "
                          f"policy={config.policy} (it is the size policy's setting); set "
                          "plugins.offload.policy=size, or drop it")
    if config.prefetch_layers < 0:
        raise ConfigError(
            f"plugins.offload.prefetch_layers must be >= 0 (0: no prefetch), got "
            f"{config.prefetch_layers}"
        )
    try:
        re.compile(config.layers)
    except re.error as exc:
        raise ConfigError(
            f"plugins.offload.layers: {config.layers!r} is not a regular expression ({exc})"
        ) from None
