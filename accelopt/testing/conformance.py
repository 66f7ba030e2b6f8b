"""The conformance suite every plugin (built-in or third-party) should pass.

Each check raises :class:`AssertionError` whose message names the plugin, what is wrong
and what to change, because the reader is a plugin author looking at a red test, not
someone who knows accelopt's internals. Use it either as one call::

    def test_conformance(tmp_path):
        conformance(PLUGIN, tmp_path)

or as a base class, which gives one pytest test per check::

    class TestMyPlugin(PluginConformance):
        spec = PLUGIN
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import difflib
import functools
import gc
import inspect
import os
import sys
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from accelopt import hookspecs
from accelopt.config import invalid_schema, register_plugin_configs
from accelopt.drivers.rows import SILENT_SUMMARY
from accelopt.errors import AccelOptError, PluginResolutionError
from accelopt.host import HOOK_DOCS, PluginHost
from accelopt.plugin import STATE_LOAD, STATE_SAVE, PluginSpec, Registry, hook_methods
from accelopt.records import RunRecord
from accelopt.testing.harness import _fresh_dir, run_workload
from accelopt.testing.recorder import HookRecorder, hook_names

DECLARATION_FIELDS = ("before", "after", "requires", "conflicts", "slots")
IMPL_MARKER = f"{hookspecs.PROJECT}_impl"


def conformance(spec: PluginSpec, tmp_path: Path, *, check_retention: bool = True) -> None:
    """Run every check on ``spec``; the first failure raises ``AssertionError``."""
    check_spec(spec)
    check_declarations(spec)
    check_config(spec)
    check_hookimpls(spec)
    instances = check_run(spec, tmp_path)
    if check_retention:
        check_no_retained_job_state(spec, instances)


# --- (a) the spec and its config ---------------------------------------------------------


def check_spec(spec: object) -> None:
    """The entry point names a described :class:`PluginSpec`."""
    if not isinstance(spec, PluginSpec):
        raise AssertionError(
            f"expected an accelopt.PluginSpec (the object your entry point names), got "
            f"{type(spec).__name__}; define PLUGIN = PluginSpec(name=..., factory=..., ...)"
        )
    if not spec.description.strip():
        raise AssertionError(
            f"plugin '{spec.name}': PluginSpec.description is empty; give one sentence "
            "saying what the plugin does (`accelopt plugins` shows it)"
        )
    if not callable(spec.factory):
        raise AssertionError(
            f"plugin '{spec.name}': PluginSpec.factory must be callable (a class or function "
            "taking the config instance and returning the object with the @hookimpl methods)"
        )


def check_config(spec: PluginSpec) -> None:
    """The config dataclass works with defaults alone, is a valid OmegaConf schema and is
    registered where ``+plugins=[name]`` and ``plugins.name.key=value`` look for it."""
    config_type = spec.config
    name = spec.name
    if not (isinstance(config_type, type) and dataclasses.is_dataclass(config_type)):
        raise AssertionError(f"plugin '{name}': PluginSpec.config must be a dataclass type")
    try:
        default = spec.default_config()
    except Exception as exc:
        raise AssertionError(
            f"plugin '{name}': {config_type.__name__}() failed ({exc}); give every field a "
            f"default so +plugins=[{name}] works without settings"
        ) from exc
    try:
        OmegaConf.structured(config_type)
    except Exception as exc:
        raise AssertionError(invalid_schema(name, config_type, exc)) from exc
    try:
        register_plugin_configs([spec])
    except PluginResolutionError as exc:  # a field typed Any: what a run refuses
        raise AssertionError(str(exc)) from exc
    try:
        node = ConfigStore.instance().load(config_path=f"plugins/{name}.yaml")
    except Exception as exc:
        raise AssertionError(
            f"plugin '{name}': its config is not in Hydra's ConfigStore as plugins/{name} "
            f"after register_plugin_configs ({exc})"
        ) from exc
    if node.package != f"plugins.{name}":
        raise AssertionError(
            f"plugin '{name}': config registered at package '{node.package}', expected "
            f"'plugins.{name}'"
        )
    try:
        spec.instantiate(default)
    except PluginResolutionError as exc:  # state it saves and could never load back
        raise AssertionError(str(exc)) from exc
    except Exception as exc:
        cause = exc.__cause__ or exc  # instantiate names the plugin; say what the factory raised
        raise AssertionError(
            f"plugin '{name}': factory({config_type.__name__}()) raised "
            f"{type(cause).__name__}: {cause}; the plugin must build from its default config"
        ) from exc


# --- (e) declared relations --------------------------------------------------------------


def check_declarations(spec: PluginSpec) -> None:
    """``before/after/requires/conflicts/slots`` hold identifiers, and make sense together."""
    for field in DECLARATION_FIELDS:
        for value in getattr(spec, field):
            if not (isinstance(value, str) and value.isidentifier()):
                raise AssertionError(
                    f"plugin '{spec.name}': {field} contains {value!r}; it must be a tuple of "
                    f"plugin (or slot) names, each a Python identifier, e.g. {field}=('other',)"
                )
    for field in ("before", "after", "requires", "conflicts"):
        if spec.name in getattr(spec, field):
            raise AssertionError(f"plugin '{spec.name}': names itself in {field}; remove it")
    both = set(spec.requires) & set(spec.conflicts)
    if both:
        raise AssertionError(
            f"plugin '{spec.name}': {', '.join(sorted(both))} is both required and conflicting"
        )
    cycle = set(spec.before) & set(spec.after)
    if cycle:
        raise AssertionError(
            f"plugin '{spec.name}': {', '.join(sorted(cycle))} is both in before and after"
        )


# --- (b), (c) hook implementations -------------------------------------------------------


def check_hookimpls(spec: PluginSpec) -> None:
    """Every hook implementation names a real hook, takes arguments the hook passes, in a
    form the core can pass them, and state it saves it can load back; then pluggy itself
    validates the plugin."""
    try:
        instance = spec.instantiate()
    except PluginResolutionError as exc:  # refuse_unpaired_state_hooks
        raise AssertionError(str(exc)) from exc
    specs = {name: getattr(hookspecs, name) for name in hook_names()}
    impls = list(_hookimpls(spec, instance))
    if not impls:
        raise AssertionError(
            f"plugin '{spec.name}': no method is decorated with @accelopt.hookimpl, so the "
            f"plugin can never do anything; see {HOOK_DOCS}"
        )
    for attr, function, hook in impls:
        if hook not in specs:
            close = difflib.get_close_matches(hook, list(specs), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise AssertionError(
                f"plugin '{spec.name}': {attr} is not an accelopt hook{hint} "
                f"(hooks are listed in {HOOK_DOCS})"
            )
        _check_signature(spec.name, attr, function, hook, specs[hook])
    try:
        PluginHost([(spec, instance)])  # registers with pluggy and runs check_pending()
    except PluginResolutionError as exc:
        raise AssertionError(str(exc)) from exc


def _hookimpls(spec: PluginSpec, instance: object) -> Iterator[tuple[str, Any, str]]:
    """(attribute, function, hook name) of each implementation; an ``accelopt_*`` method
    without the marker is an error, because pluggy silently ignores it."""
    # a marked function set on an object (not its class) is never registered; a module's
    # or class's own attributes are its hooks, as the scan below finds them
    on_object = {} if inspect.ismodule(instance) or inspect.isclass(instance) \
        else getattr(instance, "__dict__", {})
    for attr, value in sorted(on_object.items()):
        if isinstance(getattr(value, IMPL_MARKER, None), dict):
            raise AssertionError(
                f"plugin '{spec.name}': {attr} is set on the instance, not defined on its "
                "class, so the core never registers it; define it as a method of the class"
            )
    for method in sorted(hook_methods(instance), key=lambda method: method.attribute):
        if not method.marked:
            raise AssertionError(
                f"plugin '{spec.name}': {method.attribute} looks like a hook but is not "
                "decorated with @accelopt.hookimpl, so it is never called; add the decorator"
            )
        yield method.attribute, getattr(instance, method.attribute), method.hook


def _check_signature(plugin: str, attr: str, function: Any, hook: str, hookspec: Any) -> None:
    """Pluggy passes a hook's arguments by name, and only those an implementation names as
    plain parameters without defaults; the core's chained calls pass them as keywords."""
    provided = [p for p in inspect.signature(hookspec).parameters]
    where = f"plugin '{plugin}': {attr}"
    for param in inspect.signature(function).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise AssertionError(
                f"{where} takes {'*' if param.kind is param.VAR_POSITIONAL else '**'}"
                f"{param.name}, which pluggy never fills; name the arguments you need from: "
                f"{', '.join(provided)}"
            )
        if param.kind in (param.POSITIONAL_ONLY, param.KEYWORD_ONLY):
            raise AssertionError(
                f"{where}: argument '{param.name}' is {param.kind.description}; hook arguments "
                "are passed by name, so declare it as an ordinary parameter"
            )
        if param.name not in provided:
            close = difflib.get_close_matches(param.name, provided, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise AssertionError(
                f"{where}: argument '{param.name}' is not passed by {hook}{hint}; it passes: "
                f"{', '.join(provided) or 'nothing'}"
            )
        if param.default is not param.empty:
            raise AssertionError(
                f"{where}: argument '{param.name}' has a default, so pluggy never passes it "
                "(it always sees the default); remove the default"
            )


# --- (d) a real run ------------------------------------------------------------------------


MODES = ("none", "ps", "allreduce")


def check_run(spec: PluginSpec, tmp_path: Path, workload: str = "tiny", *,
              overrides: Sequence[str] = (), plugins: Sequence[PluginSpec | str] = (),
              mode: str = "none") -> list[object]:
    """Run ``workload`` under the plugin (after the plugins it requires and ``plugins``, the
    others it needs, with ``overrides``), in ``mode`` (``none``, ``ps`` or ``allreduce``):
    it must not raise, every job must finish, and the plugin must report at least one row
    of its own; and an implementation of a hook declared to return ``None`` must not answer
    (:data:`ANSWERLESS_HOOKS`), in every mode (a cluster run's ranks note such answers in
    a file under ``tmp_path``). Returns the plugin objects the run
    built in this process, with the storages of its jobs' tensors (a :class:`RunInstances`,
    for :func:`check_no_retained_job_state`; none in a cluster mode, where the plugin lives
    in the rank processes)."""
    if mode not in MODES:
        raise ValueError(f"check_run: mode must be one of {', '.join(MODES)}, got {mode!r}")
    instances = RunInstances()
    answers: list[str] = []

    def capturing_factory(config: Any) -> object:
        instance = spec.factory(config)
        instances.append(instance)
        _watch_answers(instance, answers)
        return instance

    # a cluster run sends the spec to its ranks (by reference): no capturing closure there,
    # a picklable watcher that notes answers in files instead
    notes_dir = Path(tmp_path) / "conformance-answers"
    for stale in _noted_files(notes_dir):  # an earlier check_run's, with this tmp_path
        stale.unlink()
    watching = functools.partial(_watching_factory, spec.factory, str(notes_dir))
    probe = dataclasses.replace(
        spec, factory=capturing_factory if mode == "none" else watching)
    registry = Registry.discover()
    missing = [name for name in spec.requires if name not in registry.names()]
    if missing:
        raise AssertionError(
            f"plugin '{spec.name}' requires {', '.join(missing)}, which is not installed; "
            "install it to run the conformance suite"
        )
    stateful = _implements(spec, STATE_SAVE)
    extra = [*overrides, *([f"cluster.mode={mode}"] if mode != "none" else [])]
    given = [o.split("=", 1)[1] for o in extra if o.startswith("run.checkpoint_every=")]
    if stateful and not given:
        # checkpoint every 2 iterations: the core checks each accelopt_state_save answer
        extra.append(f"run.checkpoint_every={CHECKPOINT_EVERY}")
    resumable = stateful and (not given or given[-1].strip() not in ("0", ""))
    where = f"the '{workload}' workload" + (f" in cluster.mode={mode}" if mode != "none" else "")
    recorder = HookRecorder()
    run_dir = _fresh_dir(Path(tmp_path))  # the directory run_workload makes (to resume it)
    try:
        record = run_workload(
            [*spec.requires, *plugins, probe], extra, tmp_path=tmp_path, workload=workload,
            recorder=recorder, registry=registry,
        )
    except AccelOptError as exc:
        raise AssertionError(f"plugin '{spec.name}': {where} failed under it: {exc}") from exc
    except Exception as exc:
        raise AssertionError(
            f"plugin '{spec.name}': {where} raised {type(exc).__name__}: "
            f"{exc} (does accelopt_report_rows return a list of ReportRow?)"
        ) from exc
    finally:
        for instance in instances:
            _unwatch_answers(instance)
    answers += _noted_in(notes_dir)
    if answers:
        raise AssertionError(f"plugin '{spec.name}': in {where}, {answers[0]}")
    _check_jobs_done(spec.name, where, record)
    _check_reported(spec, mode, record)
    _check_finite_metrics(spec.name, where, record)
    instances.job_storages = _job_storages(recorder)
    instances.grad_storages = _job_storages(recorder, grads=True)
    recorder.clear()  # its records hold the jobs' models: no longer needed
    if resumable:  # (overrides turning checkpoints off: nothing to resume from)
        _check_resumes(spec, dataclasses.replace(spec, factory=watching), registry,
                       [*spec.requires, *plugins], extra, workload, where, run_dir, tmp_path)
    return instances


CHECKPOINT_EVERY = 2
"""The run check's checkpoint interval for a plugin with state (``accelopt_state_save``)."""


def _check_resumes(spec: PluginSpec, probe: PluginSpec, registry: Registry,
                   others: Sequence[PluginSpec | str], extra: Sequence[str], workload: str,
                   where: str, run_dir: Path, tmp_path: Path) -> None:
    """Resume the checkpointed run from its final checkpoints (``run.resume_finished``):
    the state each job's checkpoint holds goes back through ``accelopt_state_load``, the
    path a real resume takes, and must load without an error. (Resuming from a middle
    checkpoint to the same weights as the uninterrupted run is not checked here.)"""
    recorder = HookRecorder()  # the first run had one: a resume runs with the same plugins
    try:
        record = run_workload(
            [*others, probe], [*extra, f"run.resume={run_dir}", "run.resume_finished=true"],
            tmp_path=tmp_path, workload=workload, recorder=recorder, registry=registry)
    except AccelOptError as exc:
        raise AssertionError(
            f"plugin '{spec.name}': resuming {where} from its checkpoints failed: {exc} "
            f"(the state {STATE_SAVE} returns must load back through {STATE_LOAD})") from exc
    except Exception as exc:
        raise AssertionError(
            f"plugin '{spec.name}': resuming {where} from its checkpoints raised "
            f"{type(exc).__name__}: {exc}") from exc
    finally:
        recorder.clear()
    _check_jobs_done(spec.name, f"the resume of {where}", record)


def _check_finite_metrics(name: str, where: str, record: RunRecord) -> None:
    """A nan or inf metric in the plugin's own rows: the run keeps it (metrics.json writes
    null, with a warning), the kit refuses it, because a reader of metrics.json cannot tell
    a null from a metric that was never measured."""
    import math

    for row in record.plugin_rows:
        if row.plugin != name:
            continue
        for key, value in row.metrics.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise AssertionError(
                    f"plugin '{name}': in {where} its ReportRow {row.summary[:40]!r} has "
                    f"metric '{key}' = {value}, which JSON cannot hold (metrics.json writes "
                    "null); report a finite number, or leave the metric out when there is "
                    "none")


class RunInstances(list):  # type: ignore[type-arg]
    """The plugin objects :func:`check_run` built, and weak references to the storages of
    the run's job tensors (parameters and buffers, by storage; gradients apart), which
    :func:`check_no_retained_job_state` looks for in them: a plugin keeping ``p.data``,
    ``p.detach()`` or ``model.state_dict()`` holds plain tensors that keep the job's
    weights alive, and one keeping ``gradients[name]`` (a parameter's ``.grad``, a plain
    tensor too) keeps the job's gradient buffer alive."""

    job_storages: dict[int, Any]
    grad_storages: dict[int, Any]

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.job_storages = {}
        self.grad_storages = {}


def _job_storages(recorder: HookRecorder, *, grads: bool = False) -> dict[int, Any]:
    """Storage -> a weak reference to it (which keeps its address from being reused), for
    every parameter and buffer of the models the run built (as they are at its end), or
    with ``grads`` every gradient of their parameters. A one-process run zeroes the
    gradients in place (``set_to_none=False``), so the buffers at the end are the ones every
    iteration's ``gradients`` view handed out."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    refs: dict[int, Any] = {}
    for call in recorder.calls("job_built"):
        model = getattr(call.get("job"), "model", None)
        if not isinstance(model, torch.nn.Module):
            continue  # a cluster rank's, described (Shipped)
        if grads:
            tensors = [p.grad for p in model.parameters() if p.grad is not None]
        else:
            tensors = [*model.parameters(), *model.buffers()]
        for tensor in tensors:
            ref = StorageWeakRef(tensor.untyped_storage())
            refs.setdefault(ref.cdata, ref)
    return refs


def _storage_of(tensor: Any) -> int | None:
    """The storage ``tensor`` views (as :func:`_job_storages` keys it), or None for a tensor
    without one (sparse, a subclass without storage)."""
    try:
        return int(tensor.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None


# --- answers the core ignores ------------------------------------------------------------


ANSWERLESS_HOOKS = frozenset(
    name for name in hook_names()
    if inspect.signature(getattr(hookspecs, name)).return_annotation in ("None", None))
"""The hooks declared to return ``None`` (events): the core drops what they return, so an
answer means the plugin expected an effect that never happens (``return loss * 2`` in
``accelopt_iteration_end``). The runtime does not check them (a check per call on the hot
path); the run check does."""
_WATCH_MARK = "_accelopt_conformance_watch"


def _watch_answers(instance: object, noted: list[str]) -> None:
    """Give ``instance`` (for the run check only) a wrapper of each of its implementations
    of an :data:`ANSWERLESS_HOOKS` hook that notes an answer other than ``None``. The host
    registers a plugin object's hooks as ``getattr(instance, name)``, so the wrappers are
    what it calls; they carry the implementation's marker and, through ``__wrapped__``, its
    signature. A module, a class, or an object that takes no attributes is left as it is."""
    if inspect.ismodule(instance) or inspect.isclass(instance):
        return
    for method in hook_methods(instance):
        options = method.options
        if options is None or method.wrapped or options.get("wrapper") or \
                options.get("hookwrapper") or method.hook not in ANSWERLESS_HOOKS:
            continue
        attr = method.attribute
        found = inspect.getattr_static(type(instance), attr)
        if inspect.iscoroutinefunction(found) or inspect.isgeneratorfunction(found) or \
                inspect.isasyncgenfunction(found):
            continue  # refused by the host as it is
        try:
            setattr(instance, attr, _watched(getattr(instance, attr), attr,
                                             method.hook, noted))
        except (AttributeError, TypeError):  # __slots__, a frozen dataclass
            return


def _watched(method: Any, attr: str, hook: str, noted: list[str]) -> Any:
    """``method`` noting in ``noted`` the first answer it gives that is not ``None``."""

    @functools.wraps(method)
    def watched(*args: Any) -> Any:
        answer = method(*args)
        if answer is not None and not noted:
            text = repr(answer)
            text = text if len(text) <= 60 else text[:57] + "..."
            noted.append(
                f"{attr} returned {type(answer).__name__} {text}, but {hook} is declared to "
                "return None: the core ignores the answer, so what it was meant to do never "
                f"happens; return nothing (the hooks that take an answer: {HOOK_DOCS})")
        return answer

    setattr(watched, _WATCH_MARK, True)
    return watched


class _NotesFile(list):  # type: ignore[type-arg]
    """The notes of :func:`_watched`, each also written to a file of ``directory``: a
    cluster rank's plugin object lives in the rank's process, and only files come back."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = Path(directory)

    def append(self, text: str) -> None:
        super().append(text)
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / f"{os.getpid()}-{id(self)}.txt").write_text(text)


