"""salus: one execution service shares a device among many jobs (being built)."""

from __future__ import annotations

from dataclasses import dataclass

from accelopt import PluginSpec


@dataclass
class SalusConfig:
    """Placeholder config (replaced shortly)."""

    policy: str = "fifo"


class _Stub:
    def __init__(self, config: object) -> None:
        self.config = config


PLUGIN = PluginSpec(name="salus", factory=_Stub, config=SalusConfig, description="SALUS (WIP)")
