"""Turn a composed run config into the active plugins of this process.

Used by the single-process run and by every process of a cluster run (plugin objects are
not shipped between processes; each process activates its own from the same config).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from accelopt.errors import ConfigError
from accelopt.host import PluginHost
from accelopt.plugin import PluginSpec, Registry, resolve


def selected_plugins(cfg: DictConfig) -> list[str]:
    """The plugins the user selected, in command-line order (``+plugins=[a,b]``)."""
    plugins = cfg.get("plugins") or {}
    return [str(name) for name in plugins.keys()]


def plugin_config(spec: PluginSpec, cfg: DictConfig) -> Any:
    """The plugin's own config as an instance of its dataclass (validated by OmegaConf)."""
    node = (cfg.get("plugins") or {}).get(spec.name)
    if node is None:
        return spec.default_config()
    try:
        merged = OmegaConf.merge(OmegaConf.structured(spec.config), node)
        return OmegaConf.to_object(merged)
    except Exception as exc:  # OmegaConf's validation errors carry the key
        raise ConfigError(f"plugins.{spec.name}: {exc}".splitlines()[0]) from None


def activate(cfg: DictConfig, registry: Registry) -> PluginHost:
    """Resolve the selection, instantiate each plugin with its config and configure it."""
    specs = resolve(selected_plugins(cfg), registry)
    active = []
    configs = {}
    for spec in specs:
        config = plugin_config(spec, cfg)
        configs[spec.name] = config
        active.append((spec, spec.instantiate(config)))
    host = PluginHost(active)
    for spec, instance in active:
        configure = getattr(instance, "accelopt_configure", None)
        if configure is not None:
            host.call_one(spec.name, "accelopt_configure", config=configs[spec.name], run_config=cfg)
    return host
