"""``accelopt bench``: one workload under several plugin sets, repeated and interleaved.

The sweep itself is Hydra's multirun (``accelopt run -m``), run as a child process so that
no state of the runs leaks into this process. The sweep visits every plugin set once per
repeat, so machine drift during the sweep affects all sets alike instead of penalising
whichever set ran last; and the order of the sets rotates from one repeat to the next
(repeat r starts with set r mod n), because the runs share the child process and a run can
leave state behind for the next one (warm thread pools, allocator caches, JIT code). The
sweep starts with one discarded warm-up run of every set. It is one Hydra sweep over
``+plugins`` whose values are the plan, in order (Hydra keeps repeated values).

Exit codes: 2 for a command refused before anything runs (one line); 3 when runs of the
sweep did not measure their set (failed, refused, diverged, or the metric is null there):
the report leaves them out and names them, and when not even the baseline measured there is
no report, only the line naming the runs; 0 when every measured run measured.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import asdict, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from accelopt.atomic import atomic_open, refuse_unwritable
from accelopt.bench.analysis import (
    HIGHER_IS_BETTER_HINTS,
    SetResult,
    higher_is_better,
    summarize,
)
from accelopt.bench.evaluate import EVAL_METRIC, PERPLEXITY, evaluate_run
from accelopt.bench.render import render_markdown, render_png, render_table
from accelopt.errors import (
    JobsUnfinished,
    PluginResolutionError,
    Terminated,
    UserError,
    first_line,
    listed,
)
from accelopt.plugin import Registry, resolve, valid_combinations
from accelopt.report.console import default_console
from accelopt.report.metrics import finite_json
from accelopt.runtime.compare import is_inert


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
    parser.add_argument("--metric", default=None,
                        help="a key of metrics.json's summary (default: duration_s; with "
                        "--reanalyze: the bench's own, or another its runs measured)")
    parser.add_argument("--higher-is-better", choices=("auto", "yes", "no"), default="auto",
                        help="the metric's direction; auto: higher for names with "
                        + ", ".join(HIGHER_IS_BETTER_HINTS)
                        + ", lower for every other (times, bytes, perplexity); with "
                        "--reanalyze, auto keeps the direction bench.json records for the "
                        "bench's own metric, and yes/no that reverses it says so on stderr "
                        "(the report goes beside the bench's own)")
    parser.add_argument("--out", default="", help="output directory (default: runs/bench/<time>)")
    parser.add_argument("--eval", action=argparse.BooleanOptionalAction, default=True,
                        help="the quality column, on unless --no-eval: each run's held-out "
                        "top-1 (accuracy, or P@1 for multi-label data, as the run scored it; "
                        "the perplexity of runs that train language models only)")
    parser.add_argument("--reanalyze", action="store_true",
                        help="run nothing: re-read the finished bench in --out (its bench.json "
                        "and runs) and write its table, chart and report again")
    parser.add_argument("--force", action="store_true",
                        help="with --reanalyze: write the report even when runs of the plan "
                        "are missing or unreadable, naming them in it (else it is refused)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run, before, "
                        "between or after the options; plugins.NAME.key=value applies only "
                        "to the sets that select NAME")
    # intermixed: `--plugins noop workload=tiny --repeats 1 run.seed=1` is one command line
    # (parse_args would take the overrides after an option for unrecognized arguments)
    given = {a.split("=", 1)[0] for a in args if a.startswith("--")}  # the options named
    opts = parser.parse_intermixed_args(args)
    if opts.metric is not None and not opts.metric.strip():
        raise UserError("--metric needs a name (a key of metrics.json's summary), got ''")
    if opts.metric is not None and "=" in opts.metric:  # `--metric workload=tiny`: the name
        # left out, argparse took the next override as it (and the runs lost that override)
        raise UserError(f"--metric takes a key of metrics.json's summary (e.g. --metric "
                        f"avg_jct_s), got the override {opts.metric!r}; give the metric's "
                        "name after --metric")
    opts.metric_given, opts.metric = opts.metric is not None, opts.metric or "duration_s"
    if opts.plugins and opts.sets:  # --plugins was ignored in silence beside --sets
        raise UserError("give --plugins (its valid combinations) or --sets (exactly these "
                        "sets), not both")
    extras = [name for name, on in (("--plugins", opts.plugins), ("--sets", opts.sets),
                                    ("--repeats", "--repeats" in given),
                                    ("--no-eval", "--no-eval" in given),
                                    ("--eval", "--eval" in given),
                                    (" ".join(opts.overrides), opts.overrides)) if on]
    if opts.reanalyze and extras:  # they were ignored in silence
        raise UserError("--reanalyze runs nothing: its sets and settings are those of the "
                        f"bench in --out (its bench.json); drop {', '.join(extras)}")
    if opts.repeats < 1:
        raise UserError("--repeats must be >= 1")
    if opts.force and not opts.reanalyze:
        raise UserError("--force goes with --reanalyze (a new bench never overwrites results)")
    return opts


def plugin_sets(opts: argparse.Namespace, registry: Registry) -> list[list[str]]:
    if opts.sets:
        sets = parse_sets(opts.sets)
    else:
        from accelopt.cli.commands import plugin_list

        names = plugin_list(opts.plugins, "bench") if opts.plugins else []
        twice = [n for i, n in enumerate(names) if n in names[:i]]
        if twice:  # as `accelopt run +plugins=[a,a]` refuses it (plugin.resolve)
            raise PluginResolutionError(f"plugin '{twice[0]}' is selected twice; list it once")
        if not names:
            raise UserError("name the plugins to compare: accelopt bench --plugins a,b [overrides]")
        sets = valid_combinations([registry.get(n) for n in names])
    if [] not in sets:
        sets.insert(0, [])
    if not any(sets):
        raise UserError(f"--sets {opts.sets!r} is the baseline alone, and a bench compares "
                        "plugin sets with it: add at least one, e.g. '[],[salus]' (to repeat one "
                        "configuration: accelopt run -m run.repeat=1,2,3)")
    resolved = [[s.name for s in resolve(chosen, registry)] for chosen in sets]
    twice = [_label(s) for i, s in enumerate(resolved) if s in resolved[:i]]
    if twice:
        raise UserError(f"--sets names {listed(twice)} more than once; give each set once")
    return resolved


SETS_FORMAT = "--sets takes bracketed sets separated by commas, e.g. '[],[salus],[salus,tictac]'"


def parse_sets(text: str) -> list[list[str]]:
    """``'[],[salus],[salus,tictac]'`` -> ``[[], ['salus'], ['salus', 'tictac']]``; anything
    else (an unclosed bracket, a name outside brackets) is one line saying the format."""
    sets: list[list[str]] = []
    rest = text.strip()
    while rest:
        match = re.match(r"\[\s*([\w\s,-]*)\]\s*(,\s*|$)", rest)
        if match is None:
            raise UserError(f"{SETS_FORMAT}; got {text!r}")
        sets.append([n.strip() for n in match.group(1).split(",") if n.strip()])
        rest = rest[match.end():]
    if not sets:
        raise UserError(f"{SETS_FORMAT}; got {text!r}")
    return sets


OWN_LAYOUT = ("hydra.sweep.dir", "hydra.sweep.subdir")
"""Overrides the bench sets for its sweep: a user's would move the runs where the report
does not look (``collect`` reads ``--out``/runs)."""


def split_overrides(overrides: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """(overrides for every run, {plugin: its ``plugins.NAME.*`` settings})."""
    common: list[str] = []
    per_plugin: dict[str, list[str]] = defaultdict(list)
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key == "plugins" or (key.startswith("plugins") and "." not in key):
            raise UserError("give plugin sets with --plugins/--sets, not +plugins= overrides")
        if key in OWN_LAYOUT:
            raise UserError(f"'{override}': the bench lays out its runs itself (--out DIR: "
                            "DIR/runs/<n>); drop it and choose the directory with --out")
        if key.startswith("plugins."):
            name = key.split(".")[1]
            if "=" not in override or not name:
                raise UserError(f"'{override}': plugin settings look like "
                                "plugins.NAME.key=value")
            per_plugin[name].append(override.lstrip("+"))
        else:
            common.append(override)
    return common, dict(per_plugin)


def set_overrides(plugins: list[str], common: list[str],
                  per_plugin: dict[str, list[str]]) -> list[str]:
    """The complete override list of one set's run (what ``accelopt run`` would be given)."""
    mine = [o for name in plugins for o in per_plugin.get(name, [])]
    return [f"+plugins=[{','.join(plugins)}]", *common, *mine]


