"""``run.compare``: the same workload without plugins (and each plugin alone), run in the
same invocation, printed beside the run with plugins.

Why a real second run and not an estimate: a plugin's gain is only meaningful against the
same jobs, same seeds and the same machine state, so the reference runs are executed right
before the run with plugins, in their own sub-directories (``<run_dir>/compare/<label>``),
and every figure in the comparison is measured. One run each, so small differences are
within noise: for medians of repeats use ``accelopt bench``.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from accelopt.errors import AccelOptError, ConfigError, listed
from accelopt.records import JobResult, RunRecord
from accelopt.types import INERT, ReportRow

MODES = ("none", "baseline", "each")
BASELINE = "baseline"
FIGURES: tuple[tuple[str, str, str], ...] = (
    # (metrics key, label, kind: "time" = lower is better and gain is a ratio; "e" = higher
    # is better and the change is a difference)
    ("avg_jct_s", "avg JCT s", "time"),
    ("p95_jct_s", "p95 JCT s", "time"),
    ("makespan_s", "makespan s", "time"),
    ("iteration_s", "iteration s (median)", "time"),
    ("efficiency_e", "E (median)", "e"),
    ("avg_quality", "held-out top-1 (mean)", "e"),
    ("avg_perplexity", "held-out perplexity (mean)", "time"),
)


COMPARED = "compared"
"""The metric marking a plugin's measured-gain row (:func:`attach`): a comparison, not a row
of the plugin's own (:func:`is_inert` leaves it out)."""

INERT_NOTE = ("{plugin} changed nothing in {run}, its rows say so: this difference is "
              "run-to-run noise, not its gain")
"""What a measured difference of a plugin whose every report row is inert is (``INERT``):
said beside it by ``run.compare``, ``accelopt bench`` and the benchmark scripts alike."""


def is_inert(plugin: str, rows: Iterable[tuple[str, Mapping[str, Any]]]) -> bool:
    """Whether ``plugin`` changed nothing in a run, by that run's report rows, given as
    (plugin, metrics) pairs (``ReportRow``s, or ``metrics.json``'s "plugins" list): it has
    rows, and every one of them says ``INERT``. A plugin without rows is not called inert
    (it said nothing either way). The measured-gain row ``run.compare`` adds after a
    plugin's own (``COMPARED``) says nothing of what the plugin did: counted, it made every
    plugin of a compared run read as active, its own rows' ``inert`` overruled."""
    own = [metrics for name, metrics in rows if name == plugin and not metrics.get(COMPARED)]
    return bool(own) and all(metrics.get(INERT) for metrics in own)


def inert_plugins(plugins: Iterable[str], rows: Iterable[ReportRow]) -> list[str]:
    """The ones of ``plugins`` that changed nothing in the run whose report rows are
    ``rows`` (:func:`is_inert`)."""
    pairs = [(r.plugin, r.metrics) for r in rows]
    return [name for name in plugins if is_inert(name, pairs)]


def compare_mode(cfg: DictConfig) -> str:
    mode = str(cfg.run.get("compare", "none") or "none")
    if mode not in MODES:
        raise ConfigError(f"run.compare: {mode!r} is not one of {', '.join(MODES)}; "
                          "baseline also runs the workload without plugins")
    return mode


def in_multirun() -> bool:
    """A Hydra sweep (``-m``, ``accelopt bench``) compares its runs itself."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    except Exception:  # noqa: BLE001 - no Hydra context: a direct call
        return False


def variants(selected: list[str], mode: str) -> list[tuple[str, ...]]:
    """The reference plugin sets: none; with ``each``, every selected plugin alone too."""
    out: list[tuple[str, ...]] = [()]
    if mode == "each" and len(selected) > 1:
        out += [(name,) for name in selected]
    return out


def label(subset: tuple[str, ...]) -> str:
    return "+".join(subset) if subset else BASELINE


def subset_config(cfg: DictConfig, subset: tuple[str, ...]) -> DictConfig:
    """The config of the reference run with ``subset``'s plugins: no comparison of its own,
    and no resume (a resumed run's references start over, measured in its invocation: the
    run it resumes stopped before they ended, ``runtime/run.py``)."""
    sub = copy.deepcopy(cfg)
    plugins = cfg.get("plugins") or {}
    sub.plugins = {name: plugins[name] for name in subset}
    sub.run.compare = "none"
    sub.run.progress = False
    sub.run.resume = None
    sub.run.resume_finished = False
    return sub


def reference_dir(run_dir: Path, subset: tuple[str, ...]) -> Path:
    """Where the reference run with ``subset``'s plugins writes: ``<run_dir>/compare/<label>``."""
    return Path(run_dir) / "compare" / label(subset)


