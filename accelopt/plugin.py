"""Typed plugin records, discovery through entry points, and resolution of a selection.

A plugin package exposes one :class:`PluginSpec` object under the entry-point group
``accelopt.plugins``. The built-in plugins are found the same way, so nothing about living in
this repository is special. Discovery lists entry-point *names* without importing them; a
plugin's code is imported only when it is selected, listed or asked for CLI subcommands.
A broken entry point becomes a warning, never a crash of the whole tool.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import import_module
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from accelopt.errors import AccelOptError, PluginResolutionError, UserError
from accelopt.types import Scope

ENTRY_POINT_GROUP = "accelopt.plugins"
DISABLE_AUTOLOAD_ENV = "ACCELOPT_DISABLE_PLUGIN_AUTOLOAD"
EXPLICIT_PLUGINS_ENV = "ACCELOPT_PLUGINS"
SCOPES = ("run", "job")


class PluginWarning(RuntimeWarning):
    """A plugin that is installed or named but cannot be used (the ``accelopt`` command prints
    it as one line: the message is about the plugin, not about accelopt's source)."""


def one_line_for_plugins(plain: Callable[..., str]) -> Callable[..., str]:
    """``warnings.formatwarning`` that prints a :class:`~accelopt.plugin.PluginWarning` (a
    plugin that cannot be used) as ``warning: <message>``: it is about the plugin, so
    accelopt's file and source line would only mislead. Other warnings keep ``plain``.
    Installed by the ``accelopt`` command, and by each rank process of a cluster run
    (``drivers/cluster/launch.py``), where a plugin's warning is said too."""
    if getattr(plain, "one_line_for_plugins", False):  # main() called again in-process
        return plain

    def formatted(message: Warning | str, category: type[Warning], filename: str,
                  lineno: int, line: str | None = None) -> str:
        if issubclass(category, PluginWarning):
            return f"warning: {message}\n"
        return plain(message, category, filename, lineno, line)

    formatted.one_line_for_plugins = True  # type: ignore[attr-defined]
    return formatted


@dataclass
class NoConfig:
    """The config of a plugin that declares none (module level, so a spec can be pickled and
    sent to a cluster's rank processes)."""


@dataclass(frozen=True)
class PluginSpec:
    """Everything the core needs to know about a plugin, declared once by the plugin.

    ``factory`` builds the object whose ``@hookimpl`` methods implement the hooks, from an
    instance of ``config`` (a dataclass, registered in Hydra's ConfigStore under group
    ``plugins`` with package ``plugins.<name>``). ``before``/``after`` order it relative to
    other selected plugins, ``requires`` must also be selected, ``conflicts`` must not be,
    and at most one selected plugin may claim each of its exclusive ``slots`` (for example
    ``"scheduler"``).

    ``scope`` says how many instances a process makes: ``"run"`` (the default) builds one
    that sees every job; ``"job"`` builds one per job, which sees only that job's layers,
    iterations and transfers (``RunInfo.job`` names it). Declare ``"job"`` for state that
    belongs to one job (a transfer plan, error-feedback residuals); a job-scoped plugin cannot
    implement a decision across jobs (allocation, scheduling).
    """

    name: str
    factory: Callable[[Any], object]
    config: type | None = None
    description: str = ""
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()
    slots: tuple[str, ...] = ()
    scope: Scope = "run"

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"plugin name {self.name!r} must be a Python identifier")
        refusal = value_like_name(self.name)
        if refusal is not None:
            raise ValueError(refusal)
        if self.scope not in SCOPES:
            raise ValueError(f"plugin '{self.name}': scope must be one of {', '.join(SCOPES)}, "
                             f"got {self.scope!r}")
        if self.config is None:
            object.__setattr__(self, "config", NoConfig)
        if not dataclasses.is_dataclass(self.config):
            raise TypeError(f"plugin '{self.name}': config must be a dataclass type")
        for attr in ("before", "after", "requires", "conflicts", "slots"):
            object.__setattr__(self, attr, tuple(getattr(self, attr)))

    def default_config(self) -> Any:
        assert self.config is not None
        return self.config()

    def instantiate(self, config: Any | None = None) -> object:
        """The plugin object, built by ``factory``. A factory that raises is one line naming
        the plugin (a ``UserError`` keeps its class and exit code 2, and its message where it
        names the plugin already; anything else exits 1): a third party's bug must not
        surface as a traceback out of Hydra that names no plugin. An object saving state
        it cannot load back is refused here, when the plugin is selected (or listed, or
        checked by the conformance kit), not at the first resume
        (:func:`refuse_unpaired_state_hooks`)."""
        try:
            instance = self.factory(self.default_config() if config is None else config)
        except UserError as exc:  # refused a setting on purpose: its own class and exit code
            if not re.search(rf"\b{re.escape(self.name)}\b", str(exc)):
                exc.args = (f"plugin '{self.name}' could not be created: {exc}",)
            raise
        except Exception as exc:
            raise AccelOptError(f"plugin '{self.name}' could not be created: "
                                f"{type(exc).__name__}: {exc}") from exc
        refuse_unpaired_state_hooks(self.name, instance)
        return instance


