"""The end-of-run summary printed to the terminal.

Reads the same dicts as ``metrics.json`` (:mod:`accelopt.report.metrics`) so the terminal
and the file never disagree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from accelopt.records import CANNOT_SCORE, JobResult, RunRecord
from accelopt.report.metrics import job_metrics, run_metrics
from accelopt.types import ReportRow

_MIB = 2**20
_STATUS_STYLE = {"done": "green", "failed": "bold red", "rejected": "red", "pending": "yellow"}


def fmt(value: Any, digits: int = 2) -> str:
    """Numbers to short text; ``None`` (not measured) as an en dash rather than ``0``."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _mib(value: float | None, digits: int = 1) -> str:
    return fmt(None if value is None else value / _MIB, digits)


def _loss(value: float | None, losses: list[float]) -> str:
    """The final loss: ``nan`` where the last recorded loss is not finite (it travels as
    ``None`` in JSON; a job whose last batch had no labelled point has one without having
    diverged), ``–`` where none was recorded."""
    if value is None:
        last = losses[-1] if losses else 0.0
        return "nan" if last is None or not math.isfinite(last) else "–"
    return f"{value:.4g}"


def _jobs_table(record: RunRecord) -> Table:
    table = Table(title="Jobs", title_justify="left", expand=False, pad_edge=False)
    table.add_column("job", overflow="fold", min_width=6, max_width=16)
    table.add_column("model", overflow="fold", max_width=12)
    table.add_column("status")
    table.add_column("lane", overflow="fold", max_width=10)
    for header in ("iters", "JCT s", "queue s", "samples/s", "pers MiB", "eph MiB", "loss"):
        table.add_column(header, justify="right")
    table.add_column("held-out", justify="right", no_wrap=True)  # "acc 0.930" stays one line
    for result in record.jobs:
        m = job_metrics(result)
        style = _STATUS_STYLE.get(m["status"], "")
        table.add_row(
            escape(m["name"]),
            escape(m["model"]),
            f"[{style}]{m['status']}[/]" if style else m["status"],
            escape(m["lane"]) or "–",
            f"{m['iterations']}/{result.job.iterations}",
            fmt(m["jct_s"]),
            fmt(m["queueing_s"]),
            fmt(m["throughput"], 1),
            _mib(m["persistent_bytes"]),
            _mib(m["ephemeral_bytes"]),
            _loss(m["final_loss"], result.losses),
            quality_text(m),
        )
    return table


QUALITY_LABEL = {"accuracy": "acc", "p_at_1": "P@1", "perplexity": "ppl"}


def quality_text(m: dict[str, Any]) -> str:
    """``acc 0.934`` / ``P@1 0.412``: the trained model on the held-out set (``–``: not
    scored; metrics.json's ``quality_note`` says why)."""
    if m.get("quality") is None:
        return "–"
    digits = 1 if m["quality_metric"] == "perplexity" else 3
    text = f"{QUALITY_LABEL.get(m['quality_metric'], m['quality_metric'])} {m['quality']:.{digits}f}"
    if m.get("quality_p_at_5") is not None:
        text += f" P@5 {m['quality_p_at_5']:.3f}"
    return text


def _errors(record: RunRecord) -> list[str]:
    """Errors, jobs that trained on a diverged loss, and notes on a score (a model's output
    wider than the dataset's classes) go below the table: they are long and would wreck its
    column widths."""
    return [
        f"[bold red]{r.status}[/] {escape(r.job.name)}: {escape(r.error)}"
        for r in record.jobs
        if r.error
    ] + [
        f"[bold yellow]diverged[/] {escape(diverged_text(r))}; not scored"
        for r in record.jobs
        if not r.error and r.diverged_at is not None
    ] + [
        # its quality's note, and where some losses were not finite without a divergence
        # (a skipped step), that too (score_result adds it to quality_note)
        f"[bold yellow]note[/] {escape(r.job.name)}: {escape(r.quality_note)}"
        for r in record.jobs
        if r.quality is not None and r.quality_note
    ] + [
        # not scored for a reason of its own (evaluate: false, no held-out set): the losses
        # that were not finite are still said
        f"[bold yellow]note[/] {escape(r.job.name)}: {escape(r.nonfinite_note)}"
        for r in record.jobs
        if r.quality is None and r.status == "done" and r.nonfinite_note
        and not r.quality_note.startswith(CANNOT_SCORE)
    ] + [
        # a trained job whose held-out score failed: its "–" read like a job with no
        # held-out set, and a plugin that changed its numerics looked like a pure speed-up
        f"[bold yellow]note[/] {escape(r.job.name)}: not scored, {escape(r.quality_note)}; "
        "its quality is unknown (a plugin's effect on it cannot be judged)"
        for r in record.jobs
        if r.quality is None and r.quality_note.startswith(CANNOT_SCORE)
    ]


