"""``accelopt bench``: one workload under several plugin sets, repeated and interleaved.

The sweep itself is Hydra's multirun (``accelopt run -m``), run as a child process so that
no state of one run leaks into the next through this process. ``run.repeat`` comes first in
the sweep, so Hydra's product visits every plugin set once per repeat: machine drift during
the sweep affects all sets alike instead of penalising whichever set ran last.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from accelopt.bench.analysis import SetResult, higher_is_better, summarize
from accelopt.bench.render import render_markdown, render_png, render_table
from accelopt.errors import UserError
from accelopt.plugin import Registry, resolve, valid_combinations
from accelopt.report.console import default_console


def parse_args(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="accelopt bench",
        description="Run one workload under several plugin sets (interleaved repeats) and "
        "report each set's gain over no plugins and the interaction of combinations.",
    )
    parser.add_argument("--plugins", default="", help="comma-separated plugins; sets default to "
                        "the empty set, each alone, and every valid combination")
    parser.add_argument("--sets", default="", help="explicit sets, e.g. '[],[salus],[salus,tictac]'")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--metric", default="duration_s",
                        help="a key of metrics.json's summary (default: duration_s)")
    parser.add_argument("--higher-is-better", choices=("auto", "yes", "no"), default="auto")
    parser.add_argument("--out", default="", help="output directory (default: runs/bench/<time>)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    opts = parser.parse_args(args)
    if opts.repeats < 1:
        raise UserError("--repeats must be >= 1")
    return opts


def plugin_sets(opts: argparse.Namespace, registry: Registry) -> list[list[str]]:
    if opts.sets:
        sets = [[n for n in chunk.strip("[] ").split(",") if n]
                for chunk in opts.sets.replace("],", "]|").split("|")]
    else:
        names = [n for n in opts.plugins.split(",") if n]
        if not names:
            raise UserError("name the plugins to compare: accelopt bench --plugins a,b [overrides]")
        sets = valid_combinations([registry.get(n) for n in names])
    if [] not in sets:
        sets.insert(0, [])
    return [[s.name for s in resolve(chosen, registry)] for chosen in sets]


def bench_command(args: list[str]) -> int:
    opts = parse_args(args)
    if any(o.startswith(("+plugins", "plugins=")) for o in opts.overrides):
        raise UserError("give plugin sets with --plugins/--sets, not +plugins= overrides")
    registry = Registry.discover()
    sets = plugin_sets(opts, registry)
    out = Path(opts.out or f"runs/bench/{time.strftime('%Y-%m-%d_%H-%M-%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    console = default_console()
    # Each repeat starts with one extra, discarded run of the first set: the first run in a
    # process pays one-off costs (lazy initialisation, first autograd pass, JIT caches).
    sweep = ",".join(f"[{','.join(s)}]" for s in [sets[0], *sets])
    command = [
        sys.executable, "-m", "accelopt.cli.main", "run", "-m",
        f"run.repeat={','.join(str(r) for r in range(opts.repeats))}",
        f"+plugins={sweep}", "run.progress=false",
        f"hydra.sweep.dir={out / 'runs'}", "hydra.sweep.subdir=${hydra.job.num}",
        *opts.overrides,
    ]
    total = (len(sets) + 1) * opts.repeats
    console.print(f"bench: {len(sets)} plugin sets x {opts.repeats} repeats (+1 warm-up run "
                  f"per repeat) = {total} runs, interleaved; log: {out / 'sweep.log'}")
    _run_sweep(command, out, total, console)
    results = collect(out / "runs", opts.metric, per_repeat=len(sets) + 1)
    higher = {"auto": None, "yes": True, "no": False}[opts.higher_is_better]
    summary = summarize(results, opts.metric, higher)
    context = {
        "command": "accelopt bench " + " ".join(args),
        "metric": opts.metric,
        "higher_is_better": higher_is_better(opts.metric) if higher is None else higher,
        "repeats": opts.repeats,
        "machine": f"{platform.node()} {platform.machine()} {platform.platform()}",
        "python": platform.python_version(),
    }
    console.print(render_table(summary, context))
    (out / "bench.json").write_text(json.dumps(
        {"context": context, "sets": [asdict(s) for s in summary]}, indent=2))
    render_png(summary, context, out / "bench.png")
    (out / "bench.md").write_text(render_markdown(summary, context))
    console.print(f"report: {out / 'bench.md'}  chart: {out / 'bench.png'}")
    return 0


def _run_sweep(command: list[str], out: Path, total: int, console: Console) -> None:
    log = (out / "sweep.log").open("w")
    columns = (TextColumn("runs"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("runs", total=total)
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            done = len(list((out / "runs").glob("*/metrics.json")))
            progress.update(task, completed=done)
            try:
                proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue
    log.close()
    if proc.returncode != 0:
        tail = (out / "sweep.log").read_text().strip().splitlines()[-1:]
        raise UserError(f"the sweep failed (exit {proc.returncode}): {' '.join(tail)} "
                        f"(full log: {out / 'sweep.log'})")


def collect(runs_dir: Path, metric: str, per_repeat: int) -> list[SetResult]:
    """Group every run's metric by its plugin set, skipping each repeat's warm-up run (the
    first of every ``per_repeat`` Hydra job numbers)."""
    values: dict[tuple[str, ...], list[float]] = defaultdict(list)
    available: set[str] = set()
    for path in sorted(runs_dir.glob("*/metrics.json")):
        if int(path.parent.name) % per_repeat == 0:
            continue
        data = json.loads(path.read_text())
        summary = data["summary"]
        available |= {k for k, v in summary.items() if isinstance(v, (int, float))}
        value = summary.get(metric)
        if isinstance(value, (int, float)):
            values[tuple(data["run"]["plugins"])].append(float(value))
    if not values:
        raise UserError(f"metric '{metric}' is not in the runs' metrics.json summary; "
                        f"choose one of: {', '.join(sorted(available))}")
    return [SetResult(plugins, tuple(v)) for plugins, v in values.items()]