def _watching_factory(factory: Any, directory: str, config: Any) -> object:
    """``factory(config)``, its answerless hooks watched, notes written under ``directory``
    (module level, so a spec using it travels to a cluster's ranks)."""
    instance = factory(config)
    _watch_answers(instance, _NotesFile(directory))
    return instance


def _noted_in(directory: Path) -> list[str]:
    """What the ranks' watchers noted (:class:`_NotesFile`), in a stable order."""
    return [p.read_text() for p in _noted_files(directory)]


def _noted_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.txt")) if directory.is_dir() else []


def _unwatch_answers(instance: object) -> None:
    """Take :func:`_watch_answers`'s wrappers off ``instance`` again."""
    own = getattr(instance, "__dict__", None)
    if isinstance(own, dict):
        for attr in [a for a, v in own.items() if getattr(v, _WATCH_MARK, False)]:
            delattr(instance, attr)


def _check_jobs_done(name: str, where: str, record: RunRecord) -> None:
    unfinished = [job for job in record.jobs if job.status != "done"]
    if unfinished:
        details = "; ".join(
            f"{job.job.name} {job.status}: {job.error or 'no error recorded'}"
            for job in unfinished
        )
        raise AssertionError(
            f"plugin '{name}': {len(unfinished)} of {len(record.jobs)} jobs of {where} did "
            f"not finish ({details})"
        )
    diverged = [job for job in record.jobs if job.diverged_at is not None]
    if diverged:  # "done", with a loss of nan: what the run's summary flags, the kit too
        names = ", ".join(j.job.name for j in diverged)
        raise AssertionError(  # the first one's where, as the run's summary words it
            f"plugin '{name}': under it {names} ({where}) diverged: "
            f"{diverged[0].diverged_where} (the workload trains without it)")


