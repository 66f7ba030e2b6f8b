"""SALUS + TicTac on the multi-job parameter-server workload: baseline / salus / tictac /
salus+tictac, side by side, from ONE invocation.

One discarded warm-up run of every set comes first (as ``accelopt bench`` does: the first
run of a process pays one-off costs the others do not), then every repeat runs the four
plugin sets one after another, the order rotating between
repeats (interleaved, so machine drift affects all alike); the table shows the median over repeats of average JCT, makespan and
the median per-iteration E, each set's ratio to no plugins, and the interaction of the
combination (its gain vs the product of its members' gains), computed within each repeat
against that repeat's own baseline run and classified by the rule of ``docs/combinations.md``
(``accelopt.bench.analysis.summarize``: the same code ``accelopt bench`` uses). The bound
beside average JCT is the shortest-remaining-processing-time oracle on the baseline's own
measured service times (no schedule of the same jobs on one shared cluster has a lower
average JCT); beside the makespan, the sum of those service times.

    python benchmarks/combo_salus_tictac.py \
        --repeats 3 [experiment=salus_tictac] [plugins.salus.policy=srtf] [other overrides]

Without overrides it runs the embedded default workload (five jobs, 2 workers + 1 server on
local processes, unshaped loopback); ``experiment=salus_tictac`` runs it on the shaped
network (root). Plugin settings given as ``plugins.NAME.key=value`` apply to the sets that
select NAME.

A run in which a job failed, was refused or diverged measured other work than its set's
(its JCTs are those of the jobs that survived): it is named and left out, as ``accelopt
bench`` leaves it out, and the script exits 3 (no table at all when no baseline run
measured). A plugin whose report rows say it changed nothing (``inert``: tictac with
nothing to order) is flagged, its difference being noise. A set measured below a bound is
flagged too: the bounds come from the baseline runs' measured service times, which vary
from run to run.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import _cli
from rich.console import Console
from rich.table import Table

from accelopt.bench.analysis import SetResult, SetSummary, summarize
from accelopt.bench.runner import run_failure
from accelopt.cli.hydra_run import compose_checked
from accelopt.config import register_plugin_configs, register_schema
from accelopt.errors import JobsUnfinished
from accelopt.plugin import Registry
from accelopt.report import run_metrics
from accelopt.runtime.compare import INERT_NOTE, inert_plugins
from accelopt.runtime.run import execute

SETS = ((), ("salus",), ("tictac",), ("salus", "tictac"))
FIGURES = (("avg_jct_s", "avg JCT s"), ("makespan_s", "makespan s"),
           ("efficiency_e", "E (median)"), ("iteration_s", "median iteration s"))


def compose(plugins: tuple[str, ...], overrides: list[str], registry: Registry):
    register_schema()
    register_plugin_configs([registry.get(n) for n in ("salus", "tictac")])
    mine = [o for o in overrides
            if not o.startswith("plugins.") or o.split(".")[1] in plugins]
    cfg = compose_checked([f"+plugins=[{','.join(plugins)}]", *mine, "run.compare=none",
                           "run.progress=false", "run.telemetry_interval_s=5"])
    # an experiment file may name plugin settings for both: keep only this set's plugins
    current = cfg.plugins or {}
    cfg.plugins = {name: current[name] for name in current if name in plugins}
    return cfg


def oracle_bounds(record) -> tuple[float, float] | None:
    """(average JCT of the SRPT oracle, total service time) of one run's jobs, from their
    measured service times and arrivals: one job at a time on the whole cluster, as a PS
    cluster runs them; ``None`` when no job has a service time."""
    from accelopt_plugins.salus.metrics import OracleJob, oracle_average_jct

    jobs = [OracleJob(r.job.job_id, r.job.arrival_s, r.service_s) for r in record.jobs
            if r.service_s]
    if not jobs:
        return None
    return oracle_average_jct(jobs), sum(j.length_s for j in jobs)


Measured = dict[tuple[str, ...], list[tuple[int, dict]]]
"""Each set's runs that measured it: (repeat, the run's metrics)."""


def fmt(value: float | None, spec: str = "7.3f") -> str:
    """A figure, or '–' (right-aligned as wide) where the run has none."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–".rjust(int(spec.split(".")[0] or 0))
    return f"{value:{spec}}"