def preflight(sets: list[list[str]], common: list[str], per_plugin: dict[str, list[str]],
              registry: Registry, *, explicit: bool = True) -> list[list[str]]:
    """Check every set as ``accelopt run`` checks it before training (each plugin's
    ``accelopt_configure`` validates the whole run config) before anything runs, so a set
    that cannot run is named in one line instead of failing minutes into the sweep.

    Returns the sets to run. ``explicit`` sets (``--sets``) are the user's choice: one that
    cannot run refuses the bench. Sets derived from ``--plugins`` ("every valid
    combination") leave out those this configuration refuses, as ``accelopt matrix`` does,
    one line on stderr per reason; the bench is refused only when nothing but the baseline
    would be left, or when a plugin setting the user gave is what a set refuses."""
    from accelopt.cli.hydra_run import composed_with_every_plugin
    from accelopt.runtime.run import refused_sets

    unused = sorted(set(per_plugin) - {name for s in sets for name in s})
    if unused:
        raise UserError(f"settings for plugin(s) {', '.join(unused)} but no set selects them "
                        f"(sets: {', '.join(_label(s) for s in sets)})")
    # each set is checked on its part of one composition with every set's plugin settings
    settings = [o for name in dict.fromkeys(n for s in sets for n in s)
                for o in per_plugin.get(name, [])]
    cfg = composed_with_every_plugin(sets, [*common, *settings], registry)
    refused = refused_sets(cfg, registry, [tuple(s) for s in sets])
    if not refused:
        return sets
    if not explicit:
        from accelopt.cli.commands import refuse_plugin_settings, say_left_out

        refuse_plugin_settings(refused, [*common, *settings], registry)
        kept = [s for s in sets if tuple(s) not in refused]
        if any(kept):
            say_left_out(refused, " ".join(common) or "the default configuration")
            return kept
    (first, reason), *rest = refused.items()
    others = [_label(list(s)) for s, _ in rest]
    also = f" (also cannot run: {', '.join(others)})" if others else ""
    raise UserError(f"set {_label(list(first))} cannot run: {reason}{also}")


def _label(plugins: list[str]) -> str:
    return "[" + ",".join(plugins) + "]"


def settings_line(common: list[str], per_plugin: dict[str, list[str]]) -> str:
    torch_threads = torch.get_num_threads()
    parts = [f"{os.cpu_count()} CPUs", f"torch {torch.__version__} ({torch_threads} threads)",
             "overrides: " + (" ".join([*common, *(o for v in per_plugin.values() for o in v)])
                              or "none")]
    return ", ".join(parts)


def bench_command(args: list[str]) -> int:
    opts = parse_args(args)
    if opts.reanalyze:
        return reanalyze(opts)
    common, per_plugin = split_overrides(opts.overrides)
    registry = Registry.discover()
    sets = plugin_sets(opts, registry)
    sets = preflight(sets, common, per_plugin, registry, explicit=bool(opts.sets))
    out = Path(opts.out or f"runs/bench/{datetime.now():%Y-%m-%d_%H-%M-%S-%f}").resolve()
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a directory (new, or empty)")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} {_what_out_holds(out)}")
    hydra_quoted(out / "runs")  # a path Hydra would misread: refused before anything is written
    refuse_unwritable(out, "give --out a directory you can write")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    marker = _mark_running(out)
    try:
        return _bench(opts, args, out, created, sets, common, per_plugin)
    finally:  # however it ends (a report, a refusal, SIGTERM, Ctrl-C): it is not running
        marker.unlink(missing_ok=True)


