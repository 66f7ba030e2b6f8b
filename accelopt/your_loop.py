"""Plugins on a training loop you write yourself: ``accelopt.attach``.

``accelopt run`` owns the loop; many researchers own theirs. ``attach`` gives such a loop the
same plugins, activated and configured from the same overrides, walking the same lifecycle
(``drivers/lifecycle.py``) and firing the same hooks, and ends with the same report rows::

    import accelopt                                                      # + 1 line
    ao = accelopt.attach(model, ["+plugins=[offload]"])                  # + 1
    model = ao.model                                                     # + 1
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in ao.loop(loader):                                         # changed
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    ao.close()                                                           # + 1

What fires where: ``accelopt_configure`` and the layer offers (``accelopt_layer_build``, the
model transformed in place, its root possibly replaced: use ``ao.model``) in ``attach``, then
``accelopt_job_built`` (with ``example``, the first batch, when a plugin needs one) and
``accelopt_run_start``; ``accelopt_iteration_start``/``_end`` around each item of
``ao.loop(...)`` (or each ``with ao.iteration():`` block); ``accelopt_after_forward`` in
``ao.backward(loss)`` (instead of ``loss.backward()``); ``accelopt_before_optimizer_step``
(the gradients of ``opt``'s parameters) and ``accelopt_after_step`` in ``ao.step(opt)``
(instead of ``opt.step()``); ``accelopt_optimizer_build`` in
``ao.optimizer(opt)``; ``accelopt_report_rows`` and ``accelopt_run_end`` in ``close()``. The
last three are needed only by plugins that listen to them (a clipping plugin: ``ao.step``);
``attach`` refuses, in one line, a plugin whose hooks would never fire here: decisions
between jobs (salus: ``accelopt run`` schedules jobs, a loop has one) and transfers between
processes (use ``accelopt_plugins.gradcomm.comm_hook`` in your own DDP script).

An iteration is one item of ``ao.loop`` (one ``with ao.iteration():`` block), not an
optimizer step: a loop may step several optimizers in one (a GAN) or one in several
(gradient accumulation). A setting counted in iterations that acts at a step (gpu_kernels'
``prune_at_iteration``) acts at the first ``ao.step`` at or after that iteration, and a
rebuild there repoints every optimizer the loop stepped with ``ao.step``. An ``attach`` that
fails leaves the model as it was given (the plugins' ``accelopt_run_end``, then every
module's children, parameters and hooks put back).

Torch itself is left as the loop set it (threads, determinism: ``accelopt run`` sets them,
``attach`` does not), and the loop's random numbers are its own.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import io
import json
import math
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from omegaconf import OmegaConf
from torch import nn

from accelopt.activation import PluginSet, activate
from accelopt.api import check_run_arguments, keeps_python_random
from accelopt.atomic import atomic_open, refuse_unwritable
from accelopt.config import YOUR_LOOP_DATASET, JobConfig
from accelopt.drivers.cluster.settings import local_info
from accelopt.drivers.lifecycle import Lifecycle
from accelopt.drivers.rows import with_placeholders
from accelopt.errors import ConfigError, UserError
from accelopt.hookspecs import RUN_DECISION_HOOKS, TRANSFER_HOOKS
from accelopt.host import PluginHost
from accelopt.job import inputs
from accelopt.job.events import StepEvents, rebuilds
from accelopt.job.gradients import Gradients
from accelopt.job.job import TRAINS_ITSELF
from accelopt.job.layers import offer_layers
from accelopt.job.params import buckets_by_bytes, param_table
from accelopt.job.specs import OPTIMIZERS, job_id_for, job_info
from accelopt.plugin import Registry
from accelopt.types import BuiltJob, IterationContext, IterationResult, JobInfo, ReportRow, RunInfo

T = TypeVar("T")
REPORT_FILE = "report.json"
NEVER_FIRED_HERE = RUN_DECISION_HOOKS | TRANSFER_HOOKS
"""Hooks only accelopt's own drivers call: decisions between jobs, transfers between ranks."""
FIRED_HERE = frozenset({
    "accelopt_layer_build", "accelopt_job_built", "accelopt_iteration_start",
    "accelopt_after_forward", "accelopt_before_optimizer_step", "accelopt_after_step",
    "accelopt_iteration_end", "accelopt_optimizer_build",
})
"""The job's hooks a loop of your own fires (with the lifecycle's)."""
ACTS_HERE = FIRED_HERE - {"accelopt_job_built", "accelopt_iteration_end"}
"""The hooks through which a plugin changes your loop's work (its model, loss, gradients,
steps or optimizer); job_built and iteration_end only look."""