def run_line(r: int, name: str, m: dict, seconds: float, failure: str | None,
             inert: list[str]) -> str:
    """One run's progress line: its figures, and why they do not count (the run is left
    out) or that its plugins changed nothing (their difference is noise)."""
    line = (f"repeat {r} {name:13s} avg JCT {fmt(m.get('avg_jct_s'))} s  makespan "
            f"{fmt(m.get('makespan_s'))} s  E {fmt(m.get('efficiency_e'), '.3f')}  "
            f"({seconds:.1f} s)")
    if failure:
        line += f"  LEFT OUT: {failure}"
    if inert:
        line += f"  [{', '.join(inert)} changed nothing (inert)]"
    return line


def inert_sets(inert: dict[tuple[str, ...], list[list[str]]]) -> dict[tuple[str, ...], tuple]:
    """Each set's plugins that changed nothing in every run of it that measured."""
    return {p: tuple(n for n in p if all(n in seen for seen in runs)) if runs else ()
            for p, runs in inert.items()}


def gain_text(s: SetSummary) -> str:
    """A set's gain, marked when the set changed nothing (its gain is noise)."""
    return f"{s.gain:.2f}x" + (" (inert)" if s.inert else "")


def bound_warnings(results: Measured, jct: float, work: float) -> list[str]:
    """A warning per figure where a set's median beats its bound. The bounds are computed
    from the service times the baseline's runs measured (median over its repeats), not
    from the set's own runs: service times vary from run to run (noise, contention, jobs
    that stopped early), so a set below the bound measured shorter jobs than the baseline
    did, which is no evidence that it beat the optimal schedule."""
    out = []
    for key, bound, what in (("avg_jct_s", jct, "avg JCT"), ("makespan_s", work, "makespan")):
        below = []
        for plugins, runs in results.items():
            values = [m[key] for _, m in runs if m.get(key) is not None]
            if values and statistics.median(values) < bound:
                below.append(f"{'+'.join(plugins) or 'baseline'} "
                             f"{statistics.median(values):.3f} s")
        if below:
            out.append(f"warning: {', '.join(below)} below the {what} bound {bound:.3f} s: the "
                       "bound comes from the service times the baseline's runs measured, and "
                       "those vary from run to run, so this set's jobs took less service time "
                       "than the baseline's did (noise, less contention, or less work), which "
                       "is no evidence of beating the optimal schedule")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=_cli.summary(__doc__))
    parser.add_argument("--repeats", type=_cli.positive_int, default=3)
    parser.add_argument("--out", default="runs/bench/combo_salus_tictac")
    parser.add_argument("overrides", nargs="*")
    opts = parser.parse_args()
    _cli.refuse_not_a_directory(opts.out, "--out")  # not after the first run
    registry = Registry.discover()
    out = Path(opts.out) / time.strftime("%Y%m%d-%H%M%S")
    if out.exists():  # a new directory per invocation: never written into twice
        _cli.fail(f"--out: {out} exists (another invocation this second); not overwriting it")
    results: Measured = {s: [] for s in SETS}
    inert_runs: dict[tuple[str, ...], list[list[str]]] = {s: [] for s in SETS}
    left_out: list[str] = []
    bounds: list[tuple[float, float] | None] = []
    quiet = Console(file=io.StringIO(), width=140)
    started = time.time()
    for plugins in SETS:  # one discarded warm-up run of every set, as `accelopt bench` does
        name = "+".join(plugins) or "baseline"
        t = time.time()
        execute(compose(plugins, opts.overrides, registry), run_dir=out / f"warmup-{name}",
                registry=registry, console=quiet)
        print(f"warm-up  {name:13s} (discarded, {time.time() - t:.1f} s)", flush=True)
    for r in range(opts.repeats):  # the set order rotates: every set runs in every position
        for plugins in SETS[r % len(SETS):] + SETS[:r % len(SETS)]:
            name = "+".join(plugins) or "baseline"
            cfg = compose(plugins, opts.overrides, registry)
            t = time.time()
            record = execute(cfg, run_dir=out / f"r{r}-{name}", registry=registry, console=quiet)
            m = run_metrics(record)
            # a run whose job failed or diverged measured other work than the set's: its JCTs
            # are those of the jobs that survived (`accelopt bench` leaves it out the same way)
            failure = run_failure(m)
            inert = inert_plugins(plugins, record.plugin_rows)
            print(run_line(r, name, m, time.time() - t, failure, inert), flush=True)
            if failure:
                left_out.append(f"{name} repeat {r}: {failure}")
                continue
            results[plugins].append((r, m))
            inert_runs[plugins].append(inert)
            if not plugins:
                bounds.append(oracle_bounds(record))
    if not results[()]:
        _cli.fail(f"no baseline run measured (the ratios are against it): "
                  f"{'; '.join(left_out)}", code=JobsUnfinished.exit_code)
    report(results, inert_sets(inert_runs), bounds, left_out, opts, out, started)
    (out / "combo.json").write_text(json.dumps(
        {"+".join(p) or "baseline": [m for _, m in results[p]] for p in SETS}, indent=1,
        default=str))
    return JobsUnfinished.exit_code if left_out else 0