def _check_reported(spec: PluginSpec, mode: str, record: RunRecord) -> None:
    """The plugin said something of its own in the run's summary; the failure names the
    mode (a rule such as "no rows on a worker" holds in one mode and not another) and says
    whether the hook is missing or answered nothing."""
    name = spec.name
    placeholder = _no_report_summary()
    own = [row for row in record.plugin_rows if row.plugin == name and row.summary != placeholder]
    if own:
        return
    where = f"in cluster.mode={mode}"
    if not _implements(spec, "accelopt_report_rows"):
        raise AssertionError(
            f"plugin '{name}': {where} it reported nothing, as it implements no "
            f"accelopt_report_rows; implement it and return a ReportRow(plugin='{name}', ...) "
            "saying what the plugin did on this run, or why it did nothing, so users never "
            "have to guess whether it was active"
        )
    ranks = "" if mode == "none" else " on any rank"
    raise AssertionError(
        f"plugin '{name}': {where} accelopt_report_rows gave no ReportRow(plugin='{name}', "
        f"...){ranks}; return at least one saying what the plugin did, or why it did nothing"
        + ("" if mode == "none" else " (return [] on a rank only where another rank reports: "
           "an all-reduce worker has role 'worker' and takes the optimizer step)")
    )


def _implements(spec: PluginSpec, hook: str) -> bool:
    """Whether the plugin's default object implements ``hook`` (True when that cannot be
    told: the message then assumes the hook exists rather than ask for it wrongly)."""
    try:
        instance = spec.instantiate()
        return any(found == hook for _, _, found in _hookimpls(spec, instance))
    except Exception:
        return True


