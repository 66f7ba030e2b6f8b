"""The gpu_kernels hook implementations (placeholder while the modules land)."""

from __future__ import annotations

from typing import Any

from accelopt import ReportRow, RunInfo, hookimpl


class GpuKernelsPlugin:
    def __init__(self, config: Any) -> None:
        self.config = config

    @hookimpl
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        return [ReportRow("gpu_kernels", "nothing enabled")]
