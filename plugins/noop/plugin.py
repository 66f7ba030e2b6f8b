"""The no-op hook implementations (see the package docstring)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from accelopt import hookimpl
from accelopt.types import (
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


class NoopPlugin:
    """Answers every hook with "no opinion" and counts the calls per hook (one increment in
    place: what the overhead benchmark measures is the hook path, not this plugin's own
    work); ``record`` decides whether the counts go into its report row."""

    def __init__(self, config: Any) -> None:
        self.record = bool(getattr(config, "record", True))
        self.calls: dict[str, int] = dict.fromkeys(
            (name for name in dir(type(self)) if name.startswith("accelopt_")), 0)
        """Calls per hook (a plain dict, filled up front: an increment is the cheapest work
        a plugin can do)."""

    @hookimpl
    def accelopt_configure(self, config: Any, run_config: Any) -> None:
        self.calls["accelopt_configure"] += 1

    @hookimpl
    def accelopt_job_built(self, run: RunInfo, job: BuiltJob) -> None:
        self.calls["accelopt_job_built"] += 1

    @hookimpl
    def accelopt_run_start(self, run: RunInfo) -> None:
        self.calls["accelopt_run_start"] += 1

    @hookimpl
    def accelopt_run_end(self, run: RunInfo, metrics: dict[str, Any]) -> None:
        self.calls["accelopt_run_end"] += 1

    @hookimpl
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        total = sum(self.calls.values())
        return [
            ReportRow(
                plugin="noop",
                summary=f"answered {total} hook calls with no opinion (changes nothing)",
                metrics={h: n for h, n in self.calls.items() if n} if self.record else {},
            )
        ]

    @hookimpl
    def accelopt_cli_commands(self) -> Sequence[CliCommand]:
        return []

    @hookimpl
    def accelopt_allocate(self, request: AllocationRequest) -> AllocationDecision | None:
        self.calls["accelopt_allocate"] += 1
        return None

    @hookimpl
    def accelopt_release(self, job: JobInfo, lane: str, status: str) -> None:
        self.calls["accelopt_release"] += 1

    @hookimpl
    def accelopt_select_next(
        self, lane: str, ready: Sequence[JobState], now_s: float
    ) -> str | None:
        self.calls["accelopt_select_next"] += 1
        return None

    @hookimpl
    def accelopt_iteration_start(self, context: IterationContext) -> None:
        self.calls["accelopt_iteration_start"] += 1

    @hookimpl
    def accelopt_after_forward(self, context: IterationContext, loss: Any) -> Any | None:
        self.calls["accelopt_after_forward"] += 1
        return None

    @hookimpl
    def accelopt_before_optimizer_step(self, context: IterationContext, gradients: Any) -> None:
        self.calls["accelopt_before_optimizer_step"] += 1

    @hookimpl
    def accelopt_after_step(self, context: IterationContext,
                            stepped: bool) -> OptimizerRebuild | None:
        self.calls["accelopt_after_step"] += 1
        return None

    @hookimpl
    def accelopt_iteration_end(self, context: IterationContext, result: IterationResult) -> None:
        self.calls["accelopt_iteration_end"] += 1

    @hookimpl
    def accelopt_optimizer_build(self, job: JobInfo, optimizer: Any, parameters: Any,
                                 previous: Any) -> Any | None:
        self.calls["accelopt_optimizer_build"] += 1
        return None

    @hookimpl
    def accelopt_state_save(self, job: JobInfo) -> dict[str, Any] | None:
        self.calls["accelopt_state_save"] += 1
        return None

    @hookimpl
    def accelopt_state_load(self, job: JobInfo, state: dict[str, Any]) -> None:
        self.calls["accelopt_state_load"] += 1

    @hookimpl
    def accelopt_transfer_order(
        self, transfers: Sequence[TransferRecord], destination: int
    ) -> Sequence[str] | None:
        self.calls["accelopt_transfer_order"] += 1
        return None

    @hookimpl
    def accelopt_transfer_encode(self, record: TransferRecord, payload: Any) -> Any | None:
        self.calls["accelopt_transfer_encode"] += 1
        return None

    @hookimpl
    def accelopt_transfer_decode(self, record: TransferRecord, payload: Any) -> Any | None:
        self.calls["accelopt_transfer_decode"] += 1
        return None

    @hookimpl
    def accelopt_transfer_filter(self, record: TransferRecord) -> bool | None:
        self.calls["accelopt_transfer_filter"] += 1
        return None

    @hookimpl
    def accelopt_transfer_done(self, record: TransferRecord, start_s: float, end_s: float) -> None:
        self.calls["accelopt_transfer_done"] += 1

    @hookimpl
    def accelopt_layer_build(self, layer: LayerOffer) -> Any | None:
        self.calls["accelopt_layer_build"] += 1
        return None