def command_line(args: list[str]) -> str:
    """The bench's command as the report shows it (bench.md's ``Command:``, bench.json's
    ``context.command``): each argument shell-quoted, so the line pastes back into a shell
    and runs the same bench (joined with spaces, ``--out "bench out"`` read back as two
    arguments)."""
    return shlex.join(["accelopt", "bench", *args])


def _bench(opts: argparse.Namespace, args: list[str], out: Path, created: bool,
           sets: list[list[str]], common: list[str], per_plugin: dict[str, list[str]]) -> int:
    """The bench in ``out`` (checked, created, marked running): the sweep, then its report."""
    console = default_console()
    plan = run_plan(sets, opts.repeats)
    sweep = ",".join(_label(s) for _, s, _ in plan)
    # Plugin settings are force-added (++) so that composing them works for every set; each
    # run drops them where its set does not select the plugin (cli/sweep_settings.py).
    forced = [f"++{o}" for v in per_plugin.values() for o in v]
    command = [
        sys.executable, "-m", "accelopt.cli.main", "run", "-m",
        f"+plugins={sweep}", "run.progress=false",
        f"hydra.sweep.dir={hydra_quoted(out / 'runs')}", "hydra.sweep.subdir=${hydra.job.num}",
        *common, *forced,
    ]
    total = len(plan)
    context = {
        "command": command_line(args),
        "metric": opts.metric,
        "higher_is_better": _direction(opts),
        "repeats": opts.repeats,
        "machine": f"{platform.node()} {platform.machine()} {platform.platform()}",
        "python": platform.python_version(),
        "settings": settings_line(common, per_plugin),
        "sweep_s": None,
        "quality": EVAL_METRIC if opts.eval else None,
    }
    # the plan first: a bench stopped midway (Ctrl-C, a failed run) can still be reported
    # from the runs it finished (--reanalyze --force); the report rewrites it at the end
    _write_bench_json(out, context, [], plan)
    console.print(f"bench: {len(sets)} plugin sets x {opts.repeats} repeats (+1 warm-up run "
                  f"per set) = {total} runs, interleaved; log: {out / 'sweep.log'}",
                  markup=False)  # a [ in --out is part of the path
    started = time.perf_counter()
    try:
        code = _run_sweep(command, out, total, console, metric=opts.metric,
                          baseline=plan.index((-1, [], True)))
    except UnknownMetric:  # only the first run of a mistyped command: its --out stays free
        _remove_what_the_bench_wrote(out, created)
        raise
    except BaseException:
        _say_how_to_report_what_ran(out, plan, opts.metric)
        raise
    context["sweep_s"] = round(time.perf_counter() - started, 1)
    try:
        reported = _report_runs(out, context, plan, console)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (Terminated) while it wrote the report
        _say_how_to_report_what_ran(out, plan, opts.metric, reporting=True)
        raise
    if code != 0 and reported == 0:  # every run measured, yet the sweep says it failed
        print(f"error: the sweep exited {code} though every run of the plan measured "
              f"{opts.metric}; see {out / 'sweep.log'}", file=sys.stderr)
        return JobsUnfinished.exit_code
    return reported


BENCH_WRITES = ("bench.json", "sweep.log", "runs")
"""What a bench writes in its ``--out`` before its report: the plan, the sweep's log and
the sweep's runs (its :data:`RUNNING` marker is removed however it ends)."""


def _remove_what_the_bench_wrote(out: Path, created: bool) -> None:
    """Leave ``out`` as the bench found it, so that the corrected command can use it (an
    ``--out`` that is not empty is refused): removed where the bench created it, else (it
    was empty) emptied of :data:`BENCH_WRITES` only, never of anything else."""
    if created:
        shutil.rmtree(out, ignore_errors=True)
        return
    for name in BENCH_WRITES:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def hydra_quoted(path: Path) -> str:
    """``path`` as a value of Hydra's override grammar: single-quoted, so that a comma,
    bracket, space or ``=`` in it is part of the path (unquoted, ``--out a,b`` was a sweep
    over two directories and the bench failed after writing its plan). A quote, backslash or
    ``$`` (an interpolation inside quotes too) is refused in one line before anything is
    written: Hydra would read them as grammar, not as the path."""
    text = str(path)
    odd = sorted({c for c in text if c in "'\\$"})
    if odd:
        raise UserError(f"--out {path.parent}: {' '.join(odd)} in the path is read by Hydra's "
                        "override grammar, not as part of the path; give a directory "
                        "without it")
    return f"'{text}'"


def _what_out_holds(out: Path) -> str:
    """Why a non-empty ``--out`` is refused, and what to do: a bench still running (its
    :data:`RUNNING` marker names a live process) is left to finish; a finished bench can be
    reported again (--reanalyze); a bench that did not finish (its plan written, no report,
    no process) cannot, only the runs that measured its metric with --force, where the
    baseline is among them; anything else is not a bench at all."""
    running = _still_running(out)
    if running is not None:
        return (f"holds a bench that has not finished: {running} (log: {out / 'sweep.log'}); "
                "give another --out, or wait for it to end")
    try:
        saved = json.loads((out / "bench.json").read_text())
        plan = saved_plan(saved)
        context = saved.get("context", {})
        # its sweep_s stays null unless the sweep ended: a stopped bench's report written by
        # --reanalyze --force (its 'sets') is still one of an interrupted bench
        stopped = "sweep_s" in context and context["sweep_s"] is None
        finished = bool(saved["sets"]) and not (out / RUNNING).exists() and not stopped
        metric = str(context.get("metric") or "duration_s")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ("is not empty and holds no finished bench (a bench's results are never "
                "overwritten); give another --out, or delete that directory")
    if finished:
        return ("is not empty: it holds a finished bench (a bench's results are never "
                "overwritten); give another --out, or --reanalyze to report it again")
    done, baseline = _runs_that_measured(out / "runs", plan, metric)
    measured = sum(1 for _, _, warmup in plan if not warmup)
    some = (f"; or report those with --reanalyze --force: accelopt bench --reanalyze --force "
            f"--out {out}" if baseline else "")
    forced = ", and its report is from --reanalyze --force" if saved["sets"] else ""
    return (f"holds a bench that did not finish ({done} of its {measured} measured runs "
            f"measured {metric}; it was interrupted before its sweep ended{forced}; see "
            f"{out / 'sweep.log'}); give another --out, or delete that directory{some}")


