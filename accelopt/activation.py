"""Turn a composed run config into the active plugins of this process (a :class:`PluginSet`).

Used by the single-process run and by every process of a cluster run (plugin objects are
not shipped between processes; each process activates its own from the same config), and
once per selected set before anything runs, to validate it (``validate_selection``).

Scope (``PluginSpec.scope``) decides how many instances a process makes: a run-scoped plugin
has one, shared by every job; a job-scoped plugin one per job. Each job's events go through
the job's host, which holds the run-scoped instances and that job's own instances *in
activation order*, so chained hooks keep the command-line order whatever the scopes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from accelopt.errors import ConfigError, UserError, first_line
from accelopt.hookspecs import RUN_DECISION_HOOKS
from accelopt.host import HookTrace, PluginHost
from accelopt.plugin import PluginSpec, Registry, resolve


def selected_plugins(cfg: DictConfig) -> list[str]:
    """The plugins the user selected, in command-line order (``+plugins=[a,b]``)."""
    plugins = cfg.get("plugins") or {}
    return [str(name) for name in plugins.keys()]


def plugin_config(spec: PluginSpec, cfg: DictConfig | None) -> Any:
    """The plugin's own config as an instance of its dataclass (validated by OmegaConf)."""
    node = ((cfg.get("plugins") or {}) if cfg is not None else {}).get(spec.name)
    if node is None:
        return spec.default_config()
    try:
        merged = OmegaConf.merge(OmegaConf.structured(spec.config), node)
        return OmegaConf.to_object(merged)
    except Exception as exc:  # OmegaConf's validation errors carry the key
        key = getattr(exc, "full_key", None)
        first = first_line(exc) or type(exc).__name__
        raise ConfigError(f"plugins.{spec.name}{f'.{key}' if key else ''}: {first}") from None


class PluginSet:
    """The active plugins of one process: the run host (run-scoped plugins: allocation,
    scheduling, lifecycle) and, per job, the host every event of that job goes through."""

    def __init__(self, specs: Sequence[PluginSpec], cfg: DictConfig | None = None,
                 *, instances: dict[str, object] | None = None) -> None:
        self.specs = list(specs)
        self.names: tuple[str, ...] = tuple(s.name for s in self.specs)
        self.cfg = cfg
        self._configs = {s.name: plugin_config(s, cfg) for s in self.specs}
        given = instances or {}
        self._run_instances: dict[str, object] = {}
        for spec in self.specs:
            if spec.scope == "run":
                self._run_instances[spec.name] = given.get(spec.name) or self._make(spec)
        self.run = PluginHost([(s, self._run_instances[s.name]) for s in self.specs
                               if s.scope == "run"])
        self._own: dict[str, PluginHost] = {}
        self._all: dict[str, PluginHost] = {}
        self._trace: HookTrace | None = None

    @classmethod
    def of(cls, active: Iterable[tuple[PluginSpec, object]]) -> PluginSet:
        """A set from ready-made, already configured instances (services, benchmarks)."""
        pairs = list(active)
        return cls([s for s, _ in pairs], None, instances={s.name: i for s, i in pairs})

    def _make(self, spec: PluginSpec) -> object:
        config = self._configs[spec.name]
        instance = spec.instantiate(config)
        host = PluginHost([(spec, instance)])
        if spec.scope == "job":
            decisions = sorted(h for h in RUN_DECISION_HOOKS if host.implements(h))
            if decisions:
                raise UserError(
                    f"plugin '{spec.name}' declares scope='job' (one instance per job) but "
                    f"implements {', '.join(decisions)}, a decision across jobs; declare "
                    "scope='run' in its PluginSpec")
        if self.cfg is not None:
            # read-only while the plugin reads it: a change would silently take effect (a
            # job trained 2 iterations instead of 6, config.yaml recording 2); it now raises
            # in the plugin's hook, one line naming the plugin
            was = OmegaConf.is_readonly(self.cfg)
            OmegaConf.set_readonly(self.cfg, True)
            try:
                host.call_one(spec.name, "accelopt_configure", config=config,
                              run_config=self.cfg)
            finally:
                OmegaConf.set_readonly(self.cfg, was)
        return instance

    # -- hosts -------------------------------------------------------------------------------

    def add_job(self, job_id: str) -> PluginHost:
        """Make (and configure) the job-scoped instances of a job; return its host."""
        if job_id in self._all:
            return self._all[job_id]
        own = {s.name: self._make(s) for s in self.specs if s.scope == "job"}
        self._own[job_id] = PluginHost([(s, own[s.name]) for s in self.specs if s.name in own])
        pairs = [(s, own.get(s.name) or self._run_instances[s.name]) for s in self.specs]
        self._all[job_id] = host = PluginHost(pairs)
        host.trace = self._trace
        self._own[job_id].trace = self._trace
        return host

    def for_job(self, job_id: str) -> PluginHost:
        """Every plugin that sees ``job_id``'s layers, iterations and transfers."""
        return self._all.get(job_id) or self.add_job(job_id)

    def own(self, job_id: str) -> PluginHost:
        """The job-scoped instances of ``job_id`` only (for lifecycle calls)."""
        self.for_job(job_id)
        return self._own[job_id]

    def jobs(self) -> list[str]:
        return list(self._all)

    @property
    def job_scoped(self) -> list[str]:
        return [s.name for s in self.specs if s.scope == "job"]

    def set_trace(self, trace: HookTrace | None) -> None:
        """Time every hook call of every host into ``trace`` (a flat :data:`HookTrace`, read
        with :func:`~accelopt.host.traced_calls`: the run's ``hooks`` timeline track)."""
        self._trace = trace
        for host in [self.run, *self._own.values(), *self._all.values()]:
            host.trace = trace

    def hook_code(self) -> dict[object, str]:
        """:meth:`PluginHost.hook_code` over every host of this set (made so far)."""
        owners: dict[object, str] = {}
        for host in [self.run, *self._own.values(), *self._all.values()]:
            owners.update(host.hook_code())
        return owners

    def instances(self) -> list[object]:
        """Every plugin object of this process."""
        out = list(self._run_instances.values())
        for host in self._own.values():
            out += list(host.instances.values())
        return out


def as_plugin_set(plugins: PluginSet | PluginHost | None) -> PluginSet:
    """A :class:`PluginSet` from what a caller has: a set, a host of configured instances
    (services, benchmarks), or nothing (no plugins)."""
    if isinstance(plugins, PluginSet):
        return plugins
    if plugins is None:
        return PluginSet([])
    return PluginSet.of((plugins.specs[n], plugins.instances[n]) for n in plugins.names)


def activate(cfg: DictConfig, registry: Registry, job_ids: Sequence[str] = ()) -> PluginSet:
    """Resolve the selection, instantiate each plugin with its config and configure it
    (job-scoped plugins once per job of ``job_ids``)."""
    plugins = PluginSet(resolve(selected_plugins(cfg), registry), cfg)
    for job_id in job_ids:
        plugins.add_job(job_id)
    return plugins