def refuse_taken_references(run_dir: Path, subsets: list[tuple[str, ...]]) -> None:
    """One line when a reference run's directory is not free (it holds a file the reference
    would write over, an earlier run's results or claim: ``runtime/run_dir.refuse_taken``).
    Called before the run writes anything (``execute``, before it claims ``run_dir``): found
    when the reference starts, the run with plugins had written its config, which refused
    the same command once the user's file was moved away; and, with ``each``, the second
    reference's directory was found taken only after the first reference had run."""
    from accelopt.runtime.run_dir import refuse_taken

    for subset in subsets:
        refuse_taken(reference_dir(run_dir, subset))


def run_references(cfg: DictConfig, subsets: list[tuple[str, ...]], run_dir: Path,
                   registry: Any, console: Console) -> dict[str, RunRecord]:
    """Run every reference set (quietly), return their records by label; every reference's
    directory is checked before the first runs (:func:`refuse_taken_references`)."""
    from accelopt.runtime.run import execute
    from accelopt.runtime.run_dir import shown_path

    mode = compare_mode(cfg)
    refuse_taken_references(run_dir, subsets)
    refs: dict[str, RunRecord] = {}
    for subset in subsets:
        name = label(subset)
        where = reference_dir(run_dir, subset)
        console.print(f"[dim]run.compare={mode}: running the same workload with "
                      f"{'no plugins' if not subset else name} first ({escape(str(shown_path(where)))})"
                      "[/dim]")
        quiet = Console(file=io.StringIO(), width=120)
        try:
            refs[name] = execute(subset_config(cfg, subset), run_dir=where, registry=registry,
                                 console=quiet)
        except AccelOptError as exc:
            raise references_kept(_in_reference(exc, subset, where), run_dir,
                                  list(refs)) from None
    return refs


def references_kept(exc: AccelOptError, run_dir: Path, finished: list[str]) -> AccelOptError:
    """``exc`` (its class, exit code and attributes), its line also saying where the
    reference runs that finished before it (their labels: ``finished``) kept their
    outputs, unless the run's own outputs are in ``run_dir`` (the command line says those
    are kept, and they hold the references' directory). Why: a run stopped after its
    references trained shows none of their figures, so its line says where they are."""
    kept = [name for name in finished
            if (Path(run_dir) / "compare" / name / "metrics.json").is_file()]
    if kept and not (Path(run_dir) / "metrics.json").is_file():
        exc.args = (f"{exc}; the run.compare reference runs that finished kept their outputs "
                    f"in {Path(run_dir) / 'compare'} ({', '.join(kept)})", *exc.args[1:])
    return exc


def _in_reference(exc: AccelOptError, subset: tuple[str, ...], where: Path) -> AccelOptError:
    """``exc``, raised by a reference run, with its line saying so: the line read as the run's
    own failure ("plugin 'boom' raised ..." with no directory), while the run with the
    selected plugins had not started and the evidence was in the reference's directory. The
    same error (its class, exit code and attributes), its message prefixed."""
    which = "without plugins" if not subset else f"with {label(subset)} alone"
    kept = f", outputs kept in {where}" if (where / "metrics.json").is_file() else ""
    exc.args = (f"the reference run {which} (run.compare) failed{kept}: {exc}", *exc.args[1:])
    return exc


def figures(record: RunRecord, scored: set[str] | None = None,
            finished: set[str] | None = None) -> dict[str, Any]:
    """The compared figures of ``record``; ``scored``: the names of the jobs whose held-out
    quality is averaged (those scored in every run compared, :func:`scored_in_all`), so a
    job one run did not score (diverged, failed) is left out on both sides; ``finished``:
    the jobs its times are taken over (:func:`compared_jobs`), ``None`` for all of them."""
    from accelopt.report import run_metrics
    from accelopt.report.metrics import quality_means

    m = run_metrics(record)
    if scored is not None:
        m.update(quality_means([j for j in record.jobs if j.job.name in scored]))
    if finished is not None:
        m.update(_time_figures(record, finished))
    return {key: m.get(key) for key, _, _ in FIGURES}