def _no_report_summary() -> str:
    """The summary the core writes for a plugin that reported nothing (the core's own)."""
    return SILENT_SUMMARY


# --- (f) no job state kept ---------------------------------------------------------------


def check_no_retained_job_state(spec: PluginSpec, instances: list[object]) -> None:
    """After a run, the plugin object must not keep the jobs' models, parameters,
    gradients or optimizers alive: that would hold device memory across runs (plugins are
    built per run, but a user's notebook or a sweep may keep the object). Plain tensors a
    plugin owns (e.g. error-feedback residuals, a gradient's ``.clone()``) are allowed; one
    sharing its storage with a job's parameter, buffer or gradient (``p.data``,
    ``p.detach()``, ``model.state_dict()``, ``gradients[name]``, ``p.grad``) is not, where
    ``instances`` is what :func:`check_run` returned (it knows the jobs' storages)."""
    gc.collect()
    storages = getattr(instances, "job_storages", None) or {}
    grads = getattr(instances, "grad_storages", None) or {}
    for instance in instances:
        seen = _Walk(storages, grads)
        if isinstance(instance, types.ModuleType):  # a module of hooks: its globals
            found = next(filter(None, (
                _find_job_state(value, f"{instance.__name__}.{key}", RETENTION_DEPTH - 1, seen)
                for key, value in list(vars(instance).items()) if not key.startswith("__"))),
                None)
        else:
            found = _find_job_state(instance, type(instance).__name__, RETENTION_DEPTH, seen) \
                or _find_in_shared_state(instance, seen)
        if found is not None:
            path, kind = found
            raise AssertionError(
                f"plugin '{spec.name}': after the run it still holds {kind} at {path}; keep "
                "only numbers or your own tensors (drop references in accelopt_release or "
                "accelopt_run_end), or opt out with check_retention=False"
            )