STATE_SAVE = "accelopt_state_save"
STATE_LOAD = "accelopt_state_load"


@dataclass(frozen=True)
class HookMethod:
    """One routine of a plugin that implements a hook or is named like one: what the host
    registers, the conformance kit checks and the unmarked-method refusal reads, found by one
    scan (:func:`hook_methods`) so all three agree on what a hook implementation is."""

    attribute: str
    """Its name on the plugin's class (or module)."""
    hook: str
    """The hook it implements: its ``@hookimpl(specname=...)``, else its own name."""
    options: Mapping[str, Any] | None
    """The ``@hookimpl`` options; ``None`` where the routine carries no marker."""
    wrapped: bool
    """Defined as a ``staticmethod`` or ``classmethod`` (its marker may sit on either the
    wrapper or the function)."""

    @property
    def marked(self) -> bool:
        return self.options is not None


def hook_methods(plugin: object) -> list[HookMethod]:
    """Each routine of ``plugin`` (an object, module or class) marked ``@hookimpl`` or named
    ``accelopt_*``, read statically on the class of an object, never on the object: reading an
    object's ``__dict__`` makes CPython give it a real dictionary in place of its compact
    attribute values, and every ``self.x`` in its hooks gets slower (see
    ``accelopt.host._hook_table``)."""
    import inspect

    from accelopt.hookspecs import PROJECT

    marker = f"{PROJECT}_impl"
    owner = plugin if inspect.ismodule(plugin) or inspect.isclass(plugin) else type(plugin)
    found: list[HookMethod] = []
    for attr in dir(owner):
        value = inspect.getattr_static(owner, attr, None)
        wrapped = isinstance(value, (staticmethod, classmethod))
        function = value.__func__ if wrapped else value
        if not inspect.isroutine(function):
            continue
        options = getattr(value, marker, None)
        if not isinstance(options, dict):
            options = getattr(function, marker, None)
        if not isinstance(options, dict):
            options = None
        if options is None and not attr.startswith(f"{PROJECT}_"):
            continue
        found.append(HookMethod(attr, (options or {}).get("specname") or attr, options,
                                wrapped))
    return found


def implemented_hooks(instance: object) -> frozenset[str]:
    """The hooks ``instance`` (a plugin object, module or class) implements, by their
    ``@hookimpl`` marker (``specname`` honoured)."""
    return frozenset(method.hook for method in hook_methods(instance) if method.marked)


def refuse_unpaired_state_hooks(name: str, instance: object) -> None:
    """A plugin implementing ``accelopt_state_save`` without ``accelopt_state_load`` puts
    state in every checkpoint that nothing can hand back, so every resume of its runs would
    be refused: say so where the plugin is built, in one line, before a run spends hours
    writing checkpoints. (The other way round is harmless: a plugin that loads but never
    saves is never given any state, so it is not refused.)"""
    hooks = implemented_hooks(instance)
    if STATE_SAVE in hooks and STATE_LOAD not in hooks:
        raise PluginResolutionError(
            f"plugin '{name}' implements {STATE_SAVE} but not {STATE_LOAD}: its checkpoints "
            f"could never be resumed; add {STATE_LOAD}(self, job, state) restoring what "
            f"{STATE_SAVE} returns (or drop {STATE_SAVE})")