TIMES = ("avg_jct_s", "p95_jct_s", "makespan_s")
"""The time figures derived from a run's jobs (``report.metrics.run_metrics``)."""
PER_JOB = ("iteration_s", "efficiency_e")
"""The figures a cluster run of several jobs gives per job (``job.<name>.<key>``) and as
their median over its jobs."""


def _time_figures(record: RunRecord, names: set[str]) -> dict[str, Any]:
    """:data:`TIMES` and :data:`PER_JOB` of ``record`` over its jobs named in ``names``
    only: a run that rejected a large job looked faster than the baseline that ran it. A
    per-job figure not given for each of them (a run of one job gives no per-job keys) is
    ``None``: no figure, rather than one over other jobs."""
    from accelopt.report import run_metrics

    stopped = {"error": record.metrics["error"]} if "error" in record.metrics else {}
    jobs = [j for j in record.jobs if j.job.name in names]
    derived = run_metrics(dataclasses.replace(record, jobs=jobs, metrics=stopped))
    out: dict[str, Any] = {key: derived.get(key) for key in TIMES}
    for key in PER_JOB:
        values = [record.metrics.get(f"job.{name}.{key}") for name in sorted(names)]
        known = [v for v in values if isinstance(v, int | float)]
        out[key] = statistics.median(known) if known and len(known) == len(values) else None
    return out


def _finished(record: RunRecord) -> set[str]:
    """The jobs (by name) of ``record`` that finished on a finite loss."""
    return {r.job.name for r in record.jobs if _state(r) == "done"}


def compared_jobs(*records: RunRecord) -> set[str] | None:
    """The jobs (by name) the time figures of ``records`` are compared over: ``None`` (each
    run's own, all of them) when every run finished the same jobs, else those every one of
    them finished (:func:`finished_note` says which)."""
    sets = [_finished(record) for record in records]
    if all(names == sets[0] for names in sets):
        return None
    return set.intersection(*sets)


def finished_note(*records: RunRecord) -> str:
    """'' when every run of ``records`` finished the same jobs; else over which jobs the
    times are compared (:func:`compared_jobs`)."""
    names = compared_jobs(*records)
    if names is None:
        return ""
    return (f"times are compared over the jobs every run finished: {listed(sorted(names))}"
            if names else "no job finished in every run, so no times are compared")


def _scored(record: RunRecord) -> set[str]:
    """The jobs (by name) of ``record`` with a held-out score."""
    return {r.job.name for r in record.jobs if r.quality is not None}


def scored_in_all(*records: RunRecord) -> set[str]:
    """The jobs (by name) with a held-out score in every one of ``records``: a mean over one
    job beside a mean over two read as a plugin's effect on quality."""
    return set.intersection(*map(_scored, records)) if records else set()


def _fmt(value: Any) -> str:
    return "–" if value is None else f"{value:.3f}"


def _change(key_kind: str, base: Any, mine: Any) -> str:
    if base is None or mine is None:
        return ""
    if key_kind == "e":
        return f" ({mine - base:+.3f})"
    return f" ({base / mine:.2f}x)" if mine > 0 else ""


def gain_metrics(base: dict[str, Any], mine: dict[str, Any], prefix: str) -> dict[str, float]:
    """The figures :func:`describe` puts in words, for a script: ``<prefix>.<key>`` the
    set's value and ``<prefix>.<key>.gain`` its change against the baseline (a ratio > 1
    faster for a time, a difference for E and quality), where both are known. The row's
    metrics were empty, so a script comparing runs had to parse its sentence."""
    out: dict[str, float] = {}
    for key, _, kind in FIGURES:
        value, ref = mine.get(key), base.get(key)
        if value is None:
            continue
        out[f"{prefix}.{key}"] = value
        if ref is None:
            continue
        if kind == "e":
            out[f"{prefix}.{key}.gain"] = value - ref
        elif value > 0:
            out[f"{prefix}.{key}.gain"] = ref / value
    return out


