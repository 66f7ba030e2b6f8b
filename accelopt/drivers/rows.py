"""Report rows: collected once per process (``drivers/lifecycle.py``), then merged.

Within a process, a job-scoped plugin answers once per job; its rows are tagged with the
job's name (``metrics["job"]``) and rows that say the same for several jobs, in words and in
numbers, collapse into one naming them. Across the ranks of a cluster run, a job-scoped
plugin's rows are kept from every rank (a server's plan and a worker's view differ); a
run-scoped plugin runs once per rank and would repeat itself, so its rows come from one rank,
and otherwise as it returned them, as in a one-process run: its own keys (a ``"job"`` of its
own too) are never rewritten and its distinct rows never collapsed. A plugin that answered
nothing anywhere gets a row saying so; the plugins' rows are in selection order in every mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from accelopt.types import INERT, ReportRow

SILENT_SUMMARY = "active, but reported nothing about what it did"


def with_placeholders(rows: list[ReportRow], plugins: Sequence[str]) -> list[ReportRow]:
    """Every active plugin gets a line: its own, or one saying it reported nothing; the
    plugins in ``plugins``' order (the selection's), each plugin's rows in the order they
    came. Why sorted here: rows are collected host by host (the run's, then each job's) and,
    in a cluster run, rank by rank (a plugin that reports on the server before one that
    reports on a worker), so their order of arrival differs by mode; the table must not."""
    reported = {row.plugin for row in rows}
    position = {name: i for i, name in enumerate(plugins)}
    every = rows + [ReportRow(plugin=name, summary=SILENT_SUMMARY)
                    for name in plugins if name not in reported]
    return sorted(every, key=lambda row: position.get(row.plugin, len(position)))


def stopped_report(plugins: Sequence[str], plugin: str, line: str) -> list[ReportRow]:
    """The rows of a run whose report stopped at ``plugin``'s ``accelopt_report_rows`` (it
    raised, or its answer was refused: ``line``, the run's error). That plugin's row gives
    the reason; the other plugins' rows were not collected, and their rows say so: a
    placeholder saying a plugin "reported nothing" would misstate both."""
    return [ReportRow(name, f"report refused: {line}", {"refused": 1}) if name == plugin
            else ReportRow(name, "report not collected: the run stopped at the refused "
                                 f"report of plugin '{plugin}'")
            for name in plugins]


def representative_rows(rows_by_rank: list[list[ReportRow]], roles: list[str],
                        per_job: Callable[[ReportRow], bool]) -> list[list[ReportRow]]:
    """Keep one rank's view of each run-level plugin's rows (``rows_by_rank[i]``: rank i's).

    Job-scoped plugins (``per_job(row)`` is true: tictac, gradcomm) act on each job;
    every rank's rows of them are kept (a server's plan and a worker's view differ).
    Run-level plugins (gpu_kernels, offload, salus) run once per rank and would repeat
    themselves on every rank, with a parameter server saying "nothing to do" because it never
    runs forward. Their rows are taken from the first worker that reported the plugin, else
    from the first rank that did (salus reports on the leader only). Where another rank's
    rows of the plugin differ (offload's bytes of its share of the batch, a measured
    speed-up, a server that failed where the workers did not), the kept rows say whose they
    are: one rank's figures must not read as the job's. A non-worker's rows that only say
    the plugin had nothing to do there (every one marked ``INERT``: a server never runs
    forward) are no disagreement. A worker that reported nothing does not agree either: the
    kept rows say so, unless the plugin reported on the leader (rank 0) alone, as salus,
    which decides there, does by design. Whether the plugin changed nothing is decided over
    every rank's rows, not the kept ones: kept rows marked ``INERT`` lose the mark, and say
    on which ranks it acted, where another rank's rows are not inert (a PS server applies
    the optimizer step its workers never take), so every reader of the mark
    (``runtime/compare.is_inert``) sees the run's verdict."""
    order = sorted(range(len(rows_by_rank)), key=lambda i: roles[i] != "worker")
    source: dict[str, int] = {}
    for i in order:
        for row in rows_by_rank[i]:
            if not per_job(row):
                source.setdefault(row.plugin, i)

    def run_level(i: int, plugin: str) -> list[ReportRow]:
        return [r for r in rows_by_rank[i] if r.plugin == plugin and not per_job(r)]

    notes = {plugin: note for plugin, i in source.items()
             if (note := _disagreement(plugin, i, roles, run_level))}
    active = {plugin: ranks for plugin in source
              if (ranks := _active_ranks(plugin, len(rows_by_rank), run_level))}

    def kept(row: ReportRow, i: int) -> ReportRow:
        if row.plugin not in notes:
            return row
        metrics = {**row.metrics, "rank": i}
        note = notes[row.plugin]
        if row.metrics.get(INERT) and active.get(row.plugin):
            metrics.pop(INERT)  # inert here only: the plugin acted on another rank
            ranks = active[row.plugin]
            note += (f"; active on rank{'s' if len(ranks) > 1 else ''} "
                     f"{', '.join(map(str, ranks))}")
        return dataclasses.replace(row, summary=f"{row.summary} (rank {i}'s; {note})",
                                   metrics=metrics)

    return [[r if per_job(r) else kept(r, i) for r in rows
             if per_job(r) or source.get(r.plugin) == i]
            for i, rows in enumerate(rows_by_rank)]