RUNNING = "bench.running"
"""The file a bench keeps in its ``--out`` while it runs (its process id and host), removed
however it ends: one left behind with no such process is a bench that was killed."""


def _mark_running(out: Path) -> Path:
    """Create ``out``/:data:`RUNNING` (exclusively: of two benches given the same empty
    ``--out`` at once, the second is refused as the first's ``--out`` is)."""
    marker = out / RUNNING
    try:
        with marker.open("x") as handle:
            json.dump({"pid": os.getpid(), "host": platform.node()}, handle)
    except FileExistsError:
        raise UserError(f"--out {out} {_what_out_holds(out)}") from None
    return marker


def _still_running(out: Path) -> str | None:
    """Which process runs the bench in ``out`` ("still running (process N on HOST)"), or
    ``None`` when none does: no :data:`RUNNING` marker, or its process is gone from this
    host. A process on another host cannot be asked, so it may be running."""
    try:
        recorded = json.loads((out / RUNNING).read_text())
        pid, host = int(recorded["pid"]), str(recorded["host"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):  # written this instant, or damaged
        return f"its {RUNNING} names no process it can be asked about"
    if host != platform.node():
        return f"it may still be running (process {pid} on {host}, which cannot be asked here)"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # another user's process: alive
        pass
    return f"it is still running (process {pid} on {host})"


def _runs_that_measured(runs_dir: Path, plan: list[tuple[int, list[str], bool]],
                        metric: str) -> tuple[int, bool]:
    """(how many measured runs of ``plan`` measured ``metric``, whether a baseline run is
    among them): what a stopped bench can report with --reanalyze --force. A run that was
    stopped, failed or lacks the metric wrote a metrics.json too, and counts for nothing."""
    done, baseline = 0, False
    for path in _measured(runs_dir, plan):
        try:
            summary = read_run(path, plan[int(path.parent.name)][1])["summary"]
        except UnreadableRun:
            continue
        value = summary.get(metric)
        if run_failure(summary) is None and measurement(value) is not None:
            done += 1
            baseline = baseline or not plan[int(path.parent.name)][1]
    return done, baseline


def _report_runs(out: Path, context: dict[str, Any], plan: list[tuple[int, list[str], bool]],
                 console: Console, skip: set[int] | frozenset[int] = frozenset(),
                 name: str = "bench") -> int:
    """The report from the runs that measured; exit 3 (one line naming them) when runs
    were left out because they failed, were refused, diverged or did not measure the
    metric: the report is written from the others, and says so."""
    results, left_out = collect(out / "runs", context["metric"], plan, skip)
    context["left_out"] = left_out
    if context.get("quality"):
        results = with_quality(results, out / "runs", plan, console, skip=skip,
                               context=context)
    report(results, context, plan, out, console, name)
    if not left_out:
        return 0
    print(f"error: {len(left_out)} measured run(s) left out of the report: "
          f"{listed(left_out, sep='; ')}", file=sys.stderr)
    return JobsUnfinished.exit_code


def sweep_took(context: dict[str, Any]) -> str:
    """How long the sweep took, or that it did not finish (a stopped bench reported with
    --reanalyze --force)."""
    took = context.get("sweep_s")
    return "the sweep did not finish" if took is None else f"sweep took {took} s"


def _direction(opts: argparse.Namespace) -> bool:
    """Whether higher is better for ``opts.metric``: ``--higher-is-better``, else guessed
    from its name."""
    given = {"auto": None, "yes": True, "no": False}[opts.higher_is_better]
    return higher_is_better(opts.metric) if given is None else given


def _say_how_to_report_what_ran(out: Path, plan: list[tuple[int, list[str], bool]],
                                metric: str, reporting: bool = False) -> None:
    """A stopped bench's line (stderr, before its error): how many measured runs measured
    ``metric``, and the command that reports them; none when no run did (the run that was
    stopped wrote a metrics.json, with its error, and measured nothing). ``reporting``: it
    stopped after its sweep, while it wrote its report (the table may be printed and
    bench.json written, the chart and bench.md not): the runs are all kept."""
    done, baseline = _runs_that_measured(out / "runs", plan, metric)
    measured = sum(1 for _, _, warmup in plan if not warmup)
    if done and baseline and reporting:
        print(f"the bench stopped while it wrote its report, after its sweep ({done} of its "
              f"{measured} measured runs measured {metric}; they are kept in {out / 'runs'}); "
              f"report them with: accelopt bench --reanalyze --force --out {out}",
              file=sys.stderr)
    elif done and baseline:
        print(f"the bench stopped after {done} of its {measured} measured runs; report "
              f"them with: accelopt bench --reanalyze --force --out {out}", file=sys.stderr)
    elif done:
        print(f"the bench stopped after {done} of its {measured} measured runs, none of them "
              "the baseline's (no plugins), which gains are against: there is nothing to "
              "report; rerun it", file=sys.stderr)


def reanalyze(opts: argparse.Namespace) -> int:
    """``--reanalyze``: the same report from the runs a finished bench left in ``--out``.
    Every measured run of the plan (bench.json lists them) must be readable: a report from
    fewer runs has thinner statistics under the same title, so it replaces the finished one
    only with ``--force``, and then names the runs it lacks."""
    if not opts.out:
        raise UserError("--reanalyze needs --out DIR, the directory of a finished bench")
    out = Path(opts.out).resolve()
    running = _still_running(out)
    if running is not None:  # its report would be replaced by the bench's own at its end
        raise UserError(f"--reanalyze: the bench in {out} has not finished: {running}; wait "
                        "for it to end (it writes its report itself)")
    try:
        saved = json.loads((out / "bench.json").read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"--reanalyze: cannot read {out / 'bench.json'} ({exc})") from None
    if isinstance(saved, dict) and "runs" not in saved:
        raise UserError(f"--reanalyze: {out / 'bench.json'} predates the run plan; rerun it")
    try:
        plan, context = saved_plan(saved), saved_context(saved)
    except ValueError as exc:
        raise UserError(f"--reanalyze: {out / 'bench.json'} is not what a bench writes: "
                        f"{exc}; rerun the bench") from None
    context.pop("missing_runs", None)  # this reading decides which runs are missing
    name = "bench"
    if opts.metric_given or opts.higher_is_better != "auto":
        # the runs measured more than the bench reported: another metric (or direction),
        # reported beside the bench's own report, which stays as it is
        metric = opts.metric if opts.metric_given else context["metric"]
        direction = _reanalyzed_direction(opts, metric, context)
        if (metric, direction) != (context["metric"], context["higher_is_better"]):
            name = f"bench-{metric}" + ("" if direction == higher_is_better(metric) else
                                        f"-{'higher' if direction else 'lower'}")
            context["command"] += (f" (reanalyzed: --metric {metric} --higher-is-better "
                                   f"{'yes' if direction else 'no'})")
        context["metric"], context["higher_is_better"] = metric, direction
    problems = unreadable_runs(out / "runs", plan)
    if problems:
        named = [f"{reason} ({_label(plan[i][1])}, repeat {plan[i][0]})"
                 for i, reason in problems.items()]
        if not opts.force:
            kept = ("the finished report is left as it is (rerun the bench, or"
                    if saved.get("sets")
                    else "the bench did not finish (rerun it, or")
            raise UserError(
                f"--reanalyze: {len(named)} measured run(s) of the plan in "
                f"{out / 'bench.json'} cannot be read: {listed(named, sep='; ')}; {kept} add "
                "--force to report the other runs and name these in the report)")
        context["missing_runs"] = named
    return _report_runs(out, context, plan, default_console(), set(problems), name)


def _reanalyzed_direction(opts: argparse.Namespace, metric: str, context: dict[str, Any]) -> bool:
    """Whether higher is better for ``metric`` in a reanalysis: for the bench's own metric,
    the direction its bench.json records (``--higher-is-better yes`` given to the bench was
    lost to the name's guess, and the gain was reported inverted), unless one is given; a
    given one that reverses the recorded one is said in one line on stderr. Another metric:
    :func:`_direction`."""
    recorded = context["higher_is_better"]
    if metric != context["metric"]:
        return _direction(opts)
    if opts.higher_is_better == "auto":
        return bool(recorded)
    given = opts.higher_is_better == "yes"
    if given != recorded:
        def word(higher: bool) -> str:
            return "higher" if higher else "lower"

        print(f"note: --higher-is-better {opts.higher_is_better} reports {metric} as "
              f"{word(given)} is better, but the bench recorded {word(recorded)} is better "
              "(bench.json); its own report is left as it is", file=sys.stderr)
    return given


def saved_plan(saved: Any) -> list[tuple[int, list[str], bool]]:
    """The run plan of a bench.json (its ``runs``), checked entry by entry: a partial or
    hand-edited file is a ``ValueError`` saying what is wrong, not a ``KeyError`` deep in
    the report."""
    runs = saved.get("runs") if isinstance(saved, dict) else None
    if not isinstance(runs, list) or not runs:
        raise ValueError("its 'runs' is not a list of the sweep's runs")
    plan = []
    for i, entry in enumerate(runs):
        entry = entry if isinstance(entry, dict) else {}
        repeat, plugins, warmup = (entry.get(k) for k in ("repeat", "plugins", "warmup"))
        if isinstance(repeat, bool) or not isinstance(repeat, int):
            raise ValueError(f"runs[{i}] has no integer 'repeat' (got {repeat!r})")
        if not isinstance(plugins, list) or not all(isinstance(n, str) for n in plugins):
            raise ValueError(f"runs[{i}] has no list of plugin names 'plugins' "
                             f"(got {plugins!r})")
        if not isinstance(warmup, bool):
            raise ValueError(f"runs[{i}] has no true/false 'warmup' (got {warmup!r})")
        plan.append((repeat, plugins, warmup))
    return plan


SAVED_CONTEXT = {"command": str, "metric": str, "higher_is_better": bool, "repeats": int,
                 "machine": str, "python": str}
"""The context keys the report reads from a bench.json, and their types."""


def saved_context(saved: dict[str, Any]) -> dict[str, Any]:
    """A copy of a bench.json's ``context``, checked for the keys the report reads (a
    ``ValueError`` naming the first one missing or of the wrong type)."""
    context = saved.get("context")
    if not isinstance(context, dict):
        raise ValueError("it has no 'context' object")
    for key, kind in SAVED_CONTEXT.items():
        value = context.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)) \
                or (kind is str and key == "metric" and not value.strip()):
            raise ValueError(f"its context has no {kind.__name__} '{key}' (got {value!r})")
    return dict(context)


