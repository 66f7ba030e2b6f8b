"""clip: gradient-norm clipping as an accelopt plugin (an example of the plugin guide).

It clips on ``accelopt_before_optimizer_step``, where the gradients are final in every mode:
after local backward in one process, after the all-reduce on every all-reduce worker, after
the workers' gradients were averaged on each parameter server. ``gradients.clip_norm_``
uses the norm of the job's *whole* gradient, so with several parameter servers (each holding
a shard) every server scales by the same factor: the clipping is the one a single process
would apply, in every mode.

    accelopt run '+plugins=[clip]' plugins.clip.max_norm=0.5 cluster.mode=ps
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from accelopt import PluginSpec, ReportRow, UserError, hookimpl
from accelopt.types import INERT


@dataclass
class ClipConfig:
    """``plugins.clip.<field>=<value>``."""

    max_norm: float = 1.0
    """Scale the gradients so that their norm is at most this (per job, per optimizer step)."""
    norm_type: float = 2.0
    """The p of the p-norm (``inf``: the largest absolute entry)."""
    skip_non_finite: bool = True
    """Skip an optimizer step whose gradient norm is NaN or infinite."""


class ClipPlugin:
    """Counts, per job, the optimizer steps it clipped and the largest norm it saw: steps,
    not iterations, since a loop of one's own may step twice an iteration (a GAN) or once
    in several (gradient accumulation)."""

    def __init__(self, config: ClipConfig) -> None:
        self.config = config
        self.seen: dict[str, list[float]] = {}
        self.clipped: dict[str, int] = {}
        self.skipped: dict[str, int] = {}

    @hookimpl
    def accelopt_configure(self, config: ClipConfig, run_config: object) -> None:
        if not config.max_norm > 0:
            raise UserError(f"plugins.clip.max_norm must be > 0, got {config.max_norm}")
        if not (config.norm_type > 0 or math.isinf(config.norm_type)):
            raise UserError(f"plugins.clip.norm_type must be > 0 or inf, got {config.norm_type}")
        self.config = config

    @hookimpl
    def accelopt_before_optimizer_step(self, context, gradients) -> None:
        name = context.job.name
        norm = gradients.clip_norm_(self.config.max_norm, self.config.norm_type)
        self.seen.setdefault(name, []).append(norm)
        if not math.isfinite(norm) and self.config.skip_non_finite:
            gradients.skip(f"gradient norm {norm}")
            self.skipped[name] = self.skipped.get(name, 0) + 1
        elif norm > self.config.max_norm:
            self.clipped[name] = self.clipped.get(name, 0) + 1

    @hookimpl
    def accelopt_report_rows(self, run) -> list[ReportRow]:
        if not self.seen:
            if run.role == "worker":
                return []  # a PS worker takes no optimizer step: its servers clip
            return [ReportRow("clip", "no optimizer step ran here: nothing to clip", {INERT: 1})]
        rows = []
        for name, norms in self.seen.items():
            n, clipped, skipped = len(norms), self.clipped.get(name, 0), self.skipped.get(name, 0)
            text = (f"{name}: clipped {clipped} of {n} optimizer steps to norm "
                    f"{self.config.max_norm:g} (largest norm {max(norms):.4g})")
            if skipped:
                text += f"; skipped {skipped} non-finite steps"
            metrics: dict[str, float | int | str] = {
                "job": name, "steps": n, "clipped": clipped, "max_norm_seen": round(max(norms), 6)}
            if not clipped and not skipped:
                # it changed nothing: run.compare and bench then call a difference noise,
                # not the plugin's gain
                metrics[INERT] = 1
            rows.append(ReportRow("clip", text, metrics))
        return rows


PLUGIN = PluginSpec(
    name="clip",
    factory=ClipPlugin,
    config=ClipConfig,
    description="Clips each job's gradient norm before the optimizer step, the same way in "
    "every mode.",
)
