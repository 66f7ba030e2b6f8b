"""tictac: TIC/TAC ordering of parameter transfers (Hashemi et al., MLSys 2019)."""

from __future__ import annotations

from accelopt_plugins.tictac.config import TictacConfig

from accelopt import PluginSpec


def _factory(config: TictacConfig) -> object:
    from accelopt_plugins.tictac.plugin import TictacPlugin

    return TictacPlugin(config)


PLUGIN = PluginSpec(
    name="tictac",
    factory=_factory,
    config=TictacConfig,
    description="Orders parameter-server transfers with TicTac's TIC/TAC heuristics.",
    scope="job",
)
