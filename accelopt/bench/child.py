"""The sweep process of ``accelopt bench``: ``accelopt run -m``, plus per-set plugin settings.

A Hydra sweep is a cartesian product: an override such as ``plugins.gpu_kernels.prune_amount=0.5``
applies to every run, and composing it fails for a set that does not select ``gpu_kernels``
(there is no ``plugins.gpu_kernels`` node to override). The bench therefore passes plugin
settings force-added (``++plugins.NAME.key=value``): for a set that selects the plugin this
overrides its typed node as usual; for a set that does not, it leaves a stray untyped
``plugins.NAME`` entry, which this wrapper removes before the run executes, using the run's
own ``+plugins=[...]`` override (Hydra records it in ``hydra.overrides.task``) as the truth of
which plugins the run selects. Everything else is ``accelopt run`` unchanged.

Usage (the bench builds this line): ``python -m accelopt.bench.child -m OVERRIDES...``.
"""

from __future__ import annotations

import sys
from typing import Any

from omegaconf import DictConfig, open_dict


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


def _patched_execute(original: Any) -> Any:
    def execute(cfg: DictConfig, **kwargs: Any) -> Any:
        from hydra.core.hydra_config import HydraConfig

        selected = selection_from_task_overrides(list(HydraConfig.get().overrides.task))
        drop_unselected(cfg, selected or [])
        return original(cfg, **kwargs)

    return execute


def main(argv: list[str] | None = None) -> None:
    import accelopt.runtime.run as run_module
    from accelopt.cli.main import main as cli_main

    run_module.execute = _patched_execute(run_module.execute)
    cli_main(["run", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