def report(results: Measured, inert: dict[tuple[str, ...], tuple], bounds: list,
           left_out: list[str], opts: argparse.Namespace, out: Path, started: float) -> None:
    """The table, the interaction lines, the bounds and the notes, from the runs that
    measured; the runs left out and the plugins that changed nothing are named."""
    def values(plugins: tuple[str, ...], key: str) -> list[float]:
        return [m[key] for _, m in results[plugins] if m.get(key) is not None]

    def med(plugins: tuple[str, ...], key: str) -> float | None:
        vals = values(plugins, key)
        return statistics.median(vals) if vals else None

    def spread(plugins: tuple[str, ...], key: str) -> str:
        vals = values(plugins, key)
        return f"[{min(vals):.3f}-{max(vals):.3f}]" if len(vals) > 1 else ""

    console = Console(width=160)
    table = Table(title=f"multi-job PS workload, medians of {opts.repeats} interleaved repeats "
                  "(ratio: baseline / set, > 1 is faster; E: difference)", title_justify="left")
    table.add_column("figure")
    for plugins in SETS:
        flag = " (inert)" if plugins and set(inert[plugins]) >= set(plugins) else ""
        table.add_column(("+".join(plugins) or "baseline") + flag, justify="right")
    for key, label in FIGURES:
        base = med((), key)
        cells = []
        for plugins in SETS:
            v = med(plugins, key)
            if v is None:
                cells.append("–")
                continue
            text = f"{v:.3f} {spread(plugins, key)}"
            if plugins and base is not None:
                text += f" ({v - base:+.3f})" if key == "efficiency_e" else f" ({base / v:.2f}x)"
            cells.append(text)
        table.add_row(label, *cells)
    console.print(table)
    for name in dict.fromkeys(n for p in SETS for n in inert[p]):
        console.print(f"note: {INERT_NOTE.format(plugin=name, run='every run of its sets')}")
    if left_out:
        console.print(f"left out {len(left_out)} run(s) that did not measure their set (a job "
                      f"failed, was refused or diverged): {'; '.join(left_out)}", markup=False)
    for key, label in FIGURES[:2]:
        sets = [SetResult(p, tuple(m[key] for _, m in results[p] if m.get(key) is not None),
                          repeats=tuple(r for r, m in results[p] if m.get(key) is not None),
                          inert=inert[p]) for p in SETS]
        if any(not r.values for r in sets):
            continue
        summary = {x.plugins: x for x in summarize(sets, key, higher=False)}
        combo = summary[("salus", "tictac")]
        console.print(
            f"interaction on {label}: salus {gain_text(summary[('salus',)])}, tictac "
            f"{gain_text(summary[('tictac',)])}, together {combo.gain:.2f}x vs product "
            f"{combo.expected_gain:.2f}x; interaction {fmt(combo.interaction, '.3f')} (paired "
            f"within each repeat that measured all four sets, range "
            f"{fmt(combo.interaction_low, '.3f')}-{fmt(combo.interaction_high, '.3f')}) -> "
            f"{combo.verdict} (docs/combinations.md's rule)", markup=False)
    measured = [b for b in bounds if b is not None]
    if measured:
        jct = statistics.median(b[0] for b in measured)
        work = statistics.median(b[1] for b in measured)
        base_jct, base_span = med((), "avg_jct_s"), med((), "makespan_s")
        console.print(
            f"bound: avg JCT {jct:.3f} s (SRPT oracle on the baseline's measured service "
            f"times: {base_jct / jct if base_jct else float('nan'):.2f}x below the baseline); "
            f"makespan {work:.3f} s (the jobs' service times back to back, no idle time"
            + (f": {base_span / work:.2f}x below the baseline)" if base_span else ")"))
        for line in bound_warnings(results, jct, work):
            console.print(line, markup=False)
    console.print("median iteration: a worker's iteration, no throughput where iterations "
                  "overlap (tictac's early update ends one before its gradients have left); "
                  "avg JCT and makespan are the wall-clock figures")
    console.print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
                  f"python {sys.version.split()[0]}; overrides: {' '.join(opts.overrides) or '-'};"
                  f" wall {time.time() - started:.0f} s; runs in {out}", markup=False)


if __name__ == "__main__":
    _cli.run(main)