@keeps_python_random
def attach(
    model: nn.Module,
    overrides: Sequence[str] = (),
    *,
    example: tuple[Any, Any] | None = None,
    name: str = "model",
    optimizer: str = "sgd",
    lr: float = 0.0,
    iterations: int = 0,
    run_dir: str | Path | None = None,
    registry: Registry | None = None,
    console: Any = None,
) -> Attached:
    """Activate the plugins ``overrides`` select (``["+plugins=[offload]", "plugins.offload.
    policy=size"]``, as on the command line) on ``model`` and return the handle the loop
    reports to. ``example``: one ``(inputs, labels)`` batch, for plugins that look at the
    built job (``accelopt_job_built``: a pruning probe, a planner); required only when one
    does. ``name``, ``optimizer``, ``lr``, ``iterations``: what the plugins read from the
    job's record (slide trains with Adam at the job's ``lr``), checked as a run's job is
    (``lr`` and ``iterations`` 0: not given). ``run_dir``: where plugins
    write and ``close()`` keeps ``report.json`` (default ``runs/<date>/<time>``, as the CLI;
    one that holds a report already is refused). ``console``: a ``rich.console.Console`` for
    ``close()``'s table (default: discarded)."""
    from accelopt.api import default_run_dir
    from accelopt.cli.hydra_run import drop_empty_plugin_selection, prepared_configs

    if not isinstance(model, nn.Module):
        raise ConfigError(f"accelopt.attach takes the torch.nn.Module your loop trains, got "
                          f"{type(model).__name__}")
    if isinstance(overrides, str):
        raise ConfigError(f"accelopt.attach takes a list of overrides, got the string "
                          f"{overrides!r}; write [{overrides!r}]")
    if not isinstance(overrides, Iterable):  # None: iterating it gave a TypeError traceback
        raise ConfigError(f"accelopt.attach takes a list of overrides, got "
                          f"{type(overrides).__name__}; write [] for none, or "
                          "['+plugins=[offload]']")
    _check_the_job(example, optimizer, lr, iterations)
    check_run_arguments("accelopt.attach", run_dir, registry, console)
    args = drop_empty_plugin_selection([str(o) for o in overrides])
    _refuse_settings_of_a_driven_run(args)
    if not any(a.lstrip("+").startswith("cluster.mode=") for a in args):
        args.append("cluster.mode=none")  # the loop is one process, whatever the default
    registry = registry or Registry.discover()
    (cfg,) = prepared_configs(args, registry)
    if str(cfg.cluster.mode) != "none":
        raise ConfigError(f"accelopt.attach runs in your loop's process; cluster.mode="
                          f"{cfg.cluster.mode} needs accelopt's ranks (accelopt run), or wrap "
                          "your model in DDP yourself and use accelopt.ddp.comm_hook "
                          "(accelopt_plugins.gradcomm.comm_hook for gradcomm's codecs)")
    batch_size = inputs.rows(example[0]) if example is not None else 0
    spec = JobConfig(name=name, model=type(model).__name__, dataset=YOUR_LOOP_DATASET,
                     kind="train" if model.training else "infer", batch_size=batch_size,
                     iterations=int(iterations), optimizer=optimizer, lr=float(lr))
    cfg.workload.jobs = [OmegaConf.structured(spec)]
    cfg.workload.generate.n_jobs = 0
    job_id = job_id_for(0, spec)
    plugins = activate(cfg, registry, [job_id])
    _refuse_plugins_that_would_not_fire(plugins, job_id)
    if example is None and plugins.for_job(job_id).implements("accelopt_job_built"):
        _YourJob(job_info(spec, job_id), model, None).built()  # refuses, naming the fix
    out = Path(run_dir) if run_dir is not None else default_run_dir()
    if (out / REPORT_FILE).exists():
        raise ConfigError(f"{out} already holds a report ({REPORT_FILE}); give a new run_dir "
                          "(results are never overwritten)")
    if out.resolve() in _OPEN_RUN_DIRS:  # the first one's report would be overwritten
        raise ConfigError(f"{out} is the run_dir of an attach not closed yet; close that one "
                          "first, or give each attach its own run_dir (results are never "
                          "overwritten)")
    # before any plugin touches the model: an unwritable run_dir failed after the layers
    # were offered, with a FileNotFoundError traceback and the plugins' hooks left on it
    refuse_unwritable(out, "give accelopt.attach a run_dir= you can write")
    return Attached(model, plugins, job_id, job_info(spec, job_id), example, out,
                    int(cfg.run.seed), local_info(cfg.cluster), console)


def _check_the_job(example: Any, optimizer: str, lr: float, iterations: int) -> None:
    """What attach takes for the job's record, checked as a run checks its job (0 for ``lr``
    and ``iterations``: not given; a plugin that needs them says so)."""
    if example is not None and not (isinstance(example, (tuple, list)) and len(example) == 2):
        raise ConfigError(f"accelopt.attach: example takes one (inputs, labels) batch of your "
                          f"data, got {type(example).__name__}; write example=(inputs, labels)")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"accelopt.attach: optimizer must be one of {', '.join(OPTIMIZERS)} "
                          f"(the one your loop steps), got {optimizer!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) \
            or lr < 0:
        raise ConfigError(f"accelopt.attach: lr must be your optimizer's learning rate (> 0; "
                          f"0: not given), got {lr!r}")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0:
        raise ConfigError(f"accelopt.attach: iterations must be how many your loop runs (>= 1; "
                          f"0: not given), got {iterations!r}")


