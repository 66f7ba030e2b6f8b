"""Whether a plugin changed nothing is decided over every rank's rows, not the one rank's
rows shown; ``run.compare`` compares times over the jobs every compared run finished."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from accelopt import PluginSpec, ReportRow, hookimpl
from accelopt.drivers.rows import merge_rows, representative_rows
from accelopt.records import JobInfo, JobResult, RunInfo, RunRecord
from accelopt.runtime.compare import BASELINE, COMPARED, attach, inert_plugins, table
from accelopt.types import INERT

ONE_JOB = ["workload.jobs=[{name: m, model: mlp, width: 8, batch_size: 8, iterations: 2}]",
           "cluster.timeout_s=30"]


@dataclass
class ScaleConfig:
    factor: float = 0.5
    """multiply the gradients by this before each optimizer step"""


class ScalesGradients:
    """Scales the gradients where the optimizer steps (a PS server); its row is inert only
    on a rank where it scaled nothing (a PS worker takes no optimizer step)."""

    def __init__(self, config: ScaleConfig) -> None:
        self.config = config
        self.scaled = 0
        self.rank = 0

    @hookimpl
    def accelopt_run_start(self, run: Any) -> None:
        self.rank = run.rank

    @hookimpl
    def accelopt_before_optimizer_step(self, context: Any, gradients: Any) -> None:
        gradients.scale_(self.config.factor)
        self.scaled += 1

    @hookimpl
    def accelopt_report_rows(self, run: Any) -> list[ReportRow]:
        metrics: dict[str, Any] = {"scaled": self.scaled, **({INERT: 1} if not self.scaled else {})}
        return [ReportRow("scales", f"rank {self.rank}: scaled {self.scaled}", metrics)]


SCALES = PluginSpec(name="scales", factory=ScalesGradients, config=ScaleConfig,
                    description="scales gradients on the optimizer's rank (test)")


def _shown(ranks: list[list[ReportRow]], roles: list[str]) -> list[ReportRow]:
    kept = representative_rows(ranks, roles, lambda row: False)
    return merge_rows(kept, ["a"], ["00-a"], only=lambda row: False)


def test_a_plugin_acting_on_the_server_only_is_not_inert_by_a_workers_row() -> None:
    """The kept row is the lowest worker's, which scaled nothing (inert), while the server
    scaled every step: the run read as "changed nothing" in run.compare, bench and sweeps."""
    server = [ReportRow("p", "scaled 10", {"scaled": 10})]
    idle = [ReportRow("p", "scaled 0", {"scaled": 0, INERT: 1})]
    rows = _shown([server, idle, idle], ["server", "worker", "worker"])
    (row,) = rows
    assert row.summary == "scaled 0 (rank 1's; other ranks' rows differ; active on rank 0)"
    assert INERT not in row.metrics and row.metrics["rank"] == 1
    assert inert_plugins(["p"], rows) == []
    # inert on every rank: still inert
    assert inert_plugins(["p"], _shown([idle, idle, idle], ["server", "worker", "worker"])) \
        == ["p"]
    # another worker acted: not inert either
    busy = [ReportRow("p", "scaled 3", {"scaled": 3})]
    rows = _shown([idle, idle, busy], ["server", "worker", "worker"])
    assert inert_plugins(["p"], rows) == []
    assert rows[0].summary.endswith("active on rank 2)")


@pytest.mark.timeout(180)
def test_a_ps_run_whose_plugin_scaled_on_the_server_is_not_called_inert(run_tiny,
                                                                         tmp_path: Path) -> None:
    from accelopt.bench.runner import inert_in_run

    record = run_tiny(SCALES, overrides=[*ONE_JOB, "cluster.mode=ps", "run.compare=baseline"])
    own = [r for r in record.plugin_rows if r.plugin == "scales" and not r.metrics.get(COMPARED)]
    assert own and "active on rank 0" in own[0].summary
    assert inert_plugins(["scales"], record.plugin_rows) == []
    (gain,) = [r for r in record.plugin_rows if r.metrics.get(COMPARED)]
    assert INERT not in gain.metrics and "changed nothing" not in gain.summary
    (metrics,) = [p for p in tmp_path.rglob("metrics.json") if "compare" not in p.parts]
    assert inert_in_run(json.loads(metrics.read_text())) == set()  # accelopt bench's verdict


def _run(plugins: tuple[str, ...], ends: dict[str, float | None]) -> RunRecord:
    """Jobs arriving at 0, each done at its end time, or rejected where it is ``None``."""
    jobs = []
    for k, (name, end) in enumerate(ends.items()):
        info = JobInfo(f"j{k}", name, "mlp", "train", 0.0, 10, 8, None)
        jobs.append(JobResult(info, "rejected", error="does not fit") if end is None else
                    JobResult(info, "done", "default", "", 0.0, 0.0, end, 10, end, 80, 1.0,
                              [1.0]))
    return RunRecord(info=RunInfo("r", "cpu", plugins, tuple(j.job for j in jobs), 0),
                     duration_s=1.0, jobs=jobs)


def test_times_are_compared_over_the_jobs_every_run_finished() -> None:
    """salus rejected the slow job the baseline ran: avg JCT read 2.00 -> 1.00 (2.00x), a
    mean over three jobs beside a mean over two, where over the same two it is 1.00x."""
    base = _run((), {"a": 1.0, "b": 1.0, "slow": 4.0})
    mine = _run(("salus",), {"a": 1.0, "b": 1.0, "slow": None})
    out = table(mine, {BASELINE: base})
    caption = str(out.caption)
    assert "times are compared over the jobs every run finished: a, b" in caption
    assert "over different jobs" not in caption
    attach(mine, {BASELINE: base})
    (gain,) = [r for r in mine.plugin_rows if r.metrics.get(COMPARED)]
    assert "avg JCT s 1.000 -> 1.000 (1.00x)" in gain.summary
    assert "makespan s 1.000 -> 1.000 (1.00x)" in gain.summary
    assert "[times are compared over the jobs every run finished: a, b]" in gain.summary
    assert gain.metrics["together.avg_jct_s.gain"] == pytest.approx(1.0)
    assert mine.metrics["compare.baseline.avg_jct_s"] == pytest.approx(1.0)
    # the same jobs finished: each run's own figures, nothing said
    same = _run(("salus",), {"a": 0.5, "b": 1.0, "slow": 4.0})
    assert table(same, {BASELINE: base}).caption is None
    attach(same, {BASELINE: base})
    (gain,) = [r for r in same.plugin_rows if r.metrics.get(COMPARED)]
    assert "avg JCT s 2.000 -> 1.833" in gain.summary and "times are" not in gain.summary