def describe(base: dict[str, Any], mine: dict[str, Any]) -> str:
    parts = []
    for key, name, kind in FIGURES:
        if base.get(key) is None and mine.get(key) is None:
            continue
        parts.append(f"{name} {_fmt(base.get(key))} -> {_fmt(mine.get(key))}"
                     f"{_change(kind, base.get(key), mine.get(key))}")
    return ", ".join(parts)


def _state(result: JobResult) -> str:
    """A job's status, ``diverged`` for one that ran to the end diverged (its weights, or
    where they are not known its last losses, not finite: ``JobResult.diverged_at``); it is
    ``done`` but unscored, so the runs did not finish the same jobs. A loss of nan followed
    by finite ones with finite weights (a skipped step) is no divergence."""
    return "diverged" if result.status == "done" and result.diverged_at is not None \
        else result.status


def job_set_note(base: RunRecord, other: RunRecord) -> str:
    """'' when the same jobs finished (on a finite loss) in both runs; else which did not
    (a plugin that rejected a large job looked several times faster than the baseline that
    ran it, so the times are compared over the jobs every run finished: :func:`finished_note`;
    a job diverged in one run is not scored there: :func:`quality_note`)."""
    theirs = {r.job.name: _state(r) for r in base.jobs}
    ours = {r.job.name: _state(r) for r in other.jobs}
    differ = [f"{name} ({theirs.get(name, 'absent')} without plugins, "
              f"{ours.get(name, 'absent')} here)"
              for name in sorted(set(theirs) | set(ours))
              if (theirs.get(name) == "done") != (ours.get(name) == "done")]
    if not differ:
        return ""
    return "not the same jobs finished: " + listed(differ, sep="; ")


def quality_note(*records: RunRecord) -> str:
    """'' when the same jobs were scored in every run of ``records``; else over which jobs
    the held-out quality is compared (those scored in all of them)."""
    sets = [_scored(record) for record in records]
    if all(names == sets[0] for names in sets):
        return ""
    both = sorted(scored_in_all(*records))
    return (f"held-out quality is compared over the jobs scored in every run: {listed(both)}"
            if both else "no job was scored in every run, so no held-out quality is compared")


def unfinished_jobs(name: str, record: RunRecord) -> str:
    """The jobs a reference run did not finish on a finite loss (diverged, failed,
    rejected), with why, or '': its own console is not shown, so the comparison says it."""
    from accelopt.report.summary import diverged_text

    said = []
    for result in record.jobs:
        state = _state(result)
        if state == "diverged":
            why = diverged_text(result).removeprefix(f"{result.job.name}: ")
        elif state in ("failed", "rejected"):
            why = result.error or "no error recorded"
        else:
            continue
        said.append(f"{result.job.name} {state} ({why})")
    if not said:
        return ""
    run = "the run without plugins" if name == BASELINE else f"the run with {name} alone"
    return (f"{run}: {len(said)} of {len(record.jobs)} jobs did not finish: "
            + listed(said, sep="; "))