_OPEN_RUN_DIRS: weakref.WeakValueDictionary[Path, Attached] = weakref.WeakValueDictionary()
"""The run directories of this process's attaches not closed yet (and not collected): each
writes its own report.json at close()."""


DRIVEN_ONLY = ("run.compare", "run.resume", "run.resume_finished", "run.checkpoint_every")
"""Settings of a run accelopt drives (its comparison runs, checkpoints, resume): your loop
does its own."""


def _refuse_settings_of_a_driven_run(args: Sequence[str]) -> None:
    """The workload's keys and :data:`DRIVEN_ONLY` were accepted and silently had no effect
    (``workload.jobs.0.lr=...`` did not reach the plugins, which read ``lr=``)."""
    for arg in args:
        key = arg.lstrip("+~").partition("=")[0]
        if key == "workload" or key.startswith("workload."):
            raise ConfigError(
                f"accelopt.attach: '{arg}' has no effect in your own loop (the loop is the "
                "workload: give attach name=, optimizer=, lr= and iterations= for what the "
                "plugins read of it)")
        if key in DRIVEN_ONLY:
            raise ConfigError(f"accelopt.attach: '{arg}' has no effect in your own loop "
                              f"({key} is for a run accelopt drives: accelopt run)")


def _samples(item: Any) -> int:
    """The rows of an ``(inputs, labels)`` item (0 when it is something else)."""
    if isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], torch.Tensor):
        return int(item[1].shape[0]) if item[1].dim() else 1
    return 0


def _check_optimizer(optimizer: Any, call: str) -> None:
    """A string or a model handed where the optimizer goes failed deep inside with an
    AttributeError traceback."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(f"accelopt.attach: {call} takes your torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}; pass the optimizer object your loop "
                        "steps")


def _named_in(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters ``optimizer`` steps, named as in ``model``: the gradients the plugins
    see at its step. The whole model's were shown, so a GAN's discriminator step was
    clipped by a norm that held the generator's stale gradients. A parameter from outside
    the model (a learnable temperature) has no name and is not shown."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: p for group in optimizer.param_groups for p in group["params"]
            if id(p) in names}


def _refuse_plugins_that_would_not_fire(plugins: PluginSet, job_id: str) -> None:
    """A plugin that decides between jobs (one loop is one job), or that acts only on
    transfers between ranks (one loop is one process), would do nothing here: say so."""
    host = plugins.for_job(job_id)
    for name in plugins.names:
        hooks = host.hooks_of(name)
        decisions = hooks & RUN_DECISION_HOOKS
        # tictac looks at the built job and its iterations, and acts on transfers only
        transfers_only = hooks & NEVER_FIRED_HERE and not hooks & ACTS_HERE
        if decisions or transfers_only:
            missing = ", ".join(sorted(decisions or hooks & NEVER_FIRED_HERE))
            hook = ("accelopt_plugins.gradcomm.comm_hook(model, dtype=...)"
                    if name == "gradcomm" else "accelopt.ddp.comm_hook(model, plugins=[...])")
            where = ("`accelopt run`, not in your own loop" if decisions else
                     "`accelopt run`, or in your own DDP script through a DDP communication "
                     f"hook ({hook}, docs/distributed.md)")
            raise ConfigError(
                f"plugin '{name}' acts through {missing}, which only accelopt's own drivers "
                f"call (decisions between jobs, transfers between ranks): run it with {where}")


class _YourJob:
    """The lifecycle's view of the loop's job: its record and what ``job_built`` shows."""

    def __init__(self, info: JobInfo, model: nn.Module, example: tuple[Any, Any] | None) -> None:
        self.info, self.model, self.example = info, model, example

    def built(self) -> BuiltJob:
        if self.example is None:
            raise ConfigError(
                "a selected plugin looks at the built job (accelopt_job_built) and needs one "
                "batch of your data: accelopt.attach(model, [...], example=(inputs, labels))")
        x, y = self.example
        return BuiltJob(job=self.info, model=self.model, inputs=x, targets=y,
                        loss=nn.CrossEntropyLoss())


class _ModelState:
    """Every module's own attributes as the loop gave the model to ``attach`` (its children,
    parameters, buffers and hook tables, each table copied): what a failed ``attach`` puts
    back, whatever a plugin replaced, sliced or hooked before the failure."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = [(m, {k: copy.copy(v) if isinstance(v, dict) else v
                             for k, v in vars(m).items()}) for m in model.modules()]

    def restore(self) -> None:
        for module, attributes in self.modules:
            vars(module).clear()
            vars(module).update(attributes)


