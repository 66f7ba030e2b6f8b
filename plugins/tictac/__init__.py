"""tictac: TIC/TAC ordering of parameter transfers (Hashemi et al., MLSys 2019)."""

from __future__ import annotations

from accelopt_plugins.tictac.config import TictacConfig

from accelopt import PluginSpec


def _factory(config: TictacConfig) -> object:
    from accelopt_plugins.tictac.plugin import TictacOff, TictacPlugin, TictacPriority

    # heuristic=off orders nothing and never plans: an instance without the transfer hooks,
    # so the transport does not call into the plugin for every transfer it moves; priority
    # also times its iterations (its credit window is measured)
    heuristic = getattr(config, "heuristic", "tac")
    if heuristic == "off":
        return TictacOff(config)
    return TictacPriority(config) if heuristic == "priority" else TictacPlugin(config)


PLUGIN = PluginSpec(
    name="tictac",
    factory=_factory,
    config=TictacConfig,
    description="Orders parameter-server transfers with TicTac's TIC/TAC heuristics.",
    scope="job",
)