def unreadable_runs(runs_dir: Path, plan: list[tuple[int, list[str], bool]]) -> dict[int, str]:
    """{run number: '<its metrics.json> (why)'} for each measured run of the plan whose
    metrics.json is missing or cannot be read (warm-up runs count for nothing). A run the
    sweep's log says failed before writing one is none of them: :func:`collect` leaves it
    out, with that error."""
    problems: dict[int, str] = {}
    failed = sweep_log_errors(runs_dir.parent / "sweep.log")
    for i, (_, plugins, warmup) in enumerate(plan):
        if not warmup:
            try:
                read_run(runs_dir / str(i) / "metrics.json", plugins)
            except UnreadableRun as exc:
                if not (exc.reason == "missing" and i in failed):
                    problems[i] = f"{exc.path} ({exc.reason})"
    return problems


class UnreadableRun(UserError):
    """A run's metrics.json is missing, not JSON, lacks its summary or plugin set, or lists
    another plugin set than the plan ran there (a run cut short, a disk that filled, a file
    edited by hand or copied from another run)."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(f"cannot read {path} ({reason}); rerun the bench")


def read_run(path: Path, planned: list[str] | None = None) -> dict[str, Any]:
    """A run's metrics.json, checked for what the report reads from it; with ``planned``
    (the set bench.json planned for the run), checked to be that set's run: one edited or
    copied from another run's would be counted in the wrong set, in silence."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data["summary"], dict) or not isinstance(data["run"]["plugins"], list):
            raise ValueError("its summary or run.plugins is not what a run writes")
    except FileNotFoundError:
        raise UnreadableRun(path, "missing") from None
    except KeyError as exc:
        raise UnreadableRun(path, f"no {exc} key") from None
    except (OSError, ValueError, TypeError) as exc:
        raise UnreadableRun(path, str(exc)) from None
    ran = [str(name) for name in data["run"]["plugins"]]
    if planned is not None and sorted(ran) != sorted(planned):
        raise UnreadableRun(path, f"its run.plugins is {_label(ran)}, not {_label(planned)}, "
                            "the set bench.json planned for this run: edited, or copied from "
                            "another run")
    return data


