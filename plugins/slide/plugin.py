"""Hook implementations of the slide plugin (being built)."""

from __future__ import annotations

from typing import Any

from accelopt import ReportRow, RunInfo, hookimpl


class SlidePlugin:
    """Placeholder while the layer lands."""

    def __init__(self, config: Any) -> None:
        self.config = config

    @hookimpl
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        return [ReportRow(plugin="slide", summary="slide is being built; nothing done")]
