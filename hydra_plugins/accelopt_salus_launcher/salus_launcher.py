"""``accelopt run -m <sweep> hydra/launcher=salus``: every run of the sweep is submitted to
one in-process salus execution service instead of running one after another.

Hydra only instantiates launchers defined inside the ``hydra_plugins`` namespace package, so
this module holds the class and its config; the work is in ``accelopt_plugins.salus.sweep``
(imported when a sweep launches, so Hydra's plugin scan at every start stays cheap).
"""

# No ``from __future__ import annotations``: Hydra's plugin scan executes this module
# outside sys.modules, where dataclasses cannot resolve string annotations.
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf


@dataclass
class SalusLauncherConf:
    """``hydra.launcher.*``: the shared execution's salus settings (used when the runs do
    not select salus themselves; if they do, their ``plugins.salus`` settings apply)."""

    _target_: str = "hydra_plugins.accelopt_salus_launcher.salus_launcher.SalusLauncher"
    policy: str = "pack"
    """A salus policy: pack (lanes side by side), srtf, fair, fifo, rr, las, dlas, ..."""
    max_lanes: int = -1
    """-1: one lane per core on a CPU, the policy's default on a GPU (pack: as many as fit);
    0: as many as fit."""
    threads: int = 0
    """Intra-op threads per lane (0: auto). 1 with run.threads=1 makes every run's weights
    bitwise those of the basic launcher."""


ConfigStore.instance().store(group="hydra/launcher", name="salus", node=SalusLauncherConf,
                             provider="accelopt")


class SalusLauncher(Launcher):
    """Packs a sweep onto one device (see ``accelopt_plugins.salus.sweep``)."""

    def __init__(self, policy: str = "pack", max_lanes: int = -1, threads: int = 0) -> None:
        super().__init__()
        self.policy, self.max_lanes, self.threads = policy, max_lanes, threads
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None
        self.task_function: Optional[TaskFunction] = None
        self.validated: Any = None
        """``accelopt_plugins.salus.sweep.ValidatedConfigs``: the sweeper's composed configs."""

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        from accelopt_plugins.salus.sweep import ValidatedConfigs

        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function
        self.validated = ValidatedConfigs(hydra_context.config_loader)

    def launch(self, job_overrides: Sequence[Sequence[str]],
               initial_job_idx: int) -> Sequence[JobReturn]:
        from accelopt_plugins.salus.plugin import settings_named
        from accelopt_plugins.salus.sweep import launch

        with settings_named(self.setting_names()):
            return launch(self, job_overrides, initial_job_idx)

    def setting_names(self) -> Any:
        """What the shared execution's salus calls its threads and lanes settings in its
        warnings: this launcher's (``hydra.launcher.threads``), unless the runs select salus
        themselves (``+plugins=[salus]``), whose settings are then the ones used. A packed
        sweep was told to lower ``plugins.salus.threads``, a key its command line never had."""
        from accelopt_plugins.salus.plugin import LAUNCHER_SETTINGS, RUN_SETTINGS

        own = self.config is not None and OmegaConf.select(self.config, "plugins.salus",
                                                           default=None) is not None
        return RUN_SETTINGS if own else LAUNCHER_SETTINGS

    def __repr__(self) -> str:  # Hydra logs the launcher
        return f"SalusLauncher(policy={self.policy!r})"


__all__: Any = ["SalusLauncher", "SalusLauncherConf"]