def report(results: list[SetResult], context: dict[str, Any],
           plan: list[tuple[int, list[str], bool]], out: Path, console: Console,
           name: str = "bench") -> int:
    """Summarize, print the table and write ``<name>.json``, ``.png`` and ``.md`` (bench.*:
    the bench's own report; another metric's beside it)."""
    summary = summarize(results, context["metric"], context["higher_is_better"])
    console.print(render_table(summary, context))
    console.print(f"machine: {context['machine']}; {context['settings']}; {sweep_took(context)}",
                  markup=False)  # an override's [..] ('hydra.searchpath=[file://..]') is no markup
    if context.get("missing_runs"):
        console.print(f"reported without {len(context['missing_runs'])} run(s) of the plan "
                      f"(--force): {listed(context['missing_runs'], sep='; ')}",
                      markup=False)  # the sets' [a,b] labels are not rich markup
    if context.get("left_out"):
        console.print(f"left out {len(context['left_out'])} run(s) that did not measure: "
                      f"{listed(context['left_out'], sep='; ')}", markup=False)
    _write_bench_json(out, context, [asdict(s) for s in summary], plan, name)
    render_png(summary, context, out / f"{name}.png")
    (out / f"{name}.md").write_text(render_markdown(summary, context))
    console.print(f"report: {out / f'{name}.md'}  chart: {out / f'{name}.png'}", markup=False)
    return 0


def _write_bench_json(out: Path, context: dict[str, Any], sets: list[dict[str, Any]],
                      plan: list[tuple[int, list[str], bool]], name: str = "bench") -> None:
    """bench.json: the context, each set's figures (none yet while the sweep runs) and the
    run plan (what ``--reanalyze`` reads)."""
    runs = [{"run": i, "repeat": r, "plugins": p, "warmup": w} for i, (r, p, w) in enumerate(plan)]
    with atomic_open(out / f"{name}.json") as handle:  # an undefined gain (NaN) is null
        handle.write(finite_json({"context": context, "sets": sets, "runs": runs}, indent=2))