@dataclass
class Registry:
    """The plugins this process can use: entry points (imported lazily) plus specs added
    in code (tests, notebooks)."""

    entry_points: dict[str, EntryPoint] = field(default_factory=dict)
    loaded: dict[str, PluginSpec] = field(default_factory=dict)
    broken: dict[str, str] = field(default_factory=dict)
    added: dict[str, PluginSpec] = field(default_factory=dict)
    """Specs added in code (:meth:`add`), not found by discovery: a cluster run sends them to
    its rank processes, which discover only what is installed."""

    named: dict[str, str] = field(default_factory=dict)
    """name -> ``module:attr`` of the specs loaded from ``ACCELOPT_PLUGINS``."""

    failed_references: dict[str, str] = field(default_factory=dict)
    """``module:attr`` -> why, for the ``ACCELOPT_PLUGINS`` entries that did not load (a
    spec that never loaded has no name the registry could know it by)."""

    clashes: dict[str, str] = field(default_factory=dict)
    """name -> why it cannot be used: two installed packages declare it (which one is meant
    is not ours to guess, so neither is; the one line names both)."""

    value_named: dict[str, str] = field(default_factory=dict)
    """name -> why it cannot be used: an installed entry point whose name a selection reads
    as a value (:func:`value_like_name`). It is never imported nor offered as available, so
    the ``+plugins=[...]`` lines of ``accelopt matrix`` and ``accelopt bench`` stay valid for
    every other plugin; :meth:`all` says so once, and selecting it is this one line."""

    said: set[str] = field(default_factory=set, repr=False)
    """The names of :attr:`value_named` whose warning :meth:`all` gave already."""

    @classmethod
    def discover(cls, autoload: bool | None = None) -> Registry:
        """List installed plugins. ``autoload=False`` (or the environment variable
        ``ACCELOPT_DISABLE_PLUGIN_AUTOLOAD=1``) ignores entry points; plugins named in
        ``ACCELOPT_PLUGINS=module:attr,...`` are loaded either way."""
        if autoload is None:
            autoload = os.environ.get(DISABLE_AUTOLOAD_ENV, "") in ("", "0", "false")
        registry = cls()
        if autoload:
            for ep in entry_points(group=ENTRY_POINT_GROUP):
                registry._add_entry_point(ep)
        with warnings.catch_warnings():
            if another_process_warns():
                warnings.simplefilter("ignore", PluginWarning)
            for ref in filter(None, os.environ.get(EXPLICIT_PLUGINS_ENV, "").split(",")):
                registry._load_reference(ref.strip())
        return registry

    def _add_entry_point(self, ep: EntryPoint) -> None:
        """List one installed entry point. A name is one plugin: a package declaring the name
        of a built-in plugin is ignored and listed as broken (installing a package must not
        silently replace ``salus``), and a name two other packages declare is refused where
        it is used, in one line naming both. A name a selection reads as a value (``true``)
        is refused the same way: no selection could name it, and it would break every
        selection that lists it beside others."""
        reading = read_as_value(ep.name)
        if reading is not None:
            self.entry_points.setdefault(ep.name, ep)
            self.value_named[ep.name] = self.broken[ep.name] = (
                f"accelopt plugin '{ep.name}' ({declared_by(ep)}) cannot be used: its name is "
                f"{reading}; its package must rename its entry point and PluginSpec, e.g. to "
                f"'{ep.name.lower()}_plugin'")
            return
        taken = self.entry_points.get(ep.name)
        if taken is None:
            self.entry_points[ep.name] = ep
            return
        if taken.value == ep.value:  # the same entry point seen twice (a path listed twice)
            return
        if is_builtin(taken) or is_builtin(ep):
            keep, other = (taken, ep) if is_builtin(taken) else (ep, taken)
            self.entry_points[ep.name] = keep
            self.broken[f"{ep.name} ({declared_by(other)})"] = (
                f"declares the name of the built-in plugin '{ep.name}' "
                f"({declared_by(keep)}), which is kept; rename its entry point")
            return
        self.clashes[ep.name] = (
            f"plugin '{ep.name}' is declared by two installed packages ({declared_by(taken)}; "
            f"{declared_by(ep)}); uninstall one of them or rename its entry point")
        self.broken[ep.name] = self.clashes[ep.name]

    def source(self, name: str) -> str:
        """Where the plugin called ``name`` comes from, for listings and messages."""
        if name in self.named:
            return f"{self.named[name]} ({EXPLICIT_PLUGINS_ENV})"
        ep = self.entry_points.get(name)
        if ep is not None and name not in self.added:
            return declared_by(ep)
        return "added in code"

    def add(self, spec: PluginSpec) -> None:
        self.loaded[spec.name] = spec
        self.added[spec.name] = spec

    def names(self) -> list[str]:
        return sorted((set(self.entry_points) | set(self.loaded)) - set(self.broken))

    def get(self, name: str) -> PluginSpec:
        if name in self.loaded:
            return self.loaded[name]
        if name in self.clashes:
            raise PluginResolutionError(self.clashes[name])
        if name in self.value_named:
            raise PluginResolutionError(self.value_named[name])
        if name in self.entry_points and name not in self.broken:
            spec = self._load_entry_point(self.entry_points[name])
            if spec is not None:
                return spec
        installed_but_broken = self.broken.get(name) if name in self.entry_points else None
        if installed_but_broken is None:
            self._try_every_entry_point()  # the list offered must be what can be selected
        raise unknown_plugin_error(name, self.names(), installed_but_broken,
                                   self.failed_references, sorted(self.clashes))

    def _try_every_entry_point(self) -> None:
        """Load every installed plugin not loaded yet, quietly (its failure is its listing's
        business, not this error's): an unknown name's line listed, as available, installed
        plugins whose import fails, which are then refused when picked."""
        said = set(self.said)  # quiet here: a later listing still says them
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PluginWarning)
            self.all()
        self.said = said

    def all(self) -> list[PluginSpec]:
        """Import every installed plugin (broken ones become warnings; one whose name is
        read as a value is not imported, said once)."""
        for name in sorted(set(self.value_named) - self.said):
            self.said.add(name)
            warnings.warn(self.value_named[name], PluginWarning, stacklevel=2)
        for name in sorted(self.entry_points):
            if name not in self.loaded and name not in self.broken:
                self._load_entry_point(self.entry_points[name])
        return [self.loaded[n] for n in sorted(self.loaded)]

    def _load_entry_point(self, ep: EntryPoint) -> PluginSpec | None:
        try:
            spec = ep.load()
            _check_spec(spec, f"entry point '{ep.name} = {ep.value}'")
            if spec.name != ep.name:
                raise TypeError(f"declares name '{spec.name}' but is registered as '{ep.name}'; "
                                "give its entry point and its PluginSpec the same name")
        except Exception as exc:  # a third party's bug must not take the tool down
            reason = f"{type(exc).__name__}: {exc}"
            self.broken[ep.name] = reason
            warnings.warn(
                f"accelopt plugin '{ep.name}' ({ep.value}) could not be loaded and is "
                f"skipped: {reason}",
                PluginWarning,
                stacklevel=2,
            )
            return None
        self.loaded[spec.name] = spec
        return spec

    def _load_reference(self, ref: str) -> None:
        module, _, attr = ref.partition(":")
        try:
            spec = getattr(import_module(module), attr or "PLUGIN")
            _check_spec(spec, ref)
        except Exception as exc:
            self.broken[ref] = self.failed_references[ref] = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"{EXPLICIT_PLUGINS_ENV}: cannot load {ref!r}: {self.broken[ref]}",
                          PluginWarning, stacklevel=2)
            return
        if self._is_installed(spec):  # the guide's ACCELOPT_PLUGINS after `pip install -e .`
            return
        if spec.name in self.entry_points or spec.name in self.named:
            # a name is one plugin: an explicit spec never replaces an installed one
            self.broken[ref] = (f"its plugin name '{spec.name}' is taken by "
                                f"{self.source(spec.name)}; give the PluginSpec another name")
            warnings.warn(f"{EXPLICIT_PLUGINS_ENV}: {ref!r} is ignored: {self.broken[ref]}",
                          PluginWarning, stacklevel=2)
            return
        self.loaded[spec.name] = spec
        self.named[spec.name] = ref

    def _is_installed(self, spec: PluginSpec) -> bool:
        """Whether ``spec`` is the very object already known under its name: an entry
        point naming it (its module imported already, by the reference that found it) or
        an earlier ``ACCELOPT_PLUGINS`` entry. Naming it again changes nothing, so it is not
        a second plugin taking the name."""
        if self.loaded.get(spec.name) is spec:
            return True
        ep = self.entry_points.get(spec.name)
        if ep is None or spec.name in self.broken:
            return False
        target: Any = sys.modules.get(ep.module)  # not imported: not the spec found
        for part in filter(None, (ep.attr or "").split(".")):
            target = getattr(target, part, None)
        return target is not None and target is spec


