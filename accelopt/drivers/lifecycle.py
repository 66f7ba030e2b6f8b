"""The lifecycle of a run in one process, implemented once for every mode:

    configure (activation) -> build jobs (layer_build) -> job_built -> run_start
      -> [a driver runs the jobs] -> report_rows -> run_end

A one-process run walks it in the runtime; every rank of a cluster run walks it in its own
process, with its own plugin instances. Run-scoped plugins are called once with the
process's :class:`~accelopt.types.RunInfo`; each job-scoped instance is called with the same
record plus ``job`` set to the job it serves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from accelopt.activation import PluginSet
from accelopt.drivers.rows import merge_rows, of_plugins
from accelopt.host import PluginHost
from accelopt.job import Job
from accelopt.types import ReportRow, RunInfo


class Lifecycle:
    """Calls the lifecycle hooks of one process's plugins, in order."""

    def __init__(self, plugins: PluginSet, info: RunInfo) -> None:
        self.plugins = plugins
        self.info = info
        self.resumed_at: dict[str, int] = {}
        """Per job resumed from a checkpoint: the iteration it resumed at (:meth:`start`)."""

    def update(self, jobs: Sequence[Job]) -> None:
        """Refresh the jobs' records in :attr:`info` (parameter tables, profiles)."""
        self.info = dataclasses.replace(self.info, jobs=tuple(j.info for j in jobs))

    def _hosts(self) -> list[tuple[PluginHost, RunInfo]]:
        """The run host, then each job's own job-scoped instances with ``run.job`` set."""
        by_id = {j.job_id: j for j in self.info.jobs}
        out = [(self.plugins.run, self.info)]
        for job_id in self.plugins.jobs():
            host = self.plugins.own(job_id)
            if host.names and job_id in by_id:
                out.append((host, dataclasses.replace(self.info, job=by_id[job_id])))
        return out

    def job_built(self, jobs: Sequence[Job]) -> None:
        self.update(jobs)
        for job in jobs:
            if not self.plugins.for_job(job.info.job_id).implements("accelopt_job_built"):
                continue
            built = job.built()
            self.plugins.run.call("accelopt_job_built", run=self.info, job=built)
            own = self.plugins.own(job.info.job_id)
            own.call("accelopt_job_built", run=dataclasses.replace(self.info, job=job.info),
                     job=built)

    def start(self, jobs: Sequence[Job] = ()) -> None:
        """``run_start``, then each resumed job's plugin states (``accelopt_state_load``):
        after the plugins have set themselves up, before any iteration. ``jobs``' records
        are refreshed first: a resume moved their arrivals onto its own clock after
        ``job_built`` (``job/checkpoint.py``: ``arrive_on_resumed_clock``)."""
        if jobs:
            self.update(jobs)
        self.resumed_at = {job.info.job_id: job.iteration for job in jobs if job.iteration > 0}
        for host, info in self._hosts():
            host.call("accelopt_run_start", run=info)
        for job in jobs:
            job.restore_plugin_states()

    def rows(self) -> list[ReportRow]:
        """Every plugin's rows of this process; a job-scoped instance's tagged with its job's
        name (``metrics["job"]``). No placeholders yet: a cluster run adds them after merging
        the ranks (a rank may rightly say nothing)."""
        rows: list[ReportRow] = []
        for host, info in self._hosts():
            for answer in host.call("accelopt_report_rows", run=info) or []:
                for row in answer if isinstance(answer, list) else [answer]:
                    if info.job is not None:
                        row = dataclasses.replace(row, metrics={**row.metrics,
                                                                "job": info.job.name})
                    rows.append(self._since_resume(row, host, info))
        return rows

    def _since_resume(self, row: ReportRow, host: PluginHost, info: RunInfo) -> ReportRow:
        """``row`` of a resumed run, said to count from the resume where its plugin keeps no
        state in checkpoints (no ``accelopt_state_save``): its counters started at zero in
        this process, so its figures (iterations, rebuilds, calls) cover only the iterations
        after the resume, where the job's row covers the whole job; the two disagreed
        without a word. A job-scoped row is of its own job; a run-scoped one of every
        resumed job."""
        if info.job is not None:
            at = self.resumed_at.get(info.job.job_id)
            resumed = [] if at is None else [at]
        else:
            resumed = sorted(set(self.resumed_at.values()))
        if not resumed or "accelopt_state_save" in host.hooks_of(row.plugin):
            return row
        where = ", ".join(str(i) for i in resumed)
        return dataclasses.replace(
            row, summary=(f"{row.summary} [since the resume (at iteration {where}): "
                          f"{row.plugin} keeps no state in checkpoints "
                          "(accelopt_state_save), so its figures cover the resumed part only]"),
            metrics={**row.metrics, "since_resume_at": resumed[0]})

    def merged_rows(self) -> list[ReportRow]:
        """:meth:`rows`, with what several jobs' instances said alike collapsed into one."""
        names = [j.name for j in self.info.jobs]
        return merge_rows([self.rows()], names, [j.job_id for j in self.info.jobs],
                          only=of_plugins(self.plugins.job_scoped))

    def end(self, metrics: dict[str, Any]) -> None:
        for host, info in self._hosts():
            host.call("accelopt_run_end", run=info, metrics=metrics)
