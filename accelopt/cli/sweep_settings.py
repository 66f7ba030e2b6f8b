"""Plugin settings in a sweep over plugin sets: each reaches the points that select its plugin.

A Hydra sweep is a cartesian product: ``accelopt run -m '+plugins=[],[gscale]'
plugins.gscale.factor=0.5`` gives the setting to every point, and composing it fails for
the point that does not select ``gscale`` (there is no ``plugins.gscale`` node to set), so
the documented CI recipe (a matrix of sets, the same overrides for every run) failed as soon
as it set a plugin's option. Such a setting is therefore force-added
(``++plugins.NAME.key=value``): for a point that selects the plugin it sets its typed node
as usual (type-checked); for one that does not, it leaves a stray untyped ``plugins.NAME``
entry, which :func:`drop_unselected` removes before that point runs, using the point's own
``+plugins=[...]`` override (Hydra records it in ``hydra.overrides.task``) as the truth of
which plugins it selects. A setting of a plugin that no point selects is still refused.
``accelopt bench`` passes its per-plugin settings the same way.
"""

from __future__ import annotations

from omegaconf import DictConfig, open_dict

PLUGIN_SETTING = "plugins."


def force_settings_of_swept_plugins(overrides: list[str],
                                    selections: list[list[str]]) -> list[str]:
    """``overrides`` with each ``plugins.NAME.key=value`` force-added (``++``) where NAME is
    selected by some of ``selections`` (the sweep's plugin sets) but not by all."""
    if len(selections) < 2:
        return overrides
    some = {name for names in selections for name in names}
    every = set.intersection(*(set(names) for names in selections))
    out = []
    for override in overrides:
        name = override[len(PLUGIN_SETTING):].split(".", 1)[0]
        if override.startswith(PLUGIN_SETTING) and "=" in override and name in some - every:
            override = f"++{override}"
        out.append(override)
    return out


def selection_from_task_overrides(task_overrides: list[str]) -> list[str] | None:
    """The plugin names of the ``+plugins=[...]`` override among a run's task overrides."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(task_overrides))
    for override in parsed:
        if override.key_or_group == "plugins":
            value = override.value()
            return [str(n) for n in (value if isinstance(value, list) else [value])]
    return None


def drop_unselected(cfg: DictConfig, selected: list[str]) -> list[str]:
    """Remove ``plugins.NAME`` entries of plugins the run does not select; return their names."""
    stray = [name for name in list(cfg.plugins.keys()) if str(name) not in selected]
    if stray:
        with open_dict(cfg):
            for name in stray:
                del cfg.plugins[name]
    return [str(n) for n in stray]