class Attached:
    """A loop's handle on its plugins: ``model`` (as the plugins transformed it), the
    iteration context, the optional backward/step/optimizer calls and ``close()``."""

    def __init__(self, model: nn.Module, plugins: PluginSet, job_id: str, info: JobInfo,
                 example: tuple[Any, Any] | None, run_dir: Path, seed: int, cluster: Any,
                 console: Any) -> None:
        from rich.console import Console

        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"accelopt.attach: cannot create run_dir {run_dir} "
                            f"({exc.strerror or exc}); give a run_dir= you can write") from None
        self.plugins = plugins
        self.host: PluginHost = plugins.for_job(job_id)
        self.run_dir = run_dir
        self.console = console or Console(file=io.StringIO(), width=120)
        self._rebuilt_away: weakref.WeakValueDictionary[str, nn.Parameter] = \
            weakref.WeakValueDictionary()
        """The parameters a rebuild replaced, by name (weak, as :attr:`_replaced`)."""
        self._stepped: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        """Every optimizer the loop stepped through ``ao.step``, weakly: a rebuild (pruning
        after N iterations) repoints them all, not only the one whose step it followed (a
        GAN's or a body/head loop's other optimizer went on holding the dense tensors)."""
        as_given = _ModelState(model)
        _OPEN_RUN_DIRS[run_dir.resolve()] = self
        try:
            self._set_up(model, plugins, info, example, run_dir, seed, cluster)
        except BaseException:
            _OPEN_RUN_DIRS.pop(run_dir.resolve(), None)
            self._undo(as_given, info, run_dir, seed, cluster)
            raise
        del as_given  # only what the loop holds keeps a replaced parameter alive now
        if self._replaced:  # an optimizer made before attach (or a reference of the loop's)
            warnings.warn(_stale_optimizer_note(len(self._replaced), self._given_parameters),
                          stacklevel=4)
        else:  # nothing holds the old ones: no optimizer can be stale, and a loop that only
            self._replaced_versions = {}  # evaluates must not read as "never stepped"

    def _undo(self, as_given: _ModelState, info: JobInfo, run_dir: Path, seed: int,
              cluster: Any) -> None:
        """Put the model back as the loop gave it after ``attach`` failed: every plugin's
        ``accelopt_run_end`` (the cleanup ``close()`` runs; offload takes its hooks off),
        then the modules' own attributes, children, parameters and hook tables as they were.
        Without it the failed attach's hooks stayed on a model the loop cannot reach them
        on, and the corrected retry was refused ("carries the hooks of an earlier run")."""
        lifecycle = getattr(self, "lifecycle", None) or Lifecycle(self.plugins, RunInfo(
            run_dir=str(run_dir), device="cpu", plugins=self.plugins.names, jobs=(info,),
            seed=seed, cluster=cluster))
        metrics = {"iterations": 0, "duration_s": 0.0}
        for host, run in lifecycle._hosts():  # each host, whatever another one raised
            with contextlib.suppress(Exception):  # the error attach raises is the first one
                host.call("accelopt_run_end", run=run, metrics=metrics)
        as_given.restore()

    def _set_up(self, model: nn.Module, plugins: PluginSet, info: JobInfo,
                example: tuple[Any, Any] | None, run_dir: Path, seed: int,
                cluster: Any) -> None:
        """The layer offers, ``job_built`` and ``run_start``: what :meth:`_undo` takes back
        when one of them fails."""
        given = dict(model.named_parameters())
        self.model: nn.Module = offer_layers(model, info, self.host)
        """The model the loop trains (the same object unless a plugin replaced its root)."""
        current = dict(self.model.named_parameters())
        self._replaced: weakref.WeakValueDictionary[str, nn.Parameter] = \
            weakref.WeakValueDictionary({n: p for n, p in given.items() if current.get(n) is not p})
        """The parameters a plugin replaced in ``attach`` (build-time pruning slices layers
        into new, smaller Parameters), by name; weak, so the dense ones are not kept alive
        unless an optimizer made before attach holds them: ``step`` then repoints it."""
        self._replaced_versions = {n: current[n]._version for n in self._replaced
                                   if n in current}
        """Each replacement's version counter at attach: unchanged at ``close()`` after
        training means no optimizer ever stepped it (one made before attach, stepped with
        ``opt.step()``), which ``close()`` warns about."""
        self._given_parameters = len(given)
        table = param_table(self.model)
        self.info = dataclasses.replace(info, parameters=table,
                                        buckets=buckets_by_bytes(table, cluster.bucket_bytes,
                                                                 self.model))
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        run = RunInfo(run_dir=str(run_dir), device=str(device), plugins=plugins.names,
                      jobs=(self.info,), seed=seed, cluster=cluster)
        self._job = _YourJob(self.info, self.model, example)
        self.lifecycle = Lifecycle(plugins, run)
        self.lifecycle.job_built([self._job])  # type: ignore[list-item]
        self.lifecycle.start()
        self.events = StepEvents(self.host)
        self.iterations = 0
        self.rebuild_requests: list[str] = []
        """Optimizer rebuilds plugins asked for (``accelopt_after_step``): ``step`` makes
        them on the optimizer your loop holds (:func:`repoint_optimizer`). Each is
        ``"iteration N: reason"``, N counted from 1 (the iteration after which it was made)."""
        self._notes: list[str] = []
        """Warnings ``close()`` adds to its own (a repointed optimizer, a replacement a
        plugin's ``accelopt_optimizer_build`` returned at a rebuild)."""
        self._context: IterationContext | None = None
        self._loss: float | None = None
        self._trains_itself = [(name, module) for name, module in self.model.named_modules()
                               if getattr(module, TRAINS_ITSELF, False)]
        """The layers a plugin swapped in that update their own weights inside backward
        (:data:`~accelopt.job.job.TRAINS_ITSELF`): they get the gradient backward computes,
        so neither a ``GradScaler`` (they would step on the scaled gradient, even on a step
        the scaler skips) nor several backwards per step (one update per micro-batch) can
        be honoured for them: :meth:`_refuse_for_layers_training_themselves`."""
        self._unstepped = 0
        """``ao.backward`` calls since the last ``ao.step`` (or attach)."""
        self._last_backward_iteration: int | None = None
        self._called = {"ao.backward(loss)": 0, "ao.step(opt)": 0}
        """How often the loop called each: a plugin listening where one never fired did
        nothing, which ``close()`` says."""
        self._closed: list[ReportRow] | None = None
        self._kept_error: Exception | None = None
        """A plugin's error from the ``_end`` of an iteration the loop left by ``break``,
        raised by the next accelopt call or ``close()`` (:meth:`_end_on_exit`)."""
        self._t0 = time.perf_counter()

    # -- the iteration -------------------------------------------------------------------

    def loop(self, iterable: Iterable[T]) -> Iterator[T]:
        """``iterable`` as it is, each item one iteration: ``accelopt_iteration_start``
        before the item is handed to the loop's body, ``_end`` when the body asks for the
        next one (or leaves the loop). The one line a loop changes: ``for x, y in
        ao.loop(loader):``."""
        for item in iterable:
            context = self._begin()
            try:
                yield item
            except GeneratorExit:  # the body broke out of the loop after this item
                self._end_on_exit(context, _samples(item))
                raise
            self._end(context, _samples(item))

    def _end_on_exit(self, context: IterationContext, samples: int) -> None:
        """``_end`` while the loop's generator is being closed (a ``break``, or an exception
        in the body). Python finalises the generator itself there and only prints what it
        raises ("Exception ignored in: <generator ...>"), the script going on to exit 0; so
        a plugin's error is kept and raised by the loop's next accelopt call or ``close()``
        (:meth:`_raise_kept`)."""
        try:
            self._end(context, samples)
        except Exception as error:  # noqa: BLE001 - kept, raised by the next ao.* call
            self._kept_error = self._kept_error or error

    @contextlib.contextmanager
    def iteration(self, samples: int = 0) -> Iterator[IterationContext]:
        """One iteration as a ``with`` block, for a loop :meth:`loop` cannot wrap:
        ``accelopt_iteration_start`` on entry, ``_end`` on a normal exit (with the loss
        ``backward`` saw, and ``samples``); an exception ends it without ``_end``."""
        context = self._begin()
        try:
            yield context
        except BaseException:
            self._context = None
            raise
        self._end(context, samples)

    def _begin(self) -> IterationContext:
        self._raise_kept()
        if self._closed is not None:
            raise UserError("accelopt.attach: an iteration after close(); attach again")
        if self._context is not None:  # the inner one's _end would end the outer one's too
            raise UserError(
                f"accelopt.attach: an iteration began while iteration "
                f"{self._context.iteration} is still open (an ao.loop or `with "
                "ao.iteration():` inside another, or an ao.loop left suspended); iterations "
                "do not nest: use one ao.loop (or ao.iteration) per training step, and a "
                "plain loop inside it")
        context = IterationContext(self.info, self.events.lane, self.iterations,
                                   time.perf_counter() - self._t0)
        self._context, self._loss = context, None
        if self.events.iteration_start:
            try:
                self.events.iteration_start(context)
            except BaseException:  # the iteration never began: the next one may
                self._context = None
                raise
        return context

    def _raise_kept(self) -> None:
        """Raise the plugin error :meth:`_end_on_exit` kept (once): the first accelopt call
        after the loop that lost it, or ``close()``, so that it is never lost."""
        error, self._kept_error = self._kept_error, None
        if error is not None:
            raise error

    def _end(self, context: IterationContext, samples: int) -> None:
        self._context = None
        self.iterations += 1
        if self.events.iteration_end:
            result = IterationResult(self.info.job_id, context.iteration, context.now_s,
                                     time.perf_counter() - self._t0, self._loss, int(samples))
            self.events.iteration_end(context, result)

    def _current(self, call: str) -> IterationContext:
        self._raise_kept()
        if self._context is None:
            raise UserError(f"accelopt.attach: {call} outside `with ao.iteration():`; the "
                            "hooks it fires belong to an iteration")
        return self._context

    def backward(self, loss: torch.Tensor, scaler: torch.amp.GradScaler | None = None) -> None:
        """``loss.backward()`` after ``accelopt_after_forward`` (which may replace it). With
        mixed precision pass the loop's ``GradScaler`` and the loss itself (not
        ``scaler.scale(loss)``): the plugins see the loss and the scaled one is backpropagated.
        A layer a plugin swapped in that updates itself inside backward refuses the scaler and
        a second backward before ``ao.step`` (:meth:`_refuse_for_layers_training_themselves`)."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                   else type(loss).__name__)
            raise UserError(f"accelopt.attach: ao.backward(loss) takes the loss, one number "
                            f"(a one-element tensor), got {got}; reduce it first "
                            "(loss.mean() or loss.sum())")
        context = self._current("backward()")
        self._refuse_for_layers_training_themselves(context, scaler)
        self._called["ao.backward(loss)"] += 1
        self._unstepped += 1
        self._last_backward_iteration = context.iteration
        self._loss = float(loss.detach())
        if self.events.after_forward:
            replaced = self.events.after_forward(context, loss)
            if replaced is not None:
                loss = replaced
        (loss if scaler is None else scaler.scale(loss)).backward()

    def _layer_training_itself(self) -> tuple[str, str]:
        """The first such layer, as a refusal names it: the plugin (the attribute's value
        when it is the plugin's name), the layer's path and class."""
        name, module = self._trains_itself[0]
        owner = getattr(module, TRAINS_ITSELF)
        plugin = f"plugin '{owner}'" if isinstance(owner, str) else "the plugin"
        layer = f"layer '{name or '<root>'}' ({type(module).__name__})"
        return f"{plugin.replace('the ', 'a ', 1)} replaced {layer}", plugin

    def _refuse_for_layers_training_themselves(self, context: IterationContext,
                                               scaler: torch.amp.GradScaler | None) -> None:
        """A layer that updates its own weights inside backward gets exactly what backward
        computes: under a ``GradScaler`` the gradient times the scale (its optimizer moments
        went to inf at a large scale, while ``ao.step`` returned True), and with several
        backwards per step one update per micro-batch. Both were silent; each is refused in
        one line at the first backward that would do it (a second one in the same iteration
        with no ``ao.step`` between; across iterations, :meth:`step` sees it)."""
        if not self._trains_itself:
            return
        layer, plugin = self._layer_training_itself()
        if scaler is not None:
            raise UserError(
                f"accelopt.attach: ao.backward(loss, scaler): {layer}, which updates its own "
                "weights inside backward, where it would get the gradients times the scaler's "
                "scale (and update even on a step the scaler skips); train without the "
                f"GradScaler (bf16 autocast needs none: ao.backward(loss)), or without {plugin}")
        if self._unstepped and self._last_backward_iteration == context.iteration:
            raise UserError(_accumulation_refusal(layer, plugin))

    def step(self, optimizer: torch.optim.Optimizer,
             scaler: torch.amp.GradScaler | None = None) -> bool:
        """``optimizer.step()`` between ``accelopt_before_optimizer_step`` (the gradients by
        parameter name: a plugin may clip, scale or skip them) and ``accelopt_after_step``.
        With a ``GradScaler`` (the one given to :meth:`backward`): the gradients are
        unscaled before the plugins see them (a clip at their true norm), and the step is
        ``scaler.step`` (skipped on inf or nan) and ``scaler.update()``. Returns whether the
        optimizer stepped."""
        _check_optimizer(optimizer, "ao.step(opt)")
        context = self._current("step()")
        self._repoint_stale(optimizer)
        named = _named_in(optimizer, self.model)
        if not named:  # stepped silently: the model never moved, a clip row counted 0 of N
            raise UserError(
                "ao.step(opt): the optimizer holds none of the attached model's parameters, so "
                "no plugin sees its gradients and the model does not train; pass the optimizer "
                "over ao.model.parameters(), or call opt.step() for another model's optimizer")
        if self._trains_itself and self._unstepped > 1:  # accumulated across iterations
            raise UserError(_accumulation_refusal(*self._layer_training_itself()))
        self._unstepped = 0
        self._called["ao.step(opt)"] += 1
        self._stepped.add(optimizer)
        if scaler is not None:
            scaler.unscale_(optimizer)
        stepped = True
        if self.events.before_optimizer_step:
            grads = Gradients(self.info, named)
            self.events.before_optimizer_step(context, grads)
            stepped = grads.skipped is None
        if scaler is not None:
            scale = scaler.get_scale()
            if stepped:
                scaler.step(optimizer)
            scaler.update()  # after unscale_, whether it stepped or not
            stepped = stepped and scaler.get_scale() >= scale  # a skipped step backs off
        elif stepped:
            optimizer.step()
        if self.events.after_step:
            before = dict(self.model.named_parameters())
            asked = rebuilds(self.events.after_step(context, stepped))
            if asked:
                # counted from 1, as the plugins' own text counts ("at iteration 3")
                self.rebuild_requests.extend(f"iteration {context.iteration + 1}: {r.reason}"
                                             for r in asked)
                self._rebuild(optimizer, before, context.iteration + 1)
        return stepped

    def _rebuild(self, optimizer: torch.optim.Optimizer, before: dict[str, nn.Parameter],
                 iteration: int) -> None:
        """:meth:`_rebuild_one` on the optimizer whose step the rebuild followed, then on
        every other one the loop stepped through ``ao.step`` (a GAN's two, a body's and a
        head's): only the first was repointed, and the others went on stepping tensors
        the model no longer used, with no warning."""
        self._rebuild_one(optimizer, before, iteration)
        for other in list(self._stepped):
            if other is not optimizer:
                self._rebuild_one(other, before, iteration)
        current = dict(self.model.named_parameters())
        # one the loop steps first after the rebuild is repointed at that step
        self._rebuilt_away.update({n: p for n, p in before.items() if current.get(n) is not p})

    def _rebuild_one(self, optimizer: torch.optim.Optimizer, before: dict[str, nn.Parameter],
                     iteration: int) -> None:
        """What ``accelopt run`` does at a rebuild, on an optimizer the loop holds (in
        place, since the loop keeps its own reference): repoint it at the current
        parameters, then offer it to ``accelopt_optimizer_build`` with the optimizer as it
        was (``previous``), so a plugin carries the state of the parameters it resized
        (gpu_kernels slices momentum and Adam moments); without the offer that state was
        dropped. A replacement a plugin returns cannot reach the loop: said in close()."""
        previous = copy.copy(optimizer)
        previous.state = collections.defaultdict(dict, optimizer.state)
        previous.param_groups = [dict(g) for g in optimizer.param_groups]
        params = dict(self.model.named_parameters())
        repoint_optimizer(optimizer, before, params)
        out = self.host.chain("accelopt_optimizer_build", optimizer, lambda o: {
            "job": self.info, "optimizer": o, "parameters": params, "previous": previous})
        if out is not optimizer:
            self._notes.append(
                f"at the rebuild after iteration {iteration} a plugin's "
                f"accelopt_optimizer_build returned a new {type(out).__name__}; your loop "
                "steps its own optimizer, so the replacement was not used")

    def _repoint_stale(self, optimizer: torch.optim.Optimizer) -> None:
        """Point an optimizer made before ``attach`` at the parameters a plugin put in place
        of the ones it holds (build-time pruning): it stepped the old, dense Parameters, the
        model's own never moved, and the row still said "trained at the pruned size"."""
        if not self._replaced and not self._rebuilt_away:
            return
        stale = {**self._replaced, **self._rebuilt_away}
        ids = {id(p) for p in stale.values()}
        held = sum(id(p) in ids for g in optimizer.param_groups for p in g["params"])
        if not held:
            return
        current = dict(self.model.named_parameters())
        # unchanged and new names as they are now: only the replaced ones are swapped
        repoint_optimizer(optimizer, {**current, **stale}, current)
        self._notes.append(
            f"the optimizer handed to ao.step held {held} parameters a plugin replaced "
            "(in attach, or at a rebuild before its first ao.step); it was pointed at the "
            "model's current ones, their fresh state starting at that step")

    def optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer to use: yours, or what ``accelopt_optimizer_build`` made of it (one
        made before ``attach`` is first pointed at the parameters a plugin replaced)."""
        _check_optimizer(optimizer, "ao.optimizer(opt)")
        self._raise_kept()
        self._repoint_stale(optimizer)
        params = dict(self.model.named_parameters())
        return self.host.chain("accelopt_optimizer_build", optimizer, lambda o: {
            "job": self.info, "optimizer": o, "parameters": params, "previous": None})

    # -- the end ---------------------------------------------------------------------------

    def close(self) -> list[ReportRow]:
        """Every plugin's report rows (printed on the console, kept in ``report.json``) after
        ``accelopt_run_end``; a second call returns the same rows. A plugin error kept from
        the iteration a ``break`` left (:meth:`_end_on_exit`) is raised after the run is
        closed (its rows kept, a second call returns them), as an error in the loop's body
        reaches a ``with accelopt.attach(...)`` block's end."""
        try:
            return self._closed if self._closed is not None else self._close()
        finally:
            self._raise_kept()

    def _close(self) -> list[ReportRow]:
        """:meth:`close`'s work, done once."""
        rows = with_placeholders(self.lifecycle.merged_rows(), self.plugins.names)
        metrics = {"iterations": self.iterations,
                   "duration_s": round(time.perf_counter() - self._t0, 6)}
        self.lifecycle.end(metrics)
        # the rows kept and report.json written before anything prints: a console that
        # failed to print lost the report, and a second close() returned the rows silently
        self._closed = rows
        _OPEN_RUN_DIRS.pop(self.run_dir.resolve(), None)
        warnings = self._never_reached() + self._notes + self._never_stepped()
        self._write_report(rows, metrics, warnings)
        from accelopt.report.summary import plugins_table

        self.console.print(plugins_table(rows))
        for line in warnings:
            self.console.print(f"warning: {line}", markup=False, highlight=False)
        return rows

    def _write_report(self, rows: list[ReportRow], metrics: dict[str, Any],
                      warnings: list[str]) -> None:
        """``report.json``: the rows, the loop's figures and the warnings close() prints."""
        table = param_table(self.model)
        try:  # created, never replaced: another process's report, since attach, is kept
            with atomic_open(self.run_dir / REPORT_FILE, exclusive=True) as handle:
                handle.write(json.dumps({
                    "plugins": list(self.plugins.names),
                    "job": {"name": self.info.name, "model": self.info.model,
                            # elements, as a reader counts a model's parameters (the key
                            # gave the number of tensors), the tensors beside it; of the
                            # model at close (a late prune changed it after attach)
                            "parameters": sum(math.prod(p.shape) for p in table),
                            "parameter_tensors": len(table)},
                    **metrics, "plugin_rows": [dataclasses.asdict(r) for r in rows],
                    "rebuild_requests": self.rebuild_requests, "warnings": warnings},
                    indent=1, default=str) + "\n")
        except FileExistsError:
            raise ConfigError(f"{self.run_dir / REPORT_FILE} was written since this attach "
                              "began (another loop with the same run_dir: give each process, "
                              "each torchrun rank, its own run_dir); it is kept, and this "
                              "loop's rows are not written (close() returns them)") from None

    LISTENED: ClassVar[dict[str, tuple[str, ...]]] = {
        "ao.backward(loss)": ("accelopt_after_forward",),
        "ao.step(opt)": ("accelopt_before_optimizer_step", "accelopt_after_step"),
    }
    """The hooks that fire only where the loop calls accelopt, by the call."""

    def _never_reached(self) -> list[str]:
        """A plugin listening to hooks that fire in a call the loop never made (``opt.step()``
        instead of ``ao.step(opt)``) did nothing there, and its row may not know why:
        gpu_kernels' pruning after N iterations said "the job stopped first"."""
        if not self.iterations:
            return []
        lines = []
        for call, hooks in self.LISTENED.items():
            if self._called[call]:
                continue
            for name in self.plugins.names:
                heard = sorted(set(hooks) & self.host.hooks_of(name))
                if heard:
                    lines.append(f"plugin '{name}' listens to {', '.join(heard)}, which "
                                 f"{'fires' if len(heard) == 1 else 'fire'} in {call}; this "
                                 f"loop never called it in {self.iterations} iterations, so "
                                 "the plugin did nothing there")
        return lines

    def _never_stepped(self) -> list[str]:
        """The parameters a plugin replaced in ``attach`` that no step ever changed in a loop
        that ran: the loop's optimizer was made before attach and stepped with
        ``opt.step()``, so it updated the old tensors and the model trained only what the
        plugin left in place."""
        if not self.iterations or not self._replaced_versions:
            return []
        params = dict(self.model.named_parameters())
        if any(n in params and params[n]._version != v
               for n, v in self._replaced_versions.items()):
            return []
        return [f"the {len(self._replaced_versions)} parameters a plugin replaced in attach "
                f"never changed in {self.iterations} iterations: {STALE_OPTIMIZER_FIX}"]

    def __enter__(self) -> Attached:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


STALE_OPTIMIZER_FIX = (
    "an optimizer made before attach still holds the old ones, and opt.step() does not train "
    "them; build it over ao.model.parameters() after attach, or step it with ao.step(opt), "
    "which points it at the current ones")
"""Why an optimizer made before ``attach`` is stale once a plugin replaced parameters, and
the fix."""


def _accumulation_refusal(layer: str, plugin: str) -> str:
    return (f"accelopt.attach: several ao.backward calls before one ao.step (gradient "
            f"accumulation): {layer}, which updates its own weights inside each backward, "
            "one step per micro-batch, not per ao.step; call ao.step(opt) after each "
            f"ao.backward (a larger batch instead of accumulating), or train without {plugin}")


def _stale_optimizer_note(replaced: int, total: int) -> str:
    """The warning ``attach`` gives when plugins replaced parameters."""
    return (f"accelopt.attach: plugins replaced {replaced} of the model's {total} parameters "
            "that your loop still holds (a pruned or swapped layer has new Parameters): "
            f"{STALE_OPTIMIZER_FIX}")


def repoint_optimizer(optimizer: torch.optim.Optimizer, before: dict[str, nn.Parameter],
                      after: dict[str, nn.Parameter]) -> None:
    """Point the optimizer your loop holds at the model's parameters after a plugin changed
    the model (pruned a layer: new, smaller Parameters), in place, since the loop keeps
    its own reference to it: each group keeps the parameters of the names it held, now
    the model's current ones; an unchanged parameter keeps its state, a replaced one starts
    afresh (its old state has the old shape). A parameter the loop gave the optimizer from
    outside the model (a learnable temperature) stays. A parameter of a name new to the
    model joins the first group; one the loop left out of its optimizer (a frozen body when
    fine-tuning a head) stays out: it used to join as "new", so the optimizer stepped
    layers the loop never asked it to train. Without the repointing the optimizer went on
    stepping tensors the model no longer used."""
    name_of = {id(p): n for n, p in before.items()}
    for group in optimizer.param_groups:
        group["params"] = [after[name_of[id(p)]] if id(p) in name_of else p
                           for p in group["params"]
                           if id(p) not in name_of or name_of[id(p)] in after]
    new = [p for n, p in after.items() if n not in before and p.requires_grad]
    if new and optimizer.param_groups:
        optimizer.param_groups[0]["params"].extend(new)
    current = {id(p) for group in optimizer.param_groups for p in group["params"]}
    kept = {p: s for p, s in optimizer.state.items() if id(p) in current}
    optimizer.state.clear()
    optimizer.state.update(kept)