def another_process_warns(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a rank of a cluster run whose ``ACCELOPT_PLUGINS`` warnings
    another process gives, so that a bad entry is said once per run, not once per process:
    a rank the local launcher started (``RANK`` set, and a multiprocessing child: the
    launcher, which read the same variable, said it), or a torchrun rank other than rank 0
    (no launcher reads the variable there; rank 0 says it). The entries' failures are still
    recorded in every process, so selecting a plugin that failed to load is refused there
    in one line all the same."""
    env = os.environ if env is None else env
    rank = env.get("RANK")
    if not rank:
        return False
    import multiprocessing

    return rank != "0" or multiprocessing.parent_process() is not None


BUILTIN_DISTRIBUTION = "accelopt"
"""The distribution whose entry points are the built-in plugins."""


def is_builtin(ep: EntryPoint) -> bool:
    """Whether ``ep`` is one of accelopt's own plugins (declared by accelopt's package)."""
    dist = getattr(ep, "dist", None)
    return dist is not None and dist.name.lower().replace("_", "-") == BUILTIN_DISTRIBUTION


def declared_by(ep: EntryPoint) -> str:
    """``module:attr (built-in)`` or ``module:attr (package NAME)``: who declared ``ep``."""
    dist = getattr(ep, "dist", None)
    owner = "built-in" if is_builtin(ep) else (
        f"package {dist.name}" if dist is not None else "an installed package")
    return f"{ep.value} ({owner})"


VALUE_WORDS: dict[str, tuple[str, str]] = {
    **dict.fromkeys(("true", "false", "null", "inf", "nan"),
                    ("Hydra's override grammar", "+plugins=[{name}]")),
    **dict.fromkeys(("yes", "no", "on", "off"), ("YAML", "an experiment's '- /plugins: [{name}]'")),
}
"""Words read as a value, not a name (any case), by whom, and where: Hydra's override grammar
reads ``+plugins=[true]`` as ``[True]`` (true, false, null, inf, nan), and YAML reads an
experiment's defaults list ``- /plugins: [on]`` as ``[True]`` (yes, no, on, off)."""


