"""The no-op hook implementations (see the package docstring)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from accelopt import hookimpl
from accelopt.types import (
    INERT,
    AllocationDecision,
    AllocationRequest,
    BuiltJob,
    CliCommand,
    IterationContext,
    IterationResult,
    JobInfo,
    JobState,
    LayerOffer,
    OptimizerRebuild,
    ReportRow,
    RunInfo,
    TransferRecord,
)


def _counter(hook: str) -> str:
    """The attribute counting the calls of ``hook``: ``n_iteration_start`` for
    ``accelopt_iteration_start``."""
    return "n_" + hook.removeprefix("accelopt_")


class NoopPlugin:
    """Answers every hook with "no opinion" and counts the calls per hook (one increment of
    an attribute: what the overhead benchmark measures is the hook path, not this plugin's
    own work); ``record`` decides whether the counts go into its report row."""

    def __init__(self, config: Any) -> None:
        self.record = bool(getattr(config, "record", True))
        for hook in HOOKS:  # an attribute per hook, set up front: `self.n_x += 1` is the
            setattr(self, _counter(hook), 0)  # cheapest increment Python has (no dict lookup)

    @property
    def calls(self) -> dict[str, int]:
        """Calls per hook, by hook name."""
        return {hook: getattr(self, _counter(hook)) for hook in HOOKS}

    @hookimpl
    def accelopt_configure(self, config: Any, run_config: Any) -> None:
        self.n_configure += 1

    @hookimpl
    def accelopt_job_built(self, run: RunInfo, job: BuiltJob) -> None:
        self.n_job_built += 1

    @hookimpl
    def accelopt_run_start(self, run: RunInfo) -> None:
        self.n_run_start += 1

    @hookimpl
    def accelopt_run_end(self, run: RunInfo, metrics: dict[str, Any]) -> None:
        self.n_run_end += 1

    @hookimpl
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        total = sum(self.calls.values())
        return [
            ReportRow(
                plugin="noop",
                summary=f"answered {total} hook calls with no opinion (changes nothing)",
                # changes nothing: run.compare calls a difference noise, not its gain
                metrics={**({h: n for h, n in self.calls.items() if n} if self.record else {}),
                         INERT: 1},
            )
        ]

    @hookimpl
    def accelopt_cli_commands(self) -> Sequence[CliCommand]:
        return []

    @hookimpl
    def accelopt_allocate(self, request: AllocationRequest) -> AllocationDecision | None:
        self.n_allocate += 1
        return None

    @hookimpl
    def accelopt_release(self, job: JobInfo, lane: str, status: str) -> None:
        self.n_release += 1

    @hookimpl
    def accelopt_select_next(
        self, lane: str, ready: Sequence[JobState], now_s: float
    ) -> str | None:
        self.n_select_next += 1
        return None

    @hookimpl
    def accelopt_iteration_start(self, context: IterationContext) -> None:
        self.n_iteration_start += 1

    @hookimpl
    def accelopt_after_forward(self, context: IterationContext, loss: Any) -> Any | None:
        self.n_after_forward += 1
        return None

    @hookimpl
    def accelopt_before_optimizer_step(self, context: IterationContext, gradients: Any) -> None:
        self.n_before_optimizer_step += 1

    @hookimpl
    def accelopt_after_step(self, context: IterationContext,
                            stepped: bool) -> OptimizerRebuild | None:
        self.n_after_step += 1
        return None

    @hookimpl
    def accelopt_iteration_end(self, context: IterationContext, result: IterationResult) -> None:
        self.n_iteration_end += 1

    @hookimpl
    def accelopt_optimizer_build(self, job: JobInfo, optimizer: Any, parameters: Any,
                                 previous: Any) -> Any | None:
        self.n_optimizer_build += 1
        return None

    @hookimpl
    def accelopt_state_save(self, job: JobInfo) -> dict[str, Any] | None:
        self.n_state_save += 1
        return None

    @hookimpl
    def accelopt_state_load(self, job: JobInfo, state: dict[str, Any]) -> None:
        self.n_state_load += 1

    @hookimpl
    def accelopt_transfer_order(
        self, transfers: Sequence[TransferRecord], destination: int
    ) -> Sequence[str] | None:
        self.n_transfer_order += 1
        return None

    @hookimpl
    def accelopt_transfer_encode(self, record: TransferRecord, payload: Any) -> Any | None:
        self.n_transfer_encode += 1
        return None

    @hookimpl
    def accelopt_transfer_decode(self, record: TransferRecord, payload: Any) -> Any | None:
        self.n_transfer_decode += 1
        return None

    @hookimpl
    def accelopt_transfer_filter(self, record: TransferRecord) -> bool | None:
        self.n_transfer_filter += 1
        return None

    @hookimpl
    def accelopt_transfer_done(self, record: TransferRecord, start_s: float, end_s: float) -> None:
        self.n_transfer_done += 1

    @hookimpl
    def accelopt_layer_build(self, layer: LayerOffer) -> Any | None:
        self.n_layer_build += 1
        return None


HOOKS = tuple(name for name in dir(NoopPlugin) if name.startswith("accelopt_"))
"""Every hook the plugin implements (all of them)."""
