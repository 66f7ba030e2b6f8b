"""Start-up overhead of the default run: ``accelopt run``'s wall time minus its makespan (the
run's first arrival to its last job's end), i.e. everything the user waits for that is not
the jobs: imports, config composition, process start, process group, job builds, gathering
the ranks' results, scoring and writing the outputs.

    python benchmarks/startup.py [--repeats 5] [--tree OTHER_CHECKOUT ...] [-- OVERRIDES]

Each repeat runs the command as a fresh process in its own empty directory (nothing cached
between runs but the OS's file cache). ``--tree`` adds another checkout of accelopt (e.g. a
``git worktree`` of an earlier commit) as a side: its ``accelopt`` package is put first on
``PYTHONPATH`` (the installed plugins are shared), and the sides run in interleaved rounds,
the order rotating each round, so both see the same state of a busy machine. The figure is
the median over the rounds, with min-max, and the per-round difference against the first
side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _cli

GOAL_S = 4.0
HERE = Path(__file__).resolve().parent.parent


def one_run(tree: Path, overrides: list[str]) -> tuple[float, float]:
    """(wall s, makespan s) of one ``accelopt run`` with the code of ``tree``."""
    env = dict(os.environ)
    if tree != HERE:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep)
    with tempfile.TemporaryDirectory(prefix="accelopt-startup-") as work:
        command = [sys.executable, "-m", "accelopt.cli.main", "run", "run.progress=false",
                   "hydra.run.dir=out", *overrides]
        started = time.perf_counter()
        # its own process group, stopped (and the directory removed) if this script stops
        done = _cli.run_child(command, cwd=work, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-2:]
            raise SystemExit(f"accelopt run failed ({tree}): {' | '.join(tail)}")
        summary = json.loads((Path(work) / "out" / "metrics.json").read_text())["summary"]
    return wall, float(summary["makespan_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=_cli.summary(__doc__))
    parser.add_argument("--repeats", type=_cli.positive_int, default=5)
    parser.add_argument("--tree", action="append", default=[], type=Path,
                        help="another checkout to compare (repeatable)")
    parser.add_argument("overrides", nargs="*", help="extra overrides of the run")
    args = parser.parse_args()
    trees = [HERE, *(t.resolve() for t in args.tree)]
    twice = sorted({str(t) for t in trees if trees.count(t) > 1})
    if twice:  # one side run twice a round, its rows printed twice and compared with itself
        _cli.fail(f"--tree {twice[0]}: the same checkout given twice (this checkout is always "
                  "a side); give other checkouts")
    for tree in trees:
        if not (tree / "accelopt" / "__init__.py").is_file():
            _cli.fail(f"--tree {tree}: not a checkout of accelopt (no accelopt/)")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python "
          f"{platform.python_version()}; load average {os.getloadavg()[0]:.2f}")
    print(f"command: accelopt run run.progress=false {' '.join(args.overrides)}".rstrip())
    print(f"goal: start-up (wall - makespan) <= {GOAL_S:g} s; bound: importing torch alone "
          "(timed below)")
    rounds: list[dict[Path, tuple[float, float]]] = []
    for r in range(args.repeats):
        order = trees[r % len(trees):] + trees[:r % len(trees)]
        got = {tree: one_run(tree, args.overrides) for tree in order}
        rounds.append(got)
        print(f"round {r}: " + ", ".join(
            f"{_label(t)} wall {got[t][0]:.2f} s makespan {got[t][1]:.2f} s "
            f"start-up {got[t][0] - got[t][1]:.2f} s" for t in trees), flush=True)
    started = time.perf_counter()
    _cli.run_child([sys.executable, "-c", "import torch"], check=True)
    torch_s = time.perf_counter() - started
    print(f"\n| side | start-up s, median | min-max | wall s, median | makespan s, median |"
          f" vs {_label(trees[0])} (paired median) |")
    print("|---|---:|---:|---:|---:|---:|")
    for tree in trees:
        over = [g[tree][0] - g[tree][1] for g in rounds]
        diff = [g[tree][0] - g[tree][1] - (g[trees[0]][0] - g[trees[0]][1]) for g in rounds]
        print(f"| {_label(tree)} | {statistics.median(over):.2f} | {min(over):.2f}-"
              f"{max(over):.2f} | {statistics.median(g[tree][0] for g in rounds):.2f} | "
              f"{statistics.median(g[tree][1] for g in rounds):.2f} | "
              f"{statistics.median(diff):+.2f} s |")
    print(f"bound: `import torch` in a fresh interpreter {torch_s:.2f} s")
    over = statistics.median(g[HERE][0] - g[HERE][1] for g in rounds)
    print(f"start-up of the default run: {over:.2f} s (median of {len(rounds)}; goal "
          f"<= {GOAL_S:g} s: {'met' if over <= GOAL_S else 'not met'})")


def _label(tree: Path) -> str:
    return "this checkout" if tree == HERE else str(tree.name)


if __name__ == "__main__":
    _cli.run(main)