def _find_in_shared_state(instance: object, seen: set[int]) -> tuple[str, str] | None:
    """Job state kept where the instance's own attributes do not show it: a mutable class
    attribute (``models: dict = {}`` then ``self.models[job_id] = ...`` fills the class's
    dict, shared by every instance) or a global of the plugin's own module. Only the
    plugin's own classes (its module's package, not a library base or ``object``) and only
    their data (not methods, properties, classes or modules) are walked."""
    cls = type(instance)
    package = cls.__module__.split(".")[0]
    for base in cls.__mro__:
        if base is object or base.__module__.split(".")[0] != package:
            continue
        found = _find_in_namespace(vars(base), f"{base.__name__}.", seen)
        if found is not None:
            return found
    module = sys.modules.get(cls.__module__)
    if module is None or package == "accelopt":
        return None
    return _find_in_namespace(vars(module), f"{module.__name__}.", seen)


_CODE = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type,
         types.ModuleType, property, staticmethod, classmethod)
"""What a namespace holds that is code, not state (a model is callable too: not in it)."""


def _find_in_namespace(names: Any, prefix: str, seen: set[int]) -> tuple[str, str] | None:
    """:func:`_find_job_state` over the data entries of a class's or a module's namespace."""
    for key, value in list(names.items()):
        if key.startswith("__") or isinstance(value, _CODE):
            continue
        found = _find_job_state(value, f"{prefix}{key}", RETENTION_DEPTH - 1, seen)
        if found is not None:
            return found
    return None


