"""accelopt: a small core runtime with hook points; optimisation techniques are plugins.

The public API for plugin authors is what this module exports; everything else may change.
"""

from __future__ import annotations

from accelopt.errors import AccelOptError, ConfigError, PluginHookError, UserError
from accelopt.hookspecs import hookimpl, hookspec
from accelopt.plugin import PluginSpec, Registry
from accelopt.types import (
    AllocationDecision,
    AllocationRequest,
    CliCommand,
    IterationContext,
    IterationResult,
    JobInfo,
    JobProfile,
    JobState,
    LayerOffer,
    ReportRow,
    RunInfo,
    TransferRecord,
)

__version__ = "0.1.0"

__all__ = [
    "AccelOptError",
    "AllocationDecision",
    "AllocationRequest",
    "CliCommand",
    "ConfigError",
    "IterationContext",
    "IterationResult",
    "JobInfo",
    "JobProfile",
    "JobState",
    "LayerOffer",
    "PluginHookError",
    "PluginSpec",
    "Registry",
    "ReportRow",
    "RunInfo",
    "TransferRecord",
    "UserError",
    "hookimpl",
    "hookspec",
]
