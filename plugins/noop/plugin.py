"""The no-op hook implementations (see the package docstring)."""

from __future__ import annotations

from collections import Counter
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
    """Answers every hook with "no opinion" and, optionally, counts the calls."""

    def __init__(self, config: Any) -> None:
        self.record = bool(getattr(config, "record", True))
        self.calls: Counter[str] = Counter()

    def _count(self, hook: str) -> None:
        if self.record:
            self.calls[hook] += 1

    @hookimpl
    def accelopt_configure(self, config: Any, run_config: Any) -> None:
        self._count("accelopt_configure")

    @hookimpl
    def accelopt_job_built(self, run: RunInfo, job: BuiltJob) -> None:
        self._count("accelopt_job_built")

    @hookimpl
    def accelopt_run_start(self, run: RunInfo) -> None:
        self._count("accelopt_run_start")

    @hookimpl
    def accelopt_run_end(self, run: RunInfo, metrics: dict[str, Any]) -> None:
        self._count("accelopt_run_end")

    @hookimpl
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        total = sum(self.calls.values())
        return [
            ReportRow(
                plugin="noop",
                summary=f"answered {total} hook calls with no opinion (changes nothing)",
                metrics=dict(self.calls),
            )
        ]

    @hookimpl
    def accelopt_cli_commands(self) -> Sequence[CliCommand]:
        return []

    @hookimpl
    def accelopt_allocate(self, request: AllocationRequest) -> AllocationDecision | None:
        self._count("accelopt_allocate")
        return None

    @hookimpl
    def accelopt_release(self, job: JobInfo, lane: str, status: str) -> None:
        self._count("accelopt_release")

    @hookimpl
    def accelopt_select_next(
        self, lane: str, ready: Sequence[JobState], now_s: float
    ) -> str | None:
        self._count("accelopt_select_next")
        return None

    @hookimpl
    def accelopt_iteration_start(self, context: IterationContext) -> None:
        self._count("accelopt_iteration_start")

    @hookimpl
    def accelopt_after_forward(self, context: IterationContext, loss: Any) -> Any | None:
        self._count("accelopt_after_forward")
        return None

    @hookimpl
    def accelopt_before_optimizer_step(self, context: IterationContext, gradients: Any) -> None:
        self._count("accelopt_before_optimizer_step")

    @hookimpl
    def accelopt_after_step(self, context: IterationContext,
                            stepped: bool) -> OptimizerRebuild | None:
        self._count("accelopt_after_step")
        return None

    @hookimpl
    def accelopt_iteration_end(self, context: IterationContext, result: IterationResult) -> None:
        self._count("accelopt_iteration_end")

    @hookimpl
    def accelopt_optimizer_build(self, job: JobInfo, optimizer: Any, parameters: Any,
                                 previous: Any) -> Any | None:
        self._count("accelopt_optimizer_build")
        return None

    @hookimpl
    def accelopt_state_save(self, job: JobInfo) -> dict[str, Any] | None:
        self._count("accelopt_state_save")
        return None

    @hookimpl
    def accelopt_state_load(self, job: JobInfo, state: dict[str, Any]) -> None:
        self._count("accelopt_state_load")

    @hookimpl
    def accelopt_transfer_order(
        self, transfers: Sequence[TransferRecord], destination: int
    ) -> Sequence[str] | None:
        self._count("accelopt_transfer_order")
        return None

    @hookimpl
    def accelopt_transfer_encode(self, record: TransferRecord, payload: Any) -> Any | None:
        self._count("accelopt_transfer_encode")
        return None

    @hookimpl
    def accelopt_transfer_decode(self, record: TransferRecord, payload: Any) -> Any | None:
        self._count("accelopt_transfer_decode")
        return None

    @hookimpl
    def accelopt_transfer_filter(self, record: TransferRecord) -> bool | None:
        self._count("accelopt_transfer_filter")
        return None

    @hookimpl
    def accelopt_transfer_done(self, record: TransferRecord, start_s: float, end_s: float) -> None:
        self._count("accelopt_transfer_done")

    @hookimpl
    def accelopt_layer_build(self, layer: LayerOffer) -> Any | None:
        self._count("accelopt_layer_build")
        return None
