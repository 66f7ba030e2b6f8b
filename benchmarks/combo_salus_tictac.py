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
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import _cli
from rich.console import Console
from rich.table import Table

from accelopt.bench.analysis import SetResult, summarize
from accelopt.cli.hydra_run import compose_checked
from accelopt.config import register_plugin_configs, register_schema
from accelopt.plugin import Registry
from accelopt.report import run_metrics
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


def main() -> None:
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
    results: dict[tuple[str, ...], list[dict]] = {s: [] for s in SETS}
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
            results[plugins].append(m)
            if not plugins:
                bounds.append(oracle_bounds(record))
            print(f"repeat {r} {name:13s} avg JCT {m.get('avg_jct_s', 0):7.3f} s  makespan "
                  f"{m.get('makespan_s', 0):7.3f} s  E {m.get('efficiency_e', float('nan')):.3f}"
                  f"  ({time.time() - t:.1f} s)", flush=True)

    def med(plugins: tuple[str, ...], key: str) -> float | None:
        vals = [m[key] for m in results[plugins] if m.get(key) is not None]
        return statistics.median(vals) if vals else None

    def spread(plugins: tuple[str, ...], key: str) -> str:
        vals = [m[key] for m in results[plugins] if m.get(key) is not None]
        return f"[{min(vals):.3f}-{max(vals):.3f}]" if len(vals) > 1 else ""

    console = Console(width=160)
    table = Table(title=f"multi-job PS workload, medians of {opts.repeats} interleaved repeats "
                  "(ratio: baseline / set, > 1 is faster; E: difference)", title_justify="left")
    table.add_column("figure")
    for plugins in SETS:
        table.add_column("+".join(plugins) or "baseline", justify="right")
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
    for key, label in FIGURES[:2]:
        sets = [SetResult(p, tuple(m[key] for m in results[p] if m.get(key) is not None),
                          repeats=tuple(r for r, m in enumerate(results[p])
                                        if m.get(key) is not None)) for p in SETS]
        if any(not r.values for r in sets):
            continue
        summary = {x.plugins: x for x in summarize(sets, key, higher=False)}
        combo = summary[("salus", "tictac")]
        console.print(
            f"interaction on {label}: salus {summary[('salus',)].gain:.2f}x, tictac "
            f"{summary[('tictac',)].gain:.2f}x, together {combo.gain:.2f}x vs product "
            f"{combo.expected_gain:.2f}x; interaction {combo.interaction:.3f} (paired within "
            f"each of {len(sets[0].values)} repeats, range {combo.interaction_low:.3f}-"
            f"{combo.interaction_high:.3f}) -> {combo.verdict} (docs/combinations.md's rule)")
    bounds = [b for b in bounds if b is not None]
    if bounds:
        jct = statistics.median(b[0] for b in bounds)
        work = statistics.median(b[1] for b in bounds)
        base_jct, base_span = med((), "avg_jct_s"), med((), "makespan_s")
        console.print(
            f"bound: avg JCT {jct:.3f} s (SRPT oracle on the baseline's measured service "
            f"times: {base_jct / jct if base_jct else float('nan'):.2f}x below the baseline); "
            f"makespan {work:.3f} s (the jobs' service times back to back, no idle time"
            + (f": {base_span / work:.2f}x below the baseline)" if base_span else ")"))
    console.print("median iteration: a worker's iteration, no throughput where iterations "
                  "overlap (tictac's early update ends one before its gradients have left); "
                  "avg JCT and makespan are the wall-clock figures")
    console.print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
                  f"python {sys.version.split()[0]}; overrides: {' '.join(opts.overrides) or '-'};"
                  f" wall {time.time() - started:.0f} s; runs in {out}")
    (out / "combo.json").write_text(json.dumps(
        {"+".join(p) or "baseline": results[p] for p in SETS}, indent=1, default=str))


if __name__ == "__main__":
    _cli.run(main)