def value_like_name(name: str) -> str | None:
    """The one-line refusal of a plugin name that a selection of it would read as a value
    (``None`` for any other name): ``+plugins=[true]`` selects ``True``, which no plugin is,
    and the ``+plugins=[...]`` overrides that ``accelopt matrix`` and ``accelopt bench`` write
    fail for every plugin beside it. The one check for a new package (``accelopt
    new-plugin``) and a :class:`PluginSpec`; an installed entry point is refused by
    :func:`read_as_value` too."""
    reading = read_as_value(name)
    if reading is None:
        return None
    return f"plugin name {name!r} is {reading}; choose another, e.g. '{name.lower()}_plugin'"


def read_as_value(name: str) -> str | None:
    """Who reads ``name`` as a value instead of a plugin name, and where (``None``: nobody)."""
    found = VALUE_WORDS.get(name.lower())
    if found is None:
        return None
    reader, where = found
    return (f"read by {reader} as a value, not as a name ({where.format(name=name)} selects "
            "no plugin)")


def _check_spec(spec: object, where: str) -> None:
    if not isinstance(spec, PluginSpec):
        raise TypeError(f"{where} must point to an accelopt.PluginSpec, got {type(spec).__name__}")


def unknown_plugin_error(
    name: str, installed: Sequence[str], broken_reason: str | None = None,
    failed: dict[str, str] | None = None, clashing: Sequence[str] = (),
) -> PluginResolutionError:
    """The one line for a name no usable plugin has: installed but broken, an
    ``ACCELOPT_PLUGINS`` entry that failed to load (the one whose module or attribute is
    named like it, else every one that failed is listed), or unknown with the closest name;
    ``clashing``: names two installed packages declare (not selectable, said apart)."""
    if broken_reason:
        return PluginResolutionError(
            f"plugin '{name}' is installed but failed to load ({broken_reason}); "
            "fix or reinstall its package, or remove it from +plugins"
        )
    failed = failed or {}
    like = [ref for ref in failed if name.lower() in ref.lower()]
    if like:
        return PluginResolutionError(
            f"plugin '{name}' is not available: {EXPLICIT_PLUGINS_ENV} entry '{like[0]}' "
            f"failed to load ({failed[like[0]]}); fix that entry or remove it from +plugins")
    close = difflib.get_close_matches(name, installed, n=1)
    hint = f"; did you mean '{close[0]}'? Run" if close else "; run"
    listing = ", ".join(installed) if installed else "none"
    also = "".join(f" ({EXPLICIT_PLUGINS_ENV} entry '{ref}' failed to load: {why})"
                   for ref, why in failed.items())
    if clashing:
        also += (f" (declared by two installed packages, so not selectable: "
                 f"{', '.join(clashing)}; `accelopt plugins` says which)")
    return PluginResolutionError(
        f"unknown plugin '{name}' (available: {listing}){hint} `accelopt plugins` to list "
        f"them.{also}"
    )