RETENTION_DEPTH = 8
"""How many references deep the retention check follows from the plugin object."""
RETENTION_NODES = 200_000
"""How many objects it visits at most (a plugin holding a large table of numbers)."""


class _Walk(set):  # type: ignore[type-arg]
    """The ids the retention check has visited, and the storages of the run's job tensors
    (:attr:`RunInstances.job_storages`, :attr:`RunInstances.grad_storages`) a plain tensor
    must not share."""

    def __init__(self, storages: dict[int, Any] | None = None,
                 grads: dict[int, Any] | None = None) -> None:
        super().__init__()
        self.storages = storages or {}
        self.grads = grads or {}


GRADIENT_KEPT = ("a job's gradient tensor (gradients[name] and p.grad are the job's live "
                 "gradient buffers, reused every iteration; keep a .clone() or a number such "
                 "as its norm)")
"""What the retention check says of a kept tensor sharing a job's gradient's storage."""


def _find_job_state(obj: Any, path: str, depth: int, seen: set[int]) -> tuple[str, str] | None:
    import torch

    if id(obj) in seen or len(seen) >= RETENTION_NODES:
        return None
    seen.add(id(obj))
    if isinstance(obj, torch.nn.Module):
        return path, f"a model/layer ({type(obj).__name__})"
    if isinstance(obj, torch.optim.Optimizer):
        return path, f"an optimizer ({type(obj).__name__})"
    if isinstance(obj, torch.Tensor):
        if isinstance(obj, torch.nn.Parameter) or obj.requires_grad:
            return path, "a job's parameter or autograd tensor"
        storages = getattr(seen, "storages", None)
        if storages and _storage_of(obj) in storages:
            return path, ("a tensor sharing its storage with a job's parameter or buffer "
                          "(p.data, p.detach() and model.state_dict() keep the job's weights "
                          "alive; keep a .clone())")
        grads = getattr(seen, "grads", None)
        if grads and _storage_of(obj) in grads:
            return path, GRADIENT_KEPT
        return None
    viewed = _viewed_tensor(obj)
    if viewed is not None:
        storages = getattr(seen, "storages", None)
        if storages and _storage_of(viewed) in storages:
            return path, (f"a {type(obj).__name__} viewing a job's parameter or buffer "
                          "(p.data.numpy() shares its memory and keeps the job's weights "
                          "alive; keep a .copy())")
        grads = getattr(seen, "grads", None)
        if grads and _storage_of(viewed) in grads:
            return path, (f"a {type(obj).__name__} viewing a job's gradient (p.grad.numpy() "
                          "shares the live gradient buffer's memory; keep a .copy())")
        return None
    if depth == 0 or isinstance(obj, (str, bytes, int, float, bool, type(None), type,
                                      types.ModuleType)):
        return None  # a class or a module it imported is shared code, not the plugin's state
    for key, child in _children(obj):
        found = _find_job_state(child, f"{path}{key}", depth - 1, seen)
        if found is not None:
            return found
    return None


