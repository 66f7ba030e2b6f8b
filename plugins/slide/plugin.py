"""Hook implementations of the slide plugin.

``accelopt_layer_build`` swaps a job's wide output ``nn.Linear`` (>= ``min_width`` outputs)
for a :class:`SlideLinear` initialised from the same weights, and (``sparse_input``) the XC
network's sparse first layer for :class:`SlideSparseInput`. Both train with their own sparse
Adam, at the job's learning rate unless ``plugins.slide.lr`` says otherwise.
"""

from __future__ import annotations

from typing import Any

from accelopt_plugins.slide.config import SlideConfig, as_config, validate
from accelopt_plugins.slide.layer import SlideLinear, SlideSparseInput
from accelopt_plugins.slide.xcmodel import SparseInput
from torch import nn

from accelopt import ConfigError, LayerOffer, ReportRow, RunInfo, hookimpl


class SlidePlugin:
    """Replaces wide output layers at build time and reports what the layers did."""

    def __init__(self, config: Any) -> None:
        self.cfg: SlideConfig = as_config(config)
        self.job_lr: dict[str, tuple[str, float]] = {}
        self.layers: list[tuple[str, str, SlideLinear]] = []
        self.inputs: list[tuple[str, str, SlideSparseInput]] = []
        self.skipped: list[str] = []
        self.untied: list[str] = []
        """Replaced layers whose weight another module shared (GPT-2's tied embedding)."""

    @hookimpl
    def accelopt_configure(self, config: Any, run_config: Any) -> None:
        self.cfg = as_config(config)
        validate(self.cfg)
        for job in getattr(getattr(run_config, "workload", None), "jobs", None) or []:
            self.job_lr[str(job.name)] = (str(job.optimizer), float(job.lr))

    def _lr(self, job_name: str, kind: str = "train") -> float:
        if self.cfg.lr is not None:
            return float(self.cfg.lr)
        if kind != "train":
            return 1e-3  # an inference job never updates weights
        optimizer, lr = self.job_lr.get(job_name, ("?", 0.0))
        if optimizer != "adam":
            raise ConfigError(
                f"plugins.slide.lr: job '{job_name}' uses optimizer {optimizer!r}; SLIDE trains "
                "with Adam, so set the job's optimizer to adam or give plugins.slide.lr=<rate>"
            )
        return lr

    @hookimpl
    def accelopt_layer_build(self, layer: LayerOffer) -> Any | None:
        module = layer.module
        if layer.path == "":  # the root comes last: now the output layer is known
            self._replace_output(module, layer)
            return None
        if self.cfg.sparse_input and isinstance(module, SparseInput):
            new_in = SlideSparseInput(module.weight, module.bias, self.cfg,
                                      lr=self._lr(layer.job.name, layer.job.kind))
            self.inputs.append((layer.job.name, layer.path, new_in))
            return new_in
        return None

    def _replace_output(self, model: nn.Module, layer: LayerOffer) -> None:
        """Replace the model's last parameterised module if it is a wide Linear: only an
        output layer may return SLIDE's deferred logits (a wide hidden layer stays dense)."""
        last = None
        for path, mod in model.named_modules():
            if path and any(True for _ in mod.parameters(recurse=False)) or isinstance(
                    mod, SlideSparseInput):
                last = (path, mod)
        job = layer.job.name
        for path, mod in model.named_modules():
            if not (isinstance(mod, nn.Linear) and mod.out_features >= self.cfg.min_width):
                continue
            if last is None or mod is not last[1]:
                self.skipped.append(f"{job}:{path} ({mod.out_features} outputs, not the output "
                                    "layer)")
                continue
            tied = [n for n, p in model.named_parameters(remove_duplicate=False)
                    if p is mod.weight and not n.startswith(path + ".")]
            if tied:
                self.untied.append(f"{job}:{path}'s weight was tied to {tied[0]}; SLIDE trains "
                                   "its own copy (untied)")
            new = SlideLinear.from_linear(mod, self.cfg, lr=self._lr(job, layer.job.kind))
            parent_path, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent_path), name, new)
            self.layers.append((job, path, new))

    @hookimpl
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        if not self.layers:
            why = (f"no output Linear layer has >= {self.cfg.min_width} outputs "
                   f"(plugins.slide.min_width)")
            if self.skipped:
                why += f"; wide layers left dense: {', '.join(self.skipped)}"
            return [ReportRow(plugin="slide", summary=f"nothing to do on this workload: {why}")]
        rows = []
        for job, path, lay in self.layers:
            s = lay.summary()
            rows.append(ReportRow(
                plugin="slide",
                summary=(
                    f"{job}:{path} {lay.out_features} outputs trained with LSH-sampled softmax "
                    f"({self.cfg.hash} K={self.cfg.k} L={self.cfg.l}): "
                    f"{100 * s['active_fraction']:.2f}% active per sample, "
                    f"{s['union_rows_per_batch']:.0f} rows updated per batch, "
                    f"{100 * s['rebuild_time_share']:.1f}% of layer time rebuilding tables"
                    + (f"; sparse-input first layer: {len(self.inputs)} replaced"
                       if self.inputs else "")
                    + "".join(f"; {note}" for note in self.untied if note.startswith(
                        f"{job}:{path}'"))
                ),
                metrics={k: round(float(v), 6) for k, v in s.items()},
            ))
        return rows