def diverged_text(result: JobResult) -> str:
    """A diverged job in words, with the likely causes: a first loss that is not finite
    comes before any update, so no learning rate explains it (nan or inf in the data or
    the initial weights, or a plugin's change); a later one is the usual too-large step, a
    later batch's nan or inf, or a plugin; weights that are not finite after finite losses
    are the last step's gradient, for the same reasons."""
    first = result.diverged_at or 0  # an index: loss 1 is the first
    where = f"{result.job.name}: {result.diverged_where}"
    if first == 0 and result.losses:
        return (f"{where} (the first, before any update: nan or inf in the data or the "
                "initial weights, or a plugin's change)")
    return f"{where} (a learning rate too high, nan or inf in the data, or a plugin's change?)"


def _run_line(record: RunRecord) -> str:
    s = run_metrics(record)
    profiling = (f" (of which {fmt(s['profiling_s'])} s profiling the jobs' memory, before "
                 "the first arrival)" if s.get("profiling_s") else "")
    diverged = f" ({s['n_diverged']} diverged)" if s["n_diverged"] else ""
    rejected = f", {s['n_rejected']} rejected" if s["n_rejected"] else ""
    return (
        f"[bold]Run:[/] {s['n_done']}/{s['n_jobs']} done{diverged}, "
        f"{s['n_failed']} failed{rejected}  "
        f"avg JCT {fmt(s['avg_jct_s'])} s  p95 JCT {fmt(s['p95_jct_s'])} s  "
        f"makespan {fmt(s['makespan_s'])} s  duration {fmt(s['duration_s'])} s{profiling}"
        "\n[dim]  JCT: a job's arrival to its last iteration's end; queue: arrival to its first "
        "iteration's start (waiting for the device, a lane, or the jobs before it); makespan: "
        "first arrival to last end; duration: the run's wall time (a cluster's process "
        "start-up included)[/dim]"
    )


WALL_NOTE = ("it/s (wall): the iterations after the warm-up over their wall time (several "
             "jobs: over the time some job was past its warm-up); ")
"""The throughput note (``wall_iterations_per_s``, ``drivers/cluster/outcome.py``); a run
without that figure shows one over the median iteration, labelled so."""


def _cluster_line(record: RunRecord) -> str | None:
    """Communication/computation figures of a cluster run (medians over iterations after the
    warm-up; E < 0 means the iteration took longer than communication plus computation)."""
    m = record.metrics
    if "cluster_mode" not in m:
        return None
    # the steady iterations over their wall time (one over the median iteration overstates
    # it when an early update overlaps iterations, and over several jobs it is close to the
    # fastest job's rate)
    wall = m.get("wall_iterations_per_s")
    rate = (f"{fmt(wall)} it/s (wall)" if wall is not None
            else f"{fmt(m.get('iterations_per_s'))} it/s (1/median iteration)")
    return (
        f"[bold]Cluster:[/] {m['cluster_mode']} on {m.get('cluster_backend', '?')}, "
        f"{m.get('cluster_workers', '?')} workers  {rate}  "
        f"Mc {fmt(m.get('mc_s'), 4)} s  Pc {fmt(m.get('pc_s'), 4)} s  "
        f"U {fmt(m.get('iteration_makespan_s'), 4)} s  E {fmt(m.get('efficiency_e'))}  "
        f"a {fmt(m.get('ratio_a'))}  {_mib(m.get('bytes_per_iteration'), 2)} MiB/iteration"
        f"\n[dim]  {WALL_NOTE if wall is not None else ''}"
        "medians per iteration after the warm-up: Mc communication, Pc computation inside a "
        "worker's iteration, U its length; E = (Mc+Pc-U)/(Mc+Pc-max(Mc,Pc)) is how much of "
        "the shorter one overlaps the longer (1: fully hidden; < 0: the iteration also "
        "waited, idle); a = Mc/Pc; E, a: medians of per-iteration values (not computed "
        "from the medians Mc, Pc, U shown); –: not measured in this run[/dim]"
    )


def plugins_table(rows: Sequence[ReportRow]) -> Table:
    """The plugins' report rows as the run summary prints them."""
    table = Table(title="Plugins", title_justify="left", pad_edge=False)
    table.add_column("plugin", style="cyan", no_wrap=True)
    table.add_column("summary", overflow="fold")
    for row in rows:
        table.add_row(escape(row.plugin), escape(row.summary))
    return table


def render_summary(record: RunRecord, console: Console) -> None:
    """Print jobs, run-level figures, plugin rows and the telemetry note."""
    console.print(_jobs_table(record))
    for line in _errors(record):
        console.print(line)
    console.print(_run_line(record))
    cluster = _cluster_line(record)
    if cluster:
        console.print(cluster)
    if not record.info.plugins:
        console.print("[bold]Plugins:[/] no plugins active (baseline run)")
    if record.plugin_rows:
        console.print(plugins_table(record.plugin_rows))
    if record.telemetry_note:
        console.print(f"[bold]Telemetry:[/] {escape(record.telemetry_note)}")
