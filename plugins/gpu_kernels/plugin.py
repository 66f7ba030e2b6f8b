"""The gpu_kernels hook implementations.

Everything happens in ``accelopt_layer_build`` when the *whole model* is offered (path
``""``, offered last): node pruning needs whole-model surgery (a pruned layer's consumers
are sliced too), and the other transforms must see the pruned layers. Order: prune ->
autotuned convs -> tiled Linear -> channels_last.

Pruning happens at build time by default (``prune_at_iteration=0``: the importance sees freshly
initialised weights; the network is trained at its pruned size). With
``prune_at_iteration=N`` the model trains dense for N iterations and is pruned at the end of
iteration N (``accelopt_after_step``) by the importance of the *trained* weights (Taylor: the
gradients of that iteration's batch); the plugin answers ``OptimizerRebuild`` so the core
rebuilds the optimizer over the sliced parameters, and ``accelopt_optimizer_build`` slices
each pruned parameter's optimizer state (momentum, Adam moments) with the same indices
instead of dropping it. Only single-process runs: in a parameter-server run the parameters
live on the server, in an all-reduce run DDP's buckets are fixed at wrap time, so ranks would
disagree; ``accelopt_configure`` refuses those in one line. The units kept are the plugin's
checkpoint state, so a resume re-prunes the dense build before the weights load. The sliced
layers are new tensors in the default layout: a channels_last decision already taken is
applied to them again (in place, so the rebuilt optimizer holds the live parameters).

At the first forward a one-shot probe measures, on the real input, FLOPs and inference
latency of the dense copy kept at build time vs the pruned model (deep copies, eval mode,
so the training run is not disturbed). FLOPs are of one forward of that batch, so the row
and metrics give its rows and the FLOPs per row: a cluster rank's share counts fewer.
"""

from __future__ import annotations

import copy
import dataclasses
import stat
import statistics
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelopt_plugins.gpu_kernels.autotune import (
    AutotunedConv2d,
    ConvAutotuner,
    DecisionCache,
    autotune_model,
    time_callables,
    verify_model,
)
from accelopt_plugins.gpu_kernels.config import GpuKernelsConfig, conv_cache_path
from accelopt_plugins.gpu_kernels.layout import ChannelsLast
from accelopt_plugins.gpu_kernels.pruning import (
    Lineage,
    PruneReport,
    count_flops,
    node_prune,
    prune_channels,
    record_lineage,
    slice_like,
    uncompiled,
)
from accelopt_plugins.gpu_kernels.tiled import TiledLinear
from torch import nn

from accelopt import (
    ConfigError,
    IterationContext,
    JobInfo,
    LayerOffer,
    OptimizerRebuild,
    ReportRow,
    RunInfo,
    UserError,
    hookimpl,
    isolated_rng,
)
from accelopt.atomic import refuse_unwritable
from accelopt.job.inputs import tensors
from accelopt.plugin import PluginWarning
from accelopt.types import INERT


@dataclass
class _JobRecord:
    """What the plugin did to one job's model."""

    prune: PruneReport | None = None
    probe: dict[str, float] = field(default_factory=dict)
    convs: list[AutotunedConv2d] = field(default_factory=list)
    tiled: list[TiledLinear] = field(default_factory=list)
    layout: ChannelsLast | None = None
    conv_guard: str = "not run"
    notes: list[str] = field(default_factory=list)
    late: _LatePrune | None = None
    last_iteration: int = 0
    """The latest iteration (counted from 1) whose ``accelopt_after_step`` ran: how many
    were fine-tuned after a pruning at iteration N is this minus N."""
    steps_seen: int = 0
    """``accelopt_after_step`` calls for the job: none means the loop never reached the
    point where pruning happens (a loop of your own stepping without ``ao.step``)."""
    hooked: list[Any] = field(default_factory=list)
    """Every object that put a hook on the model (probe, conv guard, layout), each with a
    ``release()``: taken off at the run's end, so a loop's own model (``accelopt.attach``)
    carries none of them past ``close()``."""