def _run_sweep(command: list[str], out: Path, total: int, console: Console,
               metric: str | None = None, baseline: int = 0) -> int:
    """Run the sweep with a progress bar; a ``metric`` the baseline's first run (number
    ``baseline``) does not measure stops it there (one line), instead of after every run.
    Returns the sweep's exit code: a run that failed does not stop the others (Hydra goes
    on), and the report leaves it out (:func:`collect`); a sweep that left no run at all,
    nor any run's error, is one line."""
    log = (out / "sweep.log").open("w")
    columns = (TextColumn("runs"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("runs", total=total)
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                done = list((out / "runs").glob("*/metrics.json"))
                progress.update(task, completed=len(done))
                first = out / "runs" / str(baseline) / "metrics.json"
                if metric is not None and first.exists():
                    missing = _missing_metric(first, metric)
                    if missing is not None:  # the baseline's first run decides
                        metric = None
                        if missing:
                            raise UnknownMetric(missing)
                try:
                    proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    continue
        except BaseException as exc:  # a refusal, SIGTERM (Terminated), Ctrl-C: the sweep
            _stop(proc, exc)  # ends too
            raise
        finally:
            log.close()
    if proc.returncode != 0 and not list((out / "runs").glob("*/metrics.json")) \
            and not sweep_log_errors(out / "sweep.log"):  # runs that failed: the report names them
        lines = [line for line in (out / "sweep.log").read_text().strip().splitlines()
                 if not line.startswith(HYDRA_HINT)]  # Hydra's hint is no cause
        tail = [line.removeprefix("error: ") for line in lines[-1:]]  # the sweep's last line
        raise UserError(f"the sweep failed (exit {proc.returncode}): {' '.join(tail)} "
                        f"(full log: {out / 'sweep.log'})")
    return proc.returncode


HYDRA_HINT = "Set the environment variable HYDRA_FULL_ERROR=1"
"""The line Hydra ends a failure with, after the one that says what failed."""


CTRL_C_GRACE_S = 5.0
"""How long a bench stopped by Ctrl-C lets its sweep end on its own before it forwards the
SIGINT: a terminal's Ctrl-C (and ``timeout -s INT``) reaches the sweep too, being in the
bench's process group, and a second signal inside the sweep's clean-up cut it short."""
STOP_WAIT_S = 10.0
"""How long the sweep has to end once asked, before it is killed."""


def _stop(proc: subprocess.Popen[bytes], why: BaseException | None = None) -> None:
    """End the sweep, as the bench was stopped (``why``): asked first (a cluster run stops
    its ranks and removes its network namespaces), killed if still there
    :data:`STOP_WAIT_S` later; reaped. Ctrl-C is passed on as SIGINT, after
    :data:`CTRL_C_GRACE_S` for the sweep to end on the one it got itself, so that the sweep
    records its stopped run as "interrupted (Ctrl-C)", 130, as the bench says (a SIGTERM
    made it "terminated (SIGTERM)", 143); the bench's own SIGTERM (:class:`Terminated`), or
    a refusal, is passed on as SIGTERM."""
    if isinstance(why, KeyboardInterrupt) and not isinstance(why, Terminated):
        try:
            proc.wait(timeout=CTRL_C_GRACE_S)
            return
        except (subprocess.TimeoutExpired, KeyboardInterrupt):  # a second Ctrl-C: at once
            proc.send_signal(signal.SIGINT)
    else:
        proc.terminate()
    try:
        proc.wait(timeout=STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _missing_metric(metrics_json: Path, metric: str) -> str | None:
    """The one-line refusal when a baseline run's summary has no value of ``metric`` (not a
    key, or null: this workload does not measure it), '' when it has one or the run failed
    (its summary says nothing of the metric: the end of the sweep decides), ``None`` when the
    file cannot be read yet."""
    try:
        summary = json.loads(metrics_json.read_text())["summary"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # not ours to judge (yet): the end of the sweep decides
    numbers = {k for k, v in summary.items() if isinstance(v, (int, float))}
    if metric in numbers or run_failure(summary):  # a failed run's summary decides nothing
        return ""
    if metric in summary:
        return (f"metric '{metric}' has no value in the baseline run's metrics.json summary "
                f"({summary[metric]!r}: this workload does not measure it); choose one of: "
                f"{', '.join(sorted(numbers))}")
    return unknown_metric(metric, numbers)


class UnknownMetric(UserError):
    """``--metric`` names no key of the first run's summary (known only once a run has
    written one: plugins and cluster runs add their own keys)."""


def unknown_metric(metric: str, available: set[str]) -> str:
    close = difflib.get_close_matches(metric, sorted(available), n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return (f"metric '{metric}' is not in the runs' metrics.json summary; {hint}choose one "
            f"of: {', '.join(sorted(available))}")


def run_plan(sets: list[list[str]], repeats: int) -> list[tuple[int, list[str], bool]]:
    """(repeat, plugin set, is warm-up) for each run, in sweep order. First one discarded
    warm-up run of *every* set: the runs share one process, and each set pays its own
    one-off costs on its first run there (numba JIT compilation, lazy imports, first
    autograd pass), which a steady-state comparison must not count. Then repeat r runs the
    sets rotated by r (a cyclic Latin square when ``repeats`` is the number of sets: every
    set runs once in every position, after every other set)."""
    plan: list[tuple[int, list[str], bool]] = [(-1, s, True) for s in sets]
    for r in range(repeats):
        k = r % len(sets)
        plan += [(r, s, False) for s in sets[k:] + sets[:k]]
    return plan


def _measured(runs_dir: Path, plan: list[tuple[int, list[str], bool]],
              skip: set[int] | frozenset[int] = frozenset()) -> list[Path]:
    """The metrics.json of every run that is not a warm-up, in sweep order (runs in
    ``skip``, the unreadable ones a forced --reanalyze reports without, left out)."""
    paths = sorted((p for p in runs_dir.glob("*/metrics.json") if p.parent.name.isdigit()),
                   key=lambda p: int(p.parent.name))
    return [p for p in paths if int(p.parent.name) < len(plan)
            and not plan[int(p.parent.name)][2] and int(p.parent.name) not in skip]


def run_failure(summary: dict[str, Any]) -> str | None:
    """Why a run's figures are no measurement of its set (``None``: they are): the run
    stopped with an error, or a job of it failed, was refused or diverged. Its duration is
    the time to the crash, its JCTs those of the jobs that survived: a set that crashed
    read as a 36x gain, one that diverged as a gain with a top-1 over its surviving jobs."""
    if summary.get("error"):
        return f"the run failed: {first_line(str(summary['error']))}"
    for key, what in (("n_failed", "failed"), ("n_rejected", "were refused"),
                      ("n_diverged", "diverged")):
        count = summary.get(key)
        if isinstance(count, int) and count > 0:
            return f"{count} of its {summary.get('n_jobs', '?')} job(s) {what}"
    return None


class NothingMeasured(JobsUnfinished):
    """The sweep ran, but no run measured the baseline (or any set): every run failed, was
    refused or diverged. Exit 3, as for runs left out of a report (the bench's runs are
    what failed, not the command line), with the runs named in one line."""


def collect(runs_dir: Path, metric: str, plan: list[tuple[int, list[str], bool]],
            skip: set[int] | frozenset[int] = frozenset()
            ) -> tuple[list[SetResult], list[str]]:
    """Group every measured run's metric by its plugin set (warm-up runs skipped), and name
    the runs left out: those that did not measure (:func:`run_failure`), those whose
    metric is null or not finite, and those that wrote no metrics.json (refused while their
    jobs were built: :func:`unwritten_runs`). Every measured run of the plan is one or the
    other, so a set whose every run is left out has no row, and the line says why."""
    values: dict[tuple[str, ...], list[float]] = defaultdict(list)
    repeats: dict[tuple[str, ...], list[int]] = defaultdict(list)
    inert: dict[tuple[str, ...], set[str]] = {}
    available: set[str] = set()
    keys: set[str] = set()
    left: dict[int, str] = {}  # run number: why it is left out
    all_failed = True
    paths = _measured(runs_dir, plan, skip)
    errors = sweep_log_errors(runs_dir.parent / "sweep.log")
    left.update(unwritten_runs(runs_dir, plan, {int(p.parent.name) for p in paths} | set(skip),
                               errors))
    if not paths and not errors:  # not even a run that failed: the runs are elsewhere
        raise UserError(f"no runs found under {runs_dir} (no <n>/metrics.json of a measured "
                        "run); see the sweep's log beside it")
    for path in paths:
        repeat, planned, _ = plan[int(path.parent.name)]
        data = read_run(path, planned)  # filed under the set the plan ran there
        summary = data["summary"]
        available |= {k for k, v in summary.items() if isinstance(v, (int, float))}
        keys |= set(summary)
        key = tuple(planned)
        where = f"{_label(list(key))} repeat {repeat} (run {path.parent.name})"
        value = summary.get(metric)
        failure = run_failure(summary)
        all_failed = all_failed and failure is not None
        why = failure or (None if measurement(value) is not None else
                          f"its {metric} is {value!r}")
        if why is not None:
            left[int(path.parent.name)] = f"{where}: {why}"
            continue
        values[key].append(float(value))
        repeats[key].append(repeat)
        here = inert_in_run(data)
        inert[key] = inert[key] & here if key in inert else here
    left_out = [left[i] for i in sorted(left)]  # in sweep order
    if metric not in keys and not all_failed:  # a failed run's summary may lack any key
        raise UserError(unknown_metric(metric, available))
    if not values:
        raise NothingMeasured(f"no run under {runs_dir} measured {metric}: "
                              f"{listed(left_out, sep='; ')}")
    if () not in values:
        raise NothingMeasured(f"no baseline run (no plugins) under {runs_dir} measured "
                              f"{metric}: gains are against it ({listed(left_out, sep='; ')}); "
                              "rerun the bench")
    return [SetResult(plugins, tuple(v), repeats=tuple(repeats[plugins]),
                      inert=tuple(p for p in plugins if p in inert[plugins]))
            for plugins, v in values.items()], left_out


def measurement(value: Any) -> float | None:
    """``value`` as a measurement, or ``None`` when it is none: not a number (null, a
    string, a bool) or not finite (NaN, infinity: a median and a gain of them are NaN
    too, a set reported with figures that say nothing)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def unwritten_runs(runs_dir: Path, plan: list[tuple[int, list[str], bool]],
                   accounted: set[int], errors: dict[int, str]) -> dict[int, str]:
    """{N: '<set> repeat R (run N): why'} for each measured run of the plan not in ``accounted``
    that wrote no metrics.json: refused while its jobs were built, or never run. Its
    reason is its first error line in the sweep's log (``errors``: :func:`sweep_log_errors`;
    it has no folder of its own to hold one)."""
    lines = {}
    for i, (repeat, plugins, warmup) in enumerate(plan):
        if warmup or i in accounted:
            continue
        why = (f"it failed before writing its metrics.json: {errors[i]}" if i in errors else
               f"it wrote no metrics.json (see {runs_dir.parent / 'sweep.log'})")
        lines[i] = f"{_label(plugins)} repeat {repeat} (run {i}): {why}"
    return lines


SWEEP_RUN = re.compile(r"\[HYDRA\]\s+#(\d+) : ")
"""The line with which Hydra's sweep log starts run N's part (``[HYDRA] <tab>#N : ...``)."""


SWEEP_CLOSING = re.compile(r"error: \d+ of \d+ runs of the sweep ")
"""The sweep's closing line after its last run (``hydra_run.sweep_failures``): about every
run, not the last one's own error."""


def sweep_log_errors(log: Path) -> dict[int, str]:
    """{run number: the first ``error:`` line of its part of the sweep's log} for the runs
    that logged one (none when the log cannot be read)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return {}
    errors: dict[int, str] = {}
    run = None
    for line in text.splitlines():
        match = SWEEP_RUN.search(line)
        if match is not None:
            run = int(match.group(1))
        elif (run is not None and run not in errors and line.startswith("error: ")
              and not SWEEP_CLOSING.match(line)):
            errors[run] = line.removeprefix("error: ").strip()
    return errors


def inert_in_run(data: dict[str, Any]) -> set[str]:
    """The plugins of a run that changed nothing in it, by its report rows in
    ``metrics.json`` (``accelopt.runtime.compare.is_inert``): a set inert in every run has
    no gain to report, whatever the noise between its runs and the baseline's shows."""
    rows = [(str(r.get("plugin")), r.get("metrics") or {}) for r in data.get("plugins") or []
            if isinstance(r, dict)]
    return {name for name in data["run"]["plugins"] if is_inert(name, rows)}


def with_quality(results: list[SetResult], runs_dir: Path,
                 plan: list[tuple[int, list[str], bool]], console: Console,
                 skip: set[int] | frozenset[int] = frozenset(),
                 context: dict[str, Any] | None = None) -> list[SetResult]:
    """Attach each set's held-out quality, one score per measured run (as each run scored
    its trained jobs, ``accelopt/job/quality.py``): top-1, or the perplexity of runs that
    train language models only, which ``context["quality"]`` then names."""
    scores: dict[str, dict[tuple[str, ...], list[float]]] = defaultdict(lambda: defaultdict(list))
    for path in _measured(runs_dir, plan, skip):
        plugins = tuple(plan[int(path.parent.name)][1])  # as collect files it
        scored = evaluate_run(path.parent)
        if scored is not None:
            scores[scored[0]][plugins].append(scored[1])
    if not scores:
        console.print("quality: no run scored a training job on a held-out set (inference "
                      "workloads and evaluate: false are not scored)")
    column = EVAL_METRIC if EVAL_METRIC in scores or not scores else PERPLEXITY
    if context is not None and scores:
        context["quality"] = column
    chosen = scores.get(column, {})
    return [replace(r, quality=tuple(chosen.get(r.plugins, ()))) for r in results]