def attach(record: RunRecord, refs: dict[str, RunRecord]) -> None:
    """Add each plugin's measured gain (a row after its own rows) and the reference figures
    (``compare.<label>.<key>`` in the run's metrics; their times over the jobs every run
    finished, :func:`compared_jobs`, and their held-out quality, as every quality compared,
    over the jobs scored in every run: :func:`scored_in_all`). The gain
    row of a plugin that changed nothing in the run measured (alone where it ran alone)
    carries ``INERT``, as its sentence says so: a script reading its ``alone.*`` and
    ``together.*`` figures can tell run-to-run noise from the plugin's gain."""
    scored = scored_in_all(record, *refs.values())
    finished = compared_jobs(*refs.values(), record)
    mine = figures(record, scored, finished)
    base = figures(refs[BASELINE], scored, finished)
    for name, ref in refs.items():
        for key, value in figures(ref, scored, finished).items():
            if value is not None:
                record.metrics[f"compare.{name}.{key}"] = value
    plugins = list(record.info.plugins)
    rows = list(record.plugin_rows)
    for plugin in plugins:
        alone = refs.get(plugin)
        source = alone.plugin_rows if alone is not None else rows
        inert = bool(inert_plugins([plugin], source))
        noise = f" ({INERT_NOTE.format(plugin=plugin, run='this run')})" if inert else ""
        together = gain_metrics(base, mine, "together")
        measured = together
        if alone is not None:
            measured = {**gain_metrics(base, figures(alone, scored, finished), "alone"),
                        **together}
            text = (f"measured gain vs the same run without plugins, {plugin} alone: "
                    f"{describe(base, figures(alone, scored, finished))}{noise}; all selected plugins "
                    f"together: {describe(base, mine)}")
        elif len(plugins) == 1:
            text = f"measured gain vs the same run without plugins: {describe(base, mine)}{noise}"
        else:
            text = (f"measured gain of all selected plugins together ({'+'.join(plugins)}) vs "
                    f"the same run without plugins: {describe(base, mine)} "
                    "(run.compare=each measures each plugin alone too)")
        differ = job_set_note(refs[BASELINE], alone if alone is not None else record)
        text += f" [{differ}]" if differ else ""
        times = finished_note(*refs.values(), record)
        text += f" [{times}]" if times else ""
        quality = quality_note(*refs.values(), record)
        text += f" [{quality}]" if quality else ""
        text += " [ratio > 1x: faster; one run each, this invocation]"
        last = max((i for i, r in enumerate(rows) if r.plugin == plugin), default=len(rows) - 1)
        rows.insert(last + 1, ReportRow(plugin, text, {
            COMPARED: 1, **({INERT: 1} if inert else {}),
            **{f"baseline.{key}": value for key, value in base.items() if value is not None},
            **measured}))
    record.plugin_rows = rows


IDLE_MARK = "(changed nothing)"
"""The comparison table's mark on the column of a run whose plugins changed nothing in it
(:func:`_idle_runs`)."""


def _idle_runs(record: RunRecord, refs: dict[str, RunRecord]) -> dict[str, str]:
    """The columns of :func:`table` whose plugins all changed nothing in their run (by that
    run's rows: :func:`inert_plugins`), each with the note saying so (:data:`INERT_NOTE`):
    unmarked, such a run's ratio reads as the plugin's gain, where the rows call it
    noise."""
    runs = [(name, ref.info.plugins, ref.plugin_rows, f"the run with {name} alone")
            for name, ref in refs.items() if name != BASELINE]
    runs.append(("+".join(record.info.plugins), record.info.plugins, record.plugin_rows,
                 "this run"))
    out: dict[str, str] = {}
    for name, plugins, rows, run in runs:
        if plugins and len(inert_plugins(plugins, rows)) == len(plugins):
            out[name] = INERT_NOTE.format(plugin=listed(list(plugins)), run=run)
    return out


def table(record: RunRecord, refs: dict[str, RunRecord]) -> Table:
    """Baseline, each reference and this run side by side; times over the jobs every one of
    them finished, held-out quality over the jobs scored in all of them. The caption says where the runs did not finish the same jobs,
    and each reference run's jobs that did not finish (its own console is not shown)."""
    scored = scored_in_all(record, *refs.values())
    finished = compared_jobs(*refs.values(), record)
    runs = [(name, figures(ref, scored, finished)) for name, ref in refs.items()]
    runs.append(("+".join(record.info.plugins) or "this run",
                 figures(record, scored, finished)))
    differ = job_set_note(refs[BASELINE], record)
    notes = [f"this run: {differ}"] if differ else []
    notes += [times] if (times := finished_note(*refs.values(), record)) else []
    notes += [quality] if (quality := quality_note(*refs.values(), record)) else []
    notes += [note for name, ref in refs.items() if (note := unfinished_jobs(name, ref))]
    idle = _idle_runs(record, refs)
    notes += list(idle.values())
    out = Table(title="Compared in this invocation (one run each; ratio vs no plugins)",
                title_justify="left", pad_edge=False,
                caption=Text("\n".join(notes)) if notes else None, caption_justify="left")
    out.add_column("figure", no_wrap=True)
    for name, _ in runs:
        header = "no plugins" if name == BASELINE else name
        out.add_column(f"{header} {IDLE_MARK}" if name in idle else header, justify="right")
    base = runs[0][1]
    for key, name, kind in FIGURES:
        values = [f.get(key) for _, f in runs]
        if all(v is None for v in values):
            continue
        cells = [_fmt(values[0])]
        cells += [_fmt(v) + _change(kind, base.get(key), v) for v in values[1:]]
        out.add_row(name, *cells)
    return out