def _viewed_tensor(obj: Any) -> Any:
    """The tensor a numpy array (``t.numpy()``, and a slice of it: ``.base`` chains) or a
    memoryview of one views, or None: such a view shares the tensor's memory and keeps it
    alive without being a tensor itself. Only the chain of bases is followed (cheap); an
    array or memoryview of anything else is the plugin's own data and is not walked."""
    import torch

    if type(obj).__name__ not in ("ndarray", "memoryview"):
        return None
    for _ in range(RETENTION_DEPTH):
        if isinstance(obj, memoryview):
            obj = obj.obj
        elif type(obj).__name__ == "ndarray" and type(obj).__module__ == "numpy":
            obj = getattr(obj, "base", None)
        else:
            break
        if isinstance(obj, torch.Tensor):
            return obj
        if obj is None:
            return None
    return None


def _key_text(key: Any) -> str:
    """A dict key as a path shows it: short values as written, others by their type (a
    tensor's repr is many lines)."""
    if isinstance(key, (str, int, float, bool, type(None))):
        text = repr(key)
        return text if len(text) <= 40 else text[:37] + "..."
    return f"<{type(key).__name__}>"


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    """What ``obj`` refers to, each with the path a user would write to reach it: the keys
    and items of a container (a deque too), an object's attributes and ``__slots__``, what
    a closure closed over, a bound method's object, a ``functools.partial``'s function and
    arguments."""
    if isinstance(obj, dict):
        for key, value in list(obj.items()):
            text = _key_text(key)
            yield f"<key {text}>", key  # a dict keyed by a model or by its parameters
            yield f"[{text}]", value
    elif isinstance(obj, functools.partial):
        yield ".func", obj.func
        yield ".args", obj.args
        yield ".keywords", obj.keywords
    elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
        for index, value in enumerate(list(obj)):
            yield f"[{index}]", value
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield f".{field.name}", getattr(obj, field.name, None)
    elif types.FunctionType is type(obj):  # a lambda or closure: what it closed over
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=False):
            with contextlib.suppress(ValueError):  # an empty cell
                yield f"<closure {name}>", cell.cell_contents
    elif isinstance(obj, types.MethodType):
        yield ".__self__", obj.__self__
    else:
        if hasattr(obj, "__dict__"):
            for key, value in list(vars(obj).items()):
                yield f".{key}", value
        for name in _slot_names(type(obj)):
            if hasattr(obj, name):
                yield f".{name}", getattr(obj, name)