@dataclass
class _LatePrune:
    """Pruning after N iterations: the model to prune, its latest forward input (for the
    trial forward and FLOPs), and what happened."""

    model: nn.Module | None
    at: int
    example: Any = None
    hook: Any = None
    pruned_at: int | None = None
    lineage: Lineage = field(default_factory=dict)
    carried: int = 0
    flops: tuple[int, int] | None = None
    flops_rows: int | None = None
    """The rows of the batch ``flops`` were counted on (:func:`batch_rows`)."""
    calls: _ChildCalls | None = None
    watchers: list[Any] = field(default_factory=list)
    uncounted: bool = False
    """Restored from a checkpoint that does not record the job's latest iteration (one
    written before the state kept it): how many iterations fine-tuned the pruned model before
    the resume is not known."""

    def capture(self, _m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.example = (args, kwargs)

    def watch(self, model: nn.Module) -> None:
        """Until the pruning, note every direct child the loop calls on its own (a GAN's
        ``model.D(real)``). Why: pruning follows the root forward, ``D(G(z))``, which cut
        the G -> D boundary from 4 features to 2, and the loop's call of D on real data
        failed with a shape error; the interfaces of the children noted here keep their
        widths (:func:`node_prune`'s ``interfaces``)."""
        self.calls = calls = _ChildCalls(model)
        self.watchers += [model.register_forward_pre_hook(calls.enter),
                          model.register_forward_hook(calls.leave, always_call=True)]
        self.watchers += [child.register_forward_pre_hook(calls.called)
                          for child in uncompiled(model).children()]

    @property
    def alone(self) -> list[str]:
        """The direct children seen called on their own, by path."""
        return sorted(self.calls.alone) if self.calls is not None else []

    def release(self) -> None:
        """Let go of the model and its last input, and take :meth:`capture` and the
        watchers off the model: at the pruning, and at the run's end when the pruning was
        never reached (the hook stayed on a loop's own model after ``close()``, keeping its
        latest input alive)."""
        self.model = self.example = None
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        for handle in self.watchers:
            handle.remove()
        self.watchers.clear()


class _ChildCalls:
    """Which direct children of a model run outside its root forward. The children are
    known by identity: a deep copy of the model (a trial or measuring forward) carries
    copies of these hooks, and its children's calls must not count as the loop's."""

    def __init__(self, model: nn.Module) -> None:
        self.root = id(model)
        self.children = {id(c): name for name, c in uncompiled(model).named_children()}
        self.inside = 0
        self.alone: set[str] = set()

    def enter(self, module: nn.Module, _args: tuple[Any, ...]) -> None:
        if id(module) == self.root:
            self.inside += 1

    def leave(self, module: nn.Module, _args: tuple[Any, ...], _out: Any) -> None:
        if id(module) == self.root:
            self.inside = max(0, self.inside - 1)

    def called(self, module: nn.Module, _args: tuple[Any, ...]) -> None:
        name = self.children.get(id(module))
        if name is not None and not self.inside:
            self.alone.add(name)


PROBE_REPS = 7
"""Interleaved timing rounds of the pruning probe (its ratio's spread is over these)."""


class _PruneProbe:
    """One-shot forward pre-hook: dense vs pruned FLOPs and latency on the real input."""

    def __init__(self, model: nn.Module, dense: nn.Module, record: _JobRecord) -> None:
        # copies of both models as they are right after pruning: the later transforms
        # (autotuned convs, tiled Linear, layout) are measured by their own rules
        self.dense, self.pruned, self.record = dense, copy.deepcopy(model), record
        self.armed = True
        self.handle = model.register_forward_pre_hook(self._pre, with_kwargs=True)
        record.hooked.append(self)

    def release(self) -> None:
        """Disarm, take the hook off and let go of both copies. Why: at the run's end a probe
        that never ran (a loop of one's own closed before its first forward) stayed on the
        model, holding a dense and a pruned copy, and ran on the loop's next forward."""
        self.armed = False
        self.handle.remove()
        self.dense = self.pruned = None  # type: ignore[assignment]

    def _pre(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.armed:
            return
        self.armed = False
        self.handle.remove()
        # keyword inputs too (HF models take input_ids=..., attention_mask=...): reading
        # only args[0] measured nothing for them and skipped the first-forward check
        args = tuple(_detached(a) for a in args)
        kwargs = {k: _detached(v) for k, v in kwargs.items()}
        found = tensors(args) + tensors(kwargs)
        if not found:
            self.record.notes.append(
                "pruning probe: the first forward got no tensor argument, so FLOPs and "
                "latency dense -> pruned were not measured")
            return
        device = found[0].device
        try:  # the probe must not move the job's random stream
            with isolated_rng():
                dense = self.dense.to(device).eval()
                pruned = self.pruned.to(device).eval()
                flops_dense = count_flops(dense, args, kwargs)
                try:
                    flops_pruned = count_flops(pruned, args, kwargs)
                except Exception as exc:  # the job's own forward will fail the same way
                    self.record.notes.append(
                        f"the pruned model failed its first forward: {type(exc).__name__}: "
                        f"{str(exc)[:200]} (set plugins.gpu_kernels.prune_amount=0 to run it "
                        "dense)")
                    return
                self.record.probe.update(flops_dense=flops_dense, flops_pruned=flops_pruned)
                rows = batch_rows(found)
                if rows is not None:
                    self.record.probe["flops_batch_rows"] = rows
                self._time(dense, pruned, args, kwargs, device)
        except Exception as exc:  # the probe only reports; it must never break training
            self.record.notes.append(f"probe failed: {type(exc).__name__}: {exc}")
        finally:
            self.dense = self.pruned = None  # type: ignore[assignment]

    def _time(self, dense: nn.Module, pruned: nn.Module, args: tuple[Any, ...],
              kwargs: dict[str, Any], device: torch.device) -> None:
        """Median inference latency of both, and the spread of the per-round ratios (each
        round times both, interleaved): one batch on a busy machine gave 11.88x, 0.16x and
        1.04x for identical runs, so the ratio is never shown without its spread."""
        def infer(m: nn.Module) -> Any:
            def run() -> Any:
                with torch.no_grad():
                    return m(*args, **kwargs)
            return run

        samples = time_callables({"dense": infer(dense), "pruned": infer(pruned)},
                                 device, reps=PROBE_REPS)
        med = {k: statistics.median(v) for k, v in samples.items()}
        ratios = [d / max(p, 1e-12) for d, p in zip(samples["dense"], samples["pruned"],
                                                      strict=True)]
        self.record.probe.update(
            latency_dense_ms=round(med["dense"] * 1e3, 4),
            latency_pruned_ms=round(med["pruned"] * 1e3, 4),
            speedup_low=round(min(ratios), 3), speedup_high=round(max(ratios), 3))


class _ConvGuard:
    """One-shot forward hook: after the first forward (per-layer tuning done inside it),
    run ``verify_model`` on the real input; the tuned choices stay only if the whole model
    is measurably faster than always-direct."""

    def __init__(self, model: nn.Module, reps: int, min_gain: float, record: _JobRecord) -> None:
        self.reps, self.min_gain, self.record = reps, min_gain, record
        self.armed = True
        self.handle = model.register_forward_hook(self._post, with_kwargs=True)
        record.hooked.append(self)

    def release(self) -> None:
        """Disarm and take the hook off (the run ended before the model's first forward)."""
        self.armed = False
        self.handle.remove()

    def _post(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              _out: Any) -> None:
        if not self.armed:
            return
        self.armed = False
        self.handle.remove()
        # keyword inputs too (HF image models take pixel_values=...): reading only args[0]
        # left such a model's tuned choices unchecked, the row saying "not run"
        # (detached only: the layout the tuned convs saw is the one timed)
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        if not tensors(args) + tensors(kwargs):
            self.record.conv_guard = "not run: the first forward got no tensor input"
            return
        try:
            with isolated_rng():  # its training-mode steps must not draw the job's masks
                kept = verify_model(model, args, kwargs=kwargs,
                                    training=model.training and torch.is_grad_enabled(),
                                    reps=self.reps, min_gain=self.min_gain)
            self.record.conv_guard = "kept" if kept else "all direct"
        except Exception as exc:  # measuring must never break training
            self.record.notes.append(f"conv guard failed: {type(exc).__name__}: {exc}")


class GpuKernelsPlugin:
    """Applies the configured tricks to every job's model at build time and reports them."""

    def __init__(self, config: GpuKernelsConfig) -> None:
        self.config = config
        self.jobs: dict[str, _JobRecord] = {}
        self.tuner: ConvAutotuner | None = None

    @property
    def enabled(self) -> bool:
        c = self.config
        return (c.prune_amount > 0 or c.conv_autotune or c.tiled_linear != "off"
                or c.channels_last != "off")

    @hookimpl
    def accelopt_configure(self, config: Any, run_config: Any) -> None:
        self.config = config
        config.validate()
        mode = _cluster_mode(run_config)
        if int(config.prune_at_iteration) > 0 and mode != "none":
            raise ConfigError(
                f"plugins.gpu_kernels.prune_at_iteration={config.prune_at_iteration} needs a "
                f"single-process run (cluster.mode={mode}: ranks would disagree on the "
                "parameters); use cluster.mode=none or prune_at_iteration=0")
        path = conv_cache_path(config.conv_cache) if config.conv_autotune else None
        if path is not None:
            _refuse_unusable_cache(str(config.conv_cache), path)
            # an unwritable cache failed the first conv job's profiling step, the line
            # blaming the model's inputs
            refuse_unwritable(path.parent,
                              "give plugins.gpu_kernels.conv_cache a path you can write, or "
                              "conv_cache='' to keep the decisions in memory")

    def _tuner(self) -> ConvAutotuner:
        if self.tuner is None:
            self.tuner = ConvAutotuner(
                DecisionCache.load(conv_cache_path(self.config.conv_cache)),
                reps=int(self.config.autotune_reps),
                min_gain=float(self.config.autotune_min_gain),
            )
        return self.tuner

    @hookimpl
    def accelopt_layer_build(self, layer: LayerOffer) -> Any | None:
        if layer.path != "" or not self.enabled or not isinstance(layer.module, nn.Module):
            return None
        c = self.config
        model: nn.Module = layer.module
        record = self.jobs.setdefault(layer.job.job_id, _JobRecord())
        if c.prune_amount > 0 and int(c.prune_at_iteration) > 0:
            late = _LatePrune(model, int(c.prune_at_iteration))
            late.hook = model.register_forward_pre_hook(late.capture, with_kwargs=True)
            late.watch(model)
            record.late = late
        elif c.prune_amount > 0:
            dense = copy.deepcopy(model)
            record.prune = node_prune(model, float(c.prune_amount),
                                      criterion=c.prune_criterion, rounds=int(c.prune_rounds))
            if record.prune.pruned:
                _PruneProbe(model, dense, record)
        if c.conv_autotune:
            autotune_model(model, self._tuner())
            record.convs = [m for m in model.modules() if isinstance(m, AutotunedConv2d)]
            if record.convs:
                _ConvGuard(model, int(c.autotune_reps), float(c.autotune_min_gain), record)
        if c.tiled_linear != "off":
            for path, module in list(model.named_modules()):
                if type(module) is nn.Linear:
                    new = TiledLinear.from_linear(module, c.tiled_linear)
                    parent_path, _, name = path.rpartition(".")
                    setattr(model.get_submodule(parent_path) if parent_path else model, name, new)
                    record.tiled.append(new)
        if c.channels_last != "off":
            record.layout = ChannelsLast(model, c.channels_last, reps=int(c.autotune_reps),
                                         min_gain=float(c.autotune_min_gain))
            record.hooked.append(record.layout)
        return model

    @hookimpl
    def accelopt_after_step(self, context: IterationContext, stepped: bool
                            ) -> OptimizerRebuild | None:
        rec = self.jobs.get(context.job.job_id)
        if rec is not None:
            rec.steps_seen += 1
            rec.last_iteration = context.iteration + 1
        late = rec.late if rec is not None else None
        if late is not None and late.model is None:
            # every optimizer of the rebuild was offered (a loop of one's own may step
            # several): the dense parameters the lineage holds are let go
            late.lineage = {}
        # the first step at or after the iteration, once: a loop stepping every 2nd
        # iteration (gradient accumulation) never stepped at iteration N, and stayed dense
        if late is None or late.model is None or context.iteration + 1 < late.at:
            return None
        assert rec is not None
        at = context.iteration + 1
        done = self._prune_late(rec, late, at)
        late.release()  # nothing of the job is kept past its pruning
        if not done:
            return None
        if context.job.iterations and at >= context.job.iterations:
            warnings.warn(_untuned_note(at), PluginWarning, stacklevel=2)
        return OptimizerRebuild(reason=f"gpu_kernels node-pruned {len(rec.prune.pruned)} "
                                f"layers at iteration {at}")  # type: ignore[union-attr]

    def _prune_late(self, rec: _JobRecord, late: _LatePrune, at: int) -> bool:
        """Prune a trial copy first (the model must still run on the last real input and the
        FLOPs are measured there), then the live model, recording each new parameter's
        lineage for the optimizer state."""
        c, model = self.config, late.model
        assert model is not None
        prune: dict[str, Any] = {"criterion": c.prune_criterion,
                                 "interfaces": late.alone}
        try:
            with isolated_rng():
                trial = _copy_with_gradients(model)
                node_prune(trial, float(c.prune_amount), **prune)
                if late.example is not None:
                    late.flops = (_flops(model, late.example), _flops(trial, late.example))
                    late.flops_rows = batch_rows(tensors(late.example[0])
                                                 + tensors(late.example[1]))
            del trial
        except Exception as exc:  # a model the pruner cannot handle stays dense, said so
            rec.notes.append(f"pruning at iteration {at} skipped: "
                             f"{type(exc).__name__}: {exc}")
            return False
        with record_lineage() as lineage:
            rec.prune = node_prune(model, float(c.prune_amount), **prune)
        if rec.layout is not None:  # in place (same Parameters): the lineage still holds
            rec.layout.reapply(model)
        late.lineage, late.pruned_at = dict(lineage), at
        return bool(rec.prune.pruned)

    @hookimpl
    def accelopt_optimizer_build(self, job: Any, optimizer: torch.optim.Optimizer,
                                 parameters: dict[str, nn.Parameter],
                                 previous: torch.optim.Optimizer | None) -> None:
        """Carry the state of each pruned parameter, sliced like the parameter, so momentum
        and Adam moments survive pruning (the core carries only unchanged parameters)."""
        rec = self.jobs.get(job.job_id)
        late = rec.late if rec is not None else None
        if late is None or not late.lineage or previous is None:
            return None
        for param in parameters.values():
            orig, steps = late.lineage.get(param, (None, []))
            state = previous.state.get(orig) if orig is not None else None
            if state and param not in optimizer.state:
                optimizer.state[param] = {
                    k: _like(param, slice_like(v, steps)) if isinstance(v, torch.Tensor)
                    and v.shape == orig.shape else v for k, v in state.items()}
                late.carried += 1
        return None

    @hookimpl
    def accelopt_state_save(self, job: JobInfo) -> dict[str, Any] | None:
        """Once a job is pruned after N iterations, its checkpoints hold pruned shapes: keep
        the units each group kept, so a resume (which builds the job dense) prunes the same
        units before the core loads the weights; and the job's latest iteration, so the row of
        a job restored finished (no iteration runs after the resume) says how many iterations
        fine-tuned the pruned model, where it said 0 and warned it was pruned at its last."""
        rec = self.jobs.get(job.job_id)
        late = rec.late if rec is not None else None
        if late is None or late.pruned_at is None or rec.prune is None:  # type: ignore[union-attr]
            return None
        return {"pruned_at": late.pruned_at, "prune": dataclasses.asdict(rec.prune),  # type: ignore[union-attr]
                "flops": late.flops, "flops_rows": late.flops_rows, "carried": late.carried,
                "last_iteration": rec.last_iteration}  # type: ignore[union-attr]

    @hookimpl
    def accelopt_state_load(self, job: JobInfo, state: dict[str, Any]) -> None:
        rec = self.jobs.get(job.job_id)
        late = rec.late if rec is not None else None
        if rec is None or late is None or late.model is None:
            raise UserError(
                f"job '{job.name}': its checkpoint was node-pruned at iteration "
                f"{state.get('pruned_at')} (plugins.gpu_kernels.prune_at_iteration), which "
                "this run does not do; resume with the run's own configuration")
        prune_channels(late.model, state["prune"]["kept"])
        if rec.layout is not None:
            rec.layout.reapply(late.model)
        rec.prune = PruneReport(**state["prune"])
        late.pruned_at, late.flops, late.carried = (
            int(state["pruned_at"]), state["flops"], int(state["carried"]))
        late.flops_rows = state.get("flops_rows")  # absent from older checkpoints
        late.uncounted = "last_iteration" not in state  # so is this
        rec.last_iteration = max(rec.last_iteration, int(state.get("last_iteration", 0)))
        late.release()

    @hookimpl
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        if not self.enabled:
            # example values, each one the config accepts (tiled_linear and channels_last
            # are modes, not switches: "true" is refused)
            return [ReportRow("gpu_kernels", "nothing enabled: set plugins.gpu_kernels."
                              "prune_amount=0.5, conv_autotune=true, tiled_linear=tiled or "
                              "channels_last=on", {INERT: 1})]
        if not self.jobs:
            return [ReportRow("gpu_kernels", "no model was offered (no job was built)",
                              {INERT: 1})]
        return [self._row(job_id, rec) for job_id, rec in self.jobs.items()]

    def _row(self, job_id: str, rec: _JobRecord) -> ReportRow:
        parts: list[str] = []
        metrics: dict[str, float | int | str] = {"job": job_id}
        late = rec.late
        if late is not None and late.pruned_at is None and not rec.notes:
            parts.append(
                f"prune_at_iteration={late.at} not reached: the job stopped first"
                if rec.steps_seen else
                f"prune_at_iteration={late.at} not reached: accelopt_after_step never ran, "
                "where it prunes (a loop of your own: step with ao.step(opt))")
        if rec.prune is not None:
            p = rec.prune
            if p.pruned and late is not None:
                at = late.pruned_at if late.pruned_at is not None else late.at
                later = (f" (prune_at_iteration={late.at}: the first optimizer step at or after it)"
                         if at != late.at else "")
                parts.append(
                    f"node-pruned {len(p.pruned)} layers at iteration {at}{later} (trained "
                    f"weights, {self.config.prune_criterion}; optimizer rebuilt, state of "
                    f"{late.carried} sliced params carried), params "
                    f"{p.params_before}->{p.params_after}")
                tuned = max(0, rec.last_iteration - at)
                if late.uncounted and not tuned:  # no iteration ran after the resume
                    parts.append("restored from a checkpoint that does not record how many "
                                 "iterations fine-tuned the pruned model before the resume "
                                 "(written by an older version), and none ran after it")
                else:
                    parts.append(f"fine-tuned {tuned} iteration{'s' if tuned != 1 else ''} "
                                 "after pruning")
                    if not tuned:
                        parts.append(f"warning: {_untuned_note(at)}")
                    metrics["fine_tuned_iterations"] = tuned
                metrics["pruned_at_iteration"] = at
                if late.flops is not None:
                    metrics.update(flops_before=late.flops[0], flops_after=late.flops[1])
                    parts.append(_flops_part(late.flops[0], late.flops[1], late.flops_rows,
                                             ("flops_before", "flops_after"), metrics))
            elif p.pruned:
                parts.append(
                    f"node-pruned {len(p.pruned)} layers at build time (fresh weights, trained "
                    f"at the pruned size), params {p.params_before}->{p.params_after}")
            elif p.unremoved:  # layers to prune, but the amount rounds to 0 units of each
                parts.append(f"node pruning: {p.unremoved_note(float(self.config.prune_amount))}")
            else:
                parts.append("node pruning: no prunable layer (the model stays dense)")
            if p.floored:
                parts.append(p.floored_note())
            if p.refused:
                parts.append(_refused_part(p.refused))
            metrics.update(params_before=p.params_before, params_after=p.params_after,
                           layers_pruned=len(p.pruned), layers_refused=len(p.refused))
            parts += _probe_parts(rec.probe, metrics)
        if rec.convs:
            chosen = self._conv_choices(rec)
            # the counts are per decision, not per conv: one conv decides again for every
            # input shape and train/eval mode it sees (3 convs read "direct x6")
            n = len(rec.convs)
            parts.append(f"autotuned {n} conv{'s' if n != 1 else ''}" + (
                f" ({sum(chosen.values())} decisions, one per conv, input shape and "
                "train/eval mode): " + ", ".join(f"{a} x{n}" for a, n in chosen.items())
                if chosen else ": not run yet") + f" (whole-model guard: {rec.conv_guard})")
            metrics["conv_guard"] = rec.conv_guard
            metrics.update({f"conv_{a}": n for a, n in chosen.items()})
        elif self.config.conv_autotune:
            parts.append("conv autotune: the model has no Conv2d")
        if rec.convs and self.tuner is not None:
            # a corrupt or unwritable cache was a warning on stderr only (or failed the
            # job): the row, and so metrics.json, says what became of the decisions
            cache = self.tuner.cache
            parts += cache.notes()
            if cache.problem is not None:
                metrics["conv_cache_rebuilt"] = 1
            if cache.unsaved is not None:
                metrics["conv_cache_unsaved"] = 1
        if self.config.tiled_linear != "off":
            paths = {t.last_path for t in rec.tiled}
            if not rec.tiled:
                parts.append("tiled Linear: no Linear layer")
            elif paths <= {"torch", "none"}:
                parts.append(f"tiled Linear on {len(rec.tiled)} layers, but inputs were not "
                             "CUDA float32: ran torch's F.linear (kernels need a GPU)")
            else:
                parts.append(f"{self.config.tiled_linear} numba.cuda kernel on "
                             f"{len(rec.tiled)} Linear layers")
        if rec.layout is not None:
            d = rec.layout.decision
            if d is None:
                parts.append("channels_last: model never ran")
            else:
                parts.append(f"channels_last {'on' if d.channels_last else 'off'} ({d.reason}"
                             + (f", ms {d.median_ms}" if d.median_ms else "") + ")")
                metrics["channels_last"] = int(d.channels_last)
        parts += rec.notes
        if not self._changed(rec):
            metrics[INERT] = 1
        return ReportRow("gpu_kernels", f"{job_id}: " + "; ".join(parts), metrics)

    @staticmethod
    def _changed(rec: _JobRecord) -> bool:
        """Whether the plugin changed anything the job ran: a layer pruned, a conv running an
        algorithm other than torch's direct one (the whole-model guard kept it), a tiled
        kernel run in place of ``F.linear``, or the model put in channels_last. Why: a row
        saying "no prunable layer" carried no ``INERT``, so ``run.compare`` credited
        gpu_kernels with the run-to-run noise of a model it left as it was."""
        if rec.prune is not None and rec.prune.pruned:
            return True
        if rec.conv_guard != "all direct" and any(
                algo != "direct" for conv in rec.convs
                for algo in conv._chosen.values()):  # type: ignore[attr-defined]
            return True
        if any(t.last_path not in ("torch", "none") for t in rec.tiled):
            return True
        decision = rec.layout.decision if rec.layout is not None else None
        return decision is not None and bool(decision.channels_last)

    @hookimpl
    def accelopt_run_end(self, run: RunInfo, metrics: dict[str, Any]) -> None:
        """Drop every model reference and take off every hook still held: the run's rows are
        written, and a loop's own model (``accelopt.attach``) lives on after ``close()``."""
        for rec in self.jobs.values():
            if rec.late is not None:
                rec.late.release()
                rec.late.lineage = {}
            for owner in rec.hooked:
                owner.release()
            rec.hooked.clear()

    @staticmethod
    def _conv_choices(rec: _JobRecord) -> dict[str, int]:
        """Algorithm -> number of decisions (one per conv, input shape and mode) taking it."""
        counts: dict[str, int] = {}
        for conv in rec.convs:
            for algo in conv._chosen.values():  # type: ignore[attr-defined]
                counts[algo] = counts.get(algo, 0) + 1
        return counts


def _refuse_unusable_cache(value: str, path: Path) -> None:
    """One line before the run, unless ``path`` is a regular file or absent. Why: a
    directory there was warned about as a "corrupted" cache, then its write failed the
    job with ``IsADirectoryError``; a device or FIFO would be replaced by the write."""
    key = f"plugins.gpu_kernels.conv_cache={value}"
    fix = "or conv_cache='' to keep the decisions in memory"
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):  # created at the first decision; a
        return  # path through a file is refuse_unwritable's to say
    except OSError as exc:
        raise UserError(f"{key}: cannot read {path} ({exc.strerror or exc}); give a file "
                        f"you can read and write, {fix}") from None
    if stat.S_ISDIR(mode):
        raise UserError(f"{key}: {path} is a directory, not a file; give a file path such as "
                        f"{path / 'gpu_kernels_conv.json'}, {fix}")
    if not stat.S_ISREG(mode):
        raise UserError(f"{key}: {path} is not a regular file; give a file path, {fix}")


def _untuned_note(at: int) -> str:
    """The warning for a job pruned at its last iteration: the model it ends with is the
    pruned one untrained (a digits MLP at 50%: accuracy 0.34 against 0.59 fine-tuned), and
    every loss the job logged was the dense model's."""
    return (f"pruned at iteration {at}, the job's last: no iteration fine-tuned the pruned "
            "model, and every loss logged is the dense model's; set plugins.gpu_kernels."
            "prune_at_iteration below the job's iterations")


REFUSED_LISTED = 3
"""Refused layers named in the row; the rest are counted (``... and N more``)."""


def _refused_part(refused: dict[str, str]) -> str:
    """``refused N: path: reason; ...`` naming the first few, and saying how many more."""
    items = list(refused.items())
    listed = "; ".join(f"{k}: {v}" for k, v in items[:REFUSED_LISTED])
    more = len(items) - REFUSED_LISTED
    return f"refused {len(items)}: {listed}" + (f"; ... and {more} more" if more > 0 else "")


def _probe_parts(pr: dict[str, float], metrics: dict[str, float | int | str]) -> list[str]:
    """The probe's FLOPs and latency, for the row. A speed-up is shown with the spread of
    its per-round ratios; one whose spread reaches 1x, or beyond the FLOP ratio (the bound
    of what slicing can gain), is called noise, not a speed-up."""
    parts: list[str] = []
    if "flops_dense" in pr and "flops_pruned" in pr:
        rows = pr.get("flops_batch_rows")
        parts.append(_flops_part(pr["flops_dense"], pr["flops_pruned"],
                                 None if rows is None else int(rows),
                                 ("flops_dense", "flops_pruned"), metrics))
    if "latency_dense_ms" in pr and "latency_pruned_ms" in pr:
        speed = pr["latency_dense_ms"] / max(pr["latency_pruned_ms"], 1e-9)
        low, high = pr.get("speedup_low", speed), pr.get("speedup_high", speed)
        bound = pr.get("flops_dense", 0) / max(pr.get("flops_pruned", 0), 1)
        verdict = ""
        if low <= 1.0 <= high:
            verdict = "; noise: the spread holds 1x"
        elif bound and speed > bound:
            verdict = f"; above the FLOP bound {bound:.2f}x: noise"
        parts.append(f"inference {pr['latency_dense_ms']:.3f}->{pr['latency_pruned_ms']:.3f} "
                     f"ms ({speed:.2f}x, {low:.2f}-{high:.2f}x over {PROBE_REPS} interleaved "
                     f"rounds{verdict})")
        metrics["prune_speedup"] = round(speed, 3)
    metrics.update(pr)
    return parts


def batch_rows(found: list[torch.Tensor]) -> int | None:
    """The rows (first dimension) of the first tensor input: the batch FLOPs are counted on.
    ``None`` for a 0-d one, which has no rows."""
    return int(found[0].shape[0]) if found and found[0].dim() > 0 else None


def _flops_part(before: float, after: float, rows: int | None, keys: tuple[str, str],
                metrics: dict[str, float | int | str]) -> str:
    """``FLOPs a->b`` with the batch they were counted on and per row. Why: FLOPs are of
    one forward of the batch the job fed, which in a cluster run is one rank's share (half
    the rows with two workers), so the same job read 6967296->2041856 single-process and
    3483648->1020928 in a cluster with nothing saying why; per row, the modes agree. Adds
    ``flops_batch_rows`` and ``<key>_per_row`` to ``metrics``."""
    text = f"FLOPs {before:.0f}->{after:.0f}"
    if not rows:  # no batch dimension (or an empty batch): nothing to divide by
        return text
    per = (round(before / rows), round(after / rows))
    metrics.update({"flops_batch_rows": rows, f"{keys[0]}_per_row": per[0],
                    f"{keys[1]}_per_row": per[1]})
    return (f"{text} per batch of {rows} row{'s' if rows != 1 else ''} "
            f"({per[0]}->{per[1]} per row)")


def _detached(value: Any) -> Any:
    """A forward argument as the probe measures on it: a tensor detached and contiguous (the
    job's own graph and layout untouched), anything else as it is."""
    return value.detach().contiguous() if isinstance(value, torch.Tensor) else value


def _like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A copy of ``value`` (sliced optimizer state) in ``param``'s memory layout: slicing
    gives a default-layout tensor, while a pruned parameter converted back to channels_last
    is not one."""
    out = torch.empty_like(param, dtype=value.dtype, device=value.device)
    return out.copy_(value)


def _cluster_mode(run_config: Any) -> str:
    try:
        return str(run_config.cluster.mode)
    except Exception:  # a config without a cluster section is a single-process run
        return "none"


def _flops(model: nn.Module, example: tuple[tuple[Any, ...], dict[str, Any]]) -> int:
    """FLOPs of one forward of a copy of ``model`` (eval) on a captured ``(args, kwargs)``."""
    args, kwargs = example
    return count_flops(copy.deepcopy(model).eval(), tuple(args), kwargs)


def _copy_with_gradients(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters keep their ``.grad`` (``copy.deepcopy``
    drops them): the taylor criterion scores a trial copy from this iteration's gradients,
    and without them pruning at an iteration was always skipped."""
    trial = copy.deepcopy(model)
    for copied, own in zip(trial.parameters(), model.parameters(), strict=True):
        if own.grad is not None:
            copied.grad = own.grad.detach().clone()
    return trial
