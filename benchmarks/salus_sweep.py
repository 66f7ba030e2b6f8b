"""Sweep packing: an 8-run learning-rate sweep of small jobs under ``hydra/launcher=salus``
(every run's jobs in one salus execution, packed onto the device) vs Hydra's basic launcher
(the runs one after another, each alone), as a user types them.

    python benchmarks/salus_sweep.py [--repeats 3] [--runs 8] [--iterations 300]

Both sides run the same command line but for the launcher (same jobs, seeds, iterations,
``run.threads=1`` and one intra-op thread per lane), as subprocesses, in interleaved rounds
(the order reverses each round); a third side, the basic launcher with both cores per run
(``run.threads=2``), is the speed a user gets without deterministic settings; the figure is the median of the per-round ratios of wall
time (interpreter start, composition, every run's set-up, training and output writing
included: what the user waits for). Per-run results must be identical (each job's final
loss, both launchers): the script says so or stops.

Bounds: the basic launcher's wall time over (the jobs' total work / cores), the best a
packer could do if it removed every run's set-up and kept every core busy with the jobs'
own iterations (work = each job's time from its first iteration's start to its end, as
measured under the basic launcher, where it runs alone); and the same with the basic
launcher's own fixed costs kept (its wall time minus the work: interpreter start,
composition, every run's set-up and output writing), which packing does not remove.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _cli

from accelopt.drivers.setup import usable_cores

LRS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.08, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)


def sweep_args(runs: int, iterations: int, width: int, batch: int) -> list[str]:
    """One MLP job per run (a few seconds on one core), the learning rate swept."""
    lrs = ",".join(str(x) for x in LRS[:runs])
    job = (f"{{name:mlp,model:mlp,batch_size:{batch},iterations:{iterations},width:{width},"
           "seed:0}")
    return ["run", "-m", "workload=tiny", f"workload.jobs=[{job}]",
            f"workload.jobs.0.lr={lrs}", "run.progress=false"]


SIDES = {
    "basic": ["run.threads=1"],
    "salus": ["run.threads=1", "hydra/launcher=salus", "hydra.launcher.threads=1"],
    "basic-2t": ["run.threads=2"],
}
"""basic and salus: the same deterministic settings (one intra-op thread per job), so the
results must be identical; basic-2t: the basic launcher with both cores per run, a speed
reference only (another summation order, so not compared for identity)."""


def run_sweep(args: list[str], out: Path, side: str) -> float:
    command = [sys.executable, "-m", "accelopt.cli.main", *args, *SIDES[side],
               f"hydra.sweep.dir={out}"]
    started = time.perf_counter()
    done = _cli.run_child(command, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"sweep failed ({side}): {' | '.join(tail)}")
    return wall


def results(out: Path, runs: int) -> list[list[float]]:
    """Each run's jobs' final losses, by run number."""
    return [[j["final_loss"] for j in json.loads((out / str(r) / "metrics.json").read_text())
             ["jobs"]] for r in range(runs)]


def work_seconds(out: Path, runs: int) -> float:
    """The jobs' own time (first iteration's start to end), summed over the sweep."""
    total = 0.0
    for r in range(runs):
        for job in json.loads((out / str(r) / "metrics.json").read_text())["jobs"]:
            total += job["jct_s"] - job["queueing_s"]
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=_cli.summary(__doc__))
    ap.add_argument("--repeats", type=_cli.positive_int, default=3)
    ap.add_argument("--runs", type=_cli.positive_int, default=8)
    ap.add_argument("--iterations", type=_cli.positive_int, default=300)
    ap.add_argument("--width", type=_cli.positive_int, default=512)
    ap.add_argument("--batch", type=_cli.positive_int, default=256)
    args = ap.parse_args()
    if args.runs > len(LRS):
        ap.error(f"--runs: at most {len(LRS)} (one learning rate each); got {args.runs}")
    cores = usable_cores()
    command = sweep_args(args.runs, args.iterations, args.width, args.batch)
    print(f"machine: {platform.processor() or platform.machine()}, {cores} cores; python "
          f"{platform.python_version()}")
    print(f"sweep: accelopt {' '.join(command)}")
    for side, extra in SIDES.items():
        print(f"  {side}: {' '.join(extra)}")
    root = Path(tempfile.mkdtemp(prefix="salus_sweep_"))
    walls: dict[str, list[float]] = {side: [] for side in SIDES}
    ratios: dict[str, list[float]] = {"basic": [], "basic-2t": []}
    work = []
    try:
        for rep in range(args.repeats):
            order = list(SIDES) if rep % 2 == 0 else list(SIDES)[::-1]
            outs = {}
            for side in order:
                outs[side] = root / f"{side}-{rep}"
                walls[side].append(run_sweep(command, outs[side], side))
            if results(outs["basic"], args.runs) != results(outs["salus"], args.runs):
                raise SystemExit(f"round {rep}: per-run results differ between the launchers")
            work.append(work_seconds(outs["basic"], args.runs))
            for base in ratios:
                ratios[base].append(walls[base][-1] / walls["salus"][-1])
            print(f"round {rep}: " + ", ".join(f"{side} {walls[side][-1]:.2f} s" for side in
                                              SIDES) + f"; jobs' work {work[-1]:.2f} s")
            for out in outs.values():
                shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    basic = statistics.median(walls["basic"])
    w = statistics.median(work)
    bound = basic / (w / cores)
    print()
    print("| launcher | wall s (median) | min-max | basic / it (paired median) |")
    print("|---|---|---|---|")
    for side in SIDES:
        paired = [b / x for b, x in zip(walls["basic"], walls[side], strict=True)]
        print(f"| {side} | {statistics.median(walls[side]):.2f} | "
              f"{min(walls[side]):.2f}-{max(walls[side]):.2f} | "
              f"{statistics.median(paired):.2f}x |")
    fixed = max(0.0, basic - w)
    tight = basic / (fixed + w / cores)
    print(f"bound: basic wall / (jobs' work {w:.2f} s / {cores} cores) = {bound:.2f}x (no "
          f"set-up at all); keeping the basic launcher's {fixed:.2f} s of start-up, set-up "
          f"and output writing: {tight:.2f}x")
    print(f"per-run results identical (basic, salus): yes ({args.runs} runs x "
          f"{args.repeats} rounds)")
    print(f"salus vs the basic launcher with both cores per run: "
          f"{statistics.median(ratios['basic-2t']):.2f}x")
    print(f"salus launcher vs basic launcher: {statistics.median(ratios['basic']):.2f}x "
          f"makespan (median of {len(ratios['basic'])} paired rounds; bound {bound:.2f}x)")


if __name__ == "__main__":
    _cli.run(main)
