"""Configuration of the gpu_kernels plugin (``plugins.gpu_kernels.<key>=<value>``).

Every technique is off by default: selecting the plugin alone changes nothing and says so in
the report, so a user switches on exactly the tricks they want to measure.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from accelopt.errors import ConfigError

CRITERIA = ("l1", "l2", "taylor")
TILED_MODES = ("off", "tiled", "register_blocked")
LAYOUT_MODES = ("off", "on", "auto")
CONV_CACHE_AUTO = "auto"
"""``conv_cache`` default: the user's cache directory (:func:`default_conv_cache`)."""


def default_conv_cache() -> Path:
    """``$XDG_CACHE_HOME/accelopt/gpu_kernels_conv.json``, or under ``~/.cache`` when the
    variable is unset, empty or relative (the XDG base directory spec ignores a relative
    one). Why not a fixed ``~/.cache``: a user (or a test, or a CI job) that points
    ``XDG_CACHE_HOME`` elsewhere expects every tool's cache to follow it."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path("~/.cache").expanduser()
    return root / "accelopt" / "gpu_kernels_conv.json"


def conv_cache_path(value: str | None) -> Path | None:
    """The file ``conv_cache=value`` names: ``None`` for ``""`` (decisions in memory only),
    :func:`default_conv_cache` for ``auto``, else the path with ``~`` expanded."""
    value = "" if value is None else str(value)
    if not value:
        return None
    if value == CONV_CACHE_AUTO:
        return default_conv_cache()
    return Path(value).expanduser()


@dataclass
class GpuKernelsConfig:
    """Keys users set as ``plugins.gpu_kernels.key=value``."""

    prune_amount: float = 0.0
    """Fraction of neurons/channels removed from every prunable layer, in [0, 1); a layer
    the amount would empty keeps one unit (the row says so)."""
    prune_criterion: str = "l1"
    """Importance of a neuron/channel (a coupled group sums its members'): ``l1`` or ``l2``
    norm of its weights, or ``taylor`` (first order, ``|sum w * dL/dw|`` from the gradients
    of the pruning iteration's batch; needs ``prune_at_iteration`` > 0: at build time there
    are no gradients)."""
    prune_rounds: int = 1
    """Iterative schedule: reach ``prune_amount`` in this many equal-ratio rounds. At build
    time nothing trains between rounds: each re-ranks the fresh weights left by the last."""
    prune_at_iteration: int = 0
    """0: prune at build time (fresh weights). N > 0: train N iterations dense, prune the
    trained weights at the end of iteration N, rebuild the optimizer, fine-tune the rest.
    Single-process runs only (``cluster.mode=none``)."""
    conv_autotune: bool = False
    """Replace every Conv2d by an autotuned one (direct / im2col / FFT / Winograd)."""
    conv_cache: str = CONV_CACHE_AUTO
    """JSON file of autotuning decisions per (device, dtype, shape); ``""`` disables it;
    ``auto``: ``$XDG_CACHE_HOME/accelopt/gpu_kernels_conv.json`` (``~/.cache`` when
    ``XDG_CACHE_HOME`` is unset)."""
    autotune_reps: int = 7
    """Timed repetitions per algorithm (median compared)."""
    autotune_min_gain: float = 0.05
    """An alternative replaces direct only if its median is at least this much faster
    and the timing distributions do not overlap (see ``autotune.py``)."""
    tiled_linear: str = "off"
    """``tiled`` or ``register_blocked``: numba.cuda kernels for Linear layers (CUDA only)."""
    channels_last: str = "off"
    """``on``: always; ``auto``: measured at the first forward, kept only if faster."""

    def validate(self) -> None:
        """Raise ConfigError with one line naming the key and the fix."""
        p = "plugins.gpu_kernels"
        if not 0.0 <= float(self.prune_amount) < 1.0:
            raise ConfigError(
                f"{p}.prune_amount={self.prune_amount}: must be in [0, 1) "
                "(1.0 would remove whole layers); e.g. prune_amount=0.5"
            )
        if self.prune_criterion not in CRITERIA:
            raise ConfigError(
                f"{p}.prune_criterion={self.prune_criterion!r}: use one of {', '.join(CRITERIA)}"
            )
        if int(self.prune_rounds) < 1:
            raise ConfigError(f"{p}.prune_rounds={self.prune_rounds}: must be >= 1")
        self._validate_in_run_pruning(p)
        if int(self.autotune_reps) < 3:
            raise ConfigError(f"{p}.autotune_reps={self.autotune_reps}: must be >= 3")
        if not 0.0 <= float(self.autotune_min_gain) < 1.0:
            raise ConfigError(f"{p}.autotune_min_gain={self.autotune_min_gain}: must be in [0, 1)")
        if self.tiled_linear not in TILED_MODES:
            raise ConfigError(
                f"{p}.tiled_linear={self.tiled_linear!r}: use one of {', '.join(TILED_MODES)}"
            )
        if self.channels_last not in LAYOUT_MODES:
            raise ConfigError(
                f"{p}.channels_last={self.channels_last!r}: use one of {', '.join(LAYOUT_MODES)}"
            )

    def _validate_in_run_pruning(self, p: str) -> None:
        """Pruning after N iterations: a positive amount, one round, no layer swaps that would
        hide the layers from the pruner (autotuned convs, tiled Linear are built first)."""
        n = int(self.prune_at_iteration)
        if n < 0:
            raise ConfigError(f"{p}.prune_at_iteration={n}: must be >= 0 (0: at build time)")
        if n == 0:
            if self.prune_criterion == "taylor":
                raise ConfigError(f"{p}.prune_criterion=taylor needs gradients: set "
                                  f"{p}.prune_at_iteration=N > 0, or use l1/l2")
            return
        if float(self.prune_amount) <= 0:
            raise ConfigError(f"{p}.prune_at_iteration={n} with prune_amount=0 prunes nothing: "
                              f"set {p}.prune_amount, e.g. 0.5")
        if int(self.prune_rounds) != 1:
            raise ConfigError(f"{p}.prune_at_iteration={n} prunes once: set prune_rounds=1")
        if self.conv_autotune or self.tiled_linear != "off":
            raise ConfigError(f"{p}.prune_at_iteration={n} with conv_autotune/tiled_linear: "
                              "those layers are swapped at build time, before pruning; use "
                              "prune_at_iteration=0 or switch them off")