def resolve(selected: Sequence[str], registry: Registry) -> list[PluginSpec]:
    """Turn a user's selection into the activation order, or raise one clear error.

    Order: command-line order, then the declared ``before``/``after`` constraints (a stable
    topological sort: among plugins free to go next, the one named first goes first).
    """
    seen: set[str] = set()
    for name in selected:
        if name in seen:
            raise PluginResolutionError(f"plugin '{name}' is selected twice; list it once")
        seen.add(name)
    specs = {name: registry.get(name) for name in selected}
    _check_requirements(specs, registry)
    _check_conflicts(specs)
    _check_slots(specs)
    return _order(list(selected), specs)


def _check_requirements(specs: dict[str, PluginSpec], registry: Registry) -> None:
    """A required plugin that is not selected: the fix is to select it where it is
    installed, else to install it (selecting it would only be refused as unknown)."""
    for spec in specs.values():
        for need in spec.requires:
            if need in specs:
                continue
            if need not in registry.names():
                broken = registry.broken.get(need)
                state = (f"which is installed but failed to load ({broken})" if broken
                         else "which is not installed")
                raise PluginResolutionError(
                    f"plugin '{spec.name}' requires plugin '{need}', {state}; install it "
                    f"(`accelopt plugins` lists what is), or remove '{spec.name}' from +plugins"
                )
            wanted = ",".join([*specs, need])
            raise PluginResolutionError(
                f"plugin '{spec.name}' requires plugin '{need}', which is not selected; "
                f"select both: +plugins=[{wanted}]"
            )


def _check_conflicts(specs: dict[str, PluginSpec]) -> None:
    for spec in specs.values():
        for other in spec.conflicts:
            if other in specs:
                raise PluginResolutionError(
                    f"plugins '{spec.name}' and '{other}' conflict ('{spec.name}' declares it); "
                    "select only one of them"
                )


def _check_slots(specs: dict[str, PluginSpec]) -> None:
    holder: dict[str, str] = {}
    for spec in specs.values():
        for slot in spec.slots:
            if slot in holder:
                raise PluginResolutionError(
                    f"plugins '{holder[slot]}' and '{spec.name}' both fill the exclusive slot "
                    f"'{slot}'; select only one of them"
                )
            holder[slot] = spec.name


def _order(selected: list[str], specs: dict[str, PluginSpec]) -> list[PluginSpec]:
    after: dict[str, set[str]] = {name: set() for name in selected}  # name -> must come after
    for spec in specs.values():
        for other in spec.before:
            if other in after:
                after[other].add(spec.name)
        for other in spec.after:
            if other in after:
                after[spec.name].add(other)
    ordered: list[str] = []
    remaining = list(selected)
    while remaining:
        ready = [n for n in remaining if not (after[n] - set(ordered))]
        if not ready:
            raise PluginResolutionError(
                "plugins "
                + ", ".join(f"'{n}'" for n in remaining)
                + " declare before/after constraints that form a cycle; "
                "remove one of them from +plugins"
            )
        ordered.append(ready[0])
        remaining.remove(ready[0])
    return [specs[n] for n in ordered]


def valid_combinations(specs: Iterable[PluginSpec], max_size: int | None = None) -> list[list[str]]:
    """Every selection of the given plugins that :func:`resolve` accepts, smallest first,
    each in resolved order (for CI matrices and ablation sweeps)."""
    from itertools import combinations

    pool = {s.name: s for s in specs}
    registry = Registry(loaded=dict(pool))
    names = sorted(pool)
    limit = len(names) if max_size is None else min(max_size, len(names))
    out: list[list[str]] = []
    for size in range(limit + 1):
        for combo in combinations(names, size):
            try:
                out.append([s.name for s in resolve(list(combo), registry)])
            except PluginResolutionError:
                continue
    return out
