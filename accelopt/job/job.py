"""A job: model + data + optimizer + loss (or an inference loop), one iteration at a time.

:meth:`Job.step` is *the* training step of accelopt: the single-process executor, every
parameter server and every worker run it, and only the job's :class:`~accelopt.job.exchange.
Exchange` differs between them (``accelopt/job/events.py`` lists the sequence). A job knows
nothing about scheduling: a driver decides when ``step()`` runs.

Its data is indexed by iteration (``dataset.batch(i)``) and its random numbers come from its
own generator (:class:`~accelopt.job.rng.JobRandom`), so a job's whole state is its model,
its optimizer, its generator state and one integer, which is what makes bitwise-exact resume
possible and keeps jobs that share a process from perturbing each other.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from accelopt.config import JobConfig
from accelopt.errors import ConfigError, UserError, error_text, first_line, one_line
from accelopt.host import PluginHost
from accelopt.job import inputs
from accelopt.job.events import SILENT, Event, StepEvents, rebuilds
from accelopt.job.exchange import LOCAL, Exchange
from accelopt.job.gradients import Gradients
from accelopt.job.layers import offer_layers
from accelopt.job.optim import (
    PER_TENSOR_OPTIMIZERS,
    build_optimizer,
    lr_factor,
    schedules,
    set_lr,
    step_tensors,
)
from accelopt.job.params import buckets_by_bytes, param_table, replaced_parameters
from accelopt.job.rng import JobRandom
from accelopt.job.specs import job_info, validate_spec
from accelopt.job.timeline import NO_TIMER, PhaseTimer
from accelopt.plugin import STATE_LOAD, STATE_SAVE
from accelopt.types import BuiltJob, IterationContext, IterationResult, JobProfile
from accelopt.workloads import build_dataset, build_model, check_compatible, default_dataset_for

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 2**20


class Job:
    """One training or inference job, stepped by a driver."""

    def __init__(
        self,
        spec: JobConfig,
        *,
        job_id: str,
        device: torch.device,
        host: PluginHost | None = None,
        exchange: Exchange | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timer: PhaseTimer | None = None,
    ) -> None:
        validate_spec(spec)
        self.spec = spec
        self.device = device
        self.host = host if host is not None else PluginHost()
        self.exchange = exchange if exchange is not None else LOCAL
        self.timer = timer
        """The compute spans of the job's iterations (``None``: not recorded)."""
        try:
            dataset_name = spec.dataset or default_dataset_for(spec.model)
            self.dataset = build_dataset(dataset_name, seed=spec.seed,
                                         kwargs=spec.dataset_kwargs)
            check_compatible(spec.model, self.dataset)
            check_rows(self.dataset, spec)
            self._one_tensor = check_batch(self.dataset, spec)
            """Batches hold one input tensor (else a tuple or mapping of them)."""
        except ValueError as exc:  # the chain kept: --debug shows where a factory raised
            raise ConfigError(f"job '{spec.name}': {exc}") from exc
        info = job_info(spec, job_id)
        # Weights come from the job's own seed, not from whatever the global RNG holds, so
        # a job built next to others starts from the same weights as when built alone.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            try:
                model = build_model(
                    spec.model,
                    input_shape=tuple(self.dataset.input_shape),
                    num_classes=self.dataset.num_classes,
                    vocab_size=getattr(self.dataset, "vocab_size", None),
                    width=spec.width,
                    kwargs=spec.model_kwargs,
                )
            except ValueError as exc:  # as above: the chain is --debug's
                raise ConfigError(f"job '{spec.name}': {exc}") from exc
            refuse_sparse_gradients(model, spec.name)
            model = offer_layers(model, info, self.host)
        if spec.kind == "train":
            refuse_untrainable(model, spec.name)
        self.model = model.to(device)
        self._on_cpu = device.type == "cpu"
        self.bucket_bytes = bucket_bytes
        table = param_table(self.model)
        self.info = dataclasses.replace(info, parameters=table,
                                        buckets=buckets_by_bytes(table, bucket_bytes,
                                                                 self.model))
        self.model_loss = spec.loss == "model"
        """The model computes its loss: called as ``model(x, labels=y)``."""
        if self.model_loss and not takes_labels(self.model):
            raise ConfigError(
                f"job '{spec.name}': loss=model calls model(x, labels=y), but "
                f"{type(self.model).__name__}.forward takes no labels; use loss=auto (the "
                "logits' cross-entropy, or the dataset's loss_fn)")
        if not self._one_tensor:
            sample, _ = self.dataset.batch(0, self.info.batch_size)
            why = inputs.call_mismatch(self.model, sample, ("labels",) if self.model_loss else ())
            if why:
                raise ConfigError(f"job '{spec.name}': {why}")
        self.loss_fn = model_loss if self.model_loss else job_loss(self.dataset)
        self._plain_call = self._one_tensor and not self.model_loss
        """Forward is ``forward(x)`` (one input tensor, the loss computed outside the model)."""
        self.training = spec.kind == "train"
        self.random = JobRandom(spec.seed, device, stream=self.exchange.stream)
        self.iteration = 0
        self._batch_index = 0
        """The index of the batch last read (:meth:`batch`): the one a forward failed on."""
        self.rebuilds: list[str] = []
        """Why the optimizer was rebuilt, one entry per rebuild (``accelopt_after_step``)."""
        self.pending_plugin_states: dict[str, Any] = {}
        """Plugins' states from the checkpoint loaded, until the run has started."""
        self.pending_weights: tuple[dict[str, Any], str] | None = None
        """A checkpoint's weights and optimizer state (and where they came from) that did not
        fit the model as built, until the plugins have their states back."""
        self.forward: nn.Module = self.model
        """What forward calls: the model, or the exchange's wrapper of it (all-reduce: PyTorch
        DDP). Plugins, checkpoints and weights always see :attr:`model` itself."""
        self.exchange.attach(self, self.timer or NO_TIMER)
        self._built_params = dict(self.model.named_parameters())
        """The parameter objects the exchange was attached to (a cluster run refuses a
        plugin's replacing one: :meth:`_refuse_changed_parameters`)."""
        rows = self.exchange.rows(self.info.batch_size)
        self._rows = None if rows == (0, self.info.batch_size) else rows
        """This process's rows of every batch (``None``: all of them)."""
        self._stepped = self.exchange.stepped_parameters(self.model)
        self.optimizer: torch.optim.Optimizer | None = None
        if spec.kind == "train" and self.exchange.steps:
            self.optimizer = build_optimizer(self.info, spec, self._stepped, self.host)
        if spec.kind == "infer":
            self.model.eval()
        self._autocast = autocast_for(spec, device, self.exchange.role)
        """``torch.autocast`` arguments for forward and loss (``None``: full precision)."""
        self.scaler = (torch.amp.GradScaler(device.type) if spec.precision == "fp16"
                       and self.training else None)
        """fp16's gradient scaler (the loss is scaled before backward, the gradients
        unscaled before any plugin or the clipping sees them)."""
        self._schedules = schedules(spec)
        self._custom_step = self._schedules or spec.grad_clip is not None or self.scaler is not None
        """The step needs more than ``optimizer.step()`` (a schedule, clipping, a scaler)."""
        self.whole_step_reason = ""
        """Why this job's step cannot be applied tensor by tensor ('': it can)."""
        self._view: Gradients | None = None
        self._convention = (loss_convention(self.model) if self.model_loss
                            else job_loss_convention(self.dataset))
        """Over what the loss is a mean (:func:`loss_convention`, :func:`job_loss_convention`)."""
        self.warnings: list[str] = []
        """What this job did other than its settings say, one line each, as its log said it
        (the loss of unknown convention combined by rows): a cluster run keeps them in
        ``metrics.json``'s run warnings, where a line only in a rank's log went unseen."""
        self.loss_share: float | None = None
        """This process's share of the last batch's loss, where it trains on some rows of the
        batch and the loss is a mean over labelled positions, not rows (the model's own, or
        the default cross-entropy): its labelled positions over the batch's (``None``: its
        share of the rows)."""

    # -- facts -----------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.iteration >= self.info.iterations

    def with_profile(self, profile: JobProfile) -> None:
        self.info = dataclasses.replace(self.info, profile=profile)

    def batch(self, index: int) -> tuple[inputs.Inputs, torch.Tensor]:
        """This process's rows of the ``index``-th global batch, on the job's device (and,
        where it trains on some rows only, its share of the batch's loss:
        :attr:`loss_share`)."""
        self._batch_index = index
        x, y = self.dataset.batch(index, self.info.batch_size)
        if self._rows is not None:
            start, stop = self._rows
            self.loss_share = self._share_of_loss(y, start, stop)
            x, y = inputs.slice_rows(x, start, stop), y[start:stop]
        if self._one_tensor and self._on_cpu and x.is_cpu and y.is_cpu:
            return x, y  # already there (the common case: one tensor, batches on the CPU)
        # each tensor moved only if it is elsewhere (to_device and .to return it otherwise)
        return (inputs.to_device(x, self.device, non_blocking=True),
                y.to(self.device, non_blocking=True))

    def _share_of_loss(self, y: torch.Tensor, start: int, stop: int) -> float | None:
        """Rows ``[start, stop)``'s share of the loss of the whole batch ``y``.

        Why: a model computing its own loss (``loss: model``, labels -100 where nothing is to
        be predicted, as HF transformers pad) averages over the labelled positions, not the
        rows, and so does the job's default cross-entropy (``ignore_index`` -100). Each
        worker's loss is the mean over its own positions, so weighting it by its rows
        trains another objective than one process (and a worker with no labelled
        position has a nan loss, which the rows' weights put into the batch's). Every worker
        reads the whole batch, so each counts the positions of its rows and of the batch
        without talking to the others. ``None`` (weigh by rows): every row holds as many
        labelled positions, or none of the batch does (one process's loss is nan too), or
        the model's convention is unknown (said once in the run's log)."""
        if self._convention == "rows" or y.is_floating_point() or y.dim() < 1:
            return None
        ignored = y == IGNORE_INDEX
        if not bool(ignored.any()):
            return None
        if self._convention is None:
            if not self.warnings and start == 0:  # the first worker says it for all
                self.warnings.append(unknown_convention_line(self.info.name, self.model))
                log.warning("%s", self.warnings[-1])
            return None
        if self._convention == "causal" and y.dim() < 2:
            return None  # no sequence to shift: not a causal LM's labels
        per_row = loss_positions(y, self._convention).reshape(len(y), -1).sum(dim=1)
        total = int(per_row.sum())
        return int(per_row[start:stop].sum()) / total if total else None

    def built(self) -> BuiltJob:
        """The record ``accelopt_job_built`` receives: the model and this process's rows of
        the first batch (a parameter server, which trains on none, gets worker 0's)."""
        x, y = self.dataset.batch(0, self.info.batch_size)
        start, stop = self.exchange.rows(self.info.batch_size)
        return BuiltJob(job=self.info, model=self.model,
                        inputs=inputs.to_device(inputs.slice_rows(x, start, stop), self.device),
                        targets=y[start:stop].to(self.device), loss=self.loss_fn)

    # -- the step --------------------------------------------------------------------------

    def step(self, events: StepEvents = SILENT) -> IterationResult:
        """Run the next iteration (the sequence in ``accelopt/job/events.py``). Written for
        the hot path: an event nobody listens to, an exchange that moves nothing, a timeline
        nobody records and a random state nobody draws from cost no call."""
        i = self.iteration
        clock, origin = events.clock, events.origin  # the driver's time: clock() - origin
        start = clock() - origin
        context = IterationContext(self.info, events.lane, i, start) if events.listens else None
        if events.iteration_start:
            events.iteration_start(context)
        try:
            if self.random.uses_rng is False:  # known not to draw: no state to swap in
                loss_value, samples = self._run(i, context, events)
            else:
                with self.random.active():
                    loss_value, samples = self._run(i, context, events)
        except Exception as exc:
            mark_batch(exc, i)
            raise
        self.iteration += 1
        result = IterationResult(self.info.job_id, i, start, clock() - origin,
                                 None if loss_value is None else float(loss_value), samples)
        if events.iteration_end:
            # the hook sees the iteration as its work ended. What the plugin does here costs
            # the job too: a driver counts it by timing the whole call of step(), so one
            # record serves both (making a record costs ~4,000 instructions)
            events.iteration_end(context, result)
        return result

    def _run(self, i: int, context: IterationContext | None,
             events: StepEvents) -> tuple[torch.Tensor | None, int]:
        """The iteration's work between its start and end events: (loss, samples)."""
        exchange, timer = self.exchange, self.timer
        moves = exchange.moves
        loss_value: torch.Tensor | None = None
        samples = 0
        if moves:
            exchange.begin(i)
        if exchange.computes:
            x, y = self.batch(i)
            samples = int(y.shape[0])
            if not self.training:
                if timer:
                    timer.begin("forward", i)
                with torch.inference_mode():
                    self.forward(x)
                if timer:
                    timer.end()
            else:
                if self.optimizer is not None:
                    # set_to_none=False keeps gradient buffers alive between iterations:
                    # they are part of the job's persistent memory, as the profile counts
                    self.optimizer.zero_grad(set_to_none=False)
                else:  # a PS worker: fresh gradient tensors every iteration
                    self.model.zero_grad(set_to_none=True)
                if timer:
                    timer.begin("forward", i)
                if self._autocast is None:
                    loss = self.loss_fn(self.forward(x) if self._plain_call else
                                        self._call(x, y), y)
                else:
                    with torch.autocast(**self._autocast):
                        loss = self.loss_fn(self._call(x, y), y)
                if timer:
                    timer.end()
                loss_value = loss.detach()
                if moves:  # the gradients are scaled by this share of the batch's loss
                    exchange.weigh(self.loss_share)
                if events.after_forward:
                    replaced = events.after_forward(context, loss)
                    if replaced is not None:
                        loss = replaced
                if timer:
                    timer.begin("backward", i)
                (loss if self.scaler is None else self.scaler.scale(loss)).backward()
                if timer:
                    timer.end()
        if self.training:
            updated = False
            if moves:
                updated = exchange.gradients(i, self._tensor_update(i, events))
            if self.optimizer is None:
                pass  # this process takes no step (a PS worker)
            elif (updated or events.before_optimizer_step or events.after_step or timer
                  or self._custom_step):
                self._optimizer_step(i, context, events, updated)
            else:
                self.optimizer.step()
        if moves:
            exchange.end(i)
        return loss_value, samples

    def _call(self, x: inputs.Inputs, y: torch.Tensor) -> Any:
        """Forward: ``model(x)`` (a tuple's tensors positional, a mapping's by keyword:
        :mod:`accelopt.job.inputs`), with ``labels=y`` when the model computes its loss."""
        try:
            if self._one_tensor:
                return self.forward(x, labels=y) if self.model_loss else self.forward(x)
            return inputs.call(self.forward, x, **({"labels": y} if self.model_loss else {}))
        except Exception as exc:  # a forward outside step() (the profile's) names its batch
            mark_batch(exc, self._batch_index)
            raise

    def _optimizer_step(self, i: int, context: IterationContext | None, events: StepEvents,
                        updated: bool) -> None:
        """The optimizer step between its two events. ``updated``: the exchange already
        updated the parameters tensor by tensor (a PS server's early update), so only
        ``accelopt_after_step`` is left to fire."""
        assert self.optimizer is not None
        stepped = True
        if not updated:
            scaler = self.scaler
            if scaler is not None:
                scaler.unscale_(self.optimizer)  # plugins and clipping see true gradients
            if self._schedules:
                set_lr(self.optimizer, lr_factor(self.spec, i))
            gradients = None
            if events.before_optimizer_step:
                gradients = self._gradients()
                events.before_optimizer_step(context, gradients)
                stepped = gradients.skipped is None
            if stepped and self.spec.grad_clip is not None:
                if gradients is None:
                    gradients = self._gradients()
                gradients.clip_norm_(float(self.spec.grad_clip))
            if stepped:
                if self.timer:
                    self.timer.begin("optimizer", i)
                if scaler is None:
                    self.optimizer.step()
                else:
                    scaler.step(self.optimizer)  # skipped when the scaled gradients overflowed
                if self.timer:
                    self.timer.end()
            if scaler is not None:
                scaler.update()
        if events.after_step:
            answers = events.after_step(context, stepped)
            if answers and (asked := rebuilds(answers)):
                self.rebuild_optimizer("; ".join(r.reason for r in asked),
                                       by=self._implementers(Event.AFTER_STEP.value))

    def _gradients(self) -> Gradients:
        """This iteration's view of the gradients: one view per job record and parameter
        table, renewed every iteration (a probe copy of the job, or a rebuilt optimizer over
        a changed model, gets a view of its own parameters)."""
        view = self._view
        if view is None or view.job is not self.info or view.parameters is not self._stepped:
            view = self._view = Gradients(self.info, self._stepped, self.exchange.reduce,
                                          whole=self.exchange.whole)
        else:
            view.renew()
        return view

    def _tensor_update(self, i: int,
                       events: StepEvents) -> Callable[[Sequence[str]], None] | None:
        """What the exchange may call to update tensors whose gradients are final, or
        ``None`` where the step is more than independent per-tensor updates: clipping and
        the fp16 scaler read every gradient, a plugin on ``before_optimizer_step`` may
        change or skip them, and an optimizer other than torch's SGD, Adam and AdamW
        (single-tensor or foreach, as built) may couple tensors."""
        optimizer = self.optimizer
        if optimizer is None:
            return None
        self.whole_step_reason = (
            "a plugin implements accelopt_before_optimizer_step" if events.before_optimizer_step
            else settings_read_every_gradient(self.spec)
            or (f"the optimizer is {type(optimizer).__name__}, not torch's SGD, Adam or AdamW"
                if type(optimizer) not in PER_TENSOR_OPTIMIZERS else ""))
        if self.whole_step_reason:
            return None
        scheduled = self._schedules
        group_of: dict[int, int] = {}  # filled on first use: a whole-step server never asks

        def update(names: Sequence[str]) -> None:
            nonlocal scheduled
            if scheduled:  # once per iteration, before its first tensor
                set_lr(optimizer, lr_factor(self.spec, i))
                scheduled = False
            if not group_of:
                group_of.update((id(p), g) for g, group in enumerate(optimizer.param_groups)
                                for p in group["params"])
            params = [self._stepped[n] for n in names]
            step_tensors(optimizer, params, [group_of[id(p)] for p in params])

        return update

    def rebuild_optimizer(self, reason: str, by: str = "a plugin") -> None:
        """Build the optimizer again over the model's current parameters (a plugin changed
        the model), carrying over the state of every parameter that is unchanged. ``by``:
        who asked, for the refusal in a cluster run (``plugin 'prune'``)."""
        table = param_table(self.model)
        if self.exchange.role != "single":
            self._refuse_changed_parameters(table, reason, by)
        buckets = buckets_by_bytes(table, self.bucket_bytes, self.model)
        if self.exchange.role != "single" and buckets != self.info.buckets:
            # same table, so requires_grad changed: DDP's buckets and a PS worker's gradient
            # hooks were made for the old set and would not move the new one's gradients
            raise UserError(
                f"job '{self.info.name}': {by} changed which parameters train "
                f"(requires_grad) during a cluster run ({reason}); the exchange still moves "
                "the gradients of the parameters that trained when the job was built. "
                "Freeze or unfreeze at build time (accelopt_layer_build) in cluster runs")
        self.info = dataclasses.replace(self.info, parameters=table, buckets=buckets)
        self._stepped = self.exchange.stepped_parameters(self.model)
        self.optimizer = build_optimizer(self.info, self.spec, self._stepped, self.host,
                                         previous=self.optimizer)
        self.rebuilds.append(f"iteration {self.iteration}: {reason}")

    def _refuse_changed_parameters(self, table: tuple[Any, ...], reason: str, by: str) -> None:
        """In a cluster run each rank's exchange holds the parameter objects the job was built
        with (a server averages into them, a worker copies into them and hooks their
        gradients, DDP's buckets view them): another parameter table, or a parameter replaced
        by a new object under the same name and shape, would leave the exchange moving the
        old tensors while the optimizer steps the new ones (the layer silently stops
        training). Refused in one line."""
        where = f"job '{self.info.name}': {by}"
        if table != self.info.parameters:
            raise UserError(
                f"{where} changed the model's parameters during a cluster run ({reason}); the "
                f"{self.exchange.role}s' parameter tables would no longer match. Change the "
                "model at build time (accelopt_layer_build) in cluster runs")
        replaced = next(iter(replaced_parameters(self._built_params, self.model)), None)
        if replaced is not None:
            raise UserError(
                f"{where} replaced parameter '{replaced}' by a new Parameter object during a "
                f"cluster run ({reason}); the {self.exchange.role}'s exchange still moves the "
                "old one, so the new one would not train. Change its values in place "
                "(with torch.no_grad(): param.copy_(new)) or change the model at build time "
                "(accelopt_layer_build)")

    def _implementers(self, hook: str) -> str:
        """The plugins implementing ``hook``, for a line (``plugin 'prune'``)."""
        names = [n for n in self.host.names if hook in self.host.hooks_of(n)]
        if not names:
            return "a plugin"
        quoted = ", ".join(f"'{n}'" for n in names)
        return f"plugin {quoted}" if len(names) == 1 else f"one of plugins {quoted}"

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            "model": self.model.state_dict(),
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "random": self.random.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "plugins": self.plugin_states(),
        }

    def plugin_states(self) -> dict[str, Any]:
        """Each plugin's own state for this job (``accelopt_state_save``), by plugin name."""
        if not self.host.implements(STATE_SAVE):
            return {}
        out: dict[str, Any] = {}
        for name in self.host.names:
            if STATE_SAVE in self.host.hooks_of(name):
                state = self.host.call_one(name, STATE_SAVE, job=self.info)
                if state is not None:
                    out[name] = state
        return out

    def restore_plugin_states(self) -> None:
        """Hand each plugin the state it saved in the checkpoint this job was loaded from
        (``accelopt_state_load``), once: the lifecycle calls this after ``run_start``, so a
        plugin that sets itself up there is not reset afterwards."""
        pending, self.pending_plugin_states = self.pending_plugin_states, {}
        for name, state in pending.items():
            if STATE_LOAD not in self.host.hooks_of(name):
                raise self._unloadable_state(name)
            self.host.call_one(name, STATE_LOAD, job=self.info, state=state)
        weights, self.pending_weights = self.pending_weights, None
        if weights is not None:
            state, source = weights
            if param_table(self.model) != self.info.parameters:
                self.rebuild_optimizer("a plugin restored its change to the model from the "
                                       "checkpoint")
            try:
                self._load_weights(state)
            except (RuntimeError, KeyError, ValueError) as exc:
                raise misfit(source, self.info.name, exc) from None

    def _unloadable_state(self, name: str) -> UserError:
        """Why the checkpoint's state of plugin ``name`` cannot go back to it, and the fix:
        a plugin missing from this run is resumed with the run's own plugins; an active one
        without ``accelopt_state_load`` (a version of it other than the one that saved the
        state) needs that hook, and resuming without the plugin would not help."""
        where = f"job '{self.info.name}': its checkpoint holds the state of plugin '{name}'"
        if name not in self.host.names:
            return UserError(f"{where}, which is not active in this run; resume with the "
                             "run's own plugins")
        return UserError(f"{where}, which is active but does not implement {STATE_LOAD}, so "
                         f"that state cannot be restored; add {STATE_LOAD} to the plugin "
                         "(or resume with the version of it that wrote the checkpoint)")

    def load_state_dict(self, state: dict[str, Any], source: str = "state") -> None:
        """Load a checkpoint's state (``source`` names it in errors). Weights that do not
        fit the model as built wait for :meth:`restore_plugin_states` when a plugin has state
        in the checkpoint: that plugin may have changed the model during the run (pruning
        after N iterations) and changes it again when it gets its state back; otherwise the
        error is raised here."""
        self.pending_plugin_states = dict(state.get("plugins") or {})
        try:
            self._load_weights(state)
        except (RuntimeError, KeyError, ValueError):
            if not self.pending_plugin_states:
                raise
            self.pending_weights = (state, source)
        if state.get("random") is not None:
            self.random.load_state_dict(state["random"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.iteration = int(state["iteration"])

    def _load_weights(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])

    def close(self) -> None:
        self.exchange.close()


def settings_read_every_gradient(spec: JobConfig) -> str:
    """Why a job's settings make its optimizer step one over every gradient ('': they do
    not): clipping takes the norm over all of them, and fp16's scaler unscales and checks
    all of them. The step then cannot update tensors one by one as their gradients arrive
    (:meth:`Job._tensor_update`), and a plugin relying on that (tictac's priority) says so
    in its row with these words."""
    if spec.grad_clip is not None:
        return f"grad_clip={spec.grad_clip} needs the norm over every gradient"
    if spec.precision == "fp16" and spec.kind == "train":
        return "precision=fp16's gradient scaler reads every gradient"
    return ""


def misfit(source: str, job_name: str, exc: BaseException) -> UserError:
    """One line for checkpoint state that does not fit the job as this run builds it."""
    detail = one_line(str(exc))
    detail = (detail[:300] + "...") if len(detail) > 300 else detail or type(exc).__name__
    return UserError(f"checkpoint {source} does not fit job '{job_name}' as this run builds "
                     f"it ({detail}); delete the checkpoint to restart that job")


def check_precision(spec: JobConfig, device_type: str | None, one_process: bool) -> None:
    """One line when the job's ``precision`` cannot work: fp16 needs CUDA (``device_type``
    None: not known yet) and, for training, one process (its gradient scaler would have to
    agree across ranks)."""
    if spec.precision != "fp16":
        return
    if not one_process and spec.kind == "train":
        raise ConfigError(
            f"job '{spec.name}': precision=fp16 trains in one process only (its gradient "
            "scaler would have to agree across ranks); use precision=bf16 in cluster runs")
    if device_type is not None and device_type != "cuda":
        raise ConfigError(
            f"job '{spec.name}': precision=fp16 needs CUDA (fp16 autocast and a gradient "
            f"scaler); on {device_type} use precision=bf16")


def autocast_for(spec: JobConfig, device: torch.device, role: str) -> dict[str, Any] | None:
    """``torch.autocast`` arguments for the job's ``precision`` on ``device`` (``None``:
    fp32)."""
    if spec.precision == "fp32":
        return None
    check_precision(spec, device.type, role == "single")
    dtype = torch.float16 if spec.precision == "fp16" else torch.bfloat16
    return {"device_type": device.type, "dtype": dtype}


def refuse_sparse_gradients(model: nn.Module, job: str) -> None:
    """An embedding built with ``sparse=True`` gives sparse gradients, which the profile's
    copy, the exchanges (PS transfers, DDP buckets), gradient clipping and the plugins'
    gradient views do not take: refused in one line when the job is built, where each of
    those failed later with a different torch error."""
    sparse = [name or type(m).__name__ for name, m in model.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
    if sparse:
        raise ConfigError(f"job '{job}': {', '.join(sparse[:3])} "
                          f"{'is an embedding' if len(sparse) == 1 else 'are embeddings'} with "
                          "sparse=True; sparse gradients are not supported: build "
                          f"{'it' if len(sparse) == 1 else 'them'} with sparse=False")


TRAINS_ITSELF = "trains_itself"
"""A module attribute (true, or the plugin's name, which ``accelopt.attach``'s refusals
name) that a plugin's layer sets when it updates its own weights, in backward, outside the
job's optimizer (SLIDE's layers: buffers trained by a sparse Adam)."""


def refuse_untrainable(model: nn.Module, job: str) -> None:
    """A training job's model with no parameter to train (none at all, or every one frozen
    with ``requires_grad=False``) is refused in one line when the job is built: the
    optimizer refused an empty parameter list with a traceback, and a frozen model failed
    its first backward ("element 0 of tensors does not require grad", with a hint about the
    dataset's inputs), DDP's own error under all-reduce, exit 3 under a parameter server.
    A layer a plugin swapped in that trains itself (:data:`TRAINS_ITSELF`) is something to
    train: SLIDE on softmax regression (one wide Linear, now SLIDE's buffers) was refused
    as "it has no parameters"; its optimizer is then one empty group, a step of nothing."""
    params = list(model.parameters())
    if any(p.requires_grad for p in params) or any(
            getattr(m, TRAINS_ITSELF, False) for m in model.modules()):
        return
    what = (f"all {len(params)} of its parameter tensors are frozen (requires_grad=False)"
            if params else "it has no parameters")
    raise ConfigError(f"job '{job}': the model has nothing to train: {what}; use kind=infer "
                      "to only run it, or unfreeze some (requires_grad_(True))")


def job_loss(dataset: Any) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The training loss: the dataset's own ``loss_fn(out, y)`` when it has one (multi-label
    targets need one), else cross-entropy over class indices, of the model's logits
    (:func:`logits_of`: a tuple's first element, a ``ModelOutput``'s ``logits``). A model
    output that has a ``loss_against(y)`` method computes its own loss (a sampled output
    layer only knows which logits it computed once it sees the targets), but only where
    that is the loss asked for: no ``loss_fn``, or one marked ``same_as_loss_against``
    (:func:`sampled_loss_allowed`). Any other ``loss_fn`` gets the output as it is, so an
    output that cannot compute it refuses in one line: taking ``loss_against`` regardless
    trained a label-smoothed or class-weighted loss as plain sampled cross-entropy."""
    own_fn = getattr(dataset, "loss_fn", None)
    base = own_fn or nn.CrossEntropyLoss()
    sampled_ok = sampled_loss_allowed(own_fn)

    def loss(out: Any, y: torch.Tensor) -> torch.Tensor:
        if type(out) is torch.Tensor:  # logits as they are (a plain tensor has no loss_against)
            logits = out
        else:
            own = getattr(out, "loss_against", None) if sampled_ok else None
            if callable(own):
                return own(y)
            logits = logits_of(out)
        if own_fn is not None:
            return base(logits, y)
        try:
            return base(logits, y)
        except (TypeError, RuntimeError, ValueError, IndexError) as exc:
            raise UserError(_misfit(out, logits, y, exc)) from None

    return loss


def sampled_loss_allowed(own_fn: Any) -> bool:
    """Whether an output's ``loss_against(y)`` may stand for the loss: with no ``loss_fn``
    (cross-entropy, which it computes), or a ``loss_fn`` that says it computes the same loss
    (its ``same_as_loss_against`` attribute is true, as SLIDE's XC softmax loss says)."""
    return own_fn is None or bool(getattr(own_fn, "same_as_loss_against", False))


def first_step_failed(job: Job, exc: BaseException) -> str:
    """The line for a job whose steps run to measure its memory profile before it trained
    (on a copy of it: a warm-up step and the measured ones) raised: the error and the batch
    the failing step was given (:func:`mark_batch`), since that is where a model that does
    not take the dataset's batches fails (an input width or dtype it was not built for), and
    a raw "mat1 and mat2 shapes cannot be multiplied" names neither."""
    if isinstance(exc, UserError):
        return first_line(exc)
    raised = f"a step measuring its memory, before training, raised {error_text(exc)}"
    if "without overflow" in str(exc):  # torch casting a setting into the parameters' dtype
        # (lr=1e39 in float32): the inputs are not the problem, so the batch is no hint
        return (f"{raised}; a number the optimizer applies to the parameters does not fit "
                f"their dtype: check the job's lr ({job.spec.lr:g}), momentum and "
                "weight_decay")
    index = failed_batch(exc)
    if index is None:  # raised outside a step or a forward: no batch to blame
        return raised
    try:
        x, y = job.dataset.batch(index, job.info.batch_size)
        which = f" (batch {index})" if index else ""
        batch = f"; its batch{which}: {described(x, y)} ({CHECK_INPUTS})"
    except Exception:  # noqa: BLE001 - the batch is a hint; the error is the message
        batch = ""
    return f"{raised}{batch}"


FAILED_BATCH = "accelopt_batch"
"""The attribute :func:`mark_batch` sets on an exception raised in a job's step or forward."""


def mark_batch(exc: BaseException, index: int) -> None:
    """Tag ``exc`` with the index of the batch the step or forward that raised it was given
    (the innermost tag stands), so that an error's hint describes that batch: a step on a
    copy of the job (the memory profile's) leaves nothing else behind to say which it was,
    and where a dataset's later batches differ, another batch would name one that fits."""
    if getattr(exc, FAILED_BATCH, None) is None:
        try:
            setattr(exc, FAILED_BATCH, index)
        except AttributeError:  # an exception type that takes no attributes: no hint
            pass


def failed_batch(exc: BaseException) -> int | None:
    """The index :func:`mark_batch` tagged ``exc`` with (``None``: not raised in a step)."""
    index = getattr(exc, FAILED_BATCH, None)
    return index if isinstance(index, int) else None


CHECK_INPUTS = "check that the model takes the dataset's inputs: docs/your-model.md"


def described(x: inputs.Inputs, y: torch.Tensor) -> str:
    """``inputs (16, 64) float32, labels (16,)``: a batch as an error's hint shows it."""
    kind = str(inputs.tensors(x)[0].dtype).removeprefix("torch.")
    return f"inputs {inputs.describe(x)} {kind}, labels {tuple(y.shape)}"


def _misfit(out: Any, logits: Any, y: torch.Tensor, exc: Exception) -> str:
    """One line on why the default loss (cross-entropy of the logits against class indices)
    cannot take this model's output, with the fix: a raw torch error ("argument 'input' must
    be Tensor, not dict", "Expected target size [16, 200]") named neither."""
    first = first_line(exc) or type(exc).__name__
    if not isinstance(logits, torch.Tensor):
        keys = f" with keys {', '.join(map(str, out))}" if isinstance(out, Mapping) else ""
        return (f"the model's output (a {type(out).__name__}{keys}) has no logits the default "
                "loss can use: return the logits tensor, a tuple starting with it, or a "
                "mapping/ModelOutput with 'logits' (or give the dataset a loss_fn, or use "
                "loss=model for a model that computes its own)")
    shapes = f"logits {tuple(logits.shape)} {str(logits.dtype).removeprefix('torch.')} " \
             f"against labels {tuple(y.shape)} {str(y.dtype).removeprefix('torch.')}"
    if logits.dim() == 3 and y.dim() == 2:
        return (f"cross-entropy of {shapes}: a sequence model's per-token logits; let the "
                "model compute its loss (loss=model, called with labels=) or give the dataset "
                "a loss_fn")
    return (f"cross-entropy of {shapes} failed ({type(exc).__name__}: {first}); the default "
            "loss takes logits [batch, classes] and class indices [batch] (else give the "
            "dataset a loss_fn, or use loss=model)")


def logits_of(out: Any) -> Any:
    """The logits in a model's output: a tensor as it is, a tuple's or list's first element,
    a mapping's or ``ModelOutput``'s ``logits`` (HF transformers). Anything else is returned
    as it is (a dataset's own ``loss_fn`` may know it)."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, Mapping):
        logits = out.get("logits")
    if logits is None and isinstance(out, (tuple, list)) and out:
        logits = out[0]
    return out if logits is None else logits


def own_loss(out: Any) -> torch.Tensor | None:
    """The loss a model computed itself: its output's ``loss`` (an attribute, as HF
    ``ModelOutput`` has, or a mapping's key); None when it carries no loss tensor."""
    value = getattr(out, "loss", None)
    if value is None and isinstance(out, Mapping):
        value = out.get("loss")
    return value if isinstance(value, torch.Tensor) else None


def model_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    """``loss: model``: the loss the model computed (its output's ``loss``)."""
    value = own_loss(out)
    if value is None:
        raise UserError(
            f"loss=model, but the model's output ({type(out).__name__}) has no loss tensor; "
            "a model that computes its loss from labels= returns it as .loss (HF "
            "transformers do when given labels), else use loss=auto")
    return value


IGNORE_INDEX = -100
"""The label of a position a model's own loss leaves out (PyTorch's and HF's default)."""

CAUSAL_LOSS_TYPES = ("ForCausalLM",)
"""transformers loss types averaging over ``labels[..., 1:] != -100`` (the labels shifted)."""

LABEL_LOSS_TYPES = ("ForMaskedLM", "ForTokenClassification", "ForSequenceClassification",
                    "ForImageClassification", "ForAudioClassification",
                    "ForVideoClassification")
"""transformers loss types averaging over ``labels != -100``."""


SEQ2SEQ_LM_CLASSES = frozenset({
    "T5ForConditionalGeneration", "MT5ForConditionalGeneration",
    "UMT5ForConditionalGeneration", "LongT5ForConditionalGeneration",
    "BartForConditionalGeneration", "MBartForConditionalGeneration",
    "PLBartForConditionalGeneration", "MvpForConditionalGeneration",
    "PegasusForConditionalGeneration", "PegasusXForConditionalGeneration",
    "BigBirdPegasusForConditionalGeneration", "LEDForConditionalGeneration",
    "MarianMTModel", "BlenderbotForConditionalGeneration",
    "BlenderbotSmallForConditionalGeneration", "M2M100ForConditionalGeneration",
    "FSMTForConditionalGeneration", "WhisperForConditionalGeneration",
    "Speech2TextForConditionalGeneration"})
"""transformers encoder-decoder models (text and speech) whose own loss is
``CrossEntropyLoss()`` (ignore_index -100, mean) over their labels, unshifted (the decoder's
inputs are the labels shifted right): a mean over ``labels != -100``. By exact class name:
their ``loss_type``, ``ForConditionalGeneration``, is shared by multimodal models whose loss
is a causal LM's, and the MoE ones (SwitchTransformers, NllbMoe) add a router loss."""


def loss_convention(model: nn.Module) -> str | None:
    """Over what a model's own loss (``loss: model``) is a mean: ``"causal"`` (an HF causal
    LM: its shifted labels that are not -100), ``"labels"`` (other HF cross-entropy heads,
    and the seq2seq models of :data:`SEQ2SEQ_LM_CLASSES`: its labels that are not -100),
    ``None``: not known. Read from transformers' ``loss_type`` or, failing that, the class
    name (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``T5ForConditionalGeneration``)."""
    loss_type = getattr(model, "loss_type", None)
    if loss_type in CAUSAL_LOSS_TYPES:
        return "causal"
    if loss_type in LABEL_LOSS_TYPES:
        return "labels"
    name = type(model).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal"
    if name.endswith(LABEL_LOSS_TYPES) or name in SEQ2SEQ_LM_CLASSES:
        return "labels"
    return None


def loss_positions(labels: torch.Tensor, convention: str | None) -> torch.Tensor:
    """Which positions of ``labels`` a model's own loss is a mean over (a bool mask): those
    not :data:`IGNORE_INDEX`, shifted by one for a causal LM (``convention`` ``"causal"``
    with a sequence dimension: the first position of each row predicts nothing); the
    labelled ones otherwise. What weighs workers' losses (:meth:`Job._share_of_loss`) and
    held-out batches (``job/quality.py``)."""
    counted = labels != IGNORE_INDEX
    if convention == "causal" and counted.dim() >= 2:
        return counted[..., 1:]
    return counted


def unknown_convention_line(job: str, model: nn.Module) -> str:
    """The warning of a cluster job whose model's own loss is of unknown convention
    (:func:`loss_convention`) on labels holding -100: its workers are combined by rows."""
    return (f"job '{job}': its labels hold {IGNORE_INDEX} (positions to ignore) and accelopt "
            f"does not know over what {type(model).__name__}'s own loss is a mean, so the "
            "workers' losses and gradients are combined by their rows; if the model averages "
            "over labelled positions, that is not one process's loss (a transformers model "
            "naming its loss_type, e.g. 'ForCausalLM', is combined by them)")


def job_loss_convention(dataset: Any) -> str | None:
    """Over what the loss :func:`job_loss` builds for ``dataset`` is a mean: ``"labels"``
    where it is cross-entropy with ``ignore_index`` -100 and ``reduction="mean"`` (the
    default, ``nn.CrossEntropyLoss()``, or a dataset's ``loss_fn`` that is such an
    ``nn.CrossEntropyLoss``; a sampled output's ``loss_against`` computes the same), whose
    mean is over the labels that are not -100, every position of ``[B]`` or ``[B, T]``
    labels alike; ``"rows"`` for any other ``loss_fn``, whose convention is not known (a
    per-point mean, as the XC softmax loss's, is one over rows). Why: with -100 labels, the
    rows' weights trained a cluster on another objective than one process, and a worker
    whose rows were all -100 put its nan loss into the batch's."""
    own_fn = getattr(dataset, "loss_fn", None)
    if own_fn is None:
        return "labels"
    if (isinstance(own_fn, nn.CrossEntropyLoss) and own_fn.weight is None
            and own_fn.reduction == "mean" and own_fn.ignore_index == IGNORE_INDEX):
        return "labels"
    return "rows"


def takes_labels(model: nn.Module) -> bool:
    """Whether ``model.forward`` accepts ``labels=`` (by name, or through ``**kwargs``)."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return True  # cannot tell: let the call say
    return any(p.name == "labels" or p.kind is p.VAR_KEYWORD for p in params)


def check_rows(dataset: Any, spec: JobConfig) -> None:
    """Refuse a ``batch_size`` larger than the training set (where the dataset says its
    size, ``n_train``): a batch holds positions of the per-epoch permutation stream, so it
    trained silently on every row repeated, ~195 times each for 100,000 of 512 rows. A
    refusal, not a warning: the job could not train on what was asked for (a batch of that
    many distinct samples), and the dataset's size is known only once it is built, after
    the run's start-of-run warnings. An inference job is not refused: it only measures its
    model's speed on batches of that size, and repeated rows serve that as well."""
    n_train = getattr(dataset, "n_train", None)
    if spec.kind == "train" and isinstance(n_train, int) and 0 < n_train < spec.batch_size:
        name = getattr(dataset, "name", None) or spec.dataset
        raise ValueError(
            f"batch_size={spec.batch_size} is larger than the training set of dataset "
            f"{name!r} ({n_train} samples): every batch would repeat each sample "
            f"~{spec.batch_size / n_train:.0f} times; set batch_size={n_train} or less")


def first_batch(dataset: Any, spec: JobConfig) -> tuple[Any, Any]:
    """Batch 0 of ``dataset``, read while the job is built (:func:`check_batch`); data that
    raises there (an unreadable record, a stream that breaks: an iterable is read through
    once to learn its length) is refused in one line naming the dataset and its error, as a
    dataset factory that raises is. It was a traceback in one process, where the cluster
    modes, which read it on a rank, said it in one line."""
    try:
        return dataset.batch(0, spec.batch_size)
    except (ValueError, UserError):
        raise  # the adapter's own refusal of the data's form: its line names the problem
    except Exception as exc:  # the user's own data raised: one line (--debug: the chain)
        name = spec.dataset or getattr(dataset, "name", None) or "the job's dataset"
        raise ValueError(f"dataset {name!r} raised {error_text(exc)} while the job was built "
                         f"(reading its first batch, batch_size={spec.batch_size}, before any "
                         "job started); fix the data it reads (--debug shows where it "
                         "raised)") from exc


def check_batch(dataset: Any, spec: JobConfig) -> bool:
    """Refuse, in one line naming the shapes, a dataset whose labels a job cannot train on:
    not row-aligned with the inputs, or float where class indices are needed. Returns whether
    the inputs are one tensor (else a tuple or mapping of tensors, :mod:`~accelopt.job.
    inputs`)."""
    x, y = first_batch(dataset, spec)
    one_tensor = isinstance(x, torch.Tensor)
    if not one_tensor and not inputs.tensors(x):
        raise ValueError(
            f"batch 0's inputs are a {type(x).__name__} holding no tensor; return a tensor, a "
            "tuple of tensors (positional arguments) or a dict of tensors (keyword arguments)")
    try:
        rows_x = inputs.rows(x)
        rows_y = len(y)
    except TypeError:  # inputs of a kind only their model knows: its author's to match
        return one_tensor
    ragged = [t for t in inputs.tensors(x) if len(t) != rows_x]
    if rows_x != rows_y or ragged:
        raise ValueError(
            f"batch 0 has {rows_x} inputs but {rows_y} labels; labels must be row-aligned "
            f"with the inputs (one label row per input row; inputs {inputs.describe(x)}, "
            f"labels {tuple(y.shape)})" if not ragged else
            f"batch 0's input tensors have different row counts ({inputs.describe(x)}); every "
            "input tensor needs one row per label")
    plain = spec.loss == "auto" and getattr(dataset, "loss_fn", None) is None
    if plain:
        refuse_label_form(y)
    return one_tensor


def refuse_label_form(y: torch.Tensor) -> None:
    """Labels the default cross-entropy cannot take, refused when the job is built (they
    failed its first step, in torch's words): float (where a loss_fn is meant), bool (a
    binary task's mask: ``y.long()`` gives classes 0 and 1), and a column ``[N, 1]`` of
    class indices (one index per row is ``[N]``: ``y.squeeze(1)``)."""
    if y.dim() == 1 and y.is_floating_point():
        raise ValueError(
            f"labels are {y.dtype} but cross-entropy needs class indices (int64, shape "
            f"{tuple(y.shape)}); return integer labels, or give the dataset a loss_fn")
    if y.dtype == torch.bool:
        raise ValueError(
            "labels are torch.bool but cross-entropy needs class indices (int64); return "
            "y.long() (False/True as classes 0/1), or give the dataset a loss_fn")
    if y.dim() == 2 and y.shape[1] == 1 and not y.is_floating_point():
        raise ValueError(
            f"labels have shape {tuple(y.shape)} but cross-entropy needs one class index per "
            f"row (shape ({len(y)},)); return y.squeeze(1), or give the dataset a loss_fn")