def _slot_names(cls: type) -> list[str]:
    """Every ``__slots__`` name of ``cls`` and its bases."""
    names: list[str] = []
    for base in cls.__mro__:
        slots = base.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else [s for s in slots if s != "__dict__"]
    return names


# --- pytest base class ---------------------------------------------------------------------


class PluginConformance:
    """Subclass it in a test module, set ``spec``, and pytest runs one test per check.

    ``spec`` is the plugin's :class:`PluginSpec` (or the name of an installed plugin).
    ``workload``, ``overrides`` (Hydra overrides) and ``plugins`` (other plugins the run
    needs, names or specs) shape the run check; ``modes`` lists the cluster modes it runs in
    (``("none", "ps", "allreduce")`` checks every mode; every check runs in those modes
    only, the retention check in ``none`` only, skipped without it). Set
    ``check_retention = False`` if the plugin must keep job objects by design.
    """

    spec: ClassVar[PluginSpec | str]
    check_retention: ClassVar[bool] = True
    workload: ClassVar[str] = "tiny"
    overrides: ClassVar[Sequence[str]] = ()
    plugins: ClassVar[Sequence[PluginSpec | str]] = ()
    modes: ClassVar[Sequence[str]] = ("none",)

    def _spec(self) -> PluginSpec:
        spec = getattr(self, "spec", None)
        if isinstance(spec, str):
            return Registry.discover().get(spec)
        if spec is None:
            raise AssertionError(f"{type(self).__name__}: set the class attribute spec = PLUGIN")
        check_spec(spec)
        return spec

    def test_spec_is_described(self) -> None:
        check_spec(self._spec())

    def test_declarations_are_names(self) -> None:
        check_declarations(self._spec())

    def test_config_registers_with_hydra(self) -> None:
        check_config(self._spec())

    def test_hookimpls_match_hookspecs(self) -> None:
        check_hookimpls(self._spec())

    def _run(self, tmp_path: Path, mode: str) -> list[object]:
        return check_run(self._spec(), tmp_path / mode, self.workload,
                         overrides=self.overrides, plugins=self.plugins, mode=mode)

    def test_runs_workload_and_reports(self, tmp_path: Path) -> None:
        for mode in self.modes:
            self._run(tmp_path, mode)

    def test_transfer_hooks_run_in_a_cluster_mode(self) -> None:
        """A plugin's transfer hooks are called in a cluster run only: with ``modes``
        leaving every cluster mode out, the run check never calls them, and passing it
        says nothing of them. Skipped, naming them, so the summary shows it."""
        import pytest

        spec = self._spec()
        transfer = sorted({hook for _, _, hook in _hookimpls(spec, spec.instantiate())}
                          & hookspecs.TRANSFER_HOOKS)
        if transfer and not set(self.modes) - {"none"}:
            pytest.skip(f"plugin '{spec.name}': {', '.join(transfer)} run only in a cluster, "
                        "and modes has no cluster mode; add \"ps\" or \"allreduce\" to "
                        "modes to check them")

    def test_does_not_retain_job_state(self, tmp_path: Path) -> None:
        """Checked on a one-process run, the only mode whose plugin objects live in the
        test's process; skipped (saying so) when ``modes`` leaves that mode out, because a
        plugin may refuse it."""
        import pytest

        if not self.check_retention:
            return
        if "none" not in self.modes:
            pytest.skip("the retention check needs cluster.mode=none (the plugin objects of "
                        "a cluster run live in its rank processes), which modes leaves out")
        check_no_retained_job_state(self._spec(), self._run(tmp_path, "none"))
