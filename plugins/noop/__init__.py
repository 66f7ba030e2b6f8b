"""noop: implements every hook and changes nothing.

It exists to measure the cost of the hook machinery itself (``benchmarks/overhead.py``) and
to prove every hook point is reachable (the conformance suite runs it).
"""

from __future__ import annotations

from dataclasses import dataclass

from accelopt_plugins.noop.plugin import NoopPlugin

from accelopt import PluginSpec


@dataclass
class NoopConfig:
    """``record: true`` puts the calls per hook into the report row's metrics (shown in the
    summary and metrics.json)."""

    record: bool = True


PLUGIN = PluginSpec(
    name="noop",
    factory=NoopPlugin,
    config=NoopConfig,
    description="Implements every hook and changes nothing (measures hook overhead).",
)