def _active_ranks(plugin: str, world: int,
                  run_level: Callable[[int, str], list[ReportRow]]) -> list[int]:
    """The ranks whose rows of ``plugin`` do not all say ``INERT`` (it acted there). The
    plugin is inert in the run only where no rank is listed (``docs/plugin-guide.md``: every
    row of its own says so): a worker's "changed nothing" kept beside a server's "scaled every
    gradient" made the run's comparison and the bench call the server's effect noise."""
    return [k for k in range(world)
            if (rows := run_level(k, plugin)) and not all(r.metrics.get(INERT) for r in rows)]


def _disagreement(plugin: str, kept: int, roles: list[str],
                  run_level: Callable[[int, str], list[ReportRow]]) -> str:
    """What the other ranks said about ``plugin`` where it is not what rank ``kept`` said:
    "other workers' rows differ" (only workers), "other ranks' rows differ" (a server too),
    "rank 2 reported nothing"; ``""`` where they agree."""
    mine = run_level(kept, plugin)
    differ: list[int] = []
    silent: list[int] = []
    reporters = [k for k in range(len(roles)) if run_level(k, plugin)]
    # decided on the leader and said there (salus), or done where the optimizer steps and said
    # by the servers (a PS worker takes no step: clip): workers with nothing to say are silent
    leader_only = reporters == [0] or all(roles[k] == "server" for k in reporters)
    for k in range(len(roles)):
        theirs = run_level(k, plugin)
        if k == kept:
            continue
        if not theirs:
            if roles[k] == "worker" and not leader_only:
                silent.append(k)
            continue
        if roles[k] != "worker" and all(r.metrics.get(INERT) for r in theirs):
            continue  # a server with nothing to do: not a disagreement
        if theirs != mine:
            differ.append(k)
    parts = []
    if differ:
        who = "workers'" if all(roles[k] == "worker" for k in differ) else "ranks'"
        parts.append(f"other {who} rows differ")
    if silent:
        parts.append(f"rank{'s' if len(silent) > 1 else ''} "
                     f"{', '.join(map(str, silent))} reported nothing")
    return "; ".join(parts)


def of_plugins(names: Sequence[str]) -> Callable[[ReportRow], bool]:
    """``per_job`` for :func:`representative_rows`: the rows of the job-scoped plugins."""
    wanted = frozenset(names)
    return lambda row: row.plugin in wanted


def merge_rows(rows_by_rank: list[list[ReportRow]], job_names: list[str],
               job_ids: list[str] | None = None,
               only: Callable[[ReportRow], bool] | None = None) -> list[ReportRow]:
    """One row per (plugin, summary, metrics): per-job rows (tagged ``metrics["job"]``, with
    the job's name or its id: run-level plugins such as gpu_kernels tag rows with job ids)
    that say the same for several jobs, in words and in numbers, collapse into one row naming
    them ("all jobs" when every job), in its summary and in ``metrics["job"]`` (the names,
    comma-separated, so a program reading ``metrics.json`` needs no parsing). Rows whose words agree but whose numbers differ stay
    apart, each naming its jobs: a merged row shows one row's metrics, and must not pass one
    job's figures off as every job's.
    ``only``: merge just the rows it accepts; the others are kept as they are, in place. Every
    run passes the job-scoped plugins' rows (:func:`of_plugins`): only their ``"job"`` tag is
    the core's; a run-scoped plugin's ``"job"`` key is its own, and stays."""
    name_of = dict(zip(job_ids or [], job_names, strict=False))

    def rank_of(job: str) -> int:
        return job_names.index(job) if job in job_names else len(job_names)

    groups: dict[tuple[str, str, str], list[Any]] = {}
    order: list[tuple[str, str, str]] = []
    for rows in rows_by_rank:
        for row in rows:
            if only is not None and not only(row):
                key = (row.plugin, f"\0{len(order)}", "")  # kept as it is, in place
                groups[key] = [row, []]
                order.append(key)
                continue
            job = row.metrics.get("job") if row.metrics else None
            summary = row.summary
            for named in (job, name_of.get(job)) if job is not None else ():
                if named and summary.startswith(f"{named}: "):  # by id or by name: the
                    summary = summary[len(named) + 2:]  # merged row names its jobs once
                    break
            key = (row.plugin, summary, _numbers(row.metrics))
            if key not in groups:
                groups[key] = [dataclasses.replace(row, summary=summary), []]
                order.append(key)
            job = name_of.get(job, job) if job is not None else None
            if job is not None and job not in groups[key][1]:
                groups[key][1].append(job)
    out = []
    for key in order:
        row, jobs = groups[key]
        if jobs:
            metrics = {**{k: v for k, v in row.metrics.items() if k != "job"},
                       "job": ", ".join(sorted(jobs, key=rank_of))}  # readable by a program
            if len(job_names) > 1:  # a run of one job needs no "job X:" prefix
                who = ("all jobs" if len(jobs) == len(job_names)
                       else "job " + ", ".join(sorted(jobs, key=rank_of)))
                row = ReportRow(row.plugin, f"{who}: {row.summary}", metrics)
            else:
                row = ReportRow(row.plugin, row.summary, metrics)
        out.append(row)
    return out


def _numbers(metrics: dict[str, Any] | None) -> str:
    """A row's metrics less its job tag, as a key: rows merge only where these are equal."""
    return repr(sorted((k, repr(v)) for k, v in (metrics or {}).items() if k != "job"))
