"""gradcomm plugin (being built): PLUGIN is exposed first so the registry does not warn."""

from __future__ import annotations

from accelopt import PluginSpec


class _Placeholder:
    def __init__(self, config: object) -> None:
        self.config = config


PLUGIN = PluginSpec(name="gradcomm", factory=_Placeholder, description="(being built)")
