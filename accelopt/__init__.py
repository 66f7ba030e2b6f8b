"""accelopt: a small core runtime with hook points; optimisation techniques are plugins.

The public API is what this module exports: :func:`run` (``accelopt run`` as a function,
``accelopt/api.py``) and the :class:`RunRecord` it returns, and, for plugin authors, the
hook and record types (plus :mod:`accelopt.types`, :mod:`accelopt.errors` and
:mod:`accelopt.testing`); everything else may change.
"""

from __future__ import annotations

from accelopt.errors import AccelOptError, ConfigError, PluginHookError, RankFailed, UserError
from accelopt.extensions import ExtensionPoint, extension_point
from accelopt.hookspecs import hookimpl, hookspec
from accelopt.plugin import PluginSpec, Registry
from accelopt.records import RunRecord
from accelopt.types import (
    AllocationDecision,
    AllocationRequest,
    BuiltJob,
    CliCommand,
    ClusterInfo,
    IterationContext,
    IterationResult,
    JobInfo,
    JobProfile,
    JobState,
    LayerOffer,
    OptimizerRebuild,
    ParamInfo,
    ReportRow,
    RunInfo,
    TransferPriorities,
    TransferRecord,
)

__version__ = "0.1.0"

_LAZY = {"Gradients": "accelopt.job.gradients", "isolated_rng": "accelopt.job.rng",
         "run": "accelopt.api", "attach": "accelopt.your_loop", "Attached": "accelopt.your_loop"}
"""Exports that need torch: imported on first use, so ``import accelopt`` (and the CLI's
``accelopt plugins``) stays fast."""


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'accelopt' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(module), name)


__all__ = [
    "attach",
    "Attached",
    "AccelOptError",
    "AllocationDecision",
    "AllocationRequest",
    "BuiltJob",
    "CliCommand",
    "ClusterInfo",
    "ConfigError",
    "ExtensionPoint",
    "Gradients",
    "IterationContext",
    "IterationResult",
    "JobInfo",
    "JobProfile",
    "JobState",
    "LayerOffer",
    "OptimizerRebuild",
    "ParamInfo",
    "PluginHookError",
    "PluginSpec",
    "RankFailed",
    "Registry",
    "ReportRow",
    "RunInfo",
    "RunRecord",
    "TransferPriorities",
    "TransferRecord",
    "UserError",
    "extension_point",
    "hookimpl",
    "hookspec",
    "isolated_rng",
    "run",
]
